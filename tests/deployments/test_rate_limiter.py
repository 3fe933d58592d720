"""kvserve.deployments.limits' token-bucket rate limiter (rate_limiter.py) on its local backend: requests and
tokens per minute, reservations settled and refunded, a cost that never fits, both limits or neither,
the share of one replica. Fast (no Ray, no model, no Redis: test_rate_limiter_redis.py)."""

import pytest
from limits_helpers import FakeClock, run

from kvserve.deployments.limits import (
    KeyPolicy,
    NeverFits,
    RateLimited,
    RateLimiter,
)

pytestmark = pytest.mark.timeout(60)


def test_rpm_exhausts_then_refills():
    clock = FakeClock()
    rl = RateLimiter(default_rpm=60, clock=clock)
    p = KeyPolicy("k")

    async def go():
        for _ in range(60):
            await rl.acquire(p, 0)
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 0)
        assert ei.value.limit == "requests" and ei.value.retry_after_s == pytest.approx(1.0)
        assert ei.value.retry_after_header == "1" and "60 requests per minute" in str(ei.value)
        clock.advance(0.5)
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 0)
        assert ei.value.retry_after_s == pytest.approx(0.5)
        assert ei.value.retry_after_header == "1"  # rounded up to >= 1 s
        clock.advance(0.5)
        await rl.acquire(p, 0)  # one refilled
        with pytest.raises(RateLimited):
            await rl.acquire(p, 0)
        clock.advance(3600)  # refill stops at the capacity: one minute's worth
        for _ in range(60):
            await rl.acquire(p, 0)
        with pytest.raises(RateLimited):
            await rl.acquire(p, 0)

    run(go())


def test_policy_limit_overrides_default_and_inf_means_unlimited():
    clock = FakeClock()
    rl = RateLimiter(default_rpm=1, clock=clock)
    own, free, dflt = (
        KeyPolicy("a", requests_per_minute=3),
        KeyPolicy("b", requests_per_minute=float("inf")),
        KeyPolicy("c"),
    )
    assert rl.enabled_for(own) and not rl.enabled_for(free) and rl.enabled_for(dflt)
    assert not RateLimiter(clock=clock).enabled_for(dflt)

    async def go():
        for _ in range(3):
            await rl.acquire(own, 0)
        with pytest.raises(RateLimited):
            await rl.acquire(own, 0)
        for _ in range(500):
            g = await rl.acquire(free, 10**6)
        assert g.backend == "none"
        await rl.acquire(dflt, 0)
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(dflt, 0)
        assert ei.value.retry_after_s == pytest.approx(60.0)

    run(go())


def test_tpm_reservation_settle_refund():
    clock = FakeClock()
    rl = RateLimiter(default_tpm=1000, clock=clock)
    p = KeyPolicy("k")

    async def go():
        g = await rl.acquire(p, 800)  # reserves 800 of 1000
        assert g.reserved_tokens == 800 and g.backend == "local"
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 800)  # 200 left
        assert ei.value.limit == "tokens"
        assert ei.value.retry_after_s == pytest.approx(600 / (1000 / 60))  # 36 s
        await rl.settle(g, 100)  # used 100: 700 go back -> 900
        g2 = await rl.acquire(p, 800)
        await rl.settle(g, 0)  # a second settle of the same grant gives nothing back
        with pytest.raises(RateLimited):
            await rl.acquire(p, 800)  # 100 left
        await rl.settle(g2, 800)  # used everything: nothing back
        with pytest.raises(RateLimited):
            await rl.acquire(p, 800)

    run(go())


def test_settle_refund_capped_at_capacity():
    clock = FakeClock()
    rl = RateLimiter(default_tpm=1000, clock=clock)
    p = KeyPolicy("k")

    async def go():
        g = await rl.acquire(p, 1000)
        clock.advance(60)  # bucket full again
        await rl.settle(g, 0)  # refund 1000 into a full bucket: stays at 1000
        await rl.acquire(p, 1000)
        with pytest.raises(RateLimited):
            await rl.acquire(p, 1)

    run(go())


def test_never_fits():
    clock = FakeClock()
    rl = RateLimiter(default_rpm=10, default_tpm=1000, clock=clock)
    p = KeyPolicy("k")

    async def go():
        with pytest.raises(NeverFits) as ei:
            await rl.acquire(p, 1001)
        assert isinstance(ei.value, ValueError) and not isinstance(ei.value, RateLimited)
        assert ei.value.limit == "tokens" and ei.value.cost == 1001 and "1000 tokens per minute" in str(ei.value)
        await rl.acquire(p, 1000)  # exactly the capacity fits
        with pytest.raises(NeverFits) as ei:
            await rl.acquire(KeyPolicy("z", requests_per_minute=0), 0)
        assert ei.value.limit == "requests"
        # NeverFits took nothing: 9 requests remain after the one above
        for _ in range(9):
            await rl.acquire(p, 0)
        with pytest.raises(RateLimited):
            await rl.acquire(p, 0)

    run(go())


def test_both_or_neither():
    clock = FakeClock()
    rl = RateLimiter(default_rpm=2, default_tpm=100, clock=clock)
    p = KeyPolicy("k")
    q = KeyPolicy("q")

    async def go():
        await rl.acquire(p, 100)  # 1 request, all tokens
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 50)
        assert ei.value.limit == "tokens"
        await rl.acquire(p, 0)  # the token refusal did not take the second request
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 0)
        assert ei.value.limit == "requests"
        # and a request refusal takes no tokens
        await rl.acquire(q, 10)
        await rl.acquire(q, 10)
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(q, 80)
        assert ei.value.limit == "requests"
        clock.advance(30)  # +1 request, +50 tokens (capped at 100): 80 + 50 -> 100
        await rl.acquire(q, 100)

    run(go())


def test_reports_the_longer_wait():
    clock = FakeClock()
    rl = RateLimiter(default_rpm=2, default_tpm=1000, clock=clock)
    p = KeyPolicy("k")

    async def go():
        await rl.acquire(p, 0)
        await rl.acquire(p, 1000)
        with pytest.raises(RateLimited) as ei:  # requests: 30 s away; tokens: 60 s away
            await rl.acquire(p, 1000)
        assert ei.value.limit == "tokens" and ei.value.retry_after_s == pytest.approx(60.0)
        assert ei.value.limit_per_minute == 1000

    run(go())


def test_divide_by_halves_the_limit():
    clock = FakeClock()
    rl = RateLimiter(default_rpm=10, default_tpm=1000, divide_by=2, clock=clock)
    p = KeyPolicy("k")

    async def go():
        for _ in range(5):
            await rl.acquire(p, 0)
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(p, 0)
        assert ei.value.retry_after_s == pytest.approx(12.0)  # 5 per minute
        assert ei.value.limit_per_minute == 10  # the message says the configured limit
        # a cost above the replica's share (500) but within the limit passes from a full
        # bucket and leaves it in debt: 800 - 500 = -300, full again after 96 s
        q = KeyPolicy("q")
        await rl.acquire(q, 800)
        with pytest.raises(RateLimited) as ei:
            await rl.acquire(q, 1)
        assert ei.value.retry_after_s == pytest.approx(301 / (500 / 60))
        with pytest.raises(NeverFits):
            await rl.acquire(q, 1001)

    run(go())


def test_bad_arguments():
    with pytest.raises(ValueError):
        RateLimiter(divide_by=0)
    with pytest.raises(ValueError):
        RateLimiter(default_rpm=-1)
    with pytest.raises(ValueError):
        KeyPolicy("k", requests_per_minute=float("nan"))
    with pytest.raises(ValueError):
        run(RateLimiter(default_tpm=10).acquire(KeyPolicy("k"), -1))
