"""The response cache's stores (kvserve/deployments/cache/), without Ray: the in-process one (LRU, TTL, byte
bound) and Redis (shared by two instances, LRU, byte bound, TTL on the session's redis-server,
which skips without one; a Redis that is down is a miss, logged once)."""

import asyncio
import logging
import time

from helpers import free_port
from response_cache_helpers import FakeClock, answer, chat, run

from kvserve.deployments.cache import CacheSettings, MemoryStore, RedisStore, RequestOptions, ResponseCache


def test_memory_store_lru_by_entries():
    s = MemoryStore(max_entries=2, max_bytes=1 << 20)

    async def go():
        await s.put("m", "a", b"A", 60)
        await s.put("m", "b", b"B", 60)
        assert await s.get("m", "a") == b"A"  # a is now the most recently used
        await s.put("m", "c", b"C", 60)
        return [await s.get("m", k) for k in "abc"]

    assert run(go()) == [b"A", None, b"C"]


def test_memory_store_ttl_and_bytes_bound():
    clock = FakeClock()
    s = MemoryStore(max_entries=100, max_bytes=10, clock=clock)

    async def go():
        await s.put("m", "a", b"aaaa", 5)
        await s.put("m", "b", b"bbbb", 50)
        clock.t += 6
        assert await s.get("m", "a") is None and await s.get("m", "b") == b"bbbb"  # a expired
        assert await s.put("m", "c", b"cccc", 50) and await s.put("m", "d", b"dddd", 50)  # 12 bytes > 10: b goes
        assert await s.get("m", "b") is None and await s.size() == (2, 8)
        assert not await s.put("m", "big", b"x" * 11, 50)  # larger than the whole bound: never stored
        await s.put("other", "e", b"e", 50)
        assert await s.clear("m") == 2 and await s.size() == (1, 1)

    run(go())


def _redis_store(url, prefix, **kw) -> RedisStore:
    """A store on the test's Redis. These tests are about what the store keeps, not about its
    time-outs: a generous command time-out (the store's 0.25 s default turns a slow answer into a
    miss by design) keeps a loaded 2-core box from reading a slow local answer as a miss."""
    kw.setdefault("timeout_s", 10.0)
    return RedisStore(url, kw.pop("max_entries", 100), kw.pop("max_bytes", 1 << 20), prefix=prefix, **kw)


def test_redis_store_is_shared_by_two_instances(redis_server):
    async def go():
        a, b = _redis_store(redis_server, "t1:"), _redis_store(redis_server, "t1:")
        assert await a.put("m", "k", b"answer", 60)
        got = await b.get("m", "k")
        assert await b.get("other-model", "k") is None
        n = await b.clear("m")
        after = await a.get("m", "k")
        await a.close(), await b.close()
        return got, n, after

    assert run(go()) == (b"answer", 1, None)


def test_redis_store_lru_bytes_and_ttl(redis_server):
    async def go():
        s = _redis_store(redis_server, "t2:", max_entries=2, max_bytes=10)
        await s.put("m", "a", b"aaa", 60)
        await asyncio.sleep(0.01)  # scores are Redis's clock in ms
        await s.put("m", "b", b"bbb", 60)
        await asyncio.sleep(0.01)
        assert await s.get("m", "a") == b"aaa"  # touched: b is now least recently used
        await asyncio.sleep(0.01)
        await s.put("m", "c", b"ccc", 60)
        lru = [await s.get("m", k) for k in "abc"]
        assert await s.size() == (2, 6)
        await s.put("m", "d", b"dddddddd", 60)  # 8 bytes: a and c go (10-byte bound)
        bounded = [await s.get("m", k) for k in "acd"], await s.size()
        assert not await s.put("m", "e", b"x" * 11, 60)
        await s.put("m", "short", b"s", 0.2)
        present = await s.get("m", "short")
        deadline = time.monotonic() + 5
        while await s.get("m", "short") is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        expired = await s.get("m", "short") is None
        await s.clear()
        await s.close()
        return lru, bounded, present, expired

    lru, bounded, present, expired = run(go())
    assert lru == [b"aaa", None, b"ccc"]
    assert bounded == ([None, None, b"dddddddd"], (1, 8))
    assert present == b"s" and expired


def test_redis_down_is_a_miss_not_an_error(caplog):
    caplog.set_level(logging.WARNING, logger="ray.serve")
    settings = CacheSettings(backend="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there

    async def go():
        cache = ResponseCache(settings, metrics=False)
        cache.store_backend.retry_s = 0.0  # try Redis on every call: each one fails
        looks = [await cache.lookup("m", "r", "chat", chat(), RequestOptions()) for _ in range(3)]
        cache.store_soon(looks[0], [answer()], 1)
        await asyncio.gather(*cache._tasks)
        await cache.close()
        return looks

    looks = run(go())
    assert [lk.status for lk in looks] == ["miss"] * 3 and not any(lk.hit for lk in looks)
    warnings = [r for r in caplog.records if "response cache: Redis" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # logged once, not per request
