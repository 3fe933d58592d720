"""KV-event routing without Ray: the cluster index (``kvserve/deployments/contract/kv_index.py``) against
what the engine really reuses, the hub (``kv_event_hub.py``), a replica's publisher
(``kvserve/deployments/replica/kv_publisher.py``) over a real engine, and the router
(``kvserve/deployments/routing/kv_router.py``) on fake replicas. Through a real Serve app:
test_kv_router_live.py.
"""

import asyncio
import random

import pytest

from kvserve.deployments.contract.kv_event_hub import KVEventHubCore, ReplicaLoad
from kvserve.deployments.contract.kv_index import KVBlockIndex, request_hashes
from kvserve.deployments.routing.kv_router import KVAwareRouter, replica_costs
from kvserve.engine.kv_events import MEDIUM_HOST, MEDIUM_POOL, BlockRemoved, BlockStored, KVEventBatch
from test_router import FakeReplica, _names, _pending

BS = 4


def _engine(path, **kw):
    from kvserve.engine.config import EngineConfig
    from kvserve.engine.llm_engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(path),
            device="cpu",
            dtype="float32",
            num_kv_blocks=16,
            block_size=BS,
            kv_offloading_size=0.01,
            enable_kv_cache_events=True,
            **kw,
        )
    )


def _run(engine, prompt, rid):
    from kvserve.engine.sampling_params import SamplingParams

    engine.add_request(rid, prompt, SamplingParams(max_tokens=2, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()


PROMPTS = [[2000 + 31 * p + 7 * i for i in range(26)] for p in range(8)]


def test_the_index_predicts_what_the_engine_reuses(tiny_llama_path):
    """Fed the engine's events, the index's (pool, host) match of a prompt equals the blocks the
    engine's scheduler then takes from its pool and loads from its tier, for prompts that are
    new, in the pool, in the tier, or half in each."""
    engine = _engine(tiny_llama_path)
    kv = engine.scheduler.kv
    index = KVBlockIndex()
    rng = random.Random(0)
    for n in range(40):
        base = PROMPTS[rng.randrange(len(PROMPTS))]
        prompt = base[: rng.choice([9, 17, 26])] + [rng.randrange(100, 200)]
        for batch in engine.take_kv_events()[1]:
            index.apply("r", batch)
        want = index.match(request_hashes(prompt, BS, 64, kv.root), ["r"])["r"]
        from kvserve.engine.request import Request
        from kvserve.engine.sampling_params import SamplingParams

        probe = Request("probe", prompt, SamplingParams(max_tokens=1))
        pool = kv.get_computed_blocks(probe)
        host = kv.get_offloaded_blocks(probe, len(pool))
        assert want == (len(pool), len(host), 0), n
        _run(engine, prompt, f"r{n}")
    assert kv.host_hits > 0 and kv.prefix_hits > 0  # both tiers were exercised


def test_the_hub_applies_in_order_asks_for_snapshots_and_serves_routers():
    now = [100.0]
    hub = KVEventHubCore(log_size=4, replica_ttl_s=10, clock=lambda: now[0])
    b = [KVEventBatch(0.0, [BlockStored([h], None, [h] * BS, BS)]) for h in range(1, 8)]
    assert hub.publish("a", 2, b[:2], ReplicaLoad()) == "resync"  # a replica the hub has not seen
    assert hub.publish("a", 2, b[:2], ReplicaLoad(5, 1), snapshot=(0, KVEventBatch(0.0))) == "ok"
    assert set(hub.index.where) == {1, 2} and hub.loads["a"].waiting_tokens == 5
    assert hub.publish("a", 2, b[:2], ReplicaLoad()) == "ok"  # a repeat is skipped
    assert hub.publish("a", 5, b[3:5], ReplicaLoad()) == "resync"  # batch 3 is missing
    assert set(hub.index.where) == {1, 2}
    # a router from the start gets the whole index; then the changes
    first = hub.pull(None, 0)
    assert first.dump == {"a": [(1, MEDIUM_POOL), (2, MEDIUM_POOL)]}
    assert (
        hub.publish(
            "a",
            3,
            [KVEventBatch(0.0, [BlockRemoved([1]), BlockStored([1], None, [], BS, None, MEDIUM_HOST)])],
            ReplicaLoad(),
        )
        == "ok"
    )
    nxt = hub.pull(first.hub_id, first.cursor)
    assert nxt.dump is None and [k for _, k, _ in nxt.changes] == ["batch"]
    local = KVBlockIndex.load(first.dump)
    for r, _, batch in nxt.changes:
        local.apply(r, batch)
    assert local.where == hub.index.where == {1: {"a": {MEDIUM_HOST}}, 2: {"a": {MEDIUM_POOL}}}
    # a router too far behind the log, or from another hub, reloads
    for _ in range(5):
        hub.publish("b", 0, [], ReplicaLoad(), snapshot=(0, KVEventBatch(0.0)))
    assert hub.pull(first.hub_id, first.cursor).dump is not None
    assert hub.pull("another hub", hub.version).dump is not None
    # a silent replica is dropped
    now[0] += 11
    hub.publish("b", 0, [], ReplicaLoad())
    assert "a" not in hub.loads and hub.index.replicas == ["b"]


class _Remote:
    """A Ray actor handle's ``.method.remote(...)`` over a local object (awaitable)."""

    def __init__(self, obj):
        self.obj = obj

    def __getattr__(self, name):
        fn = getattr(self.obj, name)

        class M:
            @staticmethod
            async def remote(*a, **k):
                return fn(*a, **k)

        return M


def test_the_publisher_keeps_the_hub_equal_to_the_engine(tiny_llama_path):
    """A real async engine publishing through :class:`KVEventPublisher`: after traffic, the hub's
    index of the replica equals the engine's snapshot; a new hub (the old one died) is brought
    back by a snapshot."""
    from kvserve.deployments.replica.kv_publisher import KVEventPublisher
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.sampling_params import SamplingParams

    async def body():
        eng = AsyncLLMEngine(_engine(tiny_llama_path))
        hub = KVEventHubCore()
        pub = KVEventPublisher(eng, "r1", "app", hub=_Remote(hub))

        async def truth():
            _, snap = await eng.kv_cache_snapshot()
            return {(e.block_hashes[0], e.medium) for e in snap.events}

        def held(h):
            return {(x, m) for x, rs in h.index.where.items() for m in rs.get("r1", ())}

        try:
            for i, p in enumerate(PROMPTS):
                async for _ in eng.generate(p, SamplingParams(max_tokens=2, temperature=0), request_id=f"q{i}"):
                    pass
                if await pub.publish_once() == "resync":
                    assert await pub.publish_once() == "ok"
                assert held(hub) == await truth(), i
            assert {m for _, m in held(hub)} == {MEDIUM_POOL, MEDIUM_HOST}
            pub.hub = _Remote(hub2 := KVEventHubCore())  # the hub restarted
            assert await pub.publish_once() == "resync" and await pub.publish_once() == "ok"
            assert held(hub2) == await truth()
            assert hub2.loads["r1"].running_requests == 0
        finally:
            await eng.shutdown()

    asyncio.run(body())


def test_replica_costs_weigh_the_cached_prefix_against_load():
    match = {"a": (10, 0, 0), "b": (0, 0, 0), "c": (4, 6, 0)}
    cost = replica_costs(match, 10, 16, {"a": 0, "b": 0, "c": 0}, host_cost=0.2)
    assert cost == {"a": 0, "b": 160, "c": pytest.approx(0.2 * 16 * 6)}
    # a holds the prefix but has 200 tokens queued: recomputing on b costs less
    cost = replica_costs(match, 10, 16, {"a": 200, "b": 0, "c": 100})
    assert min(cost, key=cost.get) == "c" and cost["b"] < cost["a"]


def _kv_router(**kw) -> KVAwareRouter:
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID

    r = KVAwareRouter(
        deployment_id=DeploymentID(name="LLMServer", app_name="app"),
        handle_source=DeploymentHandleSource.UNKNOWN,
        use_replica_queue_len_cache=True,
    )
    r.initialize_state(app_name=None, **kw)  # no hub: the test feeds it
    return r


def settle(router: KVAwareRouter) -> None:
    """As after the replicas' next publish and Serve's acceptance of the routed requests: this
    router's sends and reservations no longer count (they expire by time otherwise)."""
    router._sent.clear()
    router._reserved.clear()


def test_the_router_routes_on_the_index_and_falls_back_when_cold():
    async def run():
        # a conversation's context past 1,024 tokens (the prefix router's depth) is hashed too
        deep = _kv_router()
        assert deep.hasher.max_blocks == 4096 // 16
        prompt = list(range(1000, 1200))
        hashes = request_hashes(prompt, 16, 64, 0)  # (the fake replicas' root)
        a, b, c = FakeReplica("a"), FakeReplica("b"), FakeReplica("c")
        router = _kv_router()
        router.update_replicas([a, b, c])
        reps = [a, b, c]
        # cold (nobody published): the prefix router decides (a new prefix: any of two random replicas)
        assert router.num_kv_routed == 0
        await router.choose_replicas(reps, _pending(prompt))
        assert router.num_kv_routed == 0
        hub = KVEventHubCore()
        for r in ("a", "b", "c"):
            hub.publish(r, 0, [], ReplicaLoad(), snapshot=(0, KVEventBatch(0.0)))
        hub.publish("b", 1, [KVEventBatch(0.0, [BlockStored(hashes[:8], None, [], 16)])], ReplicaLoad())
        router.apply(hub.pull(None, 0))
        for _ in range(3):  # (each after b's next publish: this router's sends no longer count)
            assert _names(await router.choose_replicas(reps, _pending(prompt)))[0] == ["b"]
            settle(router)
        assert router.num_kv_routed == 3
        # b's deeper prefix is in its host tier (a holds 4 in its pool): still b, the load is cheap
        hub.publish(
            "b",
            2,
            [
                KVEventBatch(
                    0.0, [BlockRemoved(hashes[2:8]), BlockStored(hashes[2:8], hashes[1], [], 16, None, MEDIUM_HOST)]
                )
            ],
            ReplicaLoad(),
        )
        hub.publish("a", 1, [KVEventBatch(0.0, [BlockStored(hashes[:4], None, [], 16)])], ReplicaLoad())
        router.apply(hub.pull(router._hub_id, router._cursor))
        settle(router)
        assert _names(await router.choose_replicas(reps, _pending(prompt)))[0] == ["b"]
        # b is loaded: a long queue there sends the request to the next cheapest (a, 4 blocks cached)
        hub.publish("b", 2, [], ReplicaLoad(waiting_tokens=500))
        router.apply(hub.pull(router._hub_id, router._cursor))
        settle(router)
        assert _names(await router.choose_replicas(reps, _pending(prompt)))[0] == ["a"]
        # this router's own sends count until the replica's next publish: a burst spreads
        settle(router)
        hub.publish("b", 2, [], ReplicaLoad())
        router.apply(hub.pull(router._hub_id, router._cursor))
        router._pending_at.clear()
        router._pending_to.clear()
        burst = [(_names(await router.choose_replicas(reps, _pending(prompt))))[0][0] for _ in range(12)]
        # b first (its 8 cached blocks), then, with b's queue growing, a (4 cached blocks) too
        assert burst[0] == "b" and "a" in burst and burst.count("b") > burst.count("c")
        # a new prefix: its second request follows the first (the blocks are being computed there,
        # no replica has published them yet) instead of computing them again elsewhere
        settle(router)
        new = list(range(7000, 7300))
        first = _names(await router.choose_replicas(reps, _pending(new)))[0]
        settle(router)
        assert _names(await router.choose_replicas(reps, _pending(new + [1])))[0] == first
        # a replica with more than imbalance_margin ongoing requests above the least loaded is left out
        settle(router)
        cache = router.replica_queue_len_cache
        for q, n in ((a, 0), (b, 9), (c, 0)):
            cache.update(q.replica_id, n)
        assert _names(await router.choose_replicas(reps, _pending(prompt)))[0] == ["a"]
        # other methods: the prefix router's power of two choices
        assert len(await router.choose_replicas(reps, _pending(prompt, "server_info"))) == 1

    asyncio.run(run())
