"""What the response caches may do: a deployment's :class:`CacheSettings` and one request's
:class:`RequestOptions`.

**Per request** (:func:`request_options`): ``"cache": false`` in the body (or ``Cache-Control:
no-store``) neither reads nor writes; ``Cache-Control: no-cache`` does not answer from the
cache but stores the fresh answer (HTTP's meaning: revalidate); ``"cache": {"semantic": true}``
(OpenAI SDK: ``extra_body``) asks for the semantic level where the deployment allows it
(``semantic_cache: opt-in``), ``{"semantic": false}`` declines it where it is ``on``. The
response header :data:`~kvserve.deployments.cache.response_cache.CACHE_HEADER` says ``exact``,
``semantic``, ``miss`` or ``bypass`` (cache on, this request not served from it: opted out or
not deterministic); no header when the deployment's cache is off.

**Per owner** (the default): cached answers belong to the API key that made them (its owner id;
one anonymous owner without keys), so a request is answered only from its own key's answers
and the header tells only of them. ``cache_shared_across_keys: true`` (the operator's choice,
for keys of one tenant) lets every key hit every key's answers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvserve.deployments.contract.config import CacheArgs
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest

#: Semantic modes of a deployment.
SEMANTIC_MODES = ("off", "opt-in", "on")
#: The cosine similarity a semantic hit needs by default (why 0.92: :mod:`kvserve.deployments.cache.semantic`).
DEFAULT_SEMANTIC_THRESHOLD = 0.92


@dataclass(frozen=True)
class CacheSettings:
    """A deployment's response caches (the configuration's :class:`~kvserve.deployments.contract.config.CacheArgs`:
    ``response_cache``, ``cache_*``, ``semantic_cache*``; :meth:`of`).

    Attributes:
        enabled: the exact cache (and with it the semantic level) is on.
        backend: ``memory`` (per ingress replica) or ``redis`` (shared; needs ``redis_url``).
        ttl_s: seconds an entry lives.
        max_entries, max_bytes: bounds of the exact cache (least recently used go first).
        semantic: ``off``, ``opt-in`` (requests ask with ``"cache": {"semantic": true}``) or ``on``.
        semantic_threshold: cosine similarity a semantic hit needs, in (0, 1].
        semantic_max_entries: vectors kept per ingress replica.
        redis_url: the Redis of the ``redis`` backend.
        shared_across_keys: every API key hits every key's answers (default False: each key,
            by its owner id, only its own).

    Raises:
        ValueError: a value out of range, or the redis backend without ``redis_url``.
    """

    enabled: bool = True
    backend: str = "memory"
    ttl_s: float = 3600.0
    max_entries: int = 10_000
    max_bytes: int = 256 << 20
    semantic: str = "off"
    semantic_threshold: float = DEFAULT_SEMANTIC_THRESHOLD
    semantic_max_entries: int = 10_000
    redis_url: str | None = None
    shared_across_keys: bool = False

    def __post_init__(self):
        if self.backend not in ("memory", "redis"):
            raise ValueError(f"cache backend must be memory or redis, got {self.backend!r}")
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("the redis cache backend needs redis_url (or $KVSERVE_REDIS_URL)")
        if not (self.ttl_s > 0 and math.isfinite(self.ttl_s)):
            raise ValueError(f"cache ttl_s must be a positive number of seconds, got {self.ttl_s}")
        if self.max_entries < 1 or self.max_bytes < 1 or self.semantic_max_entries < 1:
            raise ValueError("cache max_entries, max_bytes and semantic_max_entries must be >= 1")
        if self.semantic not in SEMANTIC_MODES:
            raise ValueError(f"semantic cache mode must be one of {SEMANTIC_MODES}, got {self.semantic!r}")
        if not (0.0 < self.semantic_threshold <= 1.0):
            raise ValueError(f"semantic threshold must be in (0, 1], got {self.semantic_threshold}")

    @classmethod
    def of(cls, args: CacheArgs | None, redis_url: str | None = None) -> "CacheSettings":
        """The settings of the configuration's cache section (None: its defaults) with the
        limits' ``redis_url``.

        Raises:
            ValueError: as the constructor.
        """
        c = args if args is not None else CacheArgs()
        return cls(
            enabled=c.response_cache,
            backend=c.cache_backend,
            ttl_s=c.cache_ttl_s,
            max_entries=c.cache_max_entries,
            max_bytes=c.cache_max_bytes,
            semantic=c.semantic_cache,
            semantic_threshold=c.semantic_cache_threshold,
            semantic_max_entries=c.semantic_cache_max_entries,
            redis_url=redis_url,
            shared_across_keys=c.cache_shared_across_keys,
        )


@dataclass(frozen=True)
class RequestOptions:
    """What one request allows: ``read`` (answer from the cache), ``write`` (store the fresh
    answer), ``semantic`` (True / False: asked for / declined; None: the deployment's mode)."""

    read: bool = True
    write: bool = True
    semantic: bool | None = None


def request_options(body: ChatCompletionRequest | CompletionRequest, headers) -> RequestOptions:
    """The request's cache options from its ``cache`` field and ``Cache-Control`` header
    (``headers``: any mapping with ``.get``; see the module docstring)."""
    directives = {d.strip().split("=")[0].lower() for d in (headers.get("cache-control") or "").split(",")}
    c = getattr(body, "cache", None)
    if c is False or "no-store" in directives:
        return RequestOptions(read=False, write=False, semantic=False)
    semantic = None if c is None or c is True else c.semantic
    return RequestOptions(read="no-cache" not in directives, write=True, semantic=semantic)
