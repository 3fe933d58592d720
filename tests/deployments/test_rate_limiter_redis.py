"""kvserve.deployments.limits' rate limiter (rate_limiter.py) on a real Redis: one limit shared by the
instances, refunds across them, bucket keys that expire, and a Redis that is down (a local fallback
with one warning) or comes back. Uses the session's redis-server (skips without one); no Ray, no model."""

import asyncio
import logging

import pytest
from helpers import free_port
from limits_helpers import FakeClock, run

from kvserve.deployments.limits import rate_limiter
from kvserve.deployments.limits import (
    KeyPolicy,
    NeverFits,
    RateLimited,
    RateLimiter,
)

pytestmark = pytest.mark.timeout(60)


class Records(logging.Handler):
    """Collects the records of rate_limiter.logger (attached directly: independent of propagation)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)

    def at(self, level):
        return [r for r in self.records if r.levelno == level]


@pytest.fixture
def log_records():
    h = Records()
    old = rate_limiter.logger.level
    rate_limiter.logger.addHandler(h)
    rate_limiter.logger.setLevel(logging.DEBUG)
    yield h
    rate_limiter.logger.removeHandler(h)
    rate_limiter.logger.setLevel(old)


@pytest.fixture(scope="module")
def redis_url(redis_server):
    return redis_server


def test_redis_shared_limit_across_instances(redis_url, log_records):
    # rpm=6: one request refills every 10 s, far longer than this test runs
    p = KeyPolicy("shared-rpm", requests_per_minute=6)

    async def go():
        a = RateLimiter(redis_url=redis_url, divide_by=2, key_prefix="t1:")
        b = RateLimiter(redis_url=redis_url, divide_by=2, key_prefix="t1:")
        admitted = 0
        refused = []
        for i in range(20):
            try:
                g = await (a if i % 2 else b).acquire(p, 0)
                assert g.backend == "redis"
                admitted += 1
            except RateLimited as e:
                refused.append(e)
        await a.aclose()
        await b.aclose()
        return admitted, refused

    admitted, refused = run(go())
    assert admitted == 6  # the shared limit, not 2 x 6 and not 2 x 3
    assert len(refused) == 14 and all(e.limit == "requests" for e in refused)
    assert 9.0 < refused[0].retry_after_s <= 10.01
    assert not log_records.at(logging.WARNING)


def test_redis_settle_refunds_across_instances_and_both_or_neither(redis_url):
    p = KeyPolicy("shared-tpm", requests_per_minute=3, tokens_per_minute=1000)

    async def go():
        a = RateLimiter(redis_url=redis_url, key_prefix="t2:")
        b = RateLimiter(redis_url=redis_url, key_prefix="t2:")
        g = await a.acquire(p, 800)
        assert g.backend == "redis"
        with pytest.raises(RateLimited) as ei:
            await b.acquire(p, 800)  # ~200 left (+17 per second)
        assert ei.value.limit == "tokens" and 30 < ei.value.retry_after_s <= 36.01
        await a.settle(g, 100)  # 700 back, into the shared bucket
        await b.acquire(p, 800)  # second request
        with pytest.raises(RateLimited) as ei:
            await a.acquire(p, 800)
        assert ei.value.limit == "tokens"
        await b.acquire(p, 0)  # the token refusals took no request: the third passes
        with pytest.raises(RateLimited) as ei:
            await a.acquire(p, 0)
        assert ei.value.limit == "requests"
        with pytest.raises(NeverFits):
            await a.acquire(p, 1001)
        await a.aclose()
        await b.aclose()

    run(go())


def test_redis_refund_capped_at_capacity(redis_url):
    # 600k tokens per minute: 10 per ms, so the bucket refills measurably during a short sleep
    p = KeyPolicy("sk-cap", name="cap", tokens_per_minute=600_000)

    async def go():
        rl = RateLimiter(redis_url=redis_url, key_prefix="t5:")
        g = await rl.acquire(p, 600_000)  # empty
        await asyncio.sleep(0.3)  # ~3000 refilled
        await rl.settle(g, 0)  # 600k back: capped at 600k, not ~603k
        await rl.acquire(p, 600_000)
        with pytest.raises(RateLimited):
            await rl.acquire(p, 2500)  # only what refilled since (well under 2500 within 0.25 s)
        await rl.aclose()

    run(go())


def test_redis_reports_the_longer_wait(redis_url):
    p = KeyPolicy("sk-both", name="both", requests_per_minute=2, tokens_per_minute=1000)

    async def go():
        rl = RateLimiter(redis_url=redis_url, key_prefix="t6:")
        await rl.acquire(p, 0)
        await rl.acquire(p, 1000)  # both requests used, tokens at ~0
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 1000)
        # requests short by 1 (30 s at 2/min), tokens by ~1000 (60 s): the longer wait is reported
        assert ei.value.limit == "tokens" and 55 < ei.value.retry_after_s <= 60.01
        await rl.aclose()

    run(go())


def test_redis_bucket_keys_expire(redis_url):
    import redis

    p = KeyPolicy("sk-exp", name="expiring", requests_per_minute=600)  # full again 100 ms after one request

    async def go():
        rl = RateLimiter(redis_url=redis_url, key_prefix="t3:")
        await rl.acquire(p, 0)
        await rl.aclose()

    run(go())
    r = redis.Redis.from_url(redis_url)
    try:
        ttl = r.pttl("t3:{expiring}:req")
        assert 0 < ttl <= 1100
        assert r.exists("t3:{expiring}:tok") == 0  # no token limit: no token bucket
    finally:
        r.close()


def test_redis_down_falls_back_to_local_with_one_warning(log_records):
    clock = FakeClock()
    dead = f"redis://:hunter2@127.0.0.1:{free_port()}/0"  # nothing listens there
    p = KeyPolicy("k", requests_per_minute=4, tokens_per_minute=1000)

    async def go():
        rl = RateLimiter(redis_url=dead, divide_by=2, clock=clock)
        tried = []  # the clock's time at each call to Redis
        script = rl._acquire_script

        async def counted(*a, **kw):
            tried.append(clock())
            return await script(*a, **kw)

        rl._acquire_script = counted
        t0 = clock()
        g = await rl.acquire(p, 100)
        assert g.backend == "local"
        await rl.acquire(p, 100)  # this replica's share: 2 of 4
        with pytest.raises(RateLimited):
            await rl.acquire(p, 100)
        await rl.settle(g, 0)
        clock.advance(10)  # past redis_retry_s: tries Redis again, fails again, still limited
        with pytest.raises(RateLimited):
            await rl.acquire(p, 0)
        clock.advance(30)  # one request refilled (2 per minute locally)
        assert (await rl.acquire(p, 0)).backend == "local"
        # a refused connection is tried once per redis_retry_s (5 s), not on every request: the
        # first request, the one 10 s later and the one 40 s later; the others went local at once
        assert [t - t0 for t in tried] == [0, 10, 40]
        await rl.aclose()

    run(go())
    warnings = log_records.at(logging.WARNING)
    assert len(warnings) == 1
    msg = warnings[0].getMessage()
    assert "Redis" in msg and "hunter2" not in msg


def test_redis_recovers_after_outage(redis_url, log_records):
    clock = FakeClock()
    p = KeyPolicy("recover", requests_per_minute=100)

    async def go():
        rl = RateLimiter(redis_url=redis_url, clock=clock, key_prefix="t4:")
        rl._redis_failed(ConnectionError("simulated"))
        assert (await rl.acquire(p, 0)).backend == "local"  # within the retry pause
        clock.advance(6)
        assert (await rl.acquire(p, 0)).backend == "redis"
        await rl.aclose()

    run(go())
    assert len(log_records.at(logging.WARNING)) == 1
    assert any("again" in r.getMessage() for r in log_records.at(logging.INFO))
