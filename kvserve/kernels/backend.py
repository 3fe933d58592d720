"""Attention over the paged KV cache: the per-step metadata and the backend interface.

Every backend (:mod:`kvserve.kernels.torch_backend`, :mod:`kvserve.kernels.triton_backend`,
:mod:`kvserve.kernels.flash_attn_backend`) implements :class:`AttentionBackend` on the same contract;
:mod:`kvserve.kernels.selector` picks one per engine from the capabilities declared here. This module
imports nothing from ``kernels`` (every other module imports it, never the reverse).

Cache layout (every backend): one key and one value tensor per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a request lives in slot
``block_table[t // block_size] * block_size + t % block_size``.

Query tokens of all requests in a step are flattened into one ``[num_tokens, num_heads,
head_dim]`` tensor; request ``i`` owns rows ``cu_seqlens_q[i] : cu_seqlens_q[i + 1]``, which
are the *last* ``query_len`` positions of its ``seq_len`` tokens (earlier tokens are read from
the cache: prefix-cache hits, earlier chunks of a chunked prefill, or the decode context).
Attention is causal; query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.

Per layer, ``forward`` may also get a sliding ``window`` (local attention, as Mistral and Gemma
2/3 use; Hugging Face's ``sliding_window`` convention): the query at absolute position ``p`` then
sees only keys ``j`` with ``p - window < j <= p`` (itself and the ``window - 1`` tokens before
it; keys older than that are masked), and a ``softcap`` (Gemma 2's attention logit
soft-capping): scores ``s = scale * q.k`` become ``softcap * tanh(s / softcap)`` before the
softmax. The cache itself is the same for every layer: blocks that fall out of a layer's window
are kept (not freed), so prefix caching and preemption need nothing special.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by all layers.

    Attributes:
        cu_seqlens_q: int32 ``[num_reqs + 1]``, prefix sums of query lengths.
        seq_lens: int32 ``[num_reqs]``, tokens in the cache per request after this step
            (context + new tokens).
        block_tables: int32 ``[num_reqs, max_blocks_per_seq]``; unused entries are 0.
        slot_mapping: int64 ``[num_tokens]``, cache slot of each new token (-1 = skip).
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (no device sync).
        max_seqlen_q / max_seqlen_k: maxima of the above (tokens).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


class AttentionBackend:
    """One way to run attention over the paged cache: ``store_kv`` then ``forward`` per layer.

    Capabilities are class attributes, so the selector reads them without building a backend or
    importing its kernels (importing Triton kernels fixes interpreter-or-not for the process).

    Attributes:
        name: the ``attention_backend`` value that requests this backend.
        devices: device types (``torch.device.type``) it runs on.
        dtypes: cache / query dtypes it accepts.
        block_size_multiple: ``block_size`` must be a multiple of this (tokens).
        max_head_dim: largest ``head_dim`` it accepts (None: any).
        supports_fp8_kv: takes float8 e4m3 caches (``kv_cache_dtype="fp8"``): ``store_kv`` writes
            ``clamp(x / scale, +-448)``, ``forward`` reads ``value * scale`` (``k_scale`` /
            ``v_scale``, the layer's scales; other caches ignore them).
        exact_chunk_kv: with a float8 cache, ``forward`` takes the step's own K/V from its
            ``key`` / ``value`` arguments (model dtype) in the attention of a chunk of >= 2 query
            tokens over itself; only tokens cached by earlier steps (earlier chunks, prefix-cache
            hits, a decode row's context and the decode token itself) are read from float8.
            False: the backend reads everything from the cache and ignores ``key`` / ``value``.
        supports_cuda_graphs: ``forward`` and ``store_kv`` of a decode-only batch can be captured
            in a CUDA graph and replayed with new contents of the same tensors (no host sync, no
            host-side decision on tensor values; padding rows with slot -1 and seq_len 0 leave
            the cache alone and produce finite output).
    """

    name: ClassVar[str] = ""
    devices: ClassVar[tuple[str, ...]] = ()
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float16, torch.bfloat16)
    block_size_multiple: ClassVar[int] = 1
    max_head_dim: ClassVar[int | None] = None
    supports_cuda_graphs: ClassVar[bool] = False
    supports_fp8_kv: ClassVar[bool] = False
    exact_chunk_kv: ClassVar[bool] = False

    @classmethod
    def import_error(cls) -> str | None:
        """Why the packages this backend needs cannot be used here (None: they can)."""
        return None

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, *, requested: bool = False
    ) -> str | None:
        """Why this backend cannot run an engine with these settings (None: it can).

        Args:
            device: the engine's device; dtype: its KV cache dtype; block_size: tokens per
                block; head_dim: per attention head.
            requested: the backend was asked for by name (a backend may then accept more,
                e.g. Triton's CPU interpreter).
        """
        if device.type not in cls.devices:
            return f"needs a {' or '.join(cls.devices)} device, got {device.type}"
        if dtype not in cls.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in cls.dtypes)
            return f"supports {names}, not {str(dtype).removeprefix('torch.')}"
        if block_size % cls.block_size_multiple:
            return f"block_size {block_size} is not a multiple of {cls.block_size_multiple}"
        if cls.max_head_dim is not None and head_dim > cls.max_head_dim:
            return f"head_dim {head_dim} exceeds {cls.max_head_dim}"
        return cls.import_error()

    def store_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache
        slots ``slot_mapping`` (int64 ``[num_tokens]``), in the cache dtype (float8: divided
        by ``k_scale`` / ``v_scale``, see ``supports_fp8_kv``)."""
        raise NotImplementedError

    def forward(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the cache (which
        already holds this step's K/V); returns ``[num_tokens, num_heads, head_dim]`` in
        ``q.dtype``. ``scale`` multiplies ``q @ k^T`` (usually ``head_dim ** -0.5``).
        ``window`` (tokens, >= 1) and ``softcap`` (> 0): see the module docstring; None = off.
        ``key`` / ``value``: this step's K/V ``[num_tokens, num_kv_heads, head_dim]`` as given
        to ``store_kv`` (before float8 rounding); with a float8 cache a backend with
        ``exact_chunk_kv`` uses them for a prefill chunk's attention over its own tokens, so
        float8 noise enters only through context cached by earlier steps. Other backends and
        caches ignore them (no cost)."""
        raise NotImplementedError

    @classmethod
    def fp8_kv_unsupported_reason(cls, device: torch.device) -> str | None:
        """Why this backend cannot keep a float8 KV cache on ``device`` (None: it can)."""
        if not cls.supports_fp8_kv:
            return f"the {cls.name} attention backend has no float8 KV cache path"
        return None

    @staticmethod
    def check_window_softcap(window: int | None, softcap: float | None) -> None:
        """Raise ``ValueError`` unless ``window`` is None or an int >= 1 and ``softcap`` is None
        or a finite number > 0."""
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be None or an int >= 1 (tokens), got {window!r}")
        if softcap is not None and not (isinstance(softcap, (int, float)) and 0 < softcap < float("inf")):
            raise ValueError(f"softcap must be None or a finite number > 0, got {softcap!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
