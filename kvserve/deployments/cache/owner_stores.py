"""Per-owner stores in the response cache's backend: :class:`OwnerStores`, for what the gateway
keeps on behalf of an API key (stored responses, the Batch API's files and batches)."""
from __future__ import annotations

import time

from kvserve.deployments.cache.settings import CacheSettings
from kvserve.deployments.cache.stores import MemoryStore, RedisStore


class OwnerStores:
    """Each owner's (an API key's stable id) own byte store, made on first use: in this ingress
    replica's memory, or in Redis (``cache_backend: redis``, so every ingress replica sees the
    same), each bounded by the cache's entry and byte bounds on its own (one tenant never
    evicts another's), plus an ordered index of ids per owner and kind (what a list endpoint
    shows: a Redis sorted set by creation time, or a dict here).

    Args:
        settings: the response cache's backend and bounds.
        prefix: the Redis key prefix (each owner's keys under ``<prefix><owner>:``).
        timeout_s: the Redis commands' timeout (files are larger than cache entries).
    """

    def __init__(self, settings: CacheSettings, prefix: str, timeout_s: float = 0.25):
        self.settings, self.prefix, self.timeout_s = settings, prefix, timeout_s
        self._stores: dict = {}  # owner -> its MemoryStore or RedisStore
        self._index: dict[tuple[str, str], dict[str, float]] = {}  # memory: (owner, kind) -> {id: created}
        self._redis = None  # the Redis client the owners' stores share

    @property
    def redis(self):
        if self._redis is None:
            self._redis = RedisStore.connect(self.settings.redis_url, self.timeout_s)
        return self._redis

    def store_of(self, owner: str):
        """The store of ``owner`` (made on first use)."""
        store = self._stores.get(owner)
        if store is None:
            s = self.settings
            if s.backend == "redis":
                store = RedisStore(s.redis_url, s.max_entries, s.max_bytes, prefix=f"{self.prefix}{owner}:",
                                   client=self.redis)
            else:
                store = MemoryStore(s.max_entries, s.max_bytes)
            self._stores[owner] = store
        return store

    def _index_key(self, owner: str, kind: str) -> str:
        return f"{self.prefix}{owner}:index:{kind}"

    async def index_add(self, owner: str, kind: str, item_id: str) -> None:
        """Record ``item_id`` in ``owner``'s index of ``kind`` (Redis errors raise)."""
        if self.settings.backend == "redis":
            await self.redis.zadd(self._index_key(owner, kind), {item_id: time.time()})
        else:
            self._index.setdefault((owner, kind), {})[item_id] = time.time()

    async def index_remove(self, owner: str, kind: str, item_id: str) -> None:
        """Forget ``item_id`` in ``owner``'s index of ``kind``."""
        if self.settings.backend == "redis":
            await self.redis.zrem(self._index_key(owner, kind), item_id)
        else:
            self._index.get((owner, kind), {}).pop(item_id, None)

    async def index(self, owner: str, kind: str) -> list[str]:
        """``owner``'s ids of ``kind``, newest first."""
        if self.settings.backend == "redis":
            ids = await self.redis.zrevrange(self._index_key(owner, kind), 0, -1)
            return [i.decode() if isinstance(i, bytes) else i for i in ids]
        items = self._index.get((owner, kind), {})
        return sorted(items, key=items.get, reverse=True)
