"""kvserve.deployments.limits' failed-auth throttle (auth_throttle.py): the sliding window per client, a
success that resets it, and its memory bound. Fast (no Ray, no model)."""

import pytest
from limits_helpers import FakeClock

from kvserve.deployments.limits import AuthFailureThrottle

pytestmark = pytest.mark.timeout(60)


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
