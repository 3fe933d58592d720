"""What an ``LLMServer`` replica reports to the prefix-aware router
(:mod:`kvserve.deployments.routing.prefix_router`), and the prefix hashes both sides compute.

A prefix is identified exactly as the engine's prefix cache identifies it: the chained block
hash of ``kvserve.engine.kv_cache_manager.hash_block`` (vLLM's automatic prefix caching) over the
prompt's token ids, ``block_size`` tokens per block, up to :data:`MAX_PREFIX_TOKENS`
(:func:`block_hashes`).

Replica side: ``LLMServer.generate`` adds the chained hashes of every prompt it admits (token
ids as the engine got them) to a bounded LRU (:class:`RecentPrefixes`, at most
:data:`REPORTED_HASHES`); ``LLMServer.record_routing_stats`` reports that set (oldest first), the
model folder and a tokenizer probe (:func:`tokenizer_probe` of :data:`PROBE_TEXT` and
:data:`PROBE_MESSAGES`), which the router compares with its own to check that both tokenize
alike. Serve's controller polls the report every ``request_routing_stats_period_s`` and
broadcasts it to every router, so routers in different processes (each ingress replica, driver
handles) share one view.

This module is all the replica needs of prefix routing: it imports nothing from the gateway
side (no Ray Serve router, no tokenizer of its own).

Python's ``hash`` of a tuple of ints does not depend on ``PYTHONHASHSEED``, so equal prefixes
give equal hashes in every process of a cluster running one Python version.
"""
from __future__ import annotations

from kvserve.engine.kv_cache_manager import NONE_HASH, hash_block

#: Deepest prefix hashed, tokens (router default, and what a replica records per prompt).
MAX_PREFIX_TOKENS = 1024
#: Most chained block hashes one replica reports (also capped at its KV pool's block count).
REPORTED_HASHES = 2048
#: Fixed inputs whose token ids the replica and the router compare (see :func:`tokenizer_probe`).
PROBE_TEXT = "kvserve routing probe: Hello, world! 12345 <b>ünïcödé</b>\n\tend."
PROBE_MESSAGES = [{"role": "system", "content": "You are a probe."},
                  {"role": "user", "content": "Hello, world! 12345"}]


def block_hashes(token_ids: list[int], block_size: int, max_blocks: int, root: int = NONE_HASH) -> list[int]:
    """Chained hashes of the first ``min(len(token_ids) // block_size, max_blocks)`` full
    blocks, as the engine computes ``Request.block_hashes`` (``hash_block`` from ``root``:
    ``NONE_HASH``, or a LoRA adapter's ``kvserve.engine.kv_cache_manager.lora_root_hash``)."""
    out, parent = [], root
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


def for_adapter(hashes: list[int], adapter: str | None) -> list[int]:
    """``hashes`` of a prompt sent to LoRA ``adapter`` (None: the base model, unchanged): each
    re-hashed with the adapter's name, so the same prompt under two adapters (whose KV differ;
    the engine keys its blocks by adapter too) never matches."""
    if adapter is None:
        return hashes
    tag = tuple(adapter.encode())
    return [hash_block(h, tag) for h in hashes]


def tokenizer_probe(encode_text, encode_chat) -> list[int | None]:
    """``[hash of encode_text(PROBE_TEXT), hash of encode_chat(PROBE_MESSAGES)]`` (None where
    that encoder fails, e.g. no chat template): equal lists mean equal tokenization."""
    out: list[int | None] = []
    for fn, arg in ((encode_text, PROBE_TEXT), (encode_chat, PROBE_MESSAGES)):
        try:
            out.append(hash(tuple(fn(arg))))
        except Exception:
            out.append(None)
    return out


