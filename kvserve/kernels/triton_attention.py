"""Triton kernels for attention over the paged KV cache (our own, FlashAttention-2 style).

Everything here follows the conventions of :mod:`kvserve.kernels.backend`:

* Cache, per layer: ``k_cache`` / ``v_cache`` ``[num_blocks, block_size, num_kv_heads, head_dim]``
  (fp32, fp16, bf16, or float8 e4m3 with a per-layer ``k_scale`` / ``v_scale``; each slot's
  ``[num_kv_heads, head_dim]`` row contiguous). Token ``t`` of a request lives in slot
  ``block_table[t // block_size] * block_size + t % block_size``.
* Queries: ``q`` ``[num_tokens, num_heads, head_dim]`` (last dim contiguous), request ``i`` owns rows
  ``cu_seqlens_q[i]:cu_seqlens_q[i+1]``, which are the *last* ``query_len`` of its ``seq_len``
  positions; attention is causal (query at absolute position ``p`` sees keys ``0..p``).
* Grouped-query attention: query head ``h`` reads KV head ``h // (num_heads // num_kv_heads)``.
* Optional per-layer sliding ``window`` (query at ``p`` sees keys ``p - window < j <= p``) and
  attention logit ``softcap`` (scores ``softcap * tanh(scale * q.k / softcap)``), both
  ``constexpr``-gated so layers without them run the plain kernels.

Modules, one kernel family each with its launcher:

* :mod:`kvserve.kernels.triton_store_kv`: :func:`store_kv`, the scatter of new K/V rows into their
  slots (``slot < 0`` skipped; float8 encoded in the kernel).
* :mod:`kvserve.kernels.triton_prefill`: :func:`varlen_prefill_attention`, FlashAttention-2's tiled
  online softmax over the cached prefix and the chunk (also the ``query_len == 1`` rows of a
  mixed batch).
* :mod:`kvserve.kernels.triton_decode`: :func:`paged_decode_attention`, one query per request, split-K
  with a combine pass (Flash-Decoding) when the grid would be small; :func:`choose_num_splits`.
* :mod:`kvserve.kernels.triton_common`: what they share (matmul dtype, checks, the K/V tile gather, the
  online-softmax step).

This module holds the backend's entry point, :func:`paged_attention`, which picks prefill or
decode per batch, and re-exports the public names above.

Numerics: softmax statistics and accumulators are always fp32 (``exp2`` with ``scale * log2(e)``
folded in). The two matmuls take fp16/bf16 operands with fp32 accumulation on a GPU (tensor
cores, as FlashAttention does); fp32 caches use ``ieee`` fp32 dots. Under ``TRITON_INTERPRET=1``
bf16 ``tl.dot`` is wrong in Triton 3.9, so bf16 operands are converted to fp32 first there.

Triton caveats honoured: no ``make_block_ptr`` (plain pointer arithmetic, also needed for the
block-table gather), no autotuning (tile sizes by heuristic), every ``tl.dot`` dimension >= 16.
"""

from __future__ import annotations

import torch

from kvserve.kernels.backend import AttentionMetadata
from kvserve.kernels.triton_decode import (
    MAX_SPLITS,
    MIN_KEYS_PER_SPLIT,
    _num_sms,
    choose_num_splits,
    paged_decode_attention,
)
from kvserve.kernels.triton_prefill import varlen_prefill_attention
from kvserve.kernels.triton_store_kv import store_kv


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """Backend entry point (same contract as :meth:`kvserve.kernels.backend.AttentionBackend.forward`).

    Decode-only batches (every query length 1, one row per request) go to
    :func:`paged_decode_attention` (split-K when the grid would be small); anything else
    (prefill, chunked prefill, mixed prefill + decode rows) to :func:`varlen_prefill_attention`.
    ``window`` / ``softcap`` / ``k_scale`` / ``v_scale``: per layer, as in
    :func:`varlen_prefill_attention`.
    Returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    if meta.decode_only and q.shape[0] == meta.num_reqs:
        return paged_decode_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            scale,
            meta.max_seqlen_k,
            out=out,
            num_splits=num_splits,
            window=window,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
        )
    return varlen_prefill_attention(
        q,
        k_cache,
        v_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.cu_seqlens_q,
        meta.max_seqlen_q,
        scale,
        out=out,
        window=window,
        softcap=softcap,
        k_scale=k_scale,
        v_scale=v_scale,
    )


__all__ = [
    "store_kv",
    "paged_attention",
    "varlen_prefill_attention",
    "paged_decode_attention",
    "choose_num_splits",
    "MIN_KEYS_PER_SPLIT",
    "MAX_SPLITS",
    "_num_sms",
]
