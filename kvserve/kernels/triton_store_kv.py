"""Triton scatter of new K/V rows into their paged-cache slots (float8 e4m3 encoding included).

``_store_kv_kernel`` copies whole ``[num_kv_heads * head_dim]`` rows, ``BLOCK_T`` tokens per
program, to slot ``slot_mapping[t]`` (``block * block_size + offset``); a negative slot is
padding and skipped. Into a float8 cache it writes e4m3 bit patterns it computes itself
(:func:`_e4m3_bits`), rounding as torch does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_common import FP8, check_cache, interpreting


@triton.jit
def _e4m3_bits(x):
    """float32 -> float8 e4m3fn bit patterns (uint8), round to nearest even, saturating at
    +-448 (the same bits as torch's ``clamp(x, -448, 448).to(torch.float8_e4m3fn)``).

    Integer arithmetic instead of Triton's float8 cast: the interpreter's cast mis-rounds
    values whose mantissa carries into the exponent (-7.79 became -4). Normal numbers round
    the float32 mantissa to 3 bits (add ``0x7FFFF`` plus the kept LSB, drop 20 bits) and
    re-bias the exponent (127 -> 7); below ``2**-6`` the subnormal code is ``rint(|x| * 2**9)``
    (the ``2**23`` add-subtract rounds to nearest even), and 8 there is the smallest normal.
    """
    a = tl.minimum(tl.abs(x), 448.0)
    u = a.to(tl.uint32, bitcast=True)
    normal = (((u + 0x7FFFF + ((u >> 20) & 1)) >> 20) - (120 << 3)).to(tl.int32)
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a < 0.015625, sub, normal)
    sign = (x.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return (code | (sign << 7)).to(tl.uint8)


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_tokens,
    stride_kt,
    stride_vt,
    stride_kcb,
    stride_kcs,
    stride_vcb,
    stride_vcs,
    k_scale,
    v_scale,
    ROW: tl.constexpr,
    BLOCK_ROW: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    FP8: tl.constexpr,
):
    """Copy ``BLOCK_T`` tokens' ``[num_kv_heads * head_dim]`` K and V rows to their slots
    (``FP8``: the caches are uint8 views of float8 e4m3 caches; rows are divided by the scales,
     IEEE-rounded as torch divides, and encoded by :func:`_e4m3_bits`)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < num_tokens
    slot = tl.load(slot_ptr + t, mask=tmask, other=-1).to(tl.int64)
    valid = tmask & (slot >= 0)
    slot = tl.where(valid, slot, 0)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    e = tl.arange(0, BLOCK_ROW)
    mask = valid[:, None] & (e < ROW)[None, :]
    t64 = t.to(tl.int64)
    k = tl.load(key_ptr + t64[:, None] * stride_kt + e[None, :], mask=mask)
    v = tl.load(value_ptr + t64[:, None] * stride_vt + e[None, :], mask=mask)
    if FP8:
        k = _e4m3_bits(tl.math.div_rn(k.to(tl.float32), k_scale))
        v = _e4m3_bits(tl.math.div_rn(v.to(tl.float32), v_scale))
    tl.store(
        k_cache_ptr + (blk * stride_kcb + off * stride_kcs)[:, None] + e[None, :],
        k.to(k_cache_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        v_cache_ptr + (blk * stride_vcb + off * stride_vcs)[:, None] + e[None, :],
        v.to(v_cache_ptr.dtype.element_ty),
        mask=mask,
    )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` with each token's ``H*D`` row contiguous (copy only if needed)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write new K/V rows into the paged cache.

    Args:
        key, value: ``[num_tokens, num_kv_heads, head_dim]``, any float dtype (converted to the
            cache dtype); the ``[num_kv_heads, head_dim]`` part of each row is made contiguous
           if it is not.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, written in place.
        slot_mapping: int32/int64 ``[num_tokens]``; token ``t`` goes to slot ``slot_mapping[t]``
           (``block * block_size + offset``); negative slots are skipped (padding).
        k_scale, v_scale: float8 caches only: the stored value is ``clamp(x / scale, +-448)``
           rounded to e4m3 (nearest even); ignored for other cache dtypes.

    Grid: ``cdiv(num_tokens, BLOCK_T)`` programs, each copying ``BLOCK_T`` whole rows.
    """
    num_tokens = key.shape[0]
    if num_tokens == 0:
        return
    check_cache(k_cache)
    check_cache(v_cache)
    key, value = _rows(key), _rows(value)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert key.shape[1:] == (num_kv_heads, head_dim) and value.shape == key.shape
    row = num_kv_heads * head_dim
    block_row = triton.next_power_of_2(row)
    block_t = 64 if interpreting() else max(1, min(16, 4096 // block_row))
    grid = (triton.cdiv(num_tokens, block_t),)
    fp8 = k_cache.dtype == FP8
    if fp8:  # the kernel writes the e4m3 bit patterns itself (see _e4m3_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[grid](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        value.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        k_scale,
        v_scale,
        ROW=row,
        BLOCK_ROW=block_row,
        BLOCK_T=block_t,
        BLOCK_SIZE=block_size,
        FP8=fp8,
        num_warps=4,
    )
