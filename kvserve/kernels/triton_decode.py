"""Triton paged decode attention, split-K (Flash-Decoding), with its combine pass.

One query per request. ``_decode_kernel``'s program is (request, KV head, split); the GQA
group's query heads are the rows of a ``[BLOCK_G, head_dim]`` tile (padded to 16 for
``tl.dot``). With ``num_splits > 1`` the key range of each request is cut into ``num_splits``
chunks that run in parallel and write a normalised partial output plus its log-sum-exp;
``_combine_kernel`` merges them with the log-sum-exp rescaling (Flash-Decoding: Dao, Haziza,
Massa, Sizov, 2023, "Flash-Decoding for long-context inference", PyTorch/Stanford CRFM blog).
This keeps all SMs busy when ``batch x num_kv_heads`` is small and contexts are long
(:func:`choose_num_splits`). With a sliding window only the last ``window`` keys are split and
read.
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
def _decode_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    qk_scale,
    num_splits,
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
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    SPLIT: tl.constexpr,
    NATIVE_DOT: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
):
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
    q = tl.load(
        q_ptr + (req64 * stride_qt + head * stride_qh)[:, None] + d[None, :],
        mask=gmask[:, None] & dmask[None, :],
        other=0.0,
    )
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
        k = load_kv_tile(k_cache_ptr, bt_row, n, nmask, k_head, stride_kb, stride_ks, d, dmask, BLOCK_SIZE)
        v = load_kv_tile(v_cache_ptr, bt_row, n, nmask, v_head, stride_vb, stride_vs, d, dmask, BLOCK_SIZE)
        acc, m_i, l_i = softmax_update(
            q, k, v, acc, m_i, l_i, nmask[None, :], qk_scale, cap_in, cap_out, NATIVE_DOT, True, SOFTCAP
        )

    nonempty = l_i > 0.0
    out = acc * (v_scale / tl.where(nonempty, l_i, 1.0))[:, None]  # empty (seq_len 0 / split) -> 0
    omask = gmask[:, None] & dmask[None, :]
    if SPLIT:
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        row = (req64 * (GROUP * tl.num_programs(1)) + head) * num_splits + split
        tl.store(part_o_ptr + (row * HEAD_DIM)[:, None] + d[None, :], out, mask=omask)
        tl.store(part_lse_ptr + row, lse, mask=gmask)
    else:
        tl.store(
            out_ptr + (req64 * stride_ot + head * stride_oh)[:, None] + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=omask,
        )


@triton.jit
def _combine_kernel(
    part_o_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    num_heads,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
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
    o = tl.load(
        part_o_ptr + ((base + s) * HEAD_DIM)[:, None] + d[None, :], mask=smask[:, None] & dmask[None, :], other=0.0
    )
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + req * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=dmask)


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


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
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
    num_reqs, num_heads = q.shape[0], q.shape[1]
    if num_reqs == 0:
        return out
    num_kv_heads = k_cache.shape[2]
    if num_splits is None:
        keys = min(max_seq_len, window) if window else max_seq_len
        num_splits = choose_num_splits(num_reqs, num_kv_heads, keys, _num_sms(q.device))
    native = native_dot(dot_dtype(q, k_cache))
    if block_n is None:  # float8 tiles are half the bytes: twice the keys per tile pays
        # (measured by benchmarks/gpu.py: paged decode with kv_cache_dtype fp8)
        if interpreting():
            block_n = 128
        elif kv_fp8:
            block_n = max(32, min(256, 16384 // head_dim))
        else:
            block_n = 64 if head_dim <= 128 else 32
    block_g = max(16, triton.next_power_of_2(group))
    block_d = triton.next_power_of_2(head_dim)
    split = num_splits > 1
    if split:
        part_o = torch.empty((num_reqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # unused
    _decode_kernel[(num_reqs, num_kv_heads, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        out,
        part_o,
        part_lse,
        scale * LOG2E,
        num_splits,
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
        BLOCK_N=block_n,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_SIZE=k_cache.shape[1],
        SPLIT=split,
        NATIVE_DOT=native,
        USE_WINDOW=use_window,
        SOFTCAP=use_softcap,
        KV_FP8=kv_fp8,
        num_warps=4,
        num_stages=2,
    )
    if split:
        _combine_kernel[(num_reqs, num_heads)](
            part_o,
            part_lse,
            out,
            num_splits,
            num_heads,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out
