"""The cluster KV tier verifies what it imports (``kvserve/deployments/replica/kv_cluster.py``):
each block travels with the SHA-256 of its bytes; a fetched block whose bytes do not match is
not loaded but recomputed, dropped from the directory and counted
(``kv_cluster_load_fallbacks{reason="digest_mismatch"}``); the layout key names the weights'
revision, quantization and A/B variant.

Real engines (the tiny model, a host tier each), the real connector and the real directory
(``KVEventHubCore``); the hub's Ray calls and Ray's object store are stood in by awaitables (the
transport is not what is tested). The tier over Ray and Serve: test_kv_cluster_live.py.
"""

from __future__ import annotations

import asyncio

from kvserve.deployments.contract.kv_cluster_directory import kv_layout
from kvserve.deployments.contract.kv_event_hub import KVEventHubCore
from kvserve.deployments.contract.kv_index import request_hashes
from kvserve.deployments.replica.kv_cluster import ClusterKVConnector
from kvserve.engine.kv_cache_manager import root_hash
from kvserve.engine.kv_offload import block_digest

BS, SEED = 4, "kv-verify-tests"
PROMPTS = [[1000 + 97 * p + 13 * i for i in range(26)] for p in range(2)]  # 6 full blocks (+2) each
LAYOUT = kv_layout("tiny", "torch.float32", "auto", BS, 1, 1, revision="r1")


class _Remote:
    """``actor.method.remote(...)`` of a hub in this process: an awaitable of the call's result."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args):
        fut = asyncio.get_running_loop().create_future()
        fut.set_result(self.fn(*args))
        return fut


class LocalHub:
    def __init__(self, core: KVEventHubCore):
        self.core = core
        self.cluster_lookup, self.cluster_drop = _Remote(core.cluster_lookup), _Remote(core.cluster_drop)


class _Ref:
    """An object-store reference stood in: awaiting it gives the shards."""

    def __init__(self, shards):
        self.shards = shards

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.shards


def _fallbacks(metrics, reason: str) -> float:
    for family in metrics.fallbacks.prom.collect():
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("reason") == reason and s.labels["replica"] == "b":
                return s.value
    return 0.0


def test_a_block_that_fails_its_digest_is_recomputed_and_counted(tiny_llama_path):
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.config import EngineConfig
    from kvserve.telemetry.metrics import ClusterTierMetrics

    kw = dict(model=str(tiny_llama_path), device="cpu", dtype="float32", num_kv_blocks=16, block_size=BS)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in LLM(**kw, enable_prefix_caching=False).generate(PROMPTS, sp, use_tqdm=False)]
    a = LLM(**kw, kv_offloading_size=0.01, prefix_caching_hash_seed=SEED)
    a.generate(PROMPTS, SamplingParams(max_tokens=1), use_tqdm=False)
    root = root_hash(SEED)
    core = KVEventHubCore()
    for p, bad in zip(PROMPTS, (0, 3)):  # prompt 0: its first block corrupted; prompt 1: its fourth
        copies = a.engine.export_kv_blocks(request_hashes(p, BS, 64, root))
        assert len(copies) == 6
        blocks = []
        for i, c in enumerate(copies):
            shards = [s.copy() for s in c.shards]
            if i == bad:
                shards[0][17] ^= 1  # one bit flipped on its way (object store, spill file, a replica)
            blocks.append((c.block_hash, c.meta, c.nbytes, [_Ref(shards)], block_digest(c.shards)))
        core.cluster_put("a", LAYOUT, 1 << 30, blocks)

    async def body():
        b = AsyncLLMEngine.from_config(EngineConfig(**kw, kv_offloading_size=0.01, prefix_caching_hash_seed=SEED))
        metrics = ClusterTierMetrics("tiny", "b")
        conn = ClusterKVConnector(
            b, "b", "app", LAYOUT, 1 << 30, BS, max_import_blocks=8, metrics=metrics, hub=LocalHub(core), hash_root=root
        )
        conn.s_per_token = 10.0  # a generous bound on the load's wait: the check, not the clock, decides
        b.kv_connector = conn
        before = _fallbacks(metrics, "digest_mismatch")
        try:
            got = []
            for i, p in enumerate(PROMPTS):
                out = None
                async for o in b.generate(p, sp, request_id=f"r{i}"):
                    out = o
                got.append((list(out.outputs[0].token_ids), out.num_cached_tokens))
        finally:
            await b.shutdown()
        return got, conn, _fallbacks(metrics, "digest_mismatch") - before

    got, conn, counted = asyncio.run(body())
    assert [t for t, _ in got] == [list(r) for r in ref]  # outputs as if everything were computed
    # prompt 0: nothing loaded (its first block failed); prompt 1: the three blocks before the bad one
    assert [c for _, c in got] == [0, 3 * BS]
    assert conn.num_loaded_blocks == 3 and conn.num_digest_mismatches == 6 + 3
    assert counted == 2  # one fallback per load that met a bad block
    # the bad blocks left the directory: nobody loads them again
    assert core.cluster_lookup(LAYOUT, request_hashes(PROMPTS[0], BS, 64, root)) == []
    assert len(core.cluster_lookup(LAYOUT, request_hashes(PROMPTS[1], BS, 64, root))) == 3


def test_the_layout_names_the_weights_as_well_as_the_kv_shape():
    base = kv_layout("m", "torch.float32", "auto", 16, 1, 1, revision="r1")
    assert base != kv_layout("m", "torch.float32", "auto", 16, 1, 1, revision="r2")  # a rolling update
    assert base != kv_layout("m", "torch.float32", "auto", 16, 1, 1, revision="r1", quantization="int8")
    assert base != kv_layout("m", "torch.float32", "auto", 16, 1, 1, revision="r1", variant="b")  # an A/B variant
    assert base == kv_layout("m", "torch.float32", "auto", 16, 1, 1, revision="r1")
