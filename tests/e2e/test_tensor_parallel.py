"""Tensor parallelism over Ray actors: TP=2 (gloo on CPU) gives the same greedy outputs as
TP=1 on SmolLM2; the workers live in a STRICT_PACK placement group that is released."""
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
]


def test_tp2_matches_tp1_greedy_on_smollm2(ray_session, smollm2_path):
    import ray
    from ray.util import placement_group_table

    from cluster.worker_group import RayWorkerGroup
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(max_model_len=256, max_num_seqs=8, num_kv_blocks=64)
    tp1 = LLM(model=str(smollm2_path), **kw)
    ref = tp1.generate(PROMPTS, params, use_tqdm=False)
    tp1.engine.shutdown()

    groups = []

    def factory(config, path):
        g = RayWorkerGroup(config, path, num_cpus=1, torch_num_threads=1, timeout_s=120)
        groups.append(g)
        return g

    tp2 = LLM(model=str(smollm2_path), tensor_parallel_size=2, executor_factory=factory, **kw)
    try:
        out = tp2.generate(PROMPTS, params, use_tqdm=False)
        group = groups[0]
        assert [i["rank"] for i in group.worker_info] == [0, 1]
        assert {i["backend"] for i in group.worker_info} == {"gloo"}
        assert len({i["pid"] for i in group.worker_info}) == 2
        pg_id = group._owned_pg.id.hex()
        assert placement_group_table()[pg_id]["strategy"] == "STRICT_PACK"
        # SmolLM2 has 3 KV heads: rank 0 holds 2, rank 1 holds 1 (its KV cache shard is smaller)
        shards = ray.get([w.shard_info.remote() for w in group.workers])
        assert [s["num_kv_heads"] for s in shards] == [2, 1]
        assert [s["num_heads"] for s in shards] == [6, 3]
        assert [s["kv_cache_shape"] for s in shards] == [[64, 16, 2, 64], [64, 16, 1, 64]]
    finally:
        tp2.engine.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    assert placement_group_table()[pg_id]["state"] == "REMOVED"
