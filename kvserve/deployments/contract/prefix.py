"""What an ``LLMServer`` replica reports to the prefix-aware router
(:mod:`kvserve.deployments.routing.prefix_router`), and the prefix hashes both sides compute.

A prefix is identified exactly as the engine's prefix cache identifies it: the chained block
hash of ``kvserve.engine.kv_cache_manager.hash_block`` (vLLM's automatic prefix caching: SHA-256
from the engine's root, with the request's ``cache_salt``) over the prompt's token ids,
``block_size`` tokens per block, up to :data:`MAX_PREFIX_TOKENS` (:func:`block_hashes`).

Replica side: ``LLMServer.generate`` adds the chained hashes of every prompt it admits (token
ids as the engine got them) to a bounded LRU (:class:`RecentPrefixes`, at most
:data:`REPORTED_HASHES`); ``LLMServer.record_routing_stats`` reports that set (oldest first), the
model folder, the root of its hash chains (``prefix_hash_root``: the application's seed, the
same on every replica; without it a router hashes nothing) and a tokenizer probe (:func:`tokenizer_probe` of :data:`PROBE_TEXT` and
:data:`PROBE_MESSAGES`), which the router compares with its own to check that both tokenize
alike. Serve's controller polls the report every ``request_routing_stats_period_s`` and
broadcasts it to every router, so routers in different processes (each ingress replica, driver
handles) share one view.

This module is all the replica needs of prefix routing: it imports nothing from the gateway
side (no Ray Serve router, no tokenizer of its own).

The hashes are SHA-256 from a root that the replicas of an application share (a random seed
kept in Ray's GCS, :func:`shared_hash_seed`), so equal prefixes (and salts) give equal hashes on
every replica and router, and no one outside can predict them.
"""

from __future__ import annotations

from kvserve.deployments.contract.adapters import serve_app_name
from kvserve.engine.kv_cache_manager import chain_hashes, hash_block, root_hash

#: Deepest prefix hashed, tokens (router default, and what a replica records per prompt).
MAX_PREFIX_TOKENS = 1024
#: Most chained block hashes one replica reports (also capped at its KV pool's block count).
REPORTED_HASHES = 2048
#: Fixed inputs whose token ids the replica and the router compare (see :func:`tokenizer_probe`).
PROBE_TEXT = "kvserve routing probe: Hello, world! 12345 <b>ünïcödé</b>\n\tend."
PROBE_MESSAGES = [{"role": "system", "content": "You are a probe."}, {"role": "user", "content": "Hello, world! 12345"}]


def block_hashes(
    token_ids: list[int], block_size: int, max_blocks: int, root: int, cache_salt: str | None = None
) -> list[int]:
    """Chained hashes of the first ``min(len(token_ids) // block_size, max_blocks)`` full
    blocks, as the engine computes ``Request.block_hashes``
    (:func:`kvserve.engine.kv_cache_manager.chain_hashes` from ``root``: the engine's root, or a
    LoRA adapter's ``lora_root_hash``; ``cache_salt`` in the first block)."""
    return chain_hashes(token_ids, block_size, max_blocks, root, cache_salt)


def for_adapter(hashes: list[int], adapter: str | None) -> list[int]:
    """``hashes`` of a prompt sent to LoRA ``adapter`` (None: the base model, unchanged): each
    re-hashed with the adapter's name as an extra key (tagged, length-prefixed: no token
    sequence and no other name gives the same bytes), so the same prompt under two adapters
    (whose KV differ; the engine keys its blocks by adapter too) never matches."""
    if adapter is None:
        return hashes
    tag = b"a" + len(adapter.encode()).to_bytes(4, "big") + adapter.encode()
    return [hash_block(h, (), tag) for h in hashes]


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


#: Namespace and key prefix of the applications' hash seeds in Ray's GCS key-value store.
_SEED_NAMESPACE, _SEED_KEY = "kvserve", "prefix-hash-seed/"


def shared_hash_seed(app: str) -> str:
    """The prefix-cache hash seed of Serve application ``app`` (``EngineConfig.prefix_caching_hash_seed``
    of its replicas): 32 random bytes (hex) that the first replica to ask puts in Ray's GCS
    key-value store (without overwriting: every replica, in any order, reads one value); it
    lives as long as the Ray cluster, so replicas started later (autoscaling, a restart, a
    rolling update) share the blocks of the earlier ones. Blocks on the GCS (call it from a
    thread in async code).

    Raises:
        RuntimeError: not in a process connected to Ray.
    """
    import secrets

    from ray.experimental import internal_kv

    if not internal_kv._internal_kv_initialized():
        raise RuntimeError("the shared prefix hash seed needs a process connected to a Ray cluster")
    key = _SEED_KEY + app
    internal_kv._internal_kv_put(key, secrets.token_hex(32), overwrite=False, namespace=_SEED_NAMESPACE)
    value = internal_kv._internal_kv_get(key, namespace=_SEED_NAMESPACE)
    return value.decode() if isinstance(value, bytes) else str(value)


def replica_hash_seed() -> str:
    """The prefix-cache hash seed of the Serve application this replica serves
    (:func:`shared_hash_seed`); outside Serve (or Ray), a random one for this engine alone."""
    import secrets

    app = serve_app_name()
    if app is not None:
        try:
            return shared_hash_seed(app)
        except Exception:  # no GCS: this replica's blocks are its own
            pass
    return secrets.token_hex(32)


def app_hash_root(app: str) -> int:
    """The root of the KV block-hash chains of Serve application ``app``'s replicas (the base
    model's; :func:`shared_hash_seed`), for a driver that names their blocks (tests, tools).

    Raises:
        RuntimeError: not in a process connected to Ray.
    """
    return root_hash(shared_hash_seed(app))
