"""KV-event routing through a real Serve app (Ray, slow; without Ray: test_kv_router.py): a
tiny-model app on 2 replicas with ``kv_aware_routing`` and a host tier, whose KV pools are too
small for all its prefixes. Both replicas publish to the application's hub. Each prefix's first
request goes over HTTP (the ingress's router places it); a driver handle, which never routed
these prompts, sends the follow-ups to the replica that holds each prefix: every follow-up finds
its prefix cached, in the pool or loaded back from the tier, and each prefix lives on one replica
only. (The prefix router cannot do this: a replica reports only its last pool's worth of
prefixes, 24 blocks here, so the handle's router would send the older prefixes anywhere.)
"""

import asyncio
import random
import time

import pytest
from _kv_helpers import wait_for_hub

from kvserve.deployments.contract.kv_event_hub import hub_name
from kvserve.deployments.contract.kv_index import request_hashes
from kvserve.deployments.contract.prefix import app_hash_root

APP = "kvserve-kv-router"
WORDS = ["alpha", "policy", "user", "assistant", "data", "rule", "table", "river", "stone", "cloud"]


@pytest.fixture(scope="module")
def kv_app(ray_session, serve_app, tiny_llama_path):
    """The tiny model on 2 replicas, KV-aware routing, 24 blocks of 16 tokens in each pool (one
    of the 6 prefixes, ~200 tokens, fills half of it) and a host tier; yields a driver handle
    and the hub."""
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-kv",
            "num_replicas": 2,
            "max_num_seqs": 4,
            "max_model_len": 384,
            "num_kv_blocks": 24,
            "kv_offloading_size": 0.01,
            "kv_aware_routing": True,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.1,
        }
    )
    serve.run(app, name=APP, route_prefix="/kvrouter")
    hub = wait_for_hub(APP, 2, tries=300)
    yield serve.get_deployment_handle("LLMServer", APP), hub, f"{serve_app.root}/kvrouter/v1"
    serve.delete(APP)


def _prefix(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(1000, 40000) for _ in range(200)]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_follow_ups_go_where_the_kv_is(kv_app):
    import ray

    import httpx

    handle, hub, base = kv_app
    assert hub is not None and len(ray.get(hub.pull.remote(None, 0)).loads) == 2  # both replicas publish
    cached: dict[int, list[int]] = {i: [] for i in range(6)}

    def holders(h: int) -> list[str]:
        return [r for r, pairs in ray.get(hub.pull.remote(None, 0)).dump.items() if any(x == h for x, _ in pairs)]

    def wait_for(h: int) -> None:
        """Until the hub holds the block just computed, then 10 of the router's pull intervals."""
        for _ in range(300):
            if holders(h):
                break
            time.sleep(0.05)
        time.sleep(0.5)

    for i in range(6):  # first requests: over HTTP, placed by the ingress's router
        r = httpx.post(
            f"{base}/completions",
            json={"model": "tiny-kv", "prompt": _prefix(i) + [50, 60 + i], "max_tokens": 2, "temperature": 0},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        cached[i].append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        wait_for(request_hashes(_prefix(i), 16, 64, app_hash_root(APP))[-1])

    async def run():  # follow-ups: the driver handle's router, which routed none of them
        for j in range(1, 3):
            for i in range(6):
                out = await handle.complete.remote(_prefix(i) + [50 + j, 60 + i], {"max_tokens": 2, "temperature": 0})
                cached[i].append(out.num_cached_tokens)
                await asyncio.to_thread(wait_for, request_hashes(_prefix(i), 16, 64, app_hash_root(APP))[-1])

    asyncio.run(run())
    for i, c in cached.items():
        assert c[0] == 0 and all(n >= 12 * 16 for n in c[1:]), (i, c)
    for i in range(6):
        assert len(holders(request_hashes(_prefix(i), 16, 64, app_hash_root(APP))[-1])) == 1, i


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_killed_replica_leaves_the_other_serving_and_leaves_the_index(kv_app):
    """Kill one replica (its pool, tier and publisher go with it; the hub too, if it created it)
    while a request runs there: requests keep being served (a call that reached the dead replica
    is retried, at most twice), and the hub drops the dead replica from the index within its
    silence limit (or a new hub starts without it), so no router keeps sending prefixes to it."""
    import ray
    from ray._private.state import state

    from kvserve.deployments.contract.kv_event_hub import REPLICA_TTL_S

    handle, hub, _ = kv_app
    actors = {
        a["Name"]: a
        for a in state.actor_table(None).values()
        if (a.get("ActorClassName") or "") == f"ServeReplica:{APP}:LLMServer" and a["State"] == "ALIVE"
    }
    loads = ray.get(hub.pull.remote(None, 0)).loads
    victim_name = next(iter(actors))
    victim_id = next(r for r in loads if victim_name.endswith(r))
    victim = ray.get_actor(victim_name, namespace="serve")

    async def run():
        long = asyncio.ensure_future(handle.complete.remote(_prefix(50), {"max_tokens": 64, "temperature": 0}))
        await asyncio.sleep(0.5)
        ray.kill(victim, no_restart=True)
        try:
            await long
        except Exception:
            pass  # it may have run on the victim
        served = 0
        for i in range(6):
            for _ in range(3):
                try:
                    params = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
                    out = await handle.complete.remote(_prefix(i) + [90, i], params)
                    served += len(out.token_ids) == 2
                    break
                except Exception:
                    await asyncio.sleep(1.0)
        return served

    assert asyncio.run(run()) == 6
    # the hub forgets it (or, when the victim owned the hub, a new hub is made by the survivor's
    # next publish, and the victim never appears in it)
    from kvserve.deployments.contract.adapters import REGISTRY_NAMESPACE

    deadline = time.monotonic() + REPLICA_TTL_S + 30
    while time.monotonic() < deadline:
        try:
            reply = ray.get(ray.get_actor(hub_name(APP), namespace=REGISTRY_NAMESPACE).pull.remote(None, 0), timeout=30)
        except Exception:  # the old hub died with its owner; the new one is not made yet
            time.sleep(0.5)
            continue
        if reply.loads and victim_id not in reply.loads and victim_id not in reply.dump:
            break
        time.sleep(0.5)
    else:
        raise AssertionError(f"the hub still holds the killed replica {victim_id}")
