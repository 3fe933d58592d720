"""Triton kernels for attention over the paged KV cache (our own, FlashAttention-2 style).

Everything here follows the conventions of :mod:`kernels.backend`:

* Cache, per layer: ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (fp32, fp16, bf16, or float8 e4m3 with a per-layer ``k_scale`` / ``v_scale``; each slot's ``[num_kv_heads, head_dim]`` row contiguous). Token ``t`` of a
  request lives in slot ``block_table[t // block_size] * block_size + t % block_size``.
* Queries: ``q`` ``[num_tokens, num_heads, head_dim]`` (last dim contiguous), request ``i`` owns rows
  ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are the *last* ``query_len`` of its ``seq_len``
  positions; attention is causal (query at absolute position ``p`` sees keys ``0..p``).
* Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
* Optional per-layer sliding ``window`` (query at ``p`` sees keys ``p - window < j <= p``) and
  attention logit ``softcap`` (scores ``softcap * tanh(scale * q.k / softcap)``), both
  ``constexpr``-gated so layers without them run the plain kernels.

Kernels
-------
``_store_kv_kernel``
    Scatter of new K/V rows into their cache slots (``slot < 0`` skipped).
``_prefill_kernel``
    Varlen causal attention of every query row over the request's cached prefix *and* the chunk
    itself, read through the block table (so prefix-cache hits and chunked prefill starting in the
    middle of a block need nothing special). Tiled online softmax of FlashAttention-2
    (Dao, 2023, "FlashAttention-2: Faster Attention with Better Parallelism and Work
    Partitioning", Algorithm 1 / Section 3.1): one program owns a tile of query rows, streams K/V
    tiles through SRAM, keeps running max ``m``, denominator ``l`` and the unnormalised output
    ``acc`` in fp32 and rescales once at the end; the ``N x N`` score matrix never exists in
    memory. Parallelism is over (query tile, request, KV head) (Section 3.2: parallelise over the
    sequence dimension too, not only batch x heads). The query heads of one GQA group are packed
    into the row dimension of the tile, so each K/V tile is loaded once per group. Key tiles
    entirely below the causal diagonal run without a mask, only the diagonal tiles are masked,
    and tiles above it are skipped (Section 3.1.1, "causal masking"). With a sliding window the
    same holds at the band's other edge: keys older than every row's window are skipped, keys
    inside every row's window run unmasked, only the tiles straddling the window edge are masked.
``_decode_kernel`` + ``_combine_kernel``
    One query per request. Program = (request, KV head, split); the GQA group's query heads are
    the rows of a ``[BLOCK_G, head_dim]`` tile (padded to 16 for ``tl.dot``). With ``num_splits >
    1`` the key range of each request is cut into ``num_splits`` chunks that run in parallel and
    write a normalised partial output plus its log-sum-exp; ``_combine_kernel`` merges them with
    the log-sum-exp rescaling (Flash-Decoding: Dao, Haziza, Massa, Sizov, 2023, "Flash-Decoding for
    long-context inference", PyTorch/Stanford CRFM blog). This keeps all SMs busy when ``batch x num_kv_heads`` is small
    and contexts are long. With a sliding window only the last ``window`` keys are split and read.

Numerics: softmax statistics and accumulators are always fp32 (``exp2`` with ``scale * log2(e)``
folded in). The two matmuls take fp16/bf16 operands with fp32 accumulation on a GPU (tensor
cores, as FlashAttention does); fp32 caches use ``ieee`` fp32 dots. Under ``TRITON_INTERPRET=1``
bf16 ``tl.dot`` is wrong in Triton 3.9, so bf16 operands are converted to fp32 first there.

Triton caveats honoured: no ``make_block_ptr`` (plain pointer arithmetic, also needed for the
block-table gather), no autotuning (tile sizes by heuristic), every ``tl.dot`` dimension >= 16.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels.backend import AttentionBackend, AttentionMetadata

_LOG2E = 1.4426950408889634
FP8 = torch.float8_e4m3fn


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _dot_dtype(q: torch.Tensor, k_cache: torch.Tensor) -> torch.dtype:
    """The dtype the matmuls work in: the cache's, or the query's over a float8 cache (whose
    values are exact in fp16/bf16/fp32; the per-layer scales are applied outside the dots)."""
    return q.dtype if k_cache.dtype == FP8 else k_cache.dtype


def _native_dot(dtype: torch.dtype) -> bool:
    """Whether the matmuls take 16-bit operands directly (tensor cores) instead of fp32."""
    if dtype == torch.float16:
        return True
    if dtype == torch.bfloat16:
        return not _interpreting()  # interpreter bf16 dot is broken in Triton 3.9
    return False


# --------------------------------------------------------------------------------------------
# store_kv
# --------------------------------------------------------------------------------------------

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
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, num_tokens,
                     stride_kt, stride_vt, stride_kcb, stride_kcs, stride_vcb, stride_vcs,
                     k_scale, v_scale,
                     ROW: tl.constexpr, BLOCK_ROW: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
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
    tl.store(k_cache_ptr + (blk * stride_kcb + off * stride_kcs)[:, None] + e[None, :],
             k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + (blk * stride_vcb + off * stride_vcs)[:, None] + e[None, :],
             v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` with each token's ``H*D`` row contiguous (copy only if needed)."""
    if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
        x = x.contiguous()
    return x


def _check_cache(cache: torch.Tensor) -> None:
    if cache.dim() != 4 or cache.stride(3) != 1 or cache.stride(2) != cache.shape[3]:
        raise ValueError("cache must be [num_blocks, block_size, num_kv_heads, head_dim] with "
                         "contiguous [num_kv_heads, head_dim] slots, got shape "
                         f"{tuple(cache.shape)} strides {cache.stride()}")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
             v_scale: float = 1.0) -> None:
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
    _check_cache(k_cache)
    _check_cache(v_cache)
    key, value = _rows(key), _rows(value)
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    assert key.shape[1:] == (num_kv_heads, head_dim) and value.shape == key.shape
    row = num_kv_heads * head_dim
    block_row = triton.next_power_of_2(row)
    block_t = 64 if _interpreting() else max(1, min(16, 4096 // block_row))
    grid = (triton.cdiv(num_tokens, block_t),)
    fp8 = k_cache.dtype == FP8
    if fp8:  # the kernel writes the e4m3 bit patterns itself (see _e4m3_bits)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    _store_kv_kernel[grid](key, value, k_cache, v_cache, slot_mapping, num_tokens,
                           key.stride(0), value.stride(0), k_cache.stride(0), k_cache.stride(1),
                           v_cache.stride(0), v_cache.stride(1), k_scale, v_scale,
                           ROW=row, BLOCK_ROW=block_row, BLOCK_T=block_t, BLOCK_SIZE=block_size,
                           FP8=fp8, num_warps=4)


# --------------------------------------------------------------------------------------------
# shared pieces of the attention kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _load_kv_tile(cache_ptr, bt_row_ptr, n, nmask, head_off, stride_b, stride_s, d, dmask,
                  BLOCK_SIZE: tl.constexpr):
    """Gather K or V ``[BLOCK_N, BLOCK_D]`` for logical positions ``n`` through the block table.

    Positions may straddle any number of cache blocks (the tile size is independent of the
    cache block size). Masked positions read 0 and touch no memory.
    """
    blk = tl.load(bt_row_ptr + n // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
    row = blk * stride_b + (n % BLOCK_SIZE).to(tl.int64) * stride_s + head_off
    return tl.load(cache_ptr + row[:, None] + d[None, :],
                   mask=nmask[:, None] & dmask[None, :], other=0.0)


@triton.jit
def _softmax_update(q, k, v, acc, m_i, l_i, valid, qk_scale, cap_in, cap_out,
                    NATIVE_DOT: tl.constexpr, USE_MASK: tl.constexpr, SOFTCAP: tl.constexpr):
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


# --------------------------------------------------------------------------------------------
# varlen prefill (also handles query_len == 1 rows of a mixed batch)
# --------------------------------------------------------------------------------------------

@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, cu_q_ptr, out_ptr,
                    qk_scale, window, cap_in, cap_out, v_scale,
                    stride_qt, stride_qh, stride_ot, stride_oh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_Q: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    BLOCK_SIZE: tl.constexpr, NATIVE_DOT: tl.constexpr,
                    USE_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
    """Program (q_tile, request, kv_head): ``BLOCK_Q`` query tokens x ``GROUP`` query heads.

    Tile rows ``r = i * BLOCK_G + g`` (token ``i``, head ``kv_head * GROUP + g``), so the
    ``[BLOCK_Q * BLOCK_G, BLOCK_N]`` score tile shares one K/V tile across the GQA group.
    Keys ``[lo, end)`` are read in three loops: ``[lo, u0)`` masked (the window's lower edge),
    ``[u0, u1)`` unmasked (visible to every row), ``[u1, end)`` masked (the causal diagonal).
    """
    tile = tl.program_id(0)
    req = tl.program_id(1)
    kvh = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + req)
    q_len = tl.load(cu_q_ptr + req + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len  # tokens before this chunk (cached prefix / earlier chunks)

    BLOCK_M: tl.constexpr = BLOCK_Q * BLOCK_G
    r = tl.arange(0, BLOCK_M)
    qi = tile * BLOCK_Q + r // BLOCK_G
    g = r % BLOCK_G
    rmask = (qi < q_len) & (g < GROUP)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    head = kvh * GROUP + g
    q_rows = (q_start + qi).to(tl.int64)
    q = tl.load(q_ptr + (q_rows * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    elif not KV_FP8:  # float8 K/V are converted to q's 16-bit dtype inside the dots
        q = q.to(k_cache_ptr.dtype.element_ty)
    q_pos = ctx + qi  # absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req.to(tl.int64) * stride_bt
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh

    # Keys < ctx + tile*BLOCK_Q + 1 are visible to every row of this tile: no causal mask there.
    first_pos = ctx + tile * BLOCK_Q
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    # Last key any row of the tile can see, + 1 (<= seq_len).
    end = ctx + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)
    offs_n = tl.arange(0, BLOCK_N)
    if USE_WINDOW:
        lo = tl.maximum(first_pos - window + 1, 0)  # oldest key any row's window holds
        # keys >= u0 are inside every row's window (u0 tile-aligned, so the unmasked loop reads
        # whole tiles); if u0 passes full_end no key is visible to all rows: u1 = u0
        u0 = tl.cdiv(tl.maximum(end - window, lo), BLOCK_N) * BLOCK_N
        u1 = tl.maximum(full_end, u0)
        edge_end = tl.minimum(u0, end)
        for start_n in range(lo, edge_end, BLOCK_N):
            n = start_n + offs_n
            nmask = n < edge_end
            k = _load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d,
                              dmask, BLOCK_SIZE)
            v = _load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d,
                              dmask, BLOCK_SIZE)
            valid = ((n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window)
                     & nmask[None, :])
            acc, m_i, l_i = _softmax_update(q, k, v, acc, m_i, l_i, valid, qk_scale, cap_in,
                                            cap_out, NATIVE_DOT, True, SOFTCAP)
    else:
        u0 = 0
        u1 = full_end
    for start_n in range(u0, u1, BLOCK_N):
        n = start_n + offs_n
        nmask = n < u1
        k = _load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask,
                          BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask,
                          BLOCK_SIZE)
        acc, m_i, l_i = _softmax_update(q, k, v, acc, m_i, l_i, nmask[None, :], qk_scale,
                                        cap_in, cap_out, NATIVE_DOT, False, SOFTCAP)
    for start_n in range(u1, end, BLOCK_N):
        n = start_n + offs_n
        nmask = n < end
        k = _load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask,
                          BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask,
                          BLOCK_SIZE)
        valid = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        if USE_WINDOW:
            valid = valid & (n[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = _softmax_update(q, k, v, acc, m_i, l_i, valid, qk_scale, cap_in, cap_out,
                                        NATIVE_DOT, True, SOFTCAP)

    # every row of a query token saw at least its own key, so l_i > 0 there; padding rows
    # (past q_len) may have seen none and are not stored
    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    o_rows = (q_start + qi).to(tl.int64)
    tl.store(out_ptr + (o_rows * stride_ot + head * stride_oh)[:, None] + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


# --------------------------------------------------------------------------------------------
# paged decode (+ split-K / Flash-Decoding combine)
# --------------------------------------------------------------------------------------------

@triton.jit
def _decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr,
                   part_o_ptr, part_lse_ptr, qk_scale, num_splits, window, cap_in, cap_out,
                   v_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                   GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
                   HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                   SPLIT: tl.constexpr, NATIVE_DOT: tl.constexpr, USE_WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, KV_FP8: tl.constexpr):
    """Program (request, kv_head, split). Without ``SPLIT`` it writes the final output; with it,
    the normalised partial output ``part_o[req, head, split, :]`` and its log2-sum-exp
    ``part_lse[req, head, split]`` (``-inf`` for an empty split). The keys read are
    ``[first, seq_len)``: all of them, or with ``USE_WINDOW`` the last ``window``."""
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    if USE_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = 0
    if SPLIT:
        # Chunk per split, rounded to whole tiles; computed from this request's own length so a
        # fixed split count (e.g. a captured CUDA graph) stays correct for any seq_len.
        chunk = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
        lo = first + split * chunk
        hi = tl.minimum(lo + chunk, seq_len)
    else:
        lo = first
        hi = seq_len

    g = tl.arange(0, BLOCK_G)
    gmask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    head = kvh * GROUP + g
    req64 = req.to(tl.int64)
    q = tl.load(q_ptr + (req64 * stride_qt + head * stride_qh)[:, None] + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)
    if not NATIVE_DOT:
        q = q.to(tl.float32)
    elif not KV_FP8:  # float8 K/V are converted to q's 16-bit dtype inside the dots
        q = q.to(k_cache_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    bt_row = bt_ptr + req64 * stride_bt
    k_head = kvh.to(tl.int64) * stride_kh
    v_head = kvh.to(tl.int64) * stride_vh
    offs_n = tl.arange(0, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        n = start_n + offs_n
        nmask = n < hi
        k = _load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask,
                          BLOCK_SIZE)
        v = _load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask,
                          BLOCK_SIZE)
        acc, m_i, l_i = _softmax_update(q, k, v, acc, m_i, l_i, nmask[None, :], qk_scale,
                                        cap_in, cap_out, NATIVE_DOT, True, SOFTCAP)

    nonempty = l_i > 0.0
    out = acc * (v_scale / tl.where(nonempty, l_i, 1.0))[:, None]  # empty (seq_len 0 / split) -> 0
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (req64 * (GROUP * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_o_ptr + (row * HEAD_DIM)[:, None] + d[None, :], out, mask=omask)
        tl.store(part_lse_ptr + row, lse, mask=gmask)
    else:
        tl.store(out_ptr + (req64 * stride_ot + head * stride_oh)[:, None] + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit
def _combine_kernel(part_o_ptr, part_lse_ptr, out_ptr, num_splits, num_heads,
                    stride_ot, stride_oh,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Program (request, head): ``out = sum_s w_s o_s / sum_s w_s`` with
    ``w_s = 2^(lse_s - max lse)`` (Flash-Decoding's final reduction)."""
    req = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < num_splits
    base = (req * num_heads + h) * num_splits
    lse = tl.load(part_lse_ptr + base + s, mask=smask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp2(lse - lse_max)
    denom = tl.sum(w, 0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < HEAD_DIM
    o = tl.load(part_o_ptr + ((base + s) * HEAD_DIM)[:, None] + d[None, :],
                mask=smask[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + req * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty),
             mask=dmask)


# --------------------------------------------------------------------------------------------
# host-side launchers
# --------------------------------------------------------------------------------------------

_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # interpreter: pretend to a small GPU so the split path is exercised
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 32


def choose_num_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """Split-K heuristic for decode (Flash-Decoding).

    ``num_reqs * num_kv_heads`` programs run without splitting; if that is fewer than about two
    waves over the SMs (``2 * num_sms``), split each request's keys so that the grid reaches
    two waves, but keep at least ``MIN_KEYS_PER_SPLIT`` keys per split (a split must amortise the
    combine pass and its own Q load) and at most ``MAX_SPLITS``. Rounded down to a power of two
    so the combine kernel compiles for few shapes.
    """
    programs = max(1, num_reqs * num_kv_heads)
    want = triton.cdiv(2 * num_sms, programs)
    cap = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    splits = max(1, min(want, cap, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


def _tiles(head_dim: int, native: bool) -> tuple[int, int]:
    """(rows per prefill tile, keys per tile). Large tiles in the interpreter (cost ~ per op)."""
    if _interpreting():
        return 128, 128
    if head_dim <= 64:
        return 128, 64
    if head_dim <= 128:
        return (128, 64) if native else (64, 32)
    return (64, 32) if native else (32, 32)


def _check_q(q: torch.Tensor, k_cache: torch.Tensor) -> tuple[int, int]:
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match cache {tuple(k_cache.shape)}")
    if q.stride(2) != 1:
        raise ValueError("q must have a contiguous last dimension")
    return num_heads // num_kv_heads, head_dim


def _window_softcap_args(window: int | None, softcap: float | None, scale: float) -> tuple:
    """Kernel arguments ``(window, cap_in, cap_out, USE_WINDOW, SOFTCAP)`` (see
    :func:`_softmax_update`). Raises ``ValueError`` for a window < 1 or a softcap <= 0."""
    AttentionBackend.check_window_softcap(window, softcap)
    if softcap is None:
        return (window or 0, 0.0, 0.0, window is not None, False)
    return (window or 0, scale / softcap, softcap * _LOG2E, window is not None, True)


def varlen_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             block_tables: torch.Tensor, seq_lens: torch.Tensor,
                             cu_seqlens_q: torch.Tensor, max_seqlen_q: int, scale: float,
                             out: torch.Tensor | None = None, block_m: int | None = None,
                             block_n: int | None = None, window: int | None = None,
                             softcap: float | None = None, k_scale: float = 1.0,
                             v_scale: float = 1.0) -> torch.Tensor:
    """Causal varlen attention of ``q`` over the paged cache (FlashAttention-2 forward).

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` fp32/fp16/bf16 (last dim contiguous).
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``; must already
            hold this step's K/V (call :func:`store_kv` first).
        block_tables: int32 ``[num_reqs, max_blocks_per_seq]``.
        seq_lens: int32 ``[num_reqs]``, tokens per request including this chunk.
        cu_seqlens_q: int32 ``[num_reqs + 1]``; request ``i``'s rows are its last
            ``cu_seqlens_q[i+1] - cu_seqlens_q[i]`` positions (any length >= 0, 1 included).
        max_seqlen_q: max query length (sizes the grid; larger is fine).
        out: optional ``[num_tokens, num_heads, head_dim]`` output (rows of no request are not
            written).
        block_m / block_n: tile overrides (rows = query tokens x padded group, keys).
        window: sliding window in tokens (query at ``p`` sees keys ``p - window < j <= p``);
            None = full causal attention.
        softcap: attention logit soft-capping (``softcap * tanh(scores / softcap)``); None = off.
        k_scale, v_scale: float8 e4m3 caches: the cached values times these are K and V (the
            scales fold into the score scale and the output; the dots see the raw float8
            values converted to q's 16-bit dtype, exactly). Ignored for other caches.

    Raises:
        ValueError: mismatched shapes, a window < 1 or a softcap <= 0.

    Grid: ``(cdiv(max_seqlen_q, BLOCK_Q), num_reqs, num_kv_heads)`` where ``BLOCK_Q =
    block_m // next_pow2(group)``; programs past their request's query length exit at once.
    Returns ``out`` in ``q.dtype``.
    """
    group, head_dim = _check_q(q, k_cache)
    _check_cache(k_cache)
    _check_cache(v_cache)
    kv_fp8 = k_cache.dtype == FP8
    if not kv_fp8:
        k_scale = v_scale = 1.0
    scale *= k_scale
    win, cap_in, cap_out, use_window, use_softcap = _window_softcap_args(window, softcap, scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_reqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_reqs == 0 or max_seqlen_q == 0:
        return out
    native = _native_dot(_dot_dtype(q, k_cache))
    dm, dn = _tiles(head_dim, native)
    block_m, block_n = block_m or dm, block_n or dn
    block_g = triton.next_power_of_2(group)
    block_q = max(1, block_m // block_g)
    if block_q * block_g < 16:  # tl.dot needs M >= 16 on GPU
        block_q = triton.cdiv(16, block_g)
    num_kv_heads = k_cache.shape[2]
    grid = (triton.cdiv(max_seqlen_q, block_q), num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out, scale * _LOG2E,
        win, cap_in, cap_out, v_scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, BLOCK_Q=block_q, BLOCK_N=block_n, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1],
        NATIVE_DOT=native, USE_WINDOW=use_window, SOFTCAP=use_softcap, KV_FP8=kv_fp8,
        num_warps=8 if block_q * block_g * head_dim >= 128 * 128 else 4,
        num_stages=2)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int, out: torch.Tensor | None = None,
                           num_splits: int | None = None, block_n: int | None = None,
                           window: int | None = None, softcap: float | None = None,
                           k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Decode attention: row ``i`` of ``q`` is request ``i``'s single (last) query.

    Args:
        q: ``[num_reqs, num_heads, head_dim]``.
        k_cache, v_cache, block_tables, seq_lens: as in :func:`varlen_prefill_attention`
            (``seq_lens`` may be 0 for padding rows: their output is 0).
        max_seq_len: upper bound of ``seq_lens`` (host int; only feeds the split heuristic).
        num_splits: split-K count; ``None`` = :func:`choose_num_splits`. Any value is correct
            for any ``seq_lens`` (each request's chunk is computed in the kernel).
        out: optional output ``[num_reqs, num_heads, head_dim]``.
        window, softcap: as in :func:`varlen_prefill_attention` (a windowed request reads and
            splits only its last ``window`` keys).
        k_scale, v_scale: as in :func:`varlen_prefill_attention` (float8 caches only).

    Raises:
        ValueError: mismatched shapes, a window < 1 or a softcap <= 0.

    Grid: ``(num_reqs, num_kv_heads, num_splits)``; with ``num_splits > 1`` partial results go
    to an fp32 workspace ``[num_reqs, num_heads, num_splits, head_dim]`` (+ log-sum-exp) that
    ``_combine_kernel`` (grid ``(num_reqs, num_heads)``) reduces into ``out``.
    """
    group, head_dim = _check_q(q, k_cache)
    _check_cache(k_cache)
    _check_cache(v_cache)
    kv_fp8 = k_cache.dtype == FP8
    if not kv_fp8:
        k_scale = v_scale = 1.0
    scale *= k_scale
    win, cap_in, cap_out, use_window, use_softcap = _window_softcap_args(window, softcap, scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_reqs, num_heads = q.shape[0], q.shape[1]
    if num_reqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    if num_splits is None:
        keys = min(max_seq_len, window) if window else max_seq_len
        num_splits = choose_num_splits(num_reqs, num_kv_heads, keys, _num_sms(q.device))
    native = _native_dot(_dot_dtype(q, k_cache))
    if block_n is None:  # float8 tiles are half the bytes: twice the keys per tile pays
        # (H100, batch 64, 8k context: 0.57 vs 0.70 ms at head_dim 128, 0.30 vs 0.34 at 64)
        if _interpreting():
            block_n = 128
        elif kv_fp8:
            block_n = max(32, min(256, 16384 // head_dim))
        else:
            block_n = 64 if head_dim <= 128 else 32
    block_g = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_o = torch.empty((num_reqs, num_heads, num_splits, head_dim), dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32,
                               device=q.device)
    else:
        part_o = part_lse = out  # unused
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_o, part_lse, scale * _LOG2E,
        num_splits, win, cap_in, cap_out, v_scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        GROUP=group, BLOCK_G=block_g, BLOCK_N=block_n, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1], SPLIT=split, NATIVE_DOT=native, USE_WINDOW=use_window,
        SOFTCAP=use_softcap, KV_FP8=kv_fp8, num_warps=4, num_stages=2)
    if split:
        _combine_kernel[(num_reqs, num_heads)](
            part_o, part_lse, out, num_splits, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2)
    return out


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, *, out: torch.Tensor | None = None,
                    num_splits: int | None = None, window: int | None = None,
                    softcap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """Backend entry point (same contract as :meth:`kernels.backend.AttentionBackend.forward`).

    Decode-only batches (every query length 1, one row per request) go to
    :func:`paged_decode_attention` (split-K when the grid would be small); anything else
    (prefill, chunked prefill, mixed prefill + decode rows) to :func:`varlen_prefill_attention`.
    ``window`` / ``softcap`` / ``k_scale`` / ``v_scale``: per layer, as in
    :func:`varlen_prefill_attention`.
    Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    if meta.decode_only and q.shape[0] == meta.num_reqs:
        return paged_decode_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                      scale, meta.max_seqlen_k, out=out, num_splits=num_splits,
                                      window=window, softcap=softcap, k_scale=k_scale,
                                      v_scale=v_scale)
    return varlen_prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                    meta.cu_seqlens_q, meta.max_seqlen_q, scale, out=out,
                                    window=window, softcap=softcap, k_scale=k_scale,
                                    v_scale=v_scale)


__all__ = ["store_kv", "paged_attention", "varlen_prefill_attention", "paged_decode_attention",
           "choose_num_splits"]
