"""Response caches of the ingress, consulted before any replica sees a request.

Two levels, one :class:`ResponseCache` per ingress replica:

* **exact** (on by default): a SHA-256 key over the owner (the API key's owner id: each key
  only its own answers, unless ``cache_shared_across_keys``), the served model, its weights
  revision, the endpoint and the request's normalised output-relevant fields; only deterministic requests
  (``temperature`` 0 or a ``seed``) are cached, and only answers that completed;
* **semantic** (off by default, opt-in per request or on for all): a request whose last user
  message is a paraphrase of a cached one's (all-MiniLM-L6-v2 embeddings, same scope, same
  numbers) gets that one's answer.

Modules, one concern each:

* :mod:`kvserve.deployments.cache.settings` -- a deployment's :class:`CacheSettings` and one request's
  options (:func:`request_options`: the ``cache`` field, ``Cache-Control``);
* :mod:`kvserve.deployments.cache.keys` -- which requests are cacheable (:func:`deterministic`), the
  exact key (:func:`exact_key`) and the semantic scope (:func:`semantic_parts`);
* :mod:`kvserve.deployments.cache.entries` -- what is stored: each prompt's
  :class:`~kvserve.deployments.contract.types.GenerationChunk` stream as JSON (:func:`encode_entry`),
  and which answers are stored (:func:`complete`);
* :mod:`kvserve.deployments.cache.stores` -- the byte stores: :class:`MemoryStore` (per ingress
  replica) and :class:`RedisStore` (shared), both LRU-bounded with a TTL;
* :mod:`kvserve.deployments.cache.semantic` -- sentence embeddings and the vector index (imported
  only when the semantic level is on: it needs numpy, and torch to embed);
* :mod:`kvserve.deployments.cache.response_cache` -- :class:`ResponseCache` (lookup, store, clear,
  stats), :class:`Lookup` and :data:`NO_CACHE`.

Accounting: a cached answer is one request of its API key (``rpm``) and no tokens (``tpm``):
no replica generated anything. Not cached: Python handle calls (``OpenAIIngress.generate``).
Identical requests in flight together all miss (no request coalescing). Latency of hits and
the cost of misses over HTTP: ``benchmarks/cache.py``, results in ``benchmarks/results/cache.json``
(docs/benchmarks.md).
"""

from kvserve.deployments.cache.entries import complete, decode_entry, encode_entry
from kvserve.deployments.cache.keys import (
    NON_OUTPUT_FIELDS,
    canonical_json,
    deterministic,
    exact_key,
    request_payload,
    semantic_parts,
)
from kvserve.deployments.cache.response_cache import CACHE_HEADER, NO_CACHE, Lookup, ResponseCache
from kvserve.deployments.cache.settings import (
    DEFAULT_SEMANTIC_THRESHOLD,
    SEMANTIC_MODES,
    CacheSettings,
    RequestOptions,
    request_options,
)
from kvserve.deployments.cache.stores import MemoryStore, RedisStore

__all__ = [
    "CACHE_HEADER",
    "DEFAULT_SEMANTIC_THRESHOLD",
    "NON_OUTPUT_FIELDS",
    "NO_CACHE",
    "SEMANTIC_MODES",
    "CacheSettings",
    "Lookup",
    "MemoryStore",
    "RedisStore",
    "RequestOptions",
    "ResponseCache",
    "canonical_json",
    "complete",
    "decode_entry",
    "deterministic",
    "encode_entry",
    "exact_key",
    "request_options",
    "request_payload",
    "semantic_parts",
]
