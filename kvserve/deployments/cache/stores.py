"""Byte stores of the exact cache: :class:`MemoryStore` (one per ingress replica, the default)
and :class:`RedisStore` (redis-py asyncio; shared by all ingress replicas; a single Redis, not
Redis Cluster).

Both map ``(model, key)`` to the bytes of an entry (:mod:`kvserve.deployments.cache.entries`), bound
the entries and the bytes with least-recently-used eviction and expire entries after ``ttl_s``
(a hit does not extend it). Redis: ``SET PX`` for the TTL, a sorted set of entry keys scored by
last use, a hash of their sizes and a byte counter, all changed by Lua scripts in one round
trip; the bounds are ours, Redis's ``maxmemory`` is the operator's. Redis down: one warning,
every lookup a miss and every store skipped for ``retry_s``, then tried again; a request never
fails or waits on it (timeouts 0.25 s). That is right for a cache, wrong for what is kept on a
tenant's behalf (stored responses, files, batches: :mod:`~kvserve.deployments.cache.owner_stores`):
there a :class:`RedisStore` is ``strict`` and a failed read or write raises
:class:`StoreUnavailable` (a 503), never "not found", so nothing is deleted or reported stored
because Redis blinked.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.redis_url import safe_url

logger = logging.getLogger("ray.serve")


class StoreUnavailable(OpenAIError):
    """A strict store's backend (Redis) failed to answer a read or a write: HTTP 503
    ``store_unavailable`` with ``Retry-After`` (an OpenAI error body). It never means "not
    found": callers must not forget anything because of it."""

    def __init__(self, what: str, err: BaseException | None = None):
        detail = f" ({type(err).__name__})" if err is not None else ""
        super().__init__(
            f"the store did not answer {what}{detail}; nothing was changed or lost, retry later",
            503,
            "server_error",
            code="store_unavailable",
            retry_after_s=1.0,
        )


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

    async def delete(self, model: str, key: str) -> bool:
        """Remove one entry; True if it was there."""
        there = key in self._entries
        self._remove(key)
        return there

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
_PUT_LUA = (
    _DROP_LUA
    + """
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
)
# KEYS[4]: the entry. Returns its data (and marks it used) or nil.
_GET_LUA = (
    _DROP_LUA
    + """
local v = redis.call('GET', KEYS[4])
if v then redis.call('ZADD', KEYS[1], 'XX', now_ms(), KEYS[4]) end
return v
"""
)
# KEYS[4]: the entry. Returns 1 if it was there.
_DEL_LUA = (
    _DROP_LUA
    + """
return drop(KEYS[4])
"""
)
# ARGV[1]: prefix of the entry keys to delete. Returns the live entries deleted.
_CLEAR_LUA = (
    _DROP_LUA
    + """
local n, p = 0, ARGV[1]
for _, m in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(m, 1, string.len(p)) == p then n = n + drop(m) end
end
return n
"""
)


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
        prefix: key prefix (its own LRU, sizes and byte count: stores of other prefixes never
            evict its entries).
        clock: monotonic seconds for the retry pause.
        client: a ``redis.asyncio.Redis`` of ``url`` to share (several prefixes, one connection
            pool); None: a client of its own.
        strict: a failed read or write raises :class:`StoreUnavailable` (after redis-py's one
            retry) instead of a miss or a skipped store, and no ``retry_s`` pause: for what is
            kept on a tenant's behalf, where "missing" leads to deletions.
    """

    name = "redis"

    def __init__(
        self,
        url: str,
        max_entries: int,
        max_bytes: int,
        *,
        timeout_s: float = 0.25,
        retry_s: float = 5.0,
        prefix: str = "kvserve:rc:",
        clock: Callable[[], float] = time.monotonic,
        client=None,
        strict: bool = False,
    ):
        self.strict = strict
        self.url, self.max_entries, self.max_bytes, self.prefix = url, max_entries, max_bytes, prefix
        self.retry_s, self._clock = retry_s, clock
        self._redis = client if client is not None else self.connect(url, timeout_s)
        self._put = self._redis.register_script(_PUT_LUA)
        self._get = self._redis.register_script(_GET_LUA)
        self._clear = self._redis.register_script(_CLEAR_LUA)
        self._del = self._redis.register_script(_DEL_LUA)
        self._meta = [prefix + "lru", prefix + "sizes", prefix + "bytes"]
        self._down_until = -math.inf
        self._warned = False

    @staticmethod
    def connect(url: str, timeout_s: float = 0.25):
        """A ``redis.asyncio.Redis`` of ``url`` with this store's timeouts and a single retry."""
        import redis.asyncio as aioredis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        return aioredis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1)
        )

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
            if self.strict:
                raise StoreUnavailable("a read", e) from None
            return None
        self._ok()
        return data

    async def put(self, model: str, key: str, data: bytes, ttl_s: float) -> bool:
        if len(data) > self.max_bytes or not self._usable():
            return False
        try:
            await self._put(
                keys=self._meta + [self.entry_key(model, key)],
                args=[data, max(1, int(ttl_s * 1000)), self.max_entries, self.max_bytes],
            )
        except Exception as e:  # noqa: BLE001
            self._failed(e)
            if self.strict:
                raise StoreUnavailable("a write", e) from None
            return False
        self._ok()
        return True

    async def delete(self, model: str, key: str) -> bool:
        """Remove one entry; True if it was there.

        Raises:
            redis.RedisError: Redis failed (a deletion must not pass silently);
                :class:`StoreUnavailable` when ``strict``.
        """
        try:
            n = await self._del(keys=self._meta + [self.entry_key(model, key)])
        except Exception as e:  # noqa: BLE001
            if not self.strict:
                raise
            self._failed(e)
            raise StoreUnavailable("a deletion", e) from None
        self._ok()
        return bool(n)

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
            if self.strict:
                raise StoreUnavailable("a size query", e) from None
            return 0, 0
        return int(n), int(b or 0)

    async def close(self) -> None:
        await self._redis.aclose()

    def _usable(self) -> bool:
        return self.strict or self._clock() >= self._down_until

    def _failed(self, err: BaseException) -> None:
        self._down_until = self._clock() + self.retry_s
        if not self._warned:
            self._warned = True
            if self.strict:
                logger.warning(
                    "store %s: Redis at %s failed (%s: %s); its requests get 503 until it answers again",
                    self.prefix,
                    safe_url(self.url),
                    type(err).__name__,
                    err,
                )
                return
            logger.warning(
                "response cache: Redis at %s failed (%s: %s); every lookup is a miss until it answers "
                "again (retried every %.0f s)",
                safe_url(self.url),
                type(err).__name__,
                err,
                self.retry_s,
            )

    def _ok(self) -> None:
        if self._warned:
            self._warned = False
            logger.info("response cache: Redis answers again")
