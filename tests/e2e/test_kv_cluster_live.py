"""The cluster KV tier through a real Serve app (Ray, slow; its bookkeeping without Ray:
test_kv_cluster.py). Two replicas of a small model (4 layers, hidden 512: a prefill of ~200
tokens takes tens to hundreds of milliseconds on a CPU, far more than fetching its 12 blocks of
128 KiB, so loads run within the tier's "no longer than recomputing" bound) with a host tier and
``kv_cluster_tier_size``, behind Serve's default router (no prefix routing): a prefix computed on
one replica is put into Ray's object store, and a follow-up that lands on the other replica loads
it from there instead of computing it. Outputs must equal an engine that computes everything.
Then the owner of the blocks is killed: the survivor serves every request (computing what it
cannot load).
"""

import asyncio
import random
import time

import pytest
from _kv_helpers import wait_for_hub

APP = "kvserve-kv-cluster"
SHAPE = dict(
    hidden_size=512,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2048,
    num_hidden_layers=4,
    tie_word_embeddings=True,
)
SP = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster_model(tmp_path_factory):
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("kv_cluster_model"), **SHAPE)


@pytest.fixture(scope="module")
def cluster_app(ray_session, serve_app, cluster_model):
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(cluster_model),
            "served_model_name": "kv-cluster",
            "num_replicas": 2,
            "dtype": "float32",
            "max_num_seqs": 4,
            "max_model_len": 512,
            "num_kv_blocks": 64,
            "kv_offloading_size": 0.05,
            "kv_cluster_tier_size": 0.25,
            "prefix_aware_routing": False,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.1,
        }
    )
    serve.run(app, name=APP, route_prefix="/kvcluster")
    hub = wait_for_hub(APP, 2)
    yield serve.get_deployment_handle("LLMServer", APP), hub
    serve.delete(APP)


def _prefix(i: int) -> list[int]:
    rng = random.Random(1000 + i)
    return [rng.randrange(1000, 40000) for _ in range(200)]


def _reference(path, prompts):
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(model=str(path), device="cpu", dtype="float32", enable_prefix_caching=False, max_model_len=512)
    outs = llm.generate(prompts, SamplingParams(**SP), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _cluster_metric(root: str, name: str) -> float:
    from helpers import HTTP

    text = HTTP.get(f"{root}/metrics", timeout=30).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(f"kvserve:{name}") and 'model_name="kv-cluster"' in line
    )


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_prefix_computed_on_one_replica_loads_on_the_other(cluster_app, cluster_model, serve_app):
    import ray

    from kvserve.deployments.contract.kv_index import request_hashes
    from kvserve.deployments.contract.prefix import app_hash_root

    handle, hub = cluster_app
    assert hub is not None
    prompts = {(i, j): _prefix(i) + [500 + j, 600 + i] for i in range(4) for j in range(5)}
    ref = dict(zip(prompts, _reference(cluster_model, list(prompts.values()))))
    got, cached = {}, {}

    async def send(key):
        out = await handle.complete.remote(prompts[key], SP)
        got[key], cached[key] = list(out.token_ids), out.num_cached_tokens

    layout = next(iter(ray.get(hub.pull.remote(None, 0)).loads.values())).layout
    assert layout.startswith("kv-cluster|")

    async def run():
        for i in range(4):
            await send((i, 0))  # computed where Serve's router put it, then saved to the cluster tier
            want = request_hashes(_prefix(i), 16, 64, app_hash_root(APP))[:12]
            for _ in range(600):
                if len(await hub.cluster_lookup.remote(layout, want)) == 12:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"prefix {i} never reached the cluster tier")
        for j in range(1, 5):  # follow-ups: each lands on either replica
            for i in range(4):
                await send((i, j))

    asyncio.run(run())
    assert got == ref  # loaded blocks are the computed ones
    for key, n in cached.items():  # every follow-up reused the prefix: from its pool, or from the cluster
        assert n == (0 if key[1] == 0 else 12 * 16), (key, n)
    # the follow-ups went where Serve's router put them: until one has landed where its prefix was
    # not computed (and loaded it), more go (a loaded box's queue-length probes can favour one replica)
    extra = 0
    while _cluster_metric(serve_app.root, "kv_cluster_hit_tokens") < 12 * 16 and extra < 60:
        out = handle.complete.remote(_prefix(extra % 4) + [900 + extra, 7], SP).result()
        assert out.num_cached_tokens == 12 * 16
        extra += 1
        time.sleep(0.5)  # the replicas' metrics reach /metrics
    assert _cluster_metric(serve_app.root, "kv_cluster_hit_tokens") >= 12 * 16
    assert _cluster_metric(serve_app.root, "kv_cluster_bytes") > 0


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_owner_killed_leaves_the_other_serving(cluster_app, cluster_model):
    """Blocks in the cluster tier die with the replica that put them: the survivor's loads of
    them fail (or the hub has dropped them), and it computes instead; every request is served
    with the reference's tokens (a call that reached the dead replica is retried)."""
    import ray
    from ray._private.state import state

    handle, hub = cluster_app
    actors = [
        a
        for a in state.actor_table(None).values()
        if (a.get("ActorClassName") or "") == f"ServeReplica:{APP}:LLMServer" and a["State"] == "ALIVE"
    ]
    prompts = [_prefix(20 + i) + [700, i] for i in range(4)]
    follow = [_prefix(20 + i) + [701, i] for i in range(4)]
    ref = _reference(cluster_model, follow)

    async def run():
        for p in prompts:  # computed (and put into the tier) on either replica
            await handle.complete.remote(p, SP)
        await asyncio.sleep(1.0)  # saves run every 50 ms
        ray.kill(ray.get_actor(actors[0]["Name"], namespace="serve"), no_restart=True)
        out = []
        for p in follow:
            for attempt in range(5):
                try:
                    out.append(list((await handle.complete.remote(p, SP)).token_ids))
                    break
                except Exception:
                    if attempt == 4:
                        raise
                    await asyncio.sleep(1.0)
        return out

    assert asyncio.run(run()) == ref
