"""Tensor parallelism over Ray actors: TP=2 (gloo on CPU) gives the same greedy outputs as
TP=1, on a model whose 3 KV heads do not split evenly over the ranks (2 and 1): a tiny one with
SmolLM2's head layout in the fast profile, SmolLM2 itself in the thorough one; the workers live in
a STRICT_PACK placement group that is released. The offline ``LLM(model, tensor_parallel_size=2)``
picks its Ray executor itself (vLLM's ``distributed_executor_backend``), in the session's Ray or,
with none connected, a local one it starts and stops."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a land far away,",
    "The three primary colors are",
]
#: The models the TP=2 comparisons run on: a tiny Llama with SmolLM2's head layout (3 KV heads,
#: 3 query heads each: 9 heads of 16), and SmolLM2 (thorough profile).
MODELS = ["tiny-3kv", pytest.param("smollm2", marks=pytest.mark.thorough)]


@pytest.fixture(scope="module")
def tiny_3kv(tmp_path_factory):
    from tests.tiny_models import SMOLLM2_HEADS, make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_3kv"), **SMOLLM2_HEADS, initializer_range=0.2)


@pytest.fixture
def tp_model(request):
    """The folder of the model named by the test's ``model`` parameter."""
    return request.getfixturevalue({"tiny-3kv": "tiny_3kv", "smollm2": "smollm2_path"}[request.param])


@pytest.mark.parametrize("tp_model", MODELS, indirect=True)
def test_tp2_matches_tp1_greedy(ray_session, tp_model):
    import ray
    from ray.util import placement_group_table

    from kvserve.cluster.worker_group import RayWorkerGroup
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.model_loader import load_config

    cfg = load_config(tp_model)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    group_size = cfg.num_attention_heads // cfg.num_key_value_heads
    assert cfg.num_key_value_heads == 3  # what the shards below are about
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    # float32 on every CPU (the auto dtype where bfloat16 is not native): bfloat16 logits tie
    # exactly, and a TP split sums the row-parallel partial products in another order. Measured
    # on SmolLM2 with native bf16 (avx512_bf16): "def fibonacci(n):" token 13 has 304 and 2822
    # both at -1.1375 under TP=1, which TP=2 splits by 0.125 (and prompt 4's token 3, 42 and 282
    # both at -1.7493); in float32 TP=2 equals TP=1 on all four prompts. Random tiny weights have
    # such ties too.
    kw = dict(max_model_len=256, max_num_seqs=8, num_kv_blocks=64, dtype="float32")
    tp1 = LLM(model=str(tp_model), **kw)
    ref = tp1.generate(PROMPTS, params, use_tqdm=False)
    tp1.engine.shutdown()

    groups = []

    def factory(config, path):
        g = RayWorkerGroup(config, path, num_cpus=1, torch_num_threads=1, timeout_s=120)
        groups.append(g)
        return g

    tp2 = LLM(model=str(tp_model), tensor_parallel_size=2, executor_factory=factory, **kw)
    try:
        out = tp2.generate(PROMPTS, params, use_tqdm=False)
        group = groups[0]
        assert [i["rank"] for i in group.worker_info] == [0, 1]
        assert {i["backend"] for i in group.worker_info} == {"gloo"}
        assert len({i["pid"] for i in group.worker_info}) == 2
        pg_id = group._owned_pg.id.hex()
        assert placement_group_table()[pg_id]["strategy"] == "STRICT_PACK"
        # 3 KV heads: rank 0 holds 2, rank 1 holds 1 (its KV cache shard is smaller), each with
        # its KV heads' query heads (SmolLM2: [6, 3] of 9, head_dim 64)
        shards = ray.get([w.shard_info.remote() for w in group.workers])
        assert [s["num_kv_heads"] for s in shards] == [2, 1]
        assert [s["num_heads"] for s in shards] == [2 * group_size, group_size]
        assert [s["kv_cache_shape"] for s in shards] == [[64, 16, 2, head_dim], [64, 16, 1, head_dim]]
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
    from kvserve.cluster.worker_group import RayWorkerGroup
    from kvserve.engine import LLM, SamplingParams
    from kvserve.engine.lora import LoRARequest
    from tests.engine.test_lora import ADAPTERS, PROMPTS, make_adapter
    from tests.tiny_models import make_tiny_model

    base = make_tiny_model(tmp_path / "tiny", num_hidden_layers=2)
    reqs = [None] + [
        LoRARequest(name, i + 1, str(make_adapter(base, tmp_path / name, r, a, t, rs, seed=i)))
        for i, (name, r, a, t, rs) in enumerate(ADAPTERS[:2])
    ]
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
    assert len({tuple(t) for t in ref[: len(reqs)]}) == len(reqs)  # the adapters change the output


@pytest.mark.parametrize("tp_model", MODELS, indirect=True)
def test_offline_llm_picks_the_ray_executor(ray_session, tp_model):
    """vLLM's ``LLM(model, tensor_parallel_size=2)`` with no executor_factory: the engine picks
    the Ray backend (Ray is installed), runs the ranks in the session's Ray (it starts none and
    leaves it running) and gives TP=1's greedy tokens and text (float32 both: tensor ranks split
    the matmuls, so bfloat16 would round a near tie differently)."""
    import ray
    from ray.util import placement_group_table

    from kvserve.cluster.worker_group import RayWorkerGroup
    from kvserve.engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    kw = dict(dtype="float32", max_model_len=256, max_num_seqs=8, num_kv_blocks=64)
    tp1 = LLM(model=str(tp_model), **kw)
    ref = tp1.generate(PROMPTS, params, use_tqdm=False)
    tp1.engine.shutdown()

    tp2 = LLM(str(tp_model), tensor_parallel_size=2, **kw)
    group = tp2.engine.executor
    try:
        assert isinstance(group, RayWorkerGroup) and not group.started_ray
        assert [i["rank"] for i in group.worker_info] == [0, 1] and len({i["pid"] for i in group.worker_info}) == 2
        pg_id = group._owned_pg.id.hex()
        out = tp2.generate(PROMPTS, params, use_tqdm=False)
    finally:
        tp2.engine.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].text for o in out] == [o.outputs[0].text for o in ref]
    assert ray.is_initialized() and placement_group_table()[pg_id]["state"] == "REMOVED"


_LOCAL_RAY = """
import sys
import ray
from kvserve.engine import LLM, SamplingParams

path = sys.argv[1]
prompts = [[1, 2, 3, 4, 5], list(range(200, 230))]
params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
kw = dict(dtype="float32", max_model_len=64, num_kv_blocks=16)
one = LLM(path, **kw)
ref = [o.outputs[0].token_ids for o in one.generate(prompts, params, use_tqdm=False)]
one.engine.shutdown()
assert not ray.is_initialized()
llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="ray", **kw)
group = llm.engine.executor
assert type(group).__name__ == "RayWorkerGroup" and group.started_ray and ray.is_initialized()
out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
llm.engine.shutdown()
assert not ray.is_initialized(), "the Ray the engine started is still up"
assert out == ref, (out, ref)
print("SAME TOKENS")
"""


def test_ray_backend_starts_a_local_ray_when_none_is_connected(tiny_llama_path, tmp_path):
    """In a process with no Ray connected, ``distributed_executor_backend="ray"`` starts a local
    instance (token auth on, its token in a file of this test's own), runs the ranks there with
    TP=1's greedy tokens, and stops it again at shutdown. A new instance even where
    ``RAY_ADDRESS`` names another (here one that does not answer): Ray refused a CPU count for
    an address to join, so the engine failed with ValueError where a ``ray start`` had run."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_TOKEN")}
    env.update(
        PYTHONPATH=str(Path(__file__).resolve().parents[2]),
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN_PATH=str(tmp_path / "auth_token"),
        RAY_ADDRESS=f"127.0.0.1:{free_port()}",
    )
    r = subprocess.run(
        [sys.executable, "-c", _LOCAL_RAY, str(tiny_llama_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "SAME TOKENS" in r.stdout, (r.stdout[-2000:], r.stderr[-4000:])
    assert (tmp_path / "auth_token").stat().st_mode & 0o077 == 0  # the token file is the owner's only


def test_tp2_ray_ranks_export_and_import_kv_blocks(ray_session, tmp_path):
    """The cluster KV tier's copies through Ray worker actors (a Serve replica's TP executor):
    each rank reads out its share of a cached block and writes its share into its host tier; an
    engine loading another engine's prefix this way answers as an engine that computes everything
    (``tests/engine/test_kv_import.py`` does the same through local rank processes)."""
    from kvserve.cluster.worker_group import RayWorkerGroup
    from kvserve.engine import LLM, SamplingParams
    from kvserve.deployments.contract.kv_index import request_hashes
    from tests.tiny_models import SMOLLM2_HEADS, make_tiny_model

    BS = 4  # tests/engine/test_kv_offload.py's prompts: 6 blocks of 4 tokens (+2), each distinct
    TIER_PROMPTS = [[1000 + 97 * p + 13 * i for i in range(26)] for p in range(2)]

    from kvserve.engine.kv_cache_manager import root_hash

    def chain(tokens):  # both engines hash from one seed (as a Serve app's replicas do)
        return request_hashes(tokens, BS, 64, root_hash("tp-kv-tests"))

    path = make_tiny_model(tmp_path / "tiny", **SMOLLM2_HEADS)
    kw = dict(
        device="cpu",
        dtype="float32",
        num_kv_blocks=16,
        block_size=BS,
        kv_offloading_size=0.01,
        prefix_caching_hash_seed="tp-kv-tests",
    )
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ref = LLM(model=str(path), **{**kw, "kv_offloading_size": None}, enable_prefix_caching=False).generate(
        TIER_PROMPTS[:2], params, use_tqdm=False
    )

    def factory(config, model_path):
        return RayWorkerGroup(config, model_path, num_cpus=0.5, torch_num_threads=1, timeout_s=120)

    a = LLM(model=str(path), tensor_parallel_size=2, executor_factory=factory, **kw)
    b = LLM(model=str(path), tensor_parallel_size=2, executor_factory=factory, **kw)
    try:
        a.generate(TIER_PROMPTS[:2], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        copies = a.engine.export_kv_blocks(chain(TIER_PROMPTS[0])[:6] + chain(TIER_PROMPTS[1])[:6])
        assert len(copies) == 12 and all(len(c.shards) == 2 for c in copies)
        assert b.engine.import_kv_blocks(copies) == 12
        out = b.generate(TIER_PROMPTS[:2], params, use_tqdm=False)
        assert b.engine.get_stats()["kv_offload_imported_hit_tokens"] == 12 * BS
    finally:
        a.engine.shutdown()
        b.engine.shutdown()
    assert [o.outputs[0].token_ids for o in out] == [o.outputs[0].token_ids for o in ref]
