"""4-bit weight matmul (W4A16) in Triton, for CUDA: ``y = x @ W^T + bias`` with ``W`` read as
``kvserve.engine.layers.w4a16`` packs it (``qweight`` uint8 ``[N, K/2]``: per 32-value block, byte ``b``
holds value ``b`` in its low nibble and ``16 + b`` in its high one; ``scales`` and ``szeros``
float32 ``[N, K / group_size]``, ``w = q * scale - szero``).

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``, walking K 32 values at a time: it
loads the tile's 16 bytes per weight row, splits them into the low and high nibbles (two
``[BLOCK_N, 16]`` operands), and accumulates ``x_lo @ q_lo^T + x_hi @ q_hi^T`` scaled by the
block's group scale, minus ``szero * sum(x)`` of the block: the weight stays 4-bit in memory and
is never widened outside registers. Accumulation is float32; the operands are float32 (the
nibbles are exact in any float type). Runs under ``TRITON_INTERPRET=1`` on CPU tensors for the
tests (``tests/kernels/test_w4a16.py``); a GPU compile needs 16-wide dots, which these are.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is an optional extra
    triton = None


def available() -> bool:
    """Whether Triton is importable (a CUDA device or the interpreter is the caller's business)."""
    return triton is not None


if triton is not None:

    @triton.jit
    def _w4a16_kernel(
        x_ptr,
        w_ptr,
        s_ptr,
        z_ptr,
        b_ptr,
        y_ptr,
        M,
        N,
        K,
        G,
        GS: tl.constexpr,
        stride_xm,
        stride_ym,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        r16 = tl.arange(0, 16)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for blk in range(0, K // 32):
            k0 = blk * 32
            g = k0 // GS
            xl = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + r16)[None, :], mask=m_ok[:, None], other=0.0)
            xh = tl.load(x_ptr + rm[:, None] * stride_xm + (k0 + 16 + r16)[None, :], mask=m_ok[:, None], other=0.0)
            xl = xl.to(tl.float32)
            xh = xh.to(tl.float32)
            wb = tl.load(w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + r16)[None, :], mask=n_ok[:, None], other=0)
            wb = wb.to(tl.int32)
            ql = (wb & 0xF).to(tl.float32)
            qh = ((wb >> 4) & 0xF).to(tl.float32)
            part = tl.dot(xl, tl.trans(ql), input_precision="ieee") + tl.dot(xh, tl.trans(qh), input_precision="ieee")
            s = tl.load(s_ptr + rn * G + g, mask=n_ok, other=0.0)
            z = tl.load(z_ptr + rn * G + g, mask=n_ok, other=0.0)
            xs = tl.sum(xl, axis=1) + tl.sum(xh, axis=1)
            acc += part * s[None, :] - xs[:, None] * z[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )


def w4a16_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    szeros: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    block_m: int = 16,
    block_n: int = 64,
) -> torch.Tensor:
    """``x`` ``[..., K]`` (float32, float16 or bfloat16) times the 4-bit weight -> ``[..., N]``
    in ``x.dtype`` (module docstring), float32 accumulation.

    Raises:
        ValueError: shapes that do not fit (K not a multiple of 32 or of ``group_size``).
        RuntimeError: Triton is not installed.
    """
    if triton is None:
        raise RuntimeError("triton is not installed")
    n, k = qweight.shape[0], qweight.shape[1] * 2
    if x.shape[-1] != k or k % 32 or group_size % 32 or k % group_size:
        raise ValueError(f"x [..., {x.shape[-1]}] against a 4-bit weight [{n}, {k}] in groups of {group_size}")
    if scales.shape != (n, k // group_size) or szeros.shape != scales.shape:
        raise ValueError(f"scales {tuple(scales.shape)} / szeros {tuple(szeros.shape)} for [{n}, {k}]")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _w4a16_kernel[grid](
            x2,
            qweight,
            scales,
            szeros,
            bias if bias is not None else y,
            y,
            m,
            n,
            k,
            k // group_size,
            group_size,
            x2.stride(0),
            y.stride(0),
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
        )
    return y.view(*x.shape[:-1], n)
