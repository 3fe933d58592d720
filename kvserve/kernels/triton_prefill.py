"""Triton varlen prefill attention over the paged KV cache (FlashAttention-2 forward).

``_prefill_kernel`` computes varlen causal attention of every query row over the request's
cached prefix *and* the chunk itself, read through the block table (so prefix-cache hits and
chunked prefill starting in the middle of a block need nothing special); it also runs the
``query_len == 1`` rows of a mixed batch. Tiled online softmax of FlashAttention-2 (Dao, 2023,
"FlashAttention-2: Faster Attention with Better Parallelism and Work Partitioning", Algorithm 1 /
Section 3.1): one program owns a tile of query rows, streams K/V tiles through SRAM, keeps
running max ``m``, denominator ``l`` and the unnormalised output ``acc`` in fp32 and rescales
once at the end; the ``N x N`` score matrix never exists in memory. Parallelism is over (query
tile, request, KV head) (Section 3.2: parallelise over the sequence dimension too, not only
batch x heads). The query heads of one GQA group are packed into the row dimension of the tile,
so each K/V tile is loaded once per group. Key tiles entirely below the causal diagonal run
without a mask, only the diagonal tiles are masked, and tiles above it are skipped (Section
3.1.1, "causal masking"). With a sliding window the same holds at the band's other edge: keys
older than every row's window are skipped, keys inside every row's window run unmasked, only
the tiles straddling the window edge are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_common import (
    FP8,
    LOG2E,
    check_cache,
    check_q,
    dot_dtype,
    interpreting,
    load_kv_tile,
    native_dot,
    softmax_update,
    window_softcap_args,
)


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    cu_q_ptr,
    out_ptr,
    qk_scale,
    window,
    cap_in,
    cap_out,
    v_scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
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
    q = tl.load(
        q_ptr + (q_rows * stride_qt + head * stride_qh)[:, None] + d[None, :],
        mask=rmask[:, None] & dmask[None, :],
        other=0.0,
    )
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
            k = load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask, BLOCK_SIZE)
            v = load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask, BLOCK_SIZE)
            valid = (n[None, :] <= q_pos[:, None]) & (n[None, :] > q_pos[:, None] - window) & nmask[None, :]
            acc, m_i, l_i = softmax_update(
                q, k, v, acc, m_i, l_i, valid, qk_scale, cap_in, cap_out, NATIVE_DOT, True, SOFTCAP
            )
    else:
        u0 = 0
        u1 = full_end
    for start_n in range(u0, u1, BLOCK_N):
        n = start_n + offs_n
        nmask = n < u1
        k = load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask, BLOCK_SIZE)
        v = load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask, BLOCK_SIZE)
        acc, m_i, l_i = softmax_update(
            q, k, v, acc, m_i, l_i, nmask[None, :], qk_scale, cap_in, cap_out, NATIVE_DOT, False, SOFTCAP
        )
    for start_n in range(u1, end, BLOCK_N):
        n = start_n + offs_n
        nmask = n < end
        k = load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask, BLOCK_SIZE)
        v = load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask, BLOCK_SIZE)
        valid = (n[None, :] <= q_pos[:, None]) & nmask[None, :]
        if USE_WINDOW:
            valid = valid & (n[None, :] > q_pos[:, None] - window)
        acc, m_i, l_i = softmax_update(
            q, k, v, acc, m_i, l_i, valid, qk_scale, cap_in, cap_out, NATIVE_DOT, True, SOFTCAP
        )

    # every row of a query token saw at least its own key, so l_i > 0 there; padding rows
    # (past q_len) may have seen none and are not stored
    out = acc * (v_scale / tl.where(l_i > 0.0, l_i, 1.0))[:, None]
    o_rows = (q_start + qi).to(tl.int64)
    tl.store(
        out_ptr + (o_rows * stride_ot + head * stride_oh)[:, None] + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=rmask[:, None] & dmask[None, :],
    )


def _tiles(head_dim: int, native: bool) -> tuple[int, int]:
    """(rows per prefill tile, keys per tile). Large tiles in the interpreter (cost ~ per op)."""
    if interpreting():
        return 128, 128
    if head_dim <= 64:
        return 128, 64
    if head_dim <= 128:
        return (128, 64) if native else (64, 32)
    return (64, 32) if native else (32, 32)


def varlen_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
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
    group, head_dim = check_q(q, k_cache)
    check_cache(k_cache)
    check_cache(v_cache)
    kv_fp8 = k_cache.dtype == FP8
    if not kv_fp8:
        k_scale = v_scale = 1.0
    scale *= k_scale
    win, cap_in, cap_out, use_window, use_softcap = window_softcap_args(window, softcap, scale)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    num_reqs = seq_lens.shape[0]
    if q.shape[0] == 0 or num_reqs == 0 or max_seqlen_q == 0:
        return out
    native = native_dot(dot_dtype(q, k_cache))
    dm, dn = _tiles(head_dim, native)
    block_m, block_n = block_m or dm, block_n or dn
    block_g = triton.next_power_of_2(group)
    block_q = max(1, block_m // block_g)
    if block_q * block_g < 16:  # tl.dot needs M >= 16 on GPU
        block_q = triton.cdiv(16, block_g)
    num_kv_heads = k_cache.shape[2]
    grid = (triton.cdiv(max_seqlen_q, block_q), num_reqs, num_kv_heads)
    _prefill_kernel[grid](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        cu_seqlens_q,
        out,
        scale * LOG2E,
        win,
        cap_in,
        cap_out,
        v_scale,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        BLOCK_G=block_g,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=k_cache.shape[1],
        NATIVE_DOT=native,
        USE_WINDOW=use_window,
        SOFTCAP=use_softcap,
        KV_FP8=kv_fp8,
        num_warps=8 if block_q * block_g * head_dim >= 128 * 128 else 4,
        num_stages=2,
    )
    return out
