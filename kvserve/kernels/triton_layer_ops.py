"""Triton kernels for a decoder layer's elementwise steps on CUDA: RMSNorm (the residual add
fused in), rotary embedding of q and k in place, SiLU-and-mul.

Each replaces a chain of ATen ops (RMSNorm alone was eight kernels: casts, ``pow``, ``mean``,
``add``, ``rsqrt``, two ``mul``) by one launch: a batch-1 decode step of Qwen3-0.6B on an H200
ran 1,677 kernels, ~2 us each, for 3.0 ms of GPU time where its weights need 0.28 ms
(``benchmarks/gpu.py --parts decode-profile``). They round where the modules' ATen ops round
(every op of a 16-bit dtype computes in float32 and rounds its result to the dtype), so their
outputs are those of :mod:`kvserve.engine.layers` up to float32 summation order in the norm's mean (and
``exp``/``rsqrt`` ulps). Dispatch: :mod:`kvserve.kernels.gpu_ops`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    num_heads,
    stride_xt,
    stride_xh,
    stride_rt,
    H,
    eps,
    HAS_RES: tl.constexpr,
    GEMMA: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One row: ``x`` row ``(t, h)`` of ``[T, num_heads, H]`` (strided), output row-major. With
    ``HAS_RES`` (``num_heads == 1``): ``res[t] = x[t] + res[t]`` (rounded to the dtype), then the
    norm of that. ``GEMMA``: ``(x * rstd * (1 + w))`` in float32, else ``w * dtype(x * rstd)``."""
    row = tl.program_id(0)
    t = (row // num_heads).to(tl.int64)
    h = (row % num_heads).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + t * stride_xt + h * stride_xh + cols, mask=mask, other=0.0)
    dt = x.dtype
    if HAS_RES:
        r = tl.load(res_ptr + t * stride_rt + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dt)
        tl.store(res_ptr + t * stride_rt + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    rstd = 1.0 / tl.sqrt(var + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        y = xf * rstd * (1.0 + w)
    else:
        y = w * (xf * rstd).to(dt).to(tl.float32)
    tl.store(out_ptr + row.to(tl.int64) * H + cols, y.to(dt), mask=mask)


@triton.jit
def _rotary_half(
    ptr,
    t,
    stride_t,
    stride_h,
    n_heads,
    pos_row,
    cos_ptr,
    sin_ptr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotate ``n_heads`` heads of token ``t`` in place: ``x * cos + rotate_half(x) * sin``,
    each product and the sum rounded to the dtype as ATen rounds them."""
    hh = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HALF
    mask = (hh < n_heads)[:, None] & dmask[None, :]
    cos1 = tl.load(cos_ptr + pos_row + d, mask=dmask, other=0.0)
    cos2 = tl.load(cos_ptr + pos_row + HALF + d, mask=dmask, other=0.0)
    sin1 = tl.load(sin_ptr + pos_row + d, mask=dmask, other=0.0)
    sin2 = tl.load(sin_ptr + pos_row + HALF + d, mask=dmask, other=0.0)
    base = ptr + t * stride_t + hh[:, None].to(tl.int64) * stride_h + d[None, :]
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF, mask=mask, other=0.0)
    dt = x1.dtype
    c1 = cos1.to(dt).to(tl.float32)[None, :]
    c2 = cos2.to(dt).to(tl.float32)[None, :]
    s1 = sin1.to(dt).to(tl.float32)[None, :]
    s2 = sin2.to(dt).to(tl.float32)[None, :]
    a1 = x1.to(tl.float32)
    a2 = x2.to(tl.float32)
    o1 = (a1 * c1).to(dt).to(tl.float32) + (-a2 * s1).to(dt).to(tl.float32)
    o2 = (a2 * c2).to(dt).to(tl.float32) + (a1 * s2).to(dt).to(tl.float32)
    tl.store(base, o1.to(dt), mask=mask)
    tl.store(base + HALF, o2.to(dt), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cos,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """One token: its q heads, then its k heads."""
    t = tl.program_id(0).to(tl.int64)
    pos_row = tl.load(pos_ptr + t).to(tl.int64) * stride_cos
    _rotary_half(q_ptr, t, stride_qt, stride_qh, num_q_heads, pos_row, cos_ptr, sin_ptr, HALF, BLOCK_HQ, BLOCK_D)
    _rotary_half(k_ptr, t, stride_kt, stride_kh, num_k_heads, pos_row, cos_ptr, sin_ptr, HALF, BLOCK_HK, BLOCK_D)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_xt, inter, BLOCK: tl.constexpr):
    """``out[t, j] = dtype(dtype(silu(x[t, j])) * x[t, inter + j])`` for one block of ``j``."""
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = j < inter
    g = tl.load(x_ptr + t * stride_xt + j, mask=mask, other=0.0)
    u = tl.load(x_ptr + t * stride_xt + inter + j, mask=mask, other=0.0)
    dt = g.dtype
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(dt).to(tl.float32)
    tl.store(out_ptr + t * inter + j, (s * u.to(tl.float32)).to(dt), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool = False, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of the last dimension of ``x`` ``[T, H]`` or
    ``[T, heads, H]`` (strided rows allowed; the last dimension contiguous); ``weight`` ``[H]``.
    ``gemma``: scale by ``1 + weight`` in float32 (Gemma), else ``weight * dtype(normed)``
    (Llama). With ``residual`` ``[T, H]`` (2-D ``x`` only): ``residual += x`` **in place**
    first, rounded to the dtype, and the norm is of that. Returns a new contiguous tensor of
    ``x``'s shape and dtype.

    Raises:
        ValueError: a last dimension that is not contiguous, or a residual with 3-D ``x``.
    """
    if x.stride(-1) != 1:
        raise ValueError("rms_norm needs a contiguous last dimension")
    H = x.shape[-1]
    if x.dim() == 2:
        heads, stride_t, stride_h = 1, x.stride(0), 0
    else:
        heads, stride_t, stride_h = x.shape[1], x.stride(0), x.stride(1)
    if residual is not None and (x.dim() != 2 or residual.stride(-1) != 1 or residual.shape != x.shape):
        raise ValueError("a fused residual add needs 2-D x and residual of one shape, last dimension contiguous")
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    rows = x.shape[0] * heads
    if rows:
        _rms_norm_kernel[(rows,)](
            x,
            residual if residual is not None else x,
            weight,
            out,
            heads,
            stride_t,
            stride_h,
            residual.stride(0) if residual is not None else 0,
            H,
            eps,
            HAS_RES=residual is not None,
            GEMMA=gemma,
            BLOCK=triton.next_power_of_2(H),
        )
    return out


def rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ("rotate half" layout, Su et al. 2021) applied **in place** to ``q`` ``[T, Hq, D]`` and
    ``k`` ``[T, Hk, D]`` (strided token and head dimensions, contiguous last) at int64
    ``positions`` ``[T]``, from float32 ``cos``/``sin`` caches ``[max_position, D]`` (cast to the
    dtype first, as :class:`kvserve.engine.layers.rotary.RotaryEmbedding` does); returns ``(q, k)``."""
    T, hq, D = q.shape
    if T:
        _rotary_kernel[(T,)](
            q,
            k,
            positions,
            cos,
            sin,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            hq,
            k.shape[1],
            HALF=D // 2,
            BLOCK_HQ=triton.next_power_of_2(hq),
            BLOCK_HK=triton.next_power_of_2(k.shape[1]),
            BLOCK_D=triton.next_power_of_2(D // 2),
        )
    return q, k


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): ``silu(x[:, :I]) * x[:, I:]`` for ``x`` ``[T, 2I]`` (rows may be
    strided, the last dimension contiguous) -> a new ``[T, I]``, each op rounded to the dtype."""
    T, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((T, inter), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(inter))
    if T:
        _silu_and_mul_kernel[(T, triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block)
    return out
