"""Operating under load, through the live app over HTTP: open probes and /metrics, docs behind
the API key, failed-auth throttling, bounded admission (429 + Retry-After, 400 for what can
never fit, nothing lost), per-key rate limits shared through a real Redis, per-key priority
reaching the scheduler, and keys never written to Ray's logs."""

import asyncio
import glob
import json
import os
import re
import time

import httpx
import pytest
from helpers import DONE, HTTP, aiter_sse

pytestmark = pytest.mark.slow

OPS_KEYS = [
    "sk-ops-interactive name=interactive priority=0",
    "sk-ops-batch name=batch priority=10",
    "sk-ops-limited name=limited rpm=3",
]


def _metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, value = line.rsplit(" ", 1)
        got = dict(re.findall(r'(\w+)="([^"]*)"', series))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(value)
    return total


@pytest.fixture(scope="module")
def ops_app(serve_app, tiny_llama_path, redis_server):
    """A third app (route /ops): the tiny model with a small batch and a deep queue, three API
    keys (interactive, batch with a worse priority, limited to 3 requests a minute), per-key
    limits shared through a real redis-server."""
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-ops",
            "max_num_seqs": 2,
            "max_queued_requests": 40,
            "max_model_len": 256,
            "torch_num_threads": 1,
            "num_replicas": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.1,
            "api_keys": OPS_KEYS,
            "redis_url": redis_server,
            "metrics_per_key": True,
        }
    )
    serve.run(app, name="kvserve-ops", route_prefix="/ops")
    yield f"{serve_app.root}/ops"
    serve.delete("kvserve-ops")


def test_probes_and_metrics_are_open_docs_follow_the_key(serve_app):
    auth_root = serve_app.auth_base_url.removesuffix("/v1")
    for path in ("/health", "/ready", "/metrics"):
        assert HTTP.get(auth_root + path, timeout=60).status_code == 200, path
    for path in ("/docs", "/openapi.json"):
        r = HTTP.get(auth_root + path, timeout=30)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer", path
        ok = HTTP.get(auth_root + path, headers={"Authorization": f"Bearer {serve_app.api_key}"}, timeout=30)
        assert ok.status_code == 200, path
    r = HTTP.get(f"{serve_app.root}/ready", timeout=60)
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_failed_auth_is_throttled_per_client_address(serve_app):
    """20 wrong keys from one address: 401s; then 429 for its wrong keys, while the right key
    still passes from it (valid keys are checked first). The address is 127.0.0.2 (loopback), so
    the other tests' 127.0.0.1 is untouched."""
    url = f"{serve_app.auth_base_url}/models"
    attacker = httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2"), timeout=30)
    codes = [attacker.get(url, headers={"Authorization": f"Bearer wrong-{i}"}).status_code for i in range(20)]
    assert codes == [401] * 20
    r = attacker.get(url, headers={"Authorization": "Bearer wrong-20"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "auth_throttled"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert attacker.get(url, headers={"Authorization": f"Bearer {serve_app.api_key}"}).status_code == 200
    assert HTTP.get(url, headers={"Authorization": f"Bearer {serve_app.api_key}"}, timeout=30).status_code == 200
    m = HTTP.get(f"{serve_app.root}/auth/metrics", timeout=30).text
    assert _metric(m, "kvserve:requests_rejected_total", reason="unauthorized") >= 20
    assert _metric(m, "kvserve:requests_rejected_total", reason="auth_throttled") >= 1


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict | None = None) -> dict:
    """One streaming request: its status, Retry-After, error body, events and whether it ended
    with [DONE], plus the time of its first content event (seconds since the call)."""
    t0 = time.monotonic()
    out = {
        "status": None,
        "retry_after": None,
        "error": None,
        "text": "",
        "done": False,
        "finish": None,
        "ttft": None,
        "first_at": None,
    }
    async with client.stream("POST", url, json={**body, "stream": True}, headers=headers or {}) as r:
        out["status"], out["retry_after"] = r.status_code, r.headers.get("retry-after")
        if r.status_code != 200:
            out["error"] = json.loads(await r.aread())["error"]
            return out
        async for ev in aiter_sse(r):
            if ev == DONE:
                out["done"] = True
                continue
            if "error" in ev:
                out["error"] = ev["error"]
                continue
            for c in ev.get("choices", []):
                if c.get("text") and out["ttft"] is None:
                    out["first_at"] = time.monotonic()
                    out["ttft"] = out["first_at"] - t0
                out["text"] += c.get("text") or ""
                out["finish"] = c.get("finish_reason") or out["finish"]
    return out


def test_burst_gets_429s_at_once_and_loses_nothing(serve_app):
    """60 concurrent streams at the tiny model (max_num_seqs 8 + a queue of 1 per replica): the
    overflow is refused at once with 429, Retry-After and an OpenAI body; every admitted stream
    finishes with all its tokens and [DONE]; the replica ends with nothing running."""
    before = HTTP.get(f"{serve_app.root}/metrics", timeout=30).text
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 60, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(
                *(_stream(client, f"{serve_app.base_url}/completions", body) for _ in range(60))
            )

    results = asyncio.run(main())
    ok = [r for r in results if r["status"] == 200]
    refused = [r for r in results if r["status"] == 429]
    assert len(ok) + len(refused) == 60, [r["status"] for r in results]  # nothing else, nothing lost
    assert refused and len(ok) >= 9
    for r in ok:
        assert r["done"] and r["error"] is None and r["finish"] == "length"
    for r in refused:
        assert r["error"]["code"] == "queue_full" and r["error"]["type"] == "rate_limit_error"
        assert 1 <= int(r["retry_after"]) <= 60
    after = HTTP.get(f"{serve_app.root}/metrics", timeout=30).text
    refused_counted = _metric(
        after, "kvserve:requests_rejected_total", model_name="tiny", reason="queue_full"
    ) - _metric(before, "kvserve:requests_rejected_total", model_name="tiny", reason="queue_full")
    assert refused_counted == len(refused)
    from ray import serve

    stats = serve.get_deployment_handle("LLMServer-tiny", "kvserve").get_stats.remote().result()
    assert stats["num_running_requests"] == 0 and stats["free_kv_blocks"] == stats["num_kv_blocks"]


def test_request_that_can_never_fit_is_a_400(serve_app):
    url = f"{serve_app.base_url}/completions"
    r = HTTP.post(url, json={"model": "tiny", "prompt": ["hi"] * 10, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_large"  # 8 running + 1 queued at most
    r = HTTP.post(url, json={"model": "tiny", "prompt": ["hi"] * 9, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200 and len(r.json()["choices"]) == 9


def test_per_key_rate_limit_is_shared_through_redis(ops_app, redis_server):
    import redis

    url = f"{ops_app}/v1/completions"
    hdr = {"Authorization": "Bearer sk-ops-limited"}
    body = {"prompt": "hi", "max_tokens": 2}
    codes = [HTTP.post(url, json=body, headers=hdr, timeout=60).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = HTTP.post(url, json=body, headers=hdr, timeout=60)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 10 <= int(r.headers["retry-after"]) <= 21  # one request refills every 20 s
    assert "sk-ops" not in r.text
    other = HTTP.post(url, json=body, headers={"Authorization": "Bearer sk-ops-interactive"}, timeout=60)
    assert other.status_code == 200  # another key is not limited
    keys = redis.Redis.from_url(redis_server).keys("kvserve:rl:*limited*")
    assert keys, "the limiter did not use Redis"
    m = HTTP.get(f"{ops_app}/metrics", timeout=30).text
    assert _metric(m, "kvserve:api_key_tokens_total", api_key="limited", kind="generation") == 6
    assert _metric(m, "kvserve:requests_rejected_total", reason="rate_limited") >= 1


def test_interactive_key_overtakes_a_batch_flood(ops_app):
    """A batch key floods a 2-slot replica with 30 long streams; an interactive key's request
    sent a second later is scheduled ahead of the batch requests still queued (fcfs would put
    it after all of them): its key's priority reaches the engine's scheduler."""
    url = f"{ops_app}/v1/completions"
    body = {"prompt": "Once upon a time", "max_tokens": 200, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(timeout=300) as client:
            batch = [
                asyncio.create_task(_stream(client, url, body, {"Authorization": "Bearer sk-ops-batch"}))
                for _ in range(30)
            ]
            await asyncio.sleep(1.0)
            inter = await _stream(
                client, url, {**body, "max_tokens": 8}, {"Authorization": "Bearer sk-ops-interactive"}
            )
            return inter, await asyncio.gather(*batch)

    inter, batch = asyncio.run(main())
    assert inter["status"] == 200 and inter["done"]
    assert all(r["status"] == 200 and r["done"] for r in batch), [r["status"] for r in batch]
    overtaken = sum(1 for r in batch if r["first_at"] > inter["first_at"])
    assert overtaken >= 20, (overtaken, inter["ttft"], sorted(r["ttft"] for r in batch))


def test_api_keys_never_reach_ray_logs(serve_app, ops_app):
    import ray

    session = ray._private.worker.global_worker.node.get_session_dir_path()
    secrets = [serve_app.api_key] + [k.split()[0] for k in OPS_KEYS]
    leaked = []
    for path in glob.glob(os.path.join(session, "logs", "**", "*"), recursive=True):
        if not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            data = f.read()
        leaked += [(os.path.basename(path), s) for s in secrets if s.encode() in data]
    assert not leaked, leaked
