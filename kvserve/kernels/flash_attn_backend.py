"""The flash-attn attention backend (Dao-AILab FlashAttention-2 package), imported lazily.

Same contract as :mod:`kvserve.kernels.backend`. flash-attn's causal mask is aligned to the bottom-right
corner when ``seqlen_q != seqlen_k`` (since 2.1), which is exactly kvserve's convention.

* Decode-only batches: ``flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=block_tables, causal=True)`` (split-K chosen by
  flash-attn's own heuristic, ``num_splits=0``).
* Anything else: ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, causal=True, block_table=block_tables)``, K/V read from the
  paged cache, so prefix-cache hits and chunked prefill need no gather.
* ``store_kv`` is the Triton scatter of :mod:`kvserve.kernels.triton_attention` (skips slot -1).
* A layer's sliding window and logit soft-capping go to both calls as flash-attn's own
  ``window_size=(window - 1, 0)`` and ``softcap`` (both in flash-attn >= 2.6, which the backend
  requires anyway).

What upstream flash-attn 2.x supports, declared as capabilities so that the selector never picks
this backend where it cannot run (no per-call fallback): CUDA; fp16/bf16 (no fp32);
``head_dim <= 256``; a paged cache needs ``block_size % 256 == 0`` ("Paged KV cache block size
must be divisible by 256"; kvserve's default block size is 16); ``block_table`` in
``flash_attn_varlen_func`` only from 2.6. CUDA graphs: the decode call takes its shapes from the
tensors, not their contents, and writes 0 for a ``cache_seqlens`` 0 row (padding), as vLLM's
graphs over ``flash_attn_with_kvcache`` rely on.
"""

from __future__ import annotations

import inspect

import torch

from kvserve.kernels.backend import AttentionBackend, AttentionMetadata
from kvserve.kernels.triton_backend import triton_import_error

PAGE_BLOCK_MULTIPLE = 256  # flash-attn 2.x requirement for a paged (block_table) cache

_funcs: tuple | None = None


def _flash() -> tuple:
    """``(flash_attn_varlen_func, flash_attn_with_kvcache, varlen_has_block_table)``.

    Raises:
        ImportError: flash-attn is not installed (it builds only with CUDA).
    """
    global _funcs
    if _funcs is None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:
            raise ImportError(
                f"flash-attn does not import ({exc}; pip install flash-attn --no-build-isolation, CUDA only)"
            ) from exc
        has_bt = "block_table" in inspect.signature(flash_attn_varlen_func).parameters
        _funcs = (flash_attn_varlen_func, flash_attn_with_kvcache, has_bt)
    return _funcs


class FlashAttnBackend(AttentionBackend):
    """flash-attn's paged kernels for attention, the Triton scatter for ``store_kv``."""

    name = "flash_attn"
    devices = ("cuda",)
    dtypes = (torch.float16, torch.bfloat16)
    block_size_multiple = PAGE_BLOCK_MULTIPLE
    max_head_dim = 256
    supports_cuda_graphs = True

    @classmethod
    def import_error(cls) -> str | None:
        try:
            has_bt = _flash()[2]
        except ImportError as exc:
            return str(exc)
        except Exception as exc:  # noqa: BLE001 - a broken install is "not usable" too
            return f"flash-attn does not import ({type(exc).__name__}: {exc})"
        if not has_bt:
            return "flash_attn_varlen_func has no block_table (flash-attn < 2.6)"
        return triton_import_error()  # store_kv

    def __init__(self):
        from kvserve.kernels.triton_attention import store_kv

        self._store = store_kv
        self._varlen, self._with_kvcache, _ = _flash()

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to the cache slots
        ``slot_mapping`` (int64, ``-1`` skipped)."""
        self._store(key, value, k_cache, v_cache, slot_mapping)

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
        """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` (fp16/bf16, CUDA)
        over the paged cache; returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``
        (``key`` / ``value`` ignored: no float8 cache here).
        A sliding ``window`` is flash-attn's ``window_size=(window - 1, 0)`` (left keys besides
        the query's own), ``softcap`` its ``softcap`` (0 = off)."""
        self.check_window_softcap(window, softcap)
        extra = {"window_size": (window - 1, 0) if window else (-1, -1), "softcap": softcap or 0.0}
        out_dtype = q.dtype
        q = q.to(k_cache.dtype)
        if meta.decode_only and q.shape[0] == meta.num_reqs:
            out = self._with_kvcache(
                q.unsqueeze(1),
                k_cache,
                v_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_tables,
                softmax_scale=scale,
                causal=True,
                **extra,
            )
            return out.squeeze(1).to(out_dtype)
        cu_seqlens_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=q.device)
        cu_seqlens_k[1:] = torch.cumsum(meta.seq_lens, 0, dtype=torch.int32)
        out = self._varlen(
            q,
            k_cache,
            v_cache,
            cu_seqlens_q=meta.cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=meta.max_seqlen_q,
            max_seqlen_k=meta.max_seqlen_k,
            softmax_scale=scale,
            causal=True,
            block_table=meta.block_tables,
            **extra,
        )
        return out.to(out_dtype)
