"""deployments.limits: key policies (policies.py), token-bucket rate limiter (rate_limiter.py; local
and on a real Redis), failed-auth throttle (auth_throttle.py). Fast (no Ray, no model); the Redis
tests start their own redis-server."""

import asyncio
import hashlib
import logging
import time

import pytest
from helpers import free_port

from deployments.limits import policies, rate_limiter
from deployments.limits import (
    AuthFailureThrottle,
    KeyPolicy,
    NeverFits,
    RateLimited,
    RateLimiter,
    find_policy,
    load_key_file,
    parse_key_lines,
    policies_from_keys,
)

pytestmark = pytest.mark.timeout(60)


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


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


def run(coro):
    return asyncio.run(coro)


# --------------------------------------------------------------------------- key policies

SECRET = "sk-Secret-Value-123"


def test_parse_attributes_and_old_format():
    ps = parse_key_lines([
        "# a comment",
        "",
        "   ",
        "sk-plain",
        f"{SECRET}  name=team-a  rpm=60 tpm=2.5e4 priority=-2   # trailing comment",
        "sk-inf rpm=inf tpm=0",
    ])
    assert [p.key for p in ps] == ["sk-plain", SECRET, "sk-inf"]
    plain, a, inf = ps
    assert plain.name == "key-" + hashlib.sha256(b"sk-plain").hexdigest()[:8]
    assert (plain.requests_per_minute, plain.tokens_per_minute, plain.priority) == (None, None, 0)
    assert (a.name, a.requests_per_minute, a.tokens_per_minute, a.priority) == ("team-a", 60.0, 25000.0, -2)
    assert inf.requests_per_minute == float("inf") and inf.tokens_per_minute == 0.0


def test_policies_from_keys_accepts_plain_and_attributed_entries():
    ps = policies_from_keys(["k1", "", "k2 name=ci rpm=5"])
    assert [(p.key, p.requests_per_minute) for p in ps] == [("k1", None), ("k2", 5.0)]
    assert ps[1].name == "ci"
    with pytest.raises(ValueError, match="entry 2"):
        policies_from_keys(["k1", "k2 rpm=x"])


def test_key_never_in_repr():
    p = KeyPolicy(SECRET, name="x")
    assert SECRET not in repr(p) and SECRET not in str(p)
    assert "name='x'" in repr(p)


@pytest.mark.parametrize("line, needle", [
    (f"{SECRET} rpm=abc", "rpm="),
    (f"{SECRET} rpm=-1", "rpm="),
    (f"{SECRET} tpm=nan", "tpm="),
    (f"{SECRET} priority=1.5", "priority="),
    (f"{SECRET} color=red", "unknown attribute"),
    (f"{SECRET} tail-of-a-key-with-a-space", "unknown attribute"),
    (f"{SECRET} rpm=1 rpm=2", "twice"),
    (f"{SECRET} name=bad!name", "name="),
    (f"rpm=5 {SECRET}", "key must come first"),
])
def test_parse_errors_name_the_line_not_the_key(line, needle):
    with pytest.raises(ValueError) as ei:
        parse_key_lines(["sk-first", "# c", line])
    msg = str(ei.value)
    assert "line 3" in msg and needle in msg
    assert SECRET not in msg and "Secret" not in msg and "tail-of" not in msg


def test_duplicates_rejected():
    with pytest.raises(ValueError, match="line 3: duplicate key") as ei:
        parse_key_lines([SECRET, "other", f"{SECRET} name=z"])
    assert SECRET not in str(ei.value)
    with pytest.raises(ValueError, match="line 2: duplicate name 'a'"):
        parse_key_lines(["k1 name=a", "k2 name=a"])
    # a given name equal to another key's derived name is a duplicate too
    derived = KeyPolicy("k1").name
    with pytest.raises(ValueError, match="duplicate name"):
        parse_key_lines(["k1", f"k2 name={derived}"])


def test_load_key_file(tmp_path):
    f = tmp_path / "keys"
    f.write_text("# keys\nsk-a rpm=10\nsk-b\n")
    assert [p.key for p in load_key_file(f)] == ["sk-a", "sk-b"]
    (tmp_path / "empty").write_text("# nothing\n\n")
    with pytest.raises(ValueError, match="holds no keys"):
        load_key_file(tmp_path / "empty")
    with pytest.raises(ValueError, match="cannot read"):
        load_key_file(tmp_path / "missing")
    (tmp_path / "bin").write_bytes(b"sk-\xff\xfe\n")
    with pytest.raises(ValueError, match="not UTF-8"):
        load_key_file(tmp_path / "bin")
    (tmp_path / "bad").write_text(f"sk-a\n{SECRET} rpm=oops\n")
    with pytest.raises(ValueError, match="line 2") as ei:
        load_key_file(tmp_path / "bad")
    assert SECRET not in str(ei.value) and str(tmp_path / "bad") in str(ei.value)


def test_find_policy():
    ps = policies_from_keys(["alpha", "beta", "gamma"])
    assert find_policy(b"beta", ps) is ps[1]
    assert find_policy(b"gamma", ps) is ps[2]  # the last key matches too (no early-exit bug)
    assert find_policy("alpha", ps) is ps[0]
    assert find_policy(b"bet", ps) is None
    assert find_policy(b"betaa", ps) is None
    assert find_policy(b"", ps) is None
    assert find_policy(b"\xff\xfe\x00caf\xc3\xa9", ps) is None  # non-ASCII, invalid UTF-8: no error
    uni = policies_from_keys(["café-ключ"])
    assert find_policy("café-ключ".encode(), uni) is uni[0]
    assert find_policy(b"", [KeyPolicy("", name="anon")]) is None  # an empty key never matches


def test_find_policy_checks_every_key(monkeypatch):
    calls = []
    real = policies.hmac.compare_digest

    def spy(a, b):
        calls.append(b)
        return real(a, b)

    monkeypatch.setattr(policies.hmac, "compare_digest", spy)
    ps = policies_from_keys(["k1", "k2", "k3"])
    assert find_policy(b"k1", ps) is ps[0]
    assert calls == [b"k1", b"k2", b"k3"]


# --------------------------------------------------------------------------- local limiter


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
    own, free, dflt = KeyPolicy("a", requests_per_minute=3), KeyPolicy("b", requests_per_minute=float("inf")), KeyPolicy("c")
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


# --------------------------------------------------------------------------- Redis


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
        t0 = time.monotonic()
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
        assert time.monotonic() - t0 < 5  # a refused connection does not stall requests
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


# --------------------------------------------------------------------------- failed-auth throttle


def test_auth_throttle_window():
    clock = FakeClock()
    t = AuthFailureThrottle(max_failures=3, window_s=60, clock=clock)
    assert t.retry_after("1.2.3.4") is None
    for i in range(3):
        assert t.retry_after("1.2.3.4") is None
        t.record_failure("1.2.3.4")
        clock.advance(10)
    # three failures at t0, t0+10, t0+20; now t0+30: the 4th attempt waits for t0+60
    assert t.retry_after("1.2.3.4") == pytest.approx(30.0)
    assert t.retry_after("5.6.7.8") is None  # other clients unaffected
    clock.advance(29.9)
    assert t.retry_after("1.2.3.4") == pytest.approx(0.1)
    clock.advance(0.1)
    assert t.retry_after("1.2.3.4") is None  # oldest left the window
    t.record_failure("1.2.3.4")  # 3 in the window again (t0+10, t0+20, now)
    assert t.retry_after("1.2.3.4") == pytest.approx(10.0)
    clock.advance(61)
    assert t.retry_after("1.2.3.4") is None
    assert len(t) == 0  # fully expired clients are dropped


def test_auth_throttle_success_resets():
    clock = FakeClock()
    t = AuthFailureThrottle(max_failures=2, window_s=60, clock=clock)
    t.record_failure("c")
    t.record_failure("c")
    assert t.retry_after("c") is not None
    t.record_success("c")
    assert t.retry_after("c") is None


def test_auth_throttle_memory_bound():
    clock = FakeClock()
    t = AuthFailureThrottle(max_failures=2, window_s=60, max_clients=3, clock=clock)
    for c in ("a", "b", "c"):
        t.record_failure(c)
        t.record_failure(c)
    t.record_failure("a")  # a is now the most recently failed; b the oldest
    t.record_failure("d")
    assert len(t) == 3
    assert t.retry_after("b") is None  # evicted
    assert t.retry_after("a") is not None and t.retry_after("c") is not None
    for i in range(1000):
        t.record_failure(f"10.0.{i // 256}.{i % 256}")
    assert len(t) == 3
    assert all(len(q) <= 2 for q in t._failures.values())  # per-client memory bounded too
    with pytest.raises(ValueError):
        AuthFailureThrottle(max_failures=0)
