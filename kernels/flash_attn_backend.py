"""Attention backend on the ``flash-attn`` package (Dao-AILab FlashAttention-2), imported lazily.

Same contract as :mod:`kernels.attention` (cache ``[num_blocks, block_size, num_kv_heads,
head_dim]``, flattened varlen queries, each request's queries are its last ``query_len``
positions, causal). flash-attn's causal mask is aligned to the bottom-right corner when
``seqlen_q != seqlen_k`` (since 2.1), which is exactly that convention.

* Decode-only batches: ``flash_attn_with_kvcache(q[:, None], k_cache, v_cache,
  cache_seqlens=seq_lens, block_table=block_tables, causal=True)`` (split-K chosen by
  flash-attn's own heuristic, ``num_splits=0``).
* Anything else: ``flash_attn_varlen_func(q, k_cache, v_cache, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, causal=True, block_table=block_tables)``, K/V read from the
  paged cache, so prefix-cache hits and chunked prefill need no gather.

Limits of upstream flash-attn 2.x, where we fall back to our Triton kernels
(:mod:`kernels.triton_attention`) instead of failing:

* paged KV needs ``block_size % 256 == 0`` ("Paged KV cache block size must be divisible by
  256"); kvserve's default block size is 16;
* fp16/bf16 only (no fp32), ``head_dim <= 256``;
* ``block_table`` in ``flash_attn_varlen_func`` exists only in newer 2.x releases (2.6+).

``store_kv`` is the Triton scatter (any dtype, skips negative slots).
"""
from __future__ import annotations

import inspect
import warnings

import torch

from kernels.attention import AttentionMetadata

PAGE_BLOCK_MULTIPLE = 256  # flash-attn 2.x requirement for a paged (block_table) cache

_funcs: tuple | None = None
_warned: set[str] = set()


def _flash():
    """``(flash_attn_varlen_func, flash_attn_with_kvcache, varlen_has_block_table)``."""
    global _funcs
    if _funcs is None:
        try:
            from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
        except ImportError as exc:  # pragma: no cover - not installable without CUDA
            raise ImportError("attention_backend='flash_attn' needs the flash-attn package "
                              "(pip install flash-attn --no-build-isolation, CUDA only)") from exc
        has_bt = "block_table" in inspect.signature(flash_attn_varlen_func).parameters
        _funcs = (flash_attn_varlen_func, flash_attn_with_kvcache, has_bt)
    return _funcs


def _fallback(reason: str):
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flash_attn backend: {reason}; using the Triton kernels", stacklevel=3)
    from kernels import triton_attention
    return triton_attention.paged_attention


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` to the cache slots
    ``slot_mapping`` (int64, ``-1`` skipped). Triton on CUDA, torch otherwise."""
    if k_cache.is_cuda:
        from kernels.triton_attention import store_kv as triton_store
        triton_store(key, value, k_cache, v_cache, slot_mapping)
        return
    from kernels.attention import store_kv_torch
    keep = slot_mapping >= 0
    store_kv_torch(key[keep], value[keep], k_cache, v_cache, slot_mapping[keep])


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` (fp16/bf16, CUDA) over the
    paged cache; returns ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``."""
    if k_cache.shape[1] % PAGE_BLOCK_MULTIPLE:
        return _fallback(f"block_size {k_cache.shape[1]} is not a multiple of "
                         f"{PAGE_BLOCK_MULTIPLE}")(q, k_cache, v_cache, meta, scale)
    if k_cache.dtype not in (torch.float16, torch.bfloat16) or k_cache.shape[3] > 256:
        return _fallback(f"dtype {k_cache.dtype} / head_dim {k_cache.shape[3]} unsupported")(
            q, k_cache, v_cache, meta, scale)
    varlen, with_kvcache, has_bt = _flash()
    out_dtype = q.dtype
    q = q.to(k_cache.dtype)
    if meta.decode_only and q.shape[0] == meta.num_reqs:
        out = with_kvcache(q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.seq_lens,
                           block_table=meta.block_tables, softmax_scale=scale, causal=True)
        return out.squeeze(1).to(out_dtype)
    if not has_bt:
        return _fallback("flash_attn_varlen_func has no block_table (flash-attn < 2.6)")(
            q, k_cache, v_cache, meta, scale).to(out_dtype)
    cu_seqlens_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=q.device)
    cu_seqlens_k[1:] = torch.cumsum(meta.seq_lens, 0, dtype=torch.int32)
    out = varlen(q, k_cache, v_cache, cu_seqlens_q=meta.cu_seqlens_q,
                 cu_seqlens_k=cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                 max_seqlen_k=meta.max_seqlen_k, softmax_scale=scale, causal=True,
                 block_table=meta.block_tables)
    return out.to(out_dtype)
