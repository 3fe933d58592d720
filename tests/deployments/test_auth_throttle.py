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


def test_client_address_believes_only_trusted_proxies():
    """X-Forwarded-For counts only from a trusted peer, and then its rightmost untrusted hop
    (what the client prepends is ignored); CIDRs and IPv6 work; a bad entry is refused."""
    from kvserve.deployments.limits import TrustedProxies, client_address

    lb = TrustedProxies(["10.0.0.0/8", "::1"])
    assert client_address("203.0.113.9", [b"1.1.1.1"], lb) == "203.0.113.9"  # peer not a proxy: header ignored
    assert client_address("10.1.2.3", [b"6.6.6.6, 198.51.100.7"], lb) == "198.51.100.7"  # forged hop ignored
    assert client_address("10.1.2.3", [b"6.6.6.6", b"198.51.100.7:4711, 10.9.9.9"], lb) == "198.51.100.7"
    assert client_address("::1", [b"[2001:db8::5]:80"], lb) == "2001:db8::5"
    assert client_address("10.1.2.3", [], lb) == "10.1.2.3"
    assert client_address("10.1.2.3", [b"1.1.1.1"], TrustedProxies()) == "10.1.2.3"  # none trusted
    with pytest.raises(ValueError, match="forwarded_allow_ips"):
        TrustedProxies(["not-an-ip"])
    from kvserve.deployments.args import AppArgs

    with pytest.raises(ValueError, match="'10.0.0.300' is not an IP address"):  # the config, before any replica
        AppArgs.model_validate({"forwarded_allow_ips": ["10.0.0.300"]})


def _gate_app(**settings):
    from gateway_fakes import FakeReplica, make_gateway

    from kvserve.deployments.gateway.api import build_api

    return build_api(
        make_gateway(
            FakeReplica(),
            api_keys=["sk-tenant-a name=a", "sk-tenant-b name=b"],
            auth_failures_per_minute=20,
            **settings,
        )
    )


def _codes(app, calls):
    """Status codes of ``calls`` (``(peer address, key, X-Forwarded-For or None)``) to GET /v1/models
    of the one gateway ``app``, each from its own peer address."""
    import asyncio

    import httpx

    async def main():
        out = []
        for peer, key, xff in calls:
            t = httpx.ASGITransport(app=app, client=(peer, 40000))
            async with httpx.AsyncClient(transport=t, base_url="http://gw") as c:
                headers = {"authorization": f"Bearer {key}"}
                if xff is not None:
                    headers["x-forwarded-for"] = xff
                out.append((await c.get("/v1/models", headers=headers)).status_code)
        return out

    return asyncio.run(main())


def test_wrong_keys_behind_a_shared_address_never_lock_out_valid_keys():
    """25 wrong keys from one address (a load balancer's): the 21st on get 429; a valid key from
    that address still gets 200, and so does another tenant's; and, each success having cleared
    the address's count, wrong keys start over at 401 (the count is of failures only)."""
    app = _gate_app()
    lb = "10.0.0.1"
    wrong = _codes(app, [(lb, f"sk-wrong-{i}", None) for i in range(25)])
    assert wrong == [401] * 20 + [429] * 5
    after = _codes(
        app,
        [
            (lb, "sk-tenant-a", None),
            (lb, "sk-tenant-b", None),
            (lb, "sk-wrong-x", None),
            ("10.0.0.2", "sk-tenant-a", None),
        ],
    )
    assert after == [200, 200, 401, 200]


def test_the_throttle_counts_the_client_behind_a_trusted_proxy():
    """Behind a trusted proxy each client is counted on its own (X-Forwarded-For): one client's
    wrong keys throttle it (429) and not the next client of the same proxy; a forged hop the
    client prepends does not move it; from an untrusted peer the header is ignored."""
    app = _gate_app(forwarded_allow_ips=["10.0.0.0/24"])
    lb = "10.0.0.1"
    attacker = _codes(app, [(lb, f"sk-wrong-{i}", f"{i}.{i}.{i}.{i}, 198.51.100.7") for i in range(21)])
    assert attacker == [401] * 20 + [429]
    assert _codes(app, [(lb, "sk-wrong-y", "198.51.100.8")]) == [401]  # another client of the same proxy
    assert _codes(app, [(lb, "sk-tenant-a", "198.51.100.8")]) == [200]
    # an untrusted peer's header is ignored: its 21 wrong keys count to the peer, whatever it claims
    spoof = _codes(app, [("203.0.113.5", f"sk-wrong-{i}", f"192.0.2.{i}") for i in range(21)])
    assert spoof == [401] * 20 + [429]
