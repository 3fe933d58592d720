"""``GET /metrics`` stays cheap and names no tenant by default: calls at once share one render
(registry.py's CoalescedRender: at most one read of the files at a time, each caller answered by
a render begun after it called), and the per-key series carry key names only with
``metrics_per_key`` (key_limits.py), through the real gateway app in-process."""

import threading

import httpx
from gateway_fakes import FakeReplica, _run, make_gateway

from kvserve.deployments.gateway.api import build_api
from kvserve.telemetry.metrics import api_key_requests
from kvserve.telemetry.registry import CoalescedRender


def test_concurrent_metrics_calls_share_renders_and_none_gets_an_older_one():
    go, started = threading.Event(), threading.Event()
    count = [0]

    def fn():
        count[0] += 1
        n = count[0]
        if n == 1:
            started.set()
            go.wait(30)
        return str(n).encode(), "text/plain"

    r = CoalescedRender(fn)
    out = {}
    first = threading.Thread(target=lambda: out.__setitem__("first", r()))
    first.start()
    assert started.wait(30)  # render 1 runs (blocked)
    late = [threading.Thread(target=lambda i=i: out.__setitem__(i, r())) for i in range(12)]
    for t in late:
        t.start()
    with r._cond:  # every late caller waits for the render after the running one
        while len(r._cond._waiters) < len(late):
            r._cond.wait(0.05)
    go.set()
    for t in [first, *late]:
        t.join(30)
    assert out["first"][0] == b"1"
    assert {out[i][0] for i in range(12)} == {b"2"}  # one render for the twelve, begun after they called
    assert r.renders == 2
    assert r()[0] == b"3"  # a caller alone gets a fresh render


def _requests_of(label: str) -> float:
    return api_key_requests().prom.labels(api_key=label, model_name="fake", variant="")._value.get()


def _one_request(**settings):
    app = build_api(make_gateway(FakeReplica(), api_keys=["sk-metrics-acme name=acme"], **settings))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.post(
                "/v1/completions",
                json={"prompt": "hi", "max_tokens": 2},
                headers={"authorization": "Bearer sk-metrics-acme"},
            )

    return _run(main())


def test_per_key_series_name_keys_only_when_enabled():
    before_named, before_blank = _requests_of("acme"), _requests_of("")
    assert _one_request().status_code == 200
    assert _requests_of("acme") == before_named and _requests_of("") == before_blank + 1  # default: no name
    assert _one_request(metrics_per_key=True).status_code == 200
    assert _requests_of("acme") == before_named + 1
