"""A/B tests and cost metrics, live on Serve: an app whose tiny model is split into two variants
(each its own ``LLMServer`` deployment), sticky by session, with live weights in Ray's GCS (set
through the admin endpoint, no restart), the ``variant`` label on the replicas' and the
gateway's metrics, and ``cost_per_replica_hour`` priced into the replicas' cost metrics and the
response cache's savings. (The report's statistics: tests/deployments/test_experiments.py; its
detection of a real effect: tests/e2e/test_experiment_report_live.py.)"""

import re
import time

import httpx
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

APP, MODEL, ADMIN = "kvserve-ab", "tiny-ab", "sk-kvserve-ab-admin"
#: 3.6 per replica-hour: 0.001 per second.
COST = 3.6


@pytest.fixture(scope="module")
def ab_app(ray_session, serve_app, tiny_llama_path):
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": MODEL,
            "num_replicas": 1,
            "max_model_len": 256,
            "torch_num_threads": 1,
            "replica_cpus": 0.2,
            "cost_per_replica_hour": COST,
            "ingress_cpus": 0.1,
            "admin_api_keys": [ADMIN],
            "experiments": [
                {
                    "name": "seqs",
                    "model": MODEL,
                    "sticky": "session",
                    "variants": [
                        {"name": "A", "settings": {"max_num_seqs": 2}},
                        {"name": "B", "settings": {"max_num_seqs": 4}},
                    ],
                }
            ],
        }
    )
    serve.run(app, name=APP, route_prefix="/ab")
    yield f"{serve_app.root}/ab"
    serve.delete(APP)


def _chat(c: httpx.Client, root: str, session: str | None, content: str, **kw) -> httpx.Response:
    headers = {"x-session-id": session} if session else {}
    r = c.post(
        f"{root}/v1/chat/completions",
        headers=headers,
        json={"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 6, **kw},
    )
    assert r.status_code == 200, r.text
    return r


def _metric(text: str, name: str, **labels) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}\{{(.*)\}} (\S+)$", line)
        if m and all(f'{k}="{v}"' in m.group(1) for k, v in labels.items()):
            total += float(m.group(2))
    return total


def test_variants_are_deployments_sticky_by_session_with_labelled_metrics(ab_app):
    from ray import serve

    deployments = serve.status().applications[APP].deployments
    assert {"LLMServer-A", "LLMServer-B"} <= set(deployments), list(deployments)
    with httpx.Client(timeout=120) as c:
        seen = {}
        for i in range(16):
            first = _chat(c, ab_app, f"s{i}", f"hello {i}", temperature=0.7)
            again = _chat(c, ab_app, f"s{i}", f"and again {i}", temperature=0.7)
            assert first.headers["x-kvserve-experiment"] == "seqs"
            assert again.headers["x-kvserve-variant"] == first.headers["x-kvserve-variant"]  # sticky
            seen[f"s{i}"] = first.headers["x-kvserve-variant"]
        assert set(seen.values()) == {"A", "B"}, seen
        text = c.get(f"{ab_app}/metrics").text
    for v in ("A", "B"):
        assert _metric(text, "kvserve:generation_tokens_total", model_name=MODEL, variant=v) > 0
        assert _metric(text, "kvserve:api_key_requests_total", model_name=MODEL, variant=v) > 0
        assert _metric(text, "kvserve:replica_cost_total", model_name=MODEL, variant=v) > 0
        assert _metric(text, "kvserve:cost_per_million_output_tokens", model_name=MODEL, variant=v) > 0


def test_weights_change_live_through_the_gcs(ab_app):
    url = f"{ab_app}/v1/experiments/seqs"
    auth = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(timeout=120) as c:
        assert c.post(f"{url}/weights", json={"weights": {"B": 1}}).status_code == 401
        r = c.post(f"{url}/weights", json={"weights": {"B": 1}}, headers=auth)
        assert r.status_code == 200 and r.json()["weights"] == {"A": 0.0, "B": 1.0}
        assert {_chat(c, ab_app, f"new{i}", "hi").headers["x-kvserve-variant"] for i in range(12)} == {"B"}
        # the weights live in the GCS: what a restarted or other gateway replica reads
        from kvserve.deployments.contract.experiments import WeightBoard

        assert WeightBoard(APP).get("seqs") == {"A": 0.0, "B": 1.0}
        data = c.get(url, headers=auth).json()
        assert data["differences"] == {"B": {"max_num_seqs": [2, 4]}}
        assert len(data["samples"]["B"]) >= 12 and all(s["status"] == "ok" for s in data["samples"]["B"])
        r = c.post(f"{url}/weights", json={"weights": {"A": 1, "B": 1}}, headers=auth)
        assert r.status_code == 200


def test_cache_hits_count_saved_tokens_and_cost(ab_app):
    """A repeated greedy request is answered by the response cache: its output tokens count as
    saved, priced at the cost per token the variant's replica measured and published (its
    health check republishes it; the gateway re-reads it within seconds)."""
    with httpx.Client(timeout=120) as c:
        body = {"temperature": 0.0, "max_tokens": 6}
        for i in range(8):  # tokens generated on both variants, so both measure a cost per token
            _chat(c, ab_app, f"warm{i}", f"count to {i}", temperature=0.0)
        first = _chat(c, ab_app, "saver", "the same question", **body)
        tokens = first.json()["usage"]["completion_tokens"]
        variant = first.headers["x-kvserve-variant"]
        deadline = time.time() + 90
        while True:
            hit = _chat(c, ab_app, "saver", "the same question", **body)
            assert hit.headers.get("x-kvserve-cache") == "exact", hit.headers
            text = c.get(f"{ab_app}/metrics").text
            saved = _metric(text, "kvserve:cache_saved_tokens_total", model_name=MODEL, variant=variant)
            cost = _metric(text, "kvserve:cache_saved_cost_total", model_name=MODEL, variant=variant)
            if cost > 0 or time.time() > deadline:
                break
            time.sleep(3)
    assert saved >= tokens > 0
    assert cost > 0, "no saved cost: the measured cost per token never reached the gateway"
