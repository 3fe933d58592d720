"""Per-owner stores in the response cache's backend: :class:`OwnerStores`, for what the gateway
keeps on behalf of an API key (stored responses, the Batch API's files and batches)."""

from __future__ import annotations

import time

from kvserve.deployments.cache.settings import CacheSettings
from kvserve.deployments.cache.stores import MemoryStore, RedisStore, StoreUnavailable


class OwnerStores:
    """Each owner's (an API key's stable id) own byte store, made on first use: in this ingress
    replica's memory, or in Redis (``cache_backend: redis``, so every ingress replica sees the
    same), plus an ordered index of ids per owner and kind (what a list endpoint shows: a Redis
    sorted set by creation time, or a dict here).

    Each owner's store is bounded on its own (one tenant never evicts another's): the cache's
    entry bound, and an equal share of its byte bound among ``owners`` (the configured API
    keys), so all owners together stay within ``cache_max_bytes`` (not each of them).

    Redis stores are ``strict`` (:class:`~kvserve.deployments.cache.stores.RedisStore`): a read,
    write or index command Redis fails to answer raises
    :class:`~kvserve.deployments.cache.stores.StoreUnavailable` (503), never a "not found" that
    a caller would act on by forgetting an id.

    Args:
        settings: the response cache's backend and bounds.
        prefix: the Redis key prefix (each owner's keys under ``<prefix><owner>:``).
        timeout_s: the Redis commands' timeout (files are larger than cache entries).
        owners: how many owners share ``settings.max_bytes`` (at least 1).
        max_entries: each owner's entry bound (None: the cache's ``max_entries``).
    """

    def __init__(
        self,
        settings: CacheSettings,
        prefix: str,
        timeout_s: float = 0.25,
        *,
        owners: int = 1,
        max_entries: int | None = None,
    ):
        self.settings, self.prefix, self.timeout_s = settings, prefix, timeout_s
        self.owner_bytes = max(1, settings.max_bytes // max(1, owners))
        self.owner_entries = max_entries if max_entries is not None else settings.max_entries
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
                store = RedisStore(
                    s.redis_url,
                    self.owner_entries,
                    self.owner_bytes,
                    prefix=f"{self.prefix}{owner}:",
                    client=self.redis,
                    strict=True,
                )
            else:
                store = MemoryStore(self.owner_entries, self.owner_bytes)
            self._stores[owner] = store
        return store

    def _index_key(self, owner: str, kind: str) -> str:
        return f"{self.prefix}{owner}:index:{kind}"

    async def index_add(self, owner: str, kind: str, item_id: str) -> None:
        """Record ``item_id`` in ``owner``'s index of ``kind``.

        Raises:
            StoreUnavailable: Redis did not answer.
        """
        if self.settings.backend == "redis":
            try:
                await self.redis.zadd(self._index_key(owner, kind), {item_id: time.time()})
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("an index write", e) from None
        else:
            self._index.setdefault((owner, kind), {})[item_id] = time.time()

    async def index_remove(self, owner: str, kind: str, item_id: str) -> None:
        """Forget ``item_id`` in ``owner``'s index of ``kind``.

        Raises:
            StoreUnavailable: Redis did not answer.
        """
        if self.settings.backend == "redis":
            try:
                await self.redis.zrem(self._index_key(owner, kind), item_id)
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("an index write", e) from None
        else:
            self._index.get((owner, kind), {}).pop(item_id, None)

    async def index(self, owner: str, kind: str) -> list[str]:
        """``owner``'s ids of ``kind``, newest first.

        Raises:
            StoreUnavailable: Redis did not answer.
        """
        if self.settings.backend == "redis":
            try:
                ids = await self.redis.zrevrange(self._index_key(owner, kind), 0, -1)
            except Exception as e:  # noqa: BLE001
                raise StoreUnavailable("an index read", e) from None
            return [i.decode() if isinstance(i, bytes) else i for i in ids]
        items = self._index.get((owner, kind), {})
        return sorted(items, key=items.get, reverse=True)
