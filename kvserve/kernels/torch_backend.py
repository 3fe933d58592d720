"""The torch attention backend: the CPU path (also runs on CUDA, without CUDA graphs).

Pure PyTorch over the paged cache of :mod:`kvserve.kernels.backend`: K/V are gathered through the block
tables and fed to ``scaled_dot_product_attention``, whose fused CPU kernel is FlashAttention-style
(tiled online softmax, Dao 2023). Any device, any float dtype, any block size; sliding windows
and logit soft-capping per layer.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvserve.kernels.backend import AttentionBackend, AttentionMetadata


FP8 = torch.float8_e4m3fn
#: Largest finite float8 e4m3fn value; stored values are clamped to it (e4m3fn has no inf).
FP8_MAX = 448.0


def store_kv_torch(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` into the cache slots
    ``slot_mapping`` (int64 ``[num_tokens]``; all slots must be valid, >= 0). A float8 e4m3
    cache stores ``clamp(x / scale, +-448)`` (``k_scale`` / ``v_scale``: the layer's scales);
    other caches store ``x`` in their dtype and ignore the scales."""
    nb, bs, h, d = k_cache.shape
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        if cache.dtype == FP8:  # ATen has no index_copy_ for float8: copy the bytes
            q = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)
            cache.view(torch.uint8).view(nb * bs, h, d).index_copy_(0, slot_mapping, q)
        else:
            cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, x.to(cache.dtype))


def dequantize(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x`` read from a cache: float8 values times ``scale`` in float32; other caches' values
    as they are (their own dtype)."""
    if x.dtype == FP8:
        return x.to(torch.float32).mul_(scale)
    return x


def _gather(cache: torch.Tensor, block_table: torch.Tensor, n: int, start: int = 0) -> torch.Tensor:
    """Contiguous ``[n - start, num_kv_heads, head_dim]`` copy of tokens ``start .. n - 1`` of a
    request (only the blocks holding them are read)."""
    bs = cache.shape[1]
    first, nblocks = start // bs, (n + bs - 1) // bs
    src = cache.view(torch.uint8) if cache.dtype == FP8 else cache  # no float8 indexing in ATen
    out = src[block_table[first:nblocks]].flatten(0, 1)[start - first * bs : n - first * bs]
    return out.view(FP8) if cache.dtype == FP8 else out


#: Decode rows per length bucket of the torch path (see :func:`_decode_plan`).
DECODE_BUCKET_ROWS = 16


def _decode_plan(meta: AttentionMetadata, k_cache: torch.Tensor, window: int | None = None) -> list[tuple]:
    """Gather plan of the step's decode rows for one sliding ``window`` (None: full attention),
    computed once per step and window and kept on ``meta`` (all layers share it).

    Each decode row reads its last ``min(seq_len, window)`` keys (all ``seq_len`` without a
    window). Rows are sorted by that length and cut into buckets of at most
    ``DECODE_BUCKET_ROWS``, a new bucket also starting where a row is more than twice as long
    as the bucket's first (plus a block), so each bucket pads only to its own longest request
    and no short request pays for a long one (one 8k-token request among eight 300-token ones
    would otherwise make every decode step gather ~9x the K/V). Per bucket: query rows ``[b]``; row
    indices into the cache viewed as ``[num_slots * num_kv_heads, head_dim]``, head-major per
    request ``[b * Hkv * L]``; and an additive mask ``[b, 1, 1, L]`` (0 / -inf) over the padding
    past each row's length (padding reads the row's first visible token, so every value stays
    finite)."""
    plans = meta.__dict__.setdefault("_torch_decode_plans", {})
    if window in plans:
        return plans[window]
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    starts = [0]
    for n in qlens[:-1]:
        starts.append(starts[-1] + n)
    length_of = [min(s, window) if window else s for s in slens]  # keys each row reads
    decode = sorted((i for i, n in enumerate(qlens) if n == 1), key=lambda i: length_of[i])
    device, (_, block_size, num_kv_heads, _) = k_cache.device, k_cache.shape
    heads = torch.arange(num_kv_heads, device=device)
    buckets: list[list[int]] = []
    for i in decode:
        if (
            not buckets
            or len(buckets[-1]) == DECODE_BUCKET_ROWS
            or length_of[i] > 2 * length_of[buckets[-1][0]] + block_size
        ):
            buckets.append([])
        buckets[-1].append(i)
    plan = []
    for bucket in buckets:
        idx = torch.tensor(bucket, dtype=torch.long, device=device)
        rows = torch.tensor([starts[i] for i in bucket], dtype=torch.long, device=device)
        length = length_of[bucket[-1]]
        lens = torch.tensor([length_of[i] for i in bucket], dtype=torch.long, device=device)
        first = torch.tensor([slens[i] - length_of[i] for i in bucket], dtype=torch.long, device=device)
        j = torch.arange(length, device=device)
        pad = j[None, :] >= lens[:, None]  # [b, L]
        pos = first[:, None] + torch.where(pad, 0, j[None, :])
        bt = meta.block_tables[idx].long()
        slots = bt.gather(1, pos // block_size) * block_size + pos % block_size  # [b, L]
        gather = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
        mask_dtype = torch.float32 if k_cache.dtype == FP8 else k_cache.dtype  # float8 K/V are read as float32
        mask = torch.zeros(pad.shape, dtype=mask_dtype, device=device).masked_fill_(pad, float("-inf"))
        plan.append((rows, gather, mask[:, None, None, :]))
    plans[window] = plan
    return plan


def _rows(cache: torch.Tensor, head_dim: int, index: torch.Tensor, scale: float) -> torch.Tensor:
    """Rows ``index`` of ``cache`` viewed as ``[num_slots * num_kv_heads, head_dim]`` (a float8
    cache's dequantized to float32, see :func:`dequantize`)."""
    if cache.dtype == FP8:
        return dequantize(cache.view(torch.uint8).view(-1, head_dim).index_select(0, index).view(FP8), scale)
    return cache.view(-1, head_dim).index_select(0, index)


def _softcap_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with tanh logit soft-capping (Gemma 2), which SDPA has no option for.

    ``q`` ``[B, Hkv, G, M, D]`` (the ``G`` query heads of each KV head), ``k``/``v``
    ``[B, Hkv, L, D]``, ``mask`` broadcastable to ``[B, Hkv, G, M, L]``: bool (True = attend)
    or additive float, or None. Scores ``softcap * tanh(scale * q.k / softcap)``, softmax in
    float32 as Hugging Face's eager attention. Returns ``[B, Hkv, G, M, D]`` in ``q.dtype``.
    """
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)).float() * scale
    s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask
    return torch.matmul(s.softmax(dim=-1).to(v.dtype), v.unsqueeze(2)).to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``q`` ``[num_tokens, num_heads, head_dim]`` over the paged cache.

    Decode rows (query length 1), in buckets of similar length, gather their K/V through the
    block tables straight into ``[B, num_kv_heads, L, head_dim]`` and run one batched
    ``scaled_dot_product_attention`` per bucket, in which the query heads sharing a KV head
    are that head's query rows (GQA without repeating K/V; padding masked).
    Each prefill chunk runs one SDPA over its ``seq_len`` cached tokens, causal with the
    mask aligned to the bottom right (query ``j`` of the chunk sees positions ``<= seq_len -
    query_len + j``). With 4-D inputs both go to torch's fused FlashAttention-style CPU
    kernel (tiled online softmax, Dao 2023) instead of materialising the scores.

    ``window`` (sliding window, tokens): the query at position ``p`` sees keys ``p - window <
    j <= p`` only; decode rows gather just their last ``window`` keys, a prefill chunk the keys
    from ``first query position - window + 1`` on, with the band masked. ``softcap``: scores
    become ``softcap * tanh(scores / softcap)``; SDPA cannot do that, so those layers take an
    explicit matmul-softmax-matmul path (:func:`_softcap_attention`). ``key`` / ``value``
    (this step's K/V ``[num_tokens, num_kv_heads, head_dim]``): with a float8 cache a prefill
    chunk attends to its own tokens through them instead of their float8 copies (see
    :func:`prefill_attention_torch`); decode rows read the cache. Returns
    ``[num_tokens, num_heads, head_dim]`` in ``q.dtype``.

    Raises:
        ValueError: a ``window`` < 1 or a ``softcap`` <= 0.
    """
    AttentionBackend.check_window_softcap(window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)

    for rows, gather, mask in _decode_plan(meta, k_cache, window):
        b, length = mask.shape[0], mask.shape[-1]
        k = _rows(k_cache, head_dim, gather, k_scale).view(b, num_kv_heads, length, head_dim)
        v = _rows(v_cache, head_dim, gather, v_scale).view(b, num_kv_heads, length, head_dim)
        # the query heads of one KV head act as its "query tokens": K/V are read once per KV head
        qd = q[rows].to(k.dtype).view(b, num_kv_heads, group, head_dim)
        if softcap is None:
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=mask, scale=scale)
        else:
            o = _softcap_attention(qd.unsqueeze(3), k, v, mask.unsqueeze(3), scale, softcap)
        out[rows] = o.reshape(b, num_heads, head_dim).to(q.dtype)
    return prefill_attention_torch(
        q, k_cache, v_cache, meta, scale, window, softcap, out, k_scale=k_scale, v_scale=v_scale, key=key, value=value
    )


def prefill_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
    out: torch.Tensor,
    min_query_len: int = 2,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
) -> torch.Tensor:
    """The prefill half of :func:`paged_attention_torch`: writes the rows of ``out`` of every
    request whose query length is >= ``min_query_len`` (one SDPA per chunk over its gathered
    K/V) and returns ``out``; other rows are left alone.

    With a float8 cache and ``key`` / ``value`` given (this step's K/V, ``[num_tokens,
    num_kv_heads, head_dim]``, rows aligned with ``q``), the chunk's own rows of the gathered,
    dequantized K/V are replaced by them: a chunk's attention over itself is exact and only
    context cached by earlier steps carries float8 rounding (SGLang's extend attention and
    vLLM's V0 prefill do the same). Other caches ignore ``key`` / ``value``."""
    num_kv_heads, group = k_cache.shape[2], q.shape[1] // k_cache.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    qlens, slens = meta.query_lens_cpu, meta.seq_lens_cpu
    fresh = key is not None and value is not None and k_cache.dtype == FP8
    s = 0
    for i, (qlen, slen) in enumerate(zip(qlens, slens)):
        if qlen < min_query_len:
            s += qlen
            continue
        ctx = slen - qlen
        lo = max(0, ctx - window + 1) if window else 0  # first key any query of the chunk sees
        k = dequantize(_gather(k_cache, meta.block_tables[i], slen, lo), k_scale)
        v = dequantize(_gather(v_cache, meta.block_tables[i], slen, lo), v_scale)
        if fresh:  # the chunk's own K/V exact (dequantize made float32 copies); lo <= ctx
            k[ctx - lo :] = key[s : s + qlen]
            v[ctx - lo :] = value[s : s + qlen]
        k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        qi = q[s : s + qlen].transpose(0, 1)[None].to(k.dtype)  # [1, Hq, qlen, D]
        mask = None
        if qlen != slen or (window and window < slen) or softcap is not None:
            qpos = torch.arange(ctx, slen, device=q.device)[:, None]
            kpos = torch.arange(lo, slen, device=q.device)[None, :]
            mask = kpos <= qpos  # [qlen, L]
            if window:
                mask &= kpos > qpos - window
        if softcap is not None:
            o = _softcap_attention(qi.reshape(1, num_kv_heads, group, qlen, head_dim), k, v, mask, scale, softcap)
            o = o.reshape(1, num_heads, qlen, head_dim)
        elif mask is None:  # no cached context, no window in reach: plain causal
            o = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[s : s + qlen] = o[0].transpose(0, 1).to(q.dtype)
        s += qlen
    return out


class TorchBackend(AttentionBackend):
    """:func:`store_kv_torch` + :func:`paged_attention_torch`. Per-step host-side planning
    (decode buckets from ``seq_lens_cpu``) rules out CUDA graphs."""

    name = "torch"
    devices = ("cpu", "cuda")

    supports_fp8_kv = True
    exact_chunk_kv = True

    def store_kv(self, key, value, k_cache, v_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        store_kv_torch(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def forward(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return paged_attention_torch(
            q, k_cache, v_cache, meta, scale, window, softcap, k_scale, v_scale, key=key, value=value
        )
