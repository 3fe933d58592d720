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


def test_tp2_lora_matches_tp1(ray_session, tmp_path):
    """LoRA adapters under TP=2: each rank holds its shard of every slot (B's rows in the
    column-parallel layers, A's columns in the row-parallel ones, whose partial products the
    all-reduce sums); a batch mixing the base model and two adapters equals TP=1 (which
    ``tests/engine/test_lora.py`` holds equal to HF with PEFT)."""
    from cluster.worker_group import RayWorkerGroup
    from engine import LLM, SamplingParams
    from engine.lora import LoRARequest
    from tests.engine.test_lora import ADAPTERS, PROMPTS, make_adapter
    from tests.tiny_models import make_tiny_model

    base = make_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    reqs = [None] + [LoRARequest(name, i + 1, str(make_adapter(base, tmp_path / name, r, a, t, rs, seed=i)))
                     for i, (name, r, a, t, rs) in enumerate(ADAPTERS[:2])]
    prompts = [p for p in PROMPTS for _ in reqs]
    loras = [r for _ in PROMPTS for r in reqs]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, num_kv_blocks=64)
    tp1 = LLM(model=str(base), **kw)
    ref = [o.outputs[0].token_ids for o in tp1.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    tp1.engine.shutdown()

    def factory(config, path):
        return RayWorkerGroup(config, path, num_cpus=1, torch_num_threads=1, timeout_s=120)

    tp2 = LLM(model=str(base), tensor_parallel_size=2, executor_factory=factory, **kw)
    try:
        out = [o.outputs[0].token_ids for o in tp2.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    finally:
        tp2.engine.shutdown()
    assert out == ref
    assert len({tuple(t) for t in ref[:len(reqs)]}) == len(reqs)  # the adapters change the output
