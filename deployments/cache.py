"""Response caches of the ingress, consulted before any replica sees a request.

**Exact** (level ``exact``, on by default): the key is a SHA-256 over the served model name and
its weights revision (``LLMServer.model_info()["revision"]``, :func:`model_revision`), the
endpoint, and the request's normalised fields (:func:`request_payload`): every declared field of
:class:`~deployments.protocol.ChatCompletionRequest` / :class:`~deployments.protocol.CompletionRequest`
except :data:`NON_OUTPUT_FIELDS` (``stream``, ``stream_options``, ``user``, ``priority``, ``cache``,
and ``model``, replaced by the served name), so a field added to the protocol later is part of
the key unless someone decides it cannot change the output. Unknown fields (ignored by the
server) are not part of it. Normalised: messages as the chat template takes them (content parts
joined, tool-call arguments as objects), ``max_completion_tokens`` folded into ``max_tokens``,
one structured-output spec whichever field gave it, unset ``temperature`` / ``top_p`` as the 1.0
they mean, a string ``stop`` or ``prompt`` as a one-item list, canonical JSON (sorted keys).

Only deterministic requests are cached (:func:`deterministic`): ``temperature`` 0 (greedy; ``n``
greedy choices are equal), or a ``seed`` (the server gives choice ``i`` the seed ``seed + i``, so
``n > 1`` with a seed is reproducible too). Outputs of one request are then a function of the
key, up to floating-point differences between batch compositions, which every serving engine
has. An answer is stored only when it completed: every choice finished with ``stop`` or
``length`` (not an error, a timeout or an abort, and not a stream whose client went away).

Stored is what the replica sent: each prompt's stream of
:class:`~deployments.protocol.GenerationChunk` (:func:`encode_entry`, JSON: never pickle, the
Redis may be shared). A hit replays it through the ingress's normal code, so a cached answer is
the same SSE chunks (role delta, one content delta per original engine step, finish chunk, usage
chunk), the same tool-call parsing and the same ``usage`` (prompt, completion and prefix-cached
tokens of the run that produced it) as the fresh one; ids and ``created`` are new.

Backends: :class:`MemoryStore` (one per ingress replica, the default) and :class:`RedisStore`
(redis-py asyncio; shared by all ingress replicas; a single Redis, not Redis Cluster). Both
bound the entries and the bytes with least-recently-used eviction and expire entries after
``ttl_s`` (a hit does not extend it). Redis: ``SET PX`` for the TTL, a sorted set of entry keys
scored by last use, a hash of their sizes and a byte counter, all changed by Lua scripts in one
round trip; the bounds are ours, Redis's ``maxmemory`` is the operator's. Redis down: one
warning, every lookup a miss and every store skipped for ``retry_s``, then tried again; a
request never fails or waits on it (timeouts 0.25 s).

**Semantic** (level ``semantic``, off by default; :mod:`deployments.semantic`): the last user
message (or the single text prompt) is embedded with all-MiniLM-L6-v2 in a worker thread; the
request's scope is the hash of its payload with that text left out, so system prompt, earlier
turns, tools and sampling fields must be equal. A hit (cosine similarity >= the threshold,
default :data:`DEFAULT_SEMANTIC_THRESHOLD`, and the same numbers) answers with the exact-cache
entry of the similar request. The vectors are per ingress replica; the answers they point to are
in the exact backend (so a ``DELETE /v1/cache`` on a shared Redis reaches every replica's
semantic level too: its vectors then point at nothing and are dropped).

Threshold 0.92: on the 26 hand-written paraphrase pairs and 24 near-miss pairs (same template,
different answer) of ``benchmarks/cache.py``, 0.92 kept 62 % of paraphrases and let through one
near miss ("Celsius to Fahrenheit" / "Fahrenheit to Celsius": 0.995, no threshold separates a
direction swap); 0.90 keeps 88 % but sits 0.04 above the next near miss (0.862). A wrong answer
costs more than a miss, and the semantic level is opt-in for that reason.

**Per request** (:func:`request_options`): ``"cache": false`` in the body (or ``Cache-Control:
no-store``) neither reads nor writes; ``Cache-Control: no-cache`` does not answer from the
cache but stores the fresh answer (HTTP's meaning: revalidate); ``"cache": {"semantic": true}``
(OpenAI SDK: ``extra_body``) asks for the semantic level where the deployment allows it
(``semantic_cache: opt-in``), ``{"semantic": false}`` declines it where it is ``on``. The
response header :data:`CACHE_HEADER` says ``exact``, ``semantic``, ``miss`` or ``bypass``
(cache on, this request not served from it: opted out or not deterministic); no header when
the deployment's cache is off.

Accounting: a cached answer is one request of its API key (``rpm``) and no tokens (``tpm``):
no replica generated anything. Not cached: Python handle calls (``OpenAIIngress.generate``).
Identical requests in flight together all miss (no request coalescing). Measured over HTTP
(``benchmarks/cache.py``, 2 CPU cores): exact hit 6.4 ms p50, of which ~0.1 ms beyond a POST
that Serve's proxy and FastAPI turn away (6.3 ms); semantic hit 18.6 ms; a miss adds 0.3 ms to
TTFT, a semantic miss 8.1 ms (its embedding).
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deployments.protocol import ChatCompletionRequest, CompletionRequest, NamedToolChoice
from deployments.server_types import GenerationChunk

logger = logging.getLogger("ray.serve")

#: The response header that says how the answer was found.
CACHE_HEADER = "x-kvserve-cache"
#: Request fields that never change the generated text: left out of the key. Every other
#: declared field of the request models is part of it.
NON_OUTPUT_FIELDS = frozenset({"model", "stream", "stream_options", "user", "priority", "cache"})
#: Fields whose spellings are folded into ``structured`` (one spec, whichever field gave it).
_STRUCTURED_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                      "guided_grammar")
#: Semantic modes of a deployment.
SEMANTIC_MODES = ("off", "opt-in", "on")
DEFAULT_SEMANTIC_THRESHOLD = 0.92
_KEY_VERSION = b"kvserve-response-cache-v1\0"


# ---- settings --------------------------------------------------------------------------------
@dataclass(frozen=True)
class CacheSettings:
    """A deployment's response caches (``AppArgs``: ``response_cache``, ``cache_*``,
    ``semantic_cache*``).

    Attributes:
        enabled: the exact cache (and with it the semantic level) is on.
        backend: ``memory`` (per ingress replica) or ``redis`` (shared; needs ``redis_url``).
        ttl_s: seconds an entry lives.
        max_entries, max_bytes: bounds of the exact cache (least recently used go first).
        semantic: ``off``, ``opt-in`` (requests ask with ``"cache": {"semantic": true}``) or ``on``.
        semantic_threshold: cosine similarity a semantic hit needs, in (0, 1].
        semantic_max_entries: vectors kept per ingress replica.
        redis_url: the Redis of the ``redis`` backend.

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


# ---- keys ------------------------------------------------------------------------------------
def deterministic(body: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether the request's output is a function of its fields: greedy (``temperature`` 0)
    or seeded."""
    return body.temperature == 0 or body.seed is not None


def _plain(v: Any) -> Any:
    if hasattr(v, "model_dump"):
        return v.model_dump(mode="json", by_alias=True, exclude_none=True)
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


def request_payload(body: ChatCompletionRequest | CompletionRequest) -> dict[str, Any]:
    """The request's output-relevant fields, normalised (see the module docstring): equal for
    requests that ask the model the same thing the same way."""
    d = {name: _plain(getattr(body, name)) for name in type(body).model_fields if name not in NON_OUTPUT_FIELDS}
    for f in _STRUCTURED_FIELDS:
        d.pop(f, None)
    d["structured"] = body.structured_spec()
    d["temperature"] = 1.0 if body.temperature is None else float(body.temperature)
    d["top_p"] = 1.0 if body.top_p is None else float(body.top_p)
    if isinstance(body.stop, str):
        d["stop"] = [body.stop]
    if isinstance(body, ChatCompletionRequest):
        d["messages"] = [m.to_template() for m in body.messages]
        d["max_tokens"] = body.effective_max_tokens
        d.pop("max_completion_tokens", None)
        d["tools"] = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        d["tool_choice"] = body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedToolChoice) \
            else body.tool_choice
    else:
        d["prompt"] = body.prompts()
    return d


def canonical_json(obj: Any) -> bytes:
    """Sorted keys, no spaces, UTF-8: one byte string per value."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def _digest(model: str, revision: str, endpoint: str, payload: Any) -> str:
    h = hashlib.sha256(_KEY_VERSION)
    for part in (model, revision, endpoint):
        h.update(part.encode() + b"\0")
    h.update(canonical_json(payload))
    return h.hexdigest()


def exact_key(model: str, revision: str, endpoint: str, body: ChatCompletionRequest | CompletionRequest) -> str:
    """The exact-cache key (64 hex digits) of a request to ``model`` at ``revision`` on
    ``endpoint`` (``chat`` or ``completion``)."""
    return _digest(model, revision, endpoint, request_payload(body))


def semantic_parts(model: str, revision: str, endpoint: str,
                   body: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """``(scope, text)`` for the semantic level: the text to embed (the last message, if it is
    a user message with text, or the single text prompt) and the hash of everything else.
    None when the request has no such text (a conversation ending with a tool result, token
    id prompts, several prompts)."""
    payload = request_payload(body)
    if isinstance(body, ChatCompletionRequest):
        last = payload["messages"][-1]
        if last["role"] != "user" or not last["content"].strip():
            return None
        text, last["content"] = last["content"], None
    else:
        if not isinstance(body.prompt, str) or not body.prompt.strip():
            return None
        text, payload["prompt"] = body.prompt, None
    return _digest(model, revision, endpoint, payload), text



# ---- entries ---------------------------------------------------------------------------------
def encode_entry(streams: list[list[GenerationChunk]]) -> bytes:
    """A cached answer: each prompt's chunks as the replica sent them (JSON bytes)."""
    return json.dumps({"v": 1, "streams": [[c.to_dict() for c in s] for s in streams]},
                      separators=(",", ":"), ensure_ascii=False).encode()


def decode_entry(data: bytes) -> list[list[GenerationChunk]]:
    """The inverse of :func:`encode_entry`.

    Raises:
        ValueError: not an entry of this version.
    """
    obj = json.loads(data)
    if not isinstance(obj, dict) or obj.get("v") != 1:
        raise ValueError("not a kvserve response cache entry (v1)")
    return [[GenerationChunk.from_dict(d) for d in s] for s in obj["streams"]]


def complete(streams: list[list[GenerationChunk]], n: int) -> bool:
    """Whether every prompt's ``n`` choices finished with ``stop`` or ``length`` (nothing
    failed, timed out or was aborted): only such answers are stored."""
    if not streams:
        return False
    for s in streams:
        ends = {c.index: c for c in s if c.finished}
        if len(ends) != n or any(c.error is not None or c.finish_reason not in ("stop", "length")
                                 for c in ends.values()):
            return False
    return True


# ---- backends --------------------------------------------------------------------------------
class MemoryStore:
    """Entries in this process: an LRU dict bounded by entries and bytes, with a TTL.

    Args:
        max_entries, max_bytes: bounds (an entry larger than ``max_bytes`` is not stored).
        clock: monotonic seconds (tests inject a fake one).
    """

    name = "memory"

    def __init__(self, max_entries: int, max_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.max_entries, self.max_bytes, self._clock = max_entries, max_bytes, clock
        self._entries: OrderedDict[str, tuple[float, str, bytes]] = OrderedDict()  # key -> (expires, model, data)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, model: str, key: str) -> bytes | None:
        e = self._entries.get(key)
        if e is None:
            return None
        if e[0] <= self._clock():
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return e[2]

    async def put(self, model: str, key: str, data: bytes, ttl_s: float) -> bool:
        """Store ``data``; False if it alone exceeds ``max_bytes``."""
        if len(data) > self.max_bytes:
            return False
        self._remove(key)
        self._entries[key] = (self._clock() + ttl_s, model, data)
        self.bytes += len(data)
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
        return True

    async def clear(self, model: str | None = None) -> int:
        now = self._clock()
        gone = [k for k, (exp, m, _) in self._entries.items() if model is None or m == model]
        live = sum(self._entries[k][0] > now for k in gone)
        for k in gone:
            self._remove(k)
        return live

    def _remove(self, key: str) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self.bytes -= len(e[2])

    async def size(self) -> tuple[int, int]:
        return len(self._entries), self.bytes

    async def close(self) -> None:
        pass


# KEYS: lru zset, sizes hash, byte counter (the shared helpers of the scripts below)
_DROP_LUA = """
local function drop(member)
  local size = tonumber(redis.call('HGET', KEYS[2], member) or '0')
  redis.call('HDEL', KEYS[2], member)
  redis.call('ZREM', KEYS[1], member)
  if size > 0 then redis.call('DECRBY', KEYS[3], size) end
  return redis.call('DEL', member)
end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
"""
# KEYS[4]: the entry. ARGV: data, ttl ms, max entries, max bytes. Returns entries evicted.
_PUT_LUA = _DROP_LUA + """
local now, ttl = now_ms(), tonumber(ARGV[2])
-- members untouched for a whole TTL have expired: forget their sizes
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now - ttl)) do drop(m) end
if redis.call('HEXISTS', KEYS[2], KEYS[4]) == 1 then drop(KEYS[4]) end
local size = string.len(ARGV[1])
redis.call('SET', KEYS[4], ARGV[1], 'PX', ttl)
redis.call('ZADD', KEYS[1], now, KEYS[4])
redis.call('HSET', KEYS[2], KEYS[4], size)
local total = redis.call('INCRBY', KEYS[3], size)
local evicted = 0
while redis.call('ZCARD', KEYS[1]) > tonumber(ARGV[3]) or total > tonumber(ARGV[4]) do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if oldest == nil or oldest == KEYS[4] then break end
  evicted = evicted + drop(oldest)
  total = tonumber(redis.call('GET', KEYS[3]) or '0')
end
return evicted
"""
# KEYS[4]: the entry. Returns its data (and marks it used) or nil.
_GET_LUA = _DROP_LUA + """
local v = redis.call('GET', KEYS[4])
if v then redis.call('ZADD', KEYS[1], 'XX', now_ms(), KEYS[4]) end
return v
"""
# ARGV[1]: prefix of the entry keys to delete. Returns the live entries deleted.
_CLEAR_LUA = _DROP_LUA + """
local n, p = 0, ARGV[1]
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(m, 1, string.len(p)) == p then n = n + drop(m) end
end
return n
"""


class RedisStore:
    """Entries in a Redis that every ingress replica shares (see the module docstring).

    Keys: ``<prefix>e:<model tag>:<key>`` (the entry, with its TTL), ``<prefix>lru`` (sorted
    set of entry keys by last use, ms), ``<prefix>sizes`` (hash of their sizes) and
    ``<prefix>bytes`` (their total). The model tag is 16 hex digits of SHA-256 of the name.

    Args:
        url: ``redis://[:password@]host:port/db``.
        max_entries, max_bytes: bounds over every model's entries.
        timeout_s: connect and command timeout.
        retry_s: after a failure, seconds of misses before Redis is tried again.
        prefix: key prefix.
        clock: monotonic seconds for the retry pause.
    """

    name = "redis"

    def __init__(self, url: str, max_entries: int, max_bytes: int, *, timeout_s: float = 0.25,
                 retry_s: float = 5.0, prefix: str = "kvserve:rc:", clock: Callable[[], float] = time.monotonic):
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.url, self.max_entries, self.max_bytes, self.prefix = url, max_entries, max_bytes, prefix
        self.retry_s, self._clock = retry_s, clock
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                              retry=Retry(NoBackoff(), 1))
        self._put = self._redis.register_script(_PUT_LUA)
        self._get = self._redis.register_script(_GET_LUA)
        self._clear = self._redis.register_script(_CLEAR_LUA)
        self._meta = [prefix + "lru", prefix + "sizes", prefix + "bytes"]
        self._down_until = -math.inf
        self._warned = False

    @staticmethod
    def model_tag(model: str) -> str:
        return hashlib.sha256(model.encode()).hexdigest()[:16]

    def entry_key(self, model: str, key: str) -> str:
        return f"{self.prefix}e:{self.model_tag(model)}:{key}"

    async def get(self, model: str, key: str) -> bytes | None:
        if not self._usable():
            return None
        try:
            data = await self._get(keys=self._meta + [self.entry_key(model, key)])
        except Exception as e:  # noqa: BLE001 -- any Redis trouble is a miss, never a failed request
            self._failed(e)
            return None
        self._ok()
        return data

    async def put(self, model: str, key: str, data: bytes, ttl_s: float) -> bool:
        if len(data) > self.max_bytes or not self._usable():
            return False
        try:
            await self._put(keys=self._meta + [self.entry_key(model, key)],
                            args=[data, max(1, int(ttl_s * 1000)), self.max_entries, self.max_bytes])
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return False
        self._ok()
        return True

    async def clear(self, model: str | None = None) -> int:
        """Delete every entry or one model's; returns how many were live.

        Raises:
            redis.RedisError: Redis failed (an admin call reports it rather than a silent 0).
        """
        prefix = f"{self.prefix}e:" + (f"{self.model_tag(model)}:" if model is not None else "")
        n = await self._clear(keys=self._meta, args=[prefix])
        self._ok()
        return int(n)

    async def size(self) -> tuple[int, int]:
        if not self._usable():
            return 0, 0
        try:
            n, b = await asyncio.gather(self._redis.zcard(self._meta[0]), self._redis.get(self._meta[2]))
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            return 0, 0
        return int(n), int(b or 0)

    async def close(self) -> None:
        await self._redis.aclose()

    def _usable(self) -> bool:
        return self._clock() >= self._down_until

    def _failed(self, err: BaseException) -> None:
        self._down_until = self._clock() + self.retry_s
        if not self._warned:
            self._warned = True
            from deployments.limits import _safe_url

            logger.warning("response cache: Redis at %s failed (%s: %s); every lookup is a miss until it answers "
                           "again (retried every %.0f s)", _safe_url(self.url), type(err).__name__, err, self.retry_s)

    def _ok(self) -> None:
        if self._warned:
            self._warned = False
            logger.info("response cache: Redis answers again")


# ---- the cache -------------------------------------------------------------------------------
def _ingress_embedder():
    """The ingress's embedder: one torch thread and one BLAS thread for this process (the
    ingress does no other math; with two BLAS threads a 10k-entry vector search had a p99 of
    52 ms while other processes kept the 2 cores busy, with one 3.5 ms: see
    :mod:`deployments.semantic`)."""
    from threadpoolctl import threadpool_limits

    from deployments.semantic import Embedder

    threadpool_limits(limits=1, user_api="blas")
    return Embedder(num_threads=1)


@dataclass
class Lookup:
    """One request's dealings with the cache.

    Attributes:
        status: the :data:`CACHE_HEADER` value: ``exact``, ``semantic``, ``miss`` or ``bypass``.
        model: the served model name.
        streams: the cached answer (each prompt's chunks) on a hit.
        key: the exact key (None: not cacheable).
        store: store the fresh answer when it completes.
        semantic: ``(scope, vector, numbers)`` to add to the semantic index with the answer.
    """

    status: str
    model: str = ""
    streams: list[list[GenerationChunk]] | None = None
    key: str | None = None
    store: bool = False
    semantic: tuple[str, Any, tuple[str, ...]] | None = None

    @property
    def hit(self) -> bool:
        return self.streams is not None

    @property
    def headers(self) -> dict[str, str]:
        return {CACHE_HEADER: self.status} if self.status else {}


#: The lookup of a deployment whose cache is off: no header, nothing stored.
NO_CACHE = Lookup(status="")


class ResponseCache:
    """The exact and semantic levels of one ingress replica (see the module docstring).

    Args:
        settings: the deployment's :class:`CacheSettings`.
        embedder_factory: builds the :class:`~deployments.semantic.Embedder` (tests pass one
            in); default: all-MiniLM-L6-v2 on one torch thread. Built in a worker thread as
            soon as the semantic level is on; requests that want it wait for it.
        clock: monotonic seconds.
        metrics: record ``kvserve:response_cache_*`` (:mod:`telemetry.metrics`).

    Raises:
        ValueError: bad settings (see :class:`CacheSettings`).
    """

    def __init__(self, settings: CacheSettings, *, embedder_factory: Callable[[], Any] | None = None,
                 clock: Callable[[], float] = time.monotonic, metrics: bool = True):
        self.settings = settings
        if settings.backend == "redis":
            self.store_backend: MemoryStore | RedisStore = RedisStore(
                settings.redis_url, settings.max_entries, settings.max_bytes, clock=clock)
        else:
            self.store_backend = MemoryStore(settings.max_entries, settings.max_bytes, clock=clock)
        self.counts = {"exact": {"hits": 0, "misses": 0}, "semantic": {"hits": 0, "misses": 0}, "stores": 0}
        self._tasks: set[asyncio.Task] = set()
        self._metrics = None
        if metrics:
            from telemetry.metrics import cache_hits, cache_lookup_seconds, cache_misses

            self._metrics = (cache_hits(), cache_misses(), cache_lookup_seconds())
        self.index = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._embedder: concurrent.futures.Future | None = None
        if settings.semantic != "off":
            from deployments.semantic import EMBEDDING_DIM, Embedder, SemanticIndex

            self.index = SemanticIndex(EMBEDDING_DIM, settings.semantic_max_entries, clock=clock)
            # one thread: embeddings and index searches run off the event loop, one at a time
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvserve-embed")
            self._embedder = self._pool.submit(embedder_factory or _ingress_embedder)
            self._embedder.add_done_callback(self._embedder_loaded)

    @staticmethod
    def _embedder_loaded(f: concurrent.futures.Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            logger.error("response cache: the semantic level is off, its embedding model failed to load: %s",
                         f.exception())

    def wants_semantic(self, opts: RequestOptions) -> bool:
        mode = self.settings.semantic
        return mode != "off" and (opts.semantic is True or (mode == "on" and opts.semantic is None))

    def _observe(self, level: str, model: str, hit: bool, seconds: float) -> None:
        self.counts[level]["hits" if hit else "misses"] += 1
        if self._metrics is not None:
            labels = {"level": level, "model_name": model}
            try:
                (self._metrics[0] if hit else self._metrics[1]).inc(labels)
                self._metrics[2].observe(labels, seconds)
            except Exception:  # metrics never fail a request
                pass

    async def lookup(self, model: str, revision: str, endpoint: str, body: ChatCompletionRequest | CompletionRequest,
                     opts: RequestOptions) -> Lookup:
        """Look the request up (``endpoint``: ``chat`` or ``completion``). Never raises: any
        failure of the cache is a miss (logged)."""
        if not (opts.read or opts.write) or not deterministic(body):
            return Lookup("bypass", model)
        try:
            return await self._lookup(model, revision, endpoint, body, opts)
        except Exception as e:  # noqa: BLE001 -- the cache must never fail a request
            logger.warning("response cache lookup failed (%s: %s); answering without it", type(e).__name__, e)
            return Lookup("bypass", model)

    async def _lookup(self, model, revision, endpoint, body, opts) -> Lookup:
        key = exact_key(model, revision, endpoint, body)
        look = Lookup("miss" if opts.read else "bypass", model, key=key, store=opts.write)
        if opts.read:
            t0 = time.perf_counter()
            data = await self.store_backend.get(model, key)
            streams = self._decode(data)
            self._observe("exact", model, streams is not None, time.perf_counter() - t0)
            if streams is not None:
                look.status, look.streams, look.store = "exact", streams, False
                return look
        parts = semantic_parts(model, revision, endpoint, body) if self.wants_semantic(opts) else None
        if parts is None or not await self._embedder_ready():
            return look
        from deployments.semantic import numbers_of

        scope, text = parts
        numbers = numbers_of(text)
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        vec, match = await loop.run_in_executor(self._pool, self._embed_and_search, scope, text, numbers, opts.read)
        look.semantic = (scope, vec, numbers)
        if opts.read:
            streams = None
            if match is not None:
                streams = self._decode(await self.store_backend.get(model, match))
                if streams is None:  # its answer expired or was evicted
                    self.index.discard(scope, match)
            self._observe("semantic", model, streams is not None, time.perf_counter() - t0)
            if streams is not None:
                look.status, look.streams, look.store = "semantic", streams, False
        return look

    def _embed_and_search(self, scope: str, text: str, numbers: tuple[str, ...], search: bool):
        vec = self._embedder.result().embed([text])[0]
        match = self.index.search(scope, vec, self.settings.semantic_threshold, numbers) if search else None
        return vec, (match[0] if match else None)

    async def _embedder_ready(self) -> bool:
        if self._embedder is None:
            return False
        try:
            await asyncio.wrap_future(self._embedder)
            return True
        except Exception:  # logged once by _embedder_loaded
            return False

    @staticmethod
    def _decode(data: bytes | None) -> list[list[GenerationChunk]] | None:
        if data is None:
            return None
        try:
            return decode_entry(data)
        except Exception as e:  # noqa: BLE001 -- a corrupt entry is a miss
            logger.warning("response cache: undecodable entry ignored (%s)", e)
            return None

    def store_soon(self, look: Lookup, streams: list[list[GenerationChunk]], n: int) -> None:
        """Store a fresh answer (each prompt's chunks, ``n`` choices each) in a task of its own
        if the lookup allows it and the answer is complete (:func:`complete`)."""
        if not look.store or look.key is None or not complete(streams, n):
            return
        task = asyncio.ensure_future(self._store(look, streams))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _store(self, look: Lookup, streams: list[list[GenerationChunk]]) -> None:
        try:
            ok = await self.store_backend.put(look.model, look.key, encode_entry(streams), self.settings.ttl_s)
            if ok:
                self.counts["stores"] += 1
            if ok and look.semantic is not None and self.index is not None:
                scope, vec, numbers = look.semantic
                self.index.add(scope, look.model, look.key, vec, self.settings.ttl_s, numbers)
        except Exception as e:  # noqa: BLE001
            logger.warning("response cache: storing an answer failed (%s: %s)", type(e).__name__, e)

    async def clear(self, model: str | None = None) -> dict[str, int]:
        """Delete every entry (``model`` None) or one served model's: ``{"exact": n,
        "semantic": m}`` entries deleted (exact: the live ones)."""
        exact = await self.store_backend.clear(model)
        semantic = self.index.clear(model) if self.index is not None else 0
        return {"exact": exact, "semantic": semantic}

    async def stats(self) -> dict[str, Any]:
        """Counters since this replica started and the current sizes."""
        entries, nbytes = await self.store_backend.size()
        return {"backend": self.store_backend.name, "ttl_s": self.settings.ttl_s,
                "exact": {**self.counts["exact"], "entries": entries, "bytes": nbytes,
                          "max_entries": self.settings.max_entries, "max_bytes": self.settings.max_bytes},
                "semantic": {**self.counts["semantic"], "mode": self.settings.semantic,
                             "threshold": self.settings.semantic_threshold,
                             "entries": len(self.index) if self.index is not None else 0},
                "stores": self.counts["stores"]}

    async def close(self) -> None:
        await self.store_backend.close()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
