"""Prefix-aware replica routing through a real Serve app (Ray, slow; the router without Ray:
test_router.py): a tiny-model app with 2 replicas, where requests sharing a long prefix land on
one replica (every request after a prefix's first hits the prefix cache), a driver handle
follows prefixes it never saw that the ingress routed (replica-reported hashes), a hot prefix
spills over to the other replica once the preferred one is busier by the margin, and one HTTP
request with several prompts routes each prompt by its own prefix.
"""

import asyncio
import random
import time

import pytest
from helpers import DONE, iter_sse

from kvserve.deployments.contract.prefix import app_hash_root, block_hashes


# ---- a real Serve app: tiny model, 2 replicas (Ray) ------------------------------------------
APP = "kvserve-router"
PREFIX_WORDS = ["alpha", "policy", "user", "assistant", "data", "rule", "table", "river", "stone", "cloud"]


@pytest.fixture(scope="module")
def router_app(ray_session, serve_app, tiny_llama_path):
    """The tiny model on 2 replicas behind its own ingress (route ``/router``), prefix-aware
    routing with a margin of 2 ongoing requests; yields (base URL, a driver handle)."""
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-router",
            "num_replicas": 2,
            "max_num_seqs": 8,
            "max_model_len": 1024,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.1,
            "prefix_routing_margin": 2,
        }
    )
    serve.run(app, name=APP, route_prefix="/router")
    time.sleep(2.5)  # the replicas' first routing-stats report reaches the routers
    yield f"{serve_app.root}/router/v1", serve.get_deployment_handle("LLMServer", APP)
    serve.delete(APP)


def _prefix(i: int, words: int = 160) -> str:
    rng = random.Random(i)
    return f"Document {i}: " + " ".join(rng.choice(PREFIX_WORDS) for _ in range(words))


def _reports() -> dict[str, set[int]]:
    """Each live LLMServer replica of the app: the prefix hashes it reports now."""
    import ray
    from ray._private.state import state

    out = {}
    for a in state.actor_table(None).values():
        if (a.get("ActorClassName") or "") == f"ServeReplica:{APP}:LLMServer" and a["State"] == "ALIVE":
            actor = ray.get_actor(a["Name"], namespace="serve")
            out[a["Name"]] = set(ray.get(actor.record_routing_stats.remote(), timeout=30)["prefix_hashes"])
    assert len(out) == 2
    return out


def _deep_hash(tokenizer, text: str, blocks: int = 8) -> int:
    """The chained hash of the first ``blocks`` blocks of ``text`` as the engine encodes it."""
    return block_hashes(tokenizer.encode(text, add_special_tokens=True), 16, blocks, app_hash_root(APP))[-1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shared_prefixes_land_on_one_replica(router_app, tokenizers):
    """6 prefixes of ~200 tokens, 4 requests each (interleaved, one at a time, unique suffixes):
    each prefix's first request computes it, the 3 others find it in the replica's prefix cache,
    and each prefix was served by one replica only. (Serve's default router sends a prefix's
    follow-ups to either replica: ~11 of the 24 would miss.)"""
    _, handle = router_app
    _, tok = tokenizers
    cached: dict[int, list[int]] = {i: [] for i in range(6)}

    async def run():
        for j in range(4):
            for i in range(6):
                out = await handle.complete.remote(
                    _prefix(i) + f" Question {j}: what is {i * j}?", {"max_tokens": 2, "temperature": 0}
                )
                cached[i].append(out.num_cached_tokens)

    asyncio.run(run())
    for i, c in cached.items():
        assert c[0] == 0 and all(n >= 10 * 16 for n in c[1:]), (i, c)
    reports = _reports()
    for i in range(6):
        assert sum(_deep_hash(tok, _prefix(i)) in r for r in reports.values()) == 1, i


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_driver_handle_follows_what_the_ingress_routed(router_app):
    """Two independent routers agree: the ingress's router sends each new prefix's first
    request (HTTP) to some replica; once the replicas reported it (~1 s), this process's
    handle, which never saw these prefixes, sends each follow-up to the same replica: all 6 hit
    the prefix cache (by chance: 1 in 64)."""
    import httpx

    base, handle = router_app
    prompts = [_prefix(100 + i) for i in range(6)]
    with httpx.Client(timeout=120) as client:
        for p in prompts:
            r = client.post(
                f"{base}/completions", json={"model": "tiny-router", "prompt": p + " First.", "max_tokens": 2}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    time.sleep(3.0)  # request_routing_stats_period_s is 1 s; the controller broadcasts the reports

    async def run():
        return [
            (await handle.complete.remote(p + " Second question?", {"max_tokens": 2})).num_cached_tokens
            for p in prompts
        ]

    assert all(n >= 10 * 16 for n in asyncio.run(run()))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hot_prefix_spills_over(router_app, tokenizers):
    """One prefix served by one replica; then 8 long requests of it at once: affinity sends
    them to that replica until it has more than the margin (2) ongoing requests more than the
    other, then the other replica takes some (it now reports the prefix too); none fails."""
    _, handle = router_app
    _, tok = tokenizers
    hot = _prefix(200)
    h = _deep_hash(tok, hot)

    async def one(j: int, max_tokens: int) -> int:
        n = 0
        async for chunk in handle.options(stream=True).generate.remote(
            hot + f" Variant {j}.", {"max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        ):
            assert chunk.error is None
            n += len(chunk.token_ids)
        return n

    asyncio.run(one(0, 2))
    time.sleep(2.5)
    before = [name for name, r in _reports().items() if h in r]
    assert len(before) == 1

    async def burst():
        return await asyncio.gather(*(one(j, 300) for j in range(1, 9)))

    assert asyncio.run(burst()) == [300] * 8
    after = [name for name, r in _reports().items() if h in r]
    assert len(after) == 2, "the hot prefix stayed on one replica"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_http_request_with_several_prompts(router_app):
    """One completion with 3 prompts and n=2 (concurrent handle calls made while serving one
    request, which Serve 2.60 gives one internal request id): every call is routed (a router
    matching by that id leaves all but one pending forever) and each prompt by its own prefix:
    all 3 prefixes, seen before on some replica, hit the prefix cache. (3, not more: the seeds
    may all land on one replica, and with the app's margin of 2 a 4th concurrent call there
    would rightly spill over to the idle replica.)"""
    import httpx

    base, handle = router_app
    prompts = [_prefix(300 + i) for i in range(3)]

    async def seed():
        for p in prompts:
            await handle.complete.remote(p + " Seed.", {"max_tokens": 1})

    asyncio.run(seed())
    time.sleep(2.5)  # the replicas report the new prefixes
    body = {"model": "tiny-router", "prompt": [p + " Now?" for p in prompts], "n": 2, "max_tokens": 3, "temperature": 0}
    with httpx.Client(timeout=120) as client:
        r = client.post(f"{base}/completions", json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert sorted(c["index"] for c in out["choices"]) == list(range(6))
        # cached tokens counted once per prompt: each of the 3 found at least 10 blocks of its prefix
        assert out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 3 * 10 * 16, out["usage"]
        with client.stream("POST", f"{base}/completions", json={**body, "stream": True}) as s:
            assert s.status_code == 200
            events = list(iter_sse(s))
        assert events[-1] == DONE
