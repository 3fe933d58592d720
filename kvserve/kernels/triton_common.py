"""What the Triton attention kernels share: the matmul dtype, argument checks, the K/V tile gather
through the block table, and the FlashAttention-2 online-softmax step.

Softmax statistics and accumulators are always fp32 (``exp2`` with ``scale * log2(e)`` folded
in); the two matmuls take fp16/bf16 operands with fp32 accumulation on a GPU (:func:`native_dot`),
fp32 operands with ``ieee`` dots otherwise.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kvserve.kernels.backend import AttentionBackend

LOG2E = 1.4426950408889634
FP8 = torch.float8_e4m3fn


def interpreting() -> bool:
    """Whether kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls work in: the cache's, or the query's over a float8 cache (whose
    values are exact in fp16/bf16/fp32; the per-layer scales are applied outside the dots)."""
    return q.dtype if k_cache.dtype == FP8 else k_cache.dtype


def native_dot(dtype: torch.dtype) -> bool:
    """Whether the matmuls take 16-bit operands directly (tensor cores) instead of fp32."""
    if dtype == torch.float16:
        return True
    if dtype == torch.bfloat16:
        return not interpreting()  # interpreter bf16 dot is broken in Triton 3.9
    return False


def check_cache(cache: torch.Tensor) -> None:
    """Raises ``ValueError`` unless ``cache`` is ``[num_blocks, block_size, num_kv_heads,
    head_dim]`` with contiguous ``[num_kv_heads, head_dim]`` slots."""
    if cache.dim() != 4 or cache.stride(3) != 1 or cache.stride(2) != cache.shape[3]:
        raise ValueError(
            "cache must be [num_blocks, block_size, num_kv_heads, head_dim] with "
            "contiguous [num_kv_heads, head_dim] slots, got shape "
            f"{tuple(cache.shape)} strides {cache.stride()}"
        )


def check_q(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    """``(group, head_dim)`` of ``q`` ``[tokens, num_heads, head_dim]`` over ``k_cache``'s KV
    heads (``group = num_heads // num_kv_heads``). Raises ``ValueError`` for mismatched head
    sizes or counts, or a ``q`` whose last dimension is not contiguous."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1:
        raise ValueError("q must have a contiguous last dimension")
    return num_heads // num_kv_heads, head_dim


def window_softcap_args(window: int | None, softcap: float | None, scale: float) -> tuple:
    """Kernel arguments ``(window, cap_in, cap_out, USE_WINDOW, SOFTCAP)`` (see
    :func:`softmax_update`). Raises ``ValueError`` for a window < 1 or a softcap <= 0."""
    AttentionBackend.check_window_softcap(window, softcap)
    if softcap is None:
        return (window or 0, 0.0, 0.0, window is not None, False)
    return (window or 0, scale / softcap, softcap * LOG2E, window is not None, True)


@triton.jit
def load_kv_tile(cache_ptr, bt_row_ptr, n, nmask, head_off, stride_b, stride_s, d, dmask, BLOCK_SIZE: tl.constexpr):
    """Gather K or V ``[BLOCK_N, BLOCK_D]`` for logical positions ``n`` through the block table.

    Positions may straddle any number of cache blocks (the tile size is independent of the
    cache block size). Masked positions read 0 and touch no memory.
    """
    blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    row = blk * stride_b + (n % BLOCK_SIZE).to(tl.int64) * stride_s + head_off
    return tl.load(cache_ptr + row[:, None] + d[None, :], mask=nmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def softmax_update(
    q,
    k,
    v,
    acc,
    m_i,
    l_i,
    valid,
    qk_scale,
    cap_in,
    cap_out,
    NATIVE_DOT: tl.constexpr,
    USE_MASK: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One FlashAttention-2 inner step (Algorithm 1, lines 8-10) in the log2 domain.

    ``q`` ``[M, D]`` (already in the dot dtype), ``k``/``v`` ``[N, D]`` as loaded, ``valid``
    ``[M, N]`` (ignored unless ``USE_MASK``). Scores are ``q.k * qk_scale``, or with ``SOFTCAP``
    ``cap_out * tanh(q.k * cap_in)`` (``cap_in = scale / softcap``, ``cap_out = softcap *
    log2(e)``; tanh from ``exp``, which the interpreter and every GPU have). Returns the updated
    ``acc, m_i, l_i``; ``acc`` is unnormalised (divided by ``l_i`` once at the end). Under
    ``USE_MASK`` a row that has seen no visible key yet (sliding-window edge) keeps
    ``m = -inf, l = 0, acc = 0`` instead of turning NaN.
    """
    if NATIVE_DOT:
        s = tl.dot(q, tl.trans(k.to(q.dtype)))
    else:
        s = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="ieee")
    if SOFTCAP:
        s = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * (s * cap_in)) + 1.0))
    else:
        s = s * qk_scale
    if USE_MASK:
        s = tl.where(valid, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if USE_MASK:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if NATIVE_DOT:
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
    else:
        acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
    return acc, m_new, l_i
