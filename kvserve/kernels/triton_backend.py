"""The Triton attention backend: our FlashAttention-2 style kernels (:mod:`kvserve.kernels.triton_attention`).

Runs on CUDA (fp32, fp16, bf16; float8 e4m3 KV caches on compute capability >= 8.9; any
block size, any head_dim) and is safe to capture in CUDA
graphs: the decode kernel derives each request's split-K bounds from ``seq_lens`` on the device,
``store_kv`` skips slot -1 and a seq_len-0 row yields zeros. On CPU it runs only when requested
by name under ``TRITON_INTERPRET=1`` (the interpreter, for tests: it is never chosen
automatically). The kernel module is imported when the backend is built, not when this module
is, so reading the capabilities imports no Triton.
"""

from __future__ import annotations

import os

import torch

from kvserve.kernels.backend import AttentionBackend, AttentionMetadata


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def triton_import_error() -> str | None:
    """Why the ``triton`` package cannot be imported here (None: it can). Importing the package
    compiles nothing; only our kernel module's ``@triton.jit`` fixes interpreter-or-not."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "not usable"
        return f"triton cannot be imported ({type(exc).__name__}: {exc})"
    return None


class TritonBackend(AttentionBackend):
    """``store_kv`` and ``forward`` of :mod:`kvserve.kernels.triton_attention` (decode-only batches go to
    the split-K decode kernel, anything else to the varlen prefill kernel)."""

    name = "triton"
    devices = ("cuda",)
    supports_cuda_graphs = True
    supports_fp8_kv = True

    @classmethod
    def fp8_kv_unsupported_reason(cls, device: torch.device) -> str | None:
        """Float8 caches need a GPU with float8 conversions (compute capability >= 8.9, Ada or
        Hopper; Triton has no e4m3 type below it); the interpreter handles them anywhere."""
        if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
            major, minor = torch.cuda.get_device_capability(device)
            return f"float8 KV caches need compute capability >= 8.9, this GPU has {major}.{minor}"
        return None

    @classmethod
    def import_error(cls) -> str | None:
        return triton_import_error()

    @classmethod
    def unsupported_reason(
        cls, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int, *, requested: bool = False
    ) -> str | None:
        """As :meth:`AttentionBackend.unsupported_reason`; a CPU device is accepted when the
        backend is requested by name and ``TRITON_INTERPRET=1``."""
        if device.type == "cpu" and requested and interpreting():
            device = torch.device("cuda")  # the interpreter stands in for the GPU
        reason = super().unsupported_reason(device, dtype, block_size, head_dim, requested=requested)
        if reason and device.type == "cpu":
            reason += " (or TRITON_INTERPRET=1 with attention_backend='triton')"
        return reason

    def __init__(self):
        from kvserve.kernels import triton_attention

        self._store, self._attend = triton_attention.store_kv, triton_attention.paged_attention

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        self._store(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
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
        """Reads everything from the cache: ``key`` / ``value`` are ignored (``exact_chunk_kv`` False)."""
        return self._attend(
            q, k_cache, v_cache, meta, scale, window=window, softcap=softcap, k_scale=k_scale, v_scale=v_scale
        )
