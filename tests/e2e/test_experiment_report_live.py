"""The A/B report over real engines in this process (tests/local_app.py) under concurrent load:
it finds a large real effect (``max_num_seqs`` 1 against 16) with the right sign, none between
identical variants, and weights change live behind the admin key.

In tests/e2e, not tests/deployments, though no Ray starts here: these tests measure a timing
effect, so they run in the pytest-xdist worker that runs at full priority (tests/conftest.py),
not in the niced one, where the engines, the gateway and the clients of this process got so
little CPU that the clients kept few requests in flight and the effect drowned in stalls."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from kvserve.deployments.operator.experiment_report import analyse, render

ADMIN = "sk-kvserve-ab-admin"


# ---- live: real engines behind the gateway ------------------------------------------------------
@pytest.fixture(scope="module")
def ab_app(tiny_llama_path):
    """Two A/B tests of the tiny model in this process: ``batch`` (``max_num_seqs`` 1 against
    16; both let 64 requests wait, so the difference shows as waiting, not as refusals) and
    ``same`` (two identical variants), each drawing every request anew."""
    from local_app import LocalApp

    base = {
        "model": str(tiny_llama_path),
        "max_model_len": 256,
        "torch_num_threads": 1,
        "max_waiting_requests": 64,
        "enable_prefix_caching": False,
    }
    app = LocalApp(
        {
            "/": {
                "models": [
                    {**base, "served_model_name": "tiny-batch"},
                    {**base, "served_model_name": "tiny-same", "max_num_seqs": 8},
                ],
                "response_cache": False,
                "admin_api_keys": [ADMIN],
                "experiments": [
                    {
                        "name": "batch",
                        "model": "tiny-batch",
                        "sticky": "request",
                        "variants": [
                            {"name": "seqs1", "settings": {"max_num_seqs": 1}},
                            {"name": "seqs16", "settings": {"max_num_seqs": 16}},
                        ],
                    },
                    {
                        "name": "same",
                        "model": "tiny-same",
                        "sticky": "request",
                        "variants": [{"name": "A"}, {"name": "B"}],
                    },
                ],
            }
        }
    ).start()
    try:
        yield app.namespace()
    finally:
        app.stop()


def _load(
    base_url: str, model: str, clients: int, per_client: int, seed: int, max_tokens: int = 12
) -> list[httpx.Response]:
    """``clients`` concurrent clients, each sending ``per_client`` chat requests one after the
    other (fresh random prompts, ``max_tokens`` output tokens each); returns the responses."""
    words = "alpha beta gamma delta river stone cloud lamp paper orbit violet maple".split()
    rng = random.Random(seed)

    async def client(c: int, http: httpx.AsyncClient):
        out = []
        for i in range(per_client):
            prompt = " ".join(rng.choice(words) for _ in range(12)) + f" {seed}-{c}-{i}"
            r = await http.post(
                f"{base_url}/chat/completions",
                json={
                    "model": model,
                    "messages": [{"role": "user", "content": prompt}],
                    "max_tokens": max_tokens,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
            out.append(r)
        return out

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return [r for rs in await asyncio.gather(*(client(c, http) for c in range(clients))) for r in rs]

    return asyncio.run(run())


def _report(root: str, name: str, since: float | None = None) -> dict:
    r = httpx.get(
        f"{root}/v1/experiments/{name}",
        headers={"Authorization": f"Bearer {ADMIN}"},
        timeout=30,
        params={} if since is None else {"since": since},
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_live_report_finds_the_batch_size_effect(ab_app):
    # long answers: a request queued behind another on seqs1 waits for all of its 48 tokens, however
    # few requests the clients (in this process, beside the gateway) manage to keep in flight.
    # 8 clients, not more: the clients pile up on the slow variant, and the report cuts a variant's
    # requests into blocks of about its requests in flight; with 16 clients seqs1's ~64 requests
    # made blocks of ~14, fewer than the 5 blocks a verdict needs (CI, stop 58)
    responses = _load(ab_app.base_url, "tiny-batch", clients=8, per_client=16, seed=1, max_tokens=48)
    assert all(r.status_code == 200 for r in responses), {r.status_code for r in responses}
    variants = [r.headers["x-kvserve-variant"] for r in responses]
    assert set(variants) == {"seqs1", "seqs16"} and all(r.headers["x-kvserve-experiment"] == "batch" for r in responses)
    data = _report(ab_app.root, "batch")
    assert sum(len(v) for v in data["samples"].values()) == len(responses)
    rep = analyse(data, confidence=0.999)  # the level at which identical variants never differ (below)
    by = {c["measure"]: c for c in rep["comparisons"]}
    assert {"ttft_p50", "ttft_p95"} <= set(by), render(rep)
    # one request at a time: the others wait their turn, so seqs16 starts them far sooner
    assert by["ttft_p50"]["significant"] and by["ttft_p50"]["better"], render(rep)
    assert by["ttft_p95"]["significant"] and by["ttft_p95"]["better"], render(rep)
    assert any(line.startswith("seqs16 better than seqs1 on TTFT p50") for line in rep["summary"])


def test_live_report_of_identical_variants_finds_no_difference(ab_app):
    # Each variant is an engine of its own, cold until it serves: its first requests pay one-time
    # costs (first-call allocations, oneDNN primitives made for new shapes) that the other engine
    # may already have paid, a real difference between the two that is not the variants'. Warm
    # both, then judge only the requests after (``?since=``, as an operator leaves out a warm-up).
    warm = _load(ab_app.base_url, "tiny-same", clients=4, per_client=6, seed=3)
    assert {r.headers["x-kvserve-variant"] for r in warm} == {"A", "B"}
    since = time.time()
    responses = _load(ab_app.base_url, "tiny-same", clients=4, per_client=24, seed=2)
    assert all(r.status_code == 200 for r in responses)
    data = _report(ab_app.root, "same", since)
    assert sum(len(v) for v in data["samples"].values()) == len(responses)  # the warm-up left out
    rep = analyse(data, confidence=0.999)
    assert rep["summary"] == ["B vs A: no significant difference"], render(rep)
    assert any("same settings" in w for w in rep["warnings"])


def test_live_weights_change_without_restart_and_need_the_admin_key(ab_app):
    url = f"{ab_app.root}/v1/experiments/same/weights"
    assert httpx.post(url, json={"weights": {"B": 1}}).status_code == 401
    r = httpx.post(url, json={"weights": {"B": 1}}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.post(url, json={"weights": {"C": 1}}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_weights"
    r = httpx.post(url, json={"weights": {"B": 1}}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["weights"] == {"A": 0.0, "B": 1.0}
    responses = _load(ab_app.base_url, "tiny-same", clients=2, per_client=5, seed=3)
    assert {r.headers["x-kvserve-variant"] for r in responses} == {"B"}
    r = httpx.get(f"{ab_app.root}/v1/experiments", headers={"Authorization": f"Bearer {ADMIN}"})
    assert {e["name"]: e["weights"] for e in r.json()["data"]}["same"] == {"A": 0.0, "B": 1.0}
    assert (
        httpx.get(f"{ab_app.root}/v1/experiments/nope", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404
    )
