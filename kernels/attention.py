"""Attention over the paged KV cache: one interface, several backends.

Cache layout (every backend): one key and one value tensor per layer, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. Token ``t`` of a request
lives in slot ``block_table[t // block_size] * block_size + t % block_size``.

Query tokens of all requests in a step are flattened into one ``[num_tokens,
num_heads, head_dim]`` tensor; request ``i`` owns rows ``cu_seqlens_q[i] :
cu_seqlens_q[i + 1]``, which are the *last* ``query_len`` positions of its
``seq_len`` tokens (earlier tokens are read from the cache: prefix-cache hits,
earlier chunks of a chunked prefill, or the decode context).

Backends: ``flash_attn`` (CUDA, if installed), ``triton`` (our kernels, CUDA or
``TRITON_INTERPRET=1``), ``torch`` (CPU reference path). ``KVSERVE_ATTENTION_BACKEND``
forces one.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("torch", "triton", "flash_attn")


@dataclass
class AttentionMetadata:
    """Per-step batch description shared by all layers.

    Attributes:
        cu_seqlens_q: int32 ``[num_reqs + 1]``, prefix sums of query lengths.
        seq_lens: int32 ``[num_reqs]``, tokens in the cache per request after this step
            (context + new tokens).
        block_tables: int32 ``[num_reqs, max_blocks_per_seq]``; unused entries are 0.
        slot_mapping: int64 ``[num_tokens]``, cache slot of each new token (-1 = skip).
        query_lens_cpu / seq_lens_cpu: the same lengths as Python lists (no device sync).
        max_seqlen_q / max_seqlen_k: maxima of the above (tokens).
    """

    cu_seqlens_q: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    slot_mapping: torch.Tensor
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    max_seqlen_q: int
    max_seqlen_k: int

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_seqlen_q == 1


def store_kv_torch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache slots
    ``slot_mapping`` (int64 ``[num_tokens]``; all slots must be valid, >= 0)."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int) -> torch.Tensor:
    """Contiguous ``[n, num_kv_heads, head_dim]`` copy of the first ``n`` tokens of a request."""
    bs = cache.shape[1]
    nblocks = (n + bs - 1) // bs
    return cache[block_table[:nblocks]].flatten(0, 1)[:n]


#: Decode rows per length bucket of the torch path (see :func:`_decode_plan`).
DECODE_BUCKET_ROWS = 16


def _decode_plan(meta: AttentionMetadata, k_cache: torch.Tensor) -> list[tuple]:
    """Gather plan of the step's decode rows, computed once per step and kept on ``meta``
    (all layers share it).

    Decode rows are sorted by ``seq_len`` and cut into buckets of at most
    ``DECODE_BUCKET_ROWS``, a new bucket also starting where a row is more than twice as long
    as the bucket's first (plus a block), so each bucket pads only to its own longest request
    and no short request pays for a long one (one 8k-token request among eight 300-token ones
    would otherwise make every decode step gather ~9x the K/V). Per bucket: query rows ``[b]``; row
    indices into the cache viewed as ``[num_slots * num_kv_heads, head_dim]``, head-major per
    request ``[b * Hkv * L]``; and an additive mask ``[b, 1, 1, L]`` (0 / -inf) over positions
    past each request's seq_len (those read the request's first token, so every value stays
    finite)."""
    if hasattr(meta, "_torch_decode_plan"):
        return meta._torch_decode_plan
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0]
    for n in qlens[:-1]:
        starts.append(starts[-1] + n)
    decode = sorted((i for i, n in enumerate(qlens) if n == 1), key=lambda i: slens[i])
    device, (_, block_size, num_kv_heads, _) = k_cache.device, k_cache.shape
    heads = torch.arange(num_kv_heads, device=device)
    buckets: list[list[int]] = []
    for i in decode:
        if not buckets or len(buckets[-1]) == DECODE_BUCKET_ROWS or slens[i] > 2 * slens[buckets[-1][0]] + block_size:
            buckets.append([])
        buckets[-1].append(i)
    plan = []
    for bucket in buckets:
        idx = torch.tensor(bucket, dtype=torch.long, device=device)
        rows = torch.tensor([starts[i] for i in bucket], dtype=torch.long, device=device)
        length = slens[bucket[-1]]
        bt = meta.block_tables[idx, :-(-length // block_size)].long()
        pos = torch.arange(length, device=device)
        slots = bt[:, pos // block_size] * block_size + pos % block_size  # [b, L]
        pad = pos[None, :] >= meta.seq_lens[idx].long()[:, None]
        slots = torch.where(pad, slots[:, :1], slots)
        gather = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
        mask = torch.zeros(pad.shape, dtype=k_cache.dtype, device=device).masked_fill_(pad, float("-inf"))
        plan.append((rows, gather, mask[:, None, None, :]))
    meta._torch_decode_plan = plan
    return plan


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Decode rows (query length 1), in buckets of similar length, gather their K/V through the
    block tables straight into ``[B, num_kv_heads, L, head_dim]`` and run one batched
    ``scaled_dot_product_attention`` per bucket, in which the query heads sharing a KV head
    are that head's query rows (GQA without repeating K/V; padding masked).
    Each prefill chunk runs one SDPA over its ``seq_len`` cached tokens, causal with the
    mask aligned to the bottom right (query ``j`` of the chunk sees positions ``<= seq_len -
    query_len + j``). With 4-D inputs both go to torch's fused FlashAttention-style CPU
    kernel (tiled online softmax, Dao 2023) instead of materialising the scores. Returns
    ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu

    for rows, gather, mask in _decode_plan(meta, k_cache):
        b, length = mask.shape[0], mask.shape[-1]
        k = k_cache.view(-1, head_dim).index_select(0, gather).view(b, num_kv_heads, length, head_dim)
        v = v_cache.view(-1, head_dim).index_select(0, gather).view(b, num_kv_heads, length, head_dim)
        # the query heads of one KV head act as its "query tokens": K/V are read once per KV head
        qd = q[rows].to(k.dtype).view(b, num_kv_heads, num_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        out[rows] = o.reshape(b, num_heads, head_dim).to(q.dtype)

    s = 0
    for i, (qlen, slen) in enumerate(zip(qlens, slens)):
        if qlen <= 1:
            s += qlen
            continue
        k = _gather(k_cache, meta.block_tables[i], slen).transpose(0, 1)[None]  # [1, Hkv, L, D]
        v = _gather(v_cache, meta.block_tables[i], slen).transpose(0, 1)[None]
        qi = q[s:s + qlen].transpose(0, 1)[None].to(k.dtype)  # [1, Hq, qlen, D]
        if qlen == slen:  # no cached context: plain causal
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(slen - qlen, slen, device=q.device)
            mask = torch.arange(slen, device=q.device)[None, :] <= qpos[:, None]  # [qlen, L]
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s:s + qlen] = o[0].transpose(0, 1).to(q.dtype)
        s += qlen
    return out


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available()


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def select_backend(device: torch.device | str, requested: str | None = None) -> str:
    """Pick the attention backend for ``device``.

    Order: ``requested`` argument, then ``KVSERVE_ATTENTION_BACKEND``, then
    flash-attn (CUDA, importable) -> triton (CUDA) -> torch.

    Raises:
        ValueError: unknown backend name, or a backend that cannot run here.
    """
    name = requested or os.environ.get("KVSERVE_ATTENTION_BACKEND") or None
    device = torch.device(device)
    if name is None:
        if device.type == "cuda":
            return "flash_attn" if flash_attn_available() else "triton"
        return "torch"
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "flash_attn" and not flash_attn_available():
        raise ValueError("attention_backend='flash_attn' needs CUDA and the flash-attn package")
    if name == "triton" and not (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        raise ValueError("attention_backend='triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return name


class PagedAttention:
    """Backend dispatch used by the model: ``store_kv`` then ``forward``.

    Args:
        backend: one of ``BACKENDS`` (see :func:`select_backend`).
    """

    def __init__(self, backend: str = "torch"):
        self.backend = backend
        if backend == "triton":
            from kernels import triton_attention as impl
            self._store, self._attend = impl.store_kv, impl.paged_attention
        elif backend == "flash_attn":
            from kernels import flash_attn_backend as impl
            self._store, self._attend = impl.store_kv, impl.paged_attention
        else:
            self._store, self._attend = store_kv_torch, paged_attention_torch

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._store(key, value, k_cache, v_cache, slot_mapping)

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return self._attend(q, k_cache, v_cache, meta, scale)
