"""Pipeline parallelism over Ray actors (kvserve/engine/pipeline.py; gloo point-to-point on CPU): the
layers split into stages, each stage's KV cache holding its own layers, a step's batch passed
through the stages as micro-batches. Greedy output equals Hugging Face transformers token for
token with PP=2 and PP=2 x TP=2, on a tiny random-weight Llama (untied LM head) and on one with
tied embeddings (the last stage loads the embedding as its LM head: a tiny one with SmolLM2's
layout, SmolLM2 itself in the thorough profile), through chunked prefill, preemption and
prefix-cache hits; every KV block goes back to the pool."""

import pytest

from tests.engine.test_correctness import hf_greedy

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NEW_TOKENS = 12


def pp_llm(path, pp: int, tp: int = 1, **kw):
    """An offline ``LLM`` whose ``pp x tp`` ranks are Ray actors; returns ``(llm, group)``."""
    from kvserve.cluster.worker_group import RayWorkerGroup
    from kvserve.engine import LLM

    groups = []

    def factory(config, model_path):
        groups.append(
            RayWorkerGroup(config, model_path, num_cpus=1, torch_num_threads=1, timeout_s=120, collective_timeout_s=120)
        )
        return groups[-1]

    llm = LLM(
        str(path), dtype="float32", pipeline_parallel_size=pp, tensor_parallel_size=tp, executor_factory=factory, **kw
    )
    return llm, groups[0]


@pytest.fixture(scope="module")
def tiny4(tmp_path_factory):
    """The tiny Llama with 4 layers (2 per stage), untied LM head."""
    from tests.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_pp"), num_hidden_layers=4)


def _prompts(n: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, 49152) for _ in range(rng.randint(4, 60))] for _ in range(n)]


@pytest.mark.parametrize(
    "pp,tp,kw",
    [
        (2, 1, {}),
        (2, 1, {"max_num_batched_tokens": 24, "num_kv_blocks": 24, "block_size": 4}),  # chunks, preemption
        (2, 2, {"max_num_batched_tokens": 24}),
    ],
    ids=["pp2", "pp2-chunked-preempted", "pp2xtp2"],
)
def test_pipeline_equals_hf_on_the_tiny_llama(ray_session, tiny4, pp, tp, kw):
    import ray

    from kvserve.engine import SamplingParams

    prompts = [list(range(100, 150))] + _prompts(5, seed=pp * 10 + tp + len(kw))
    prompts += [prompts[0][:40] + [7, 8, 9]]  # shares its first blocks with prompts[0]: a prefix-cache hit
    ref = hf_greedy(tiny4, prompts, NEW_TOKENS)
    llm, group = pp_llm(tiny4, pp, tp, max_num_seqs=8, **kw)
    try:
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
        first = llm.generate(prompts[:1], params, use_tqdm=False)  # cached before the others come
        out = first + llm.generate(prompts[1:], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == ref
        shards = ray.get([w.shard_info.remote() for w in group.workers])
        # ranks stage * tp + t: each stage holds its own layers and their KV caches only
        assert [s["layers"] for s in shards] == [[0, 2]] * tp + [[2, 4]] * tp
        assert [s["num_kv_caches"] for s in shards] == [2] * (pp * tp)
        stats = llm.get_stats()
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
        if "num_kv_blocks" in kw:  # the small pool preempts (and may evict prompts[0]'s cached blocks)
            assert stats["num_preemptions"] > 0
        else:
            assert out[-1].num_cached_tokens == 32  # two full blocks of prompts[0]
    finally:
        llm.engine.shutdown()


@pytest.fixture(scope="module")
def tiny_tied(tmp_path_factory):
    """A tiny Llama with SmolLM2's tied embeddings and head layout (3 KV heads of 3 query heads:
    uneven over TP=2), 4 layers."""
    from tests.tiny_models import SMOLLM2_HEADS, make_tiny_model

    return make_tiny_model(
        tmp_path_factory.mktemp("tiny_tied"),
        tie_word_embeddings=True,
        num_hidden_layers=4,
        **SMOLLM2_HEADS,
        initializer_range=0.2,
    )


@pytest.mark.parametrize("model", ["tiny-tied", pytest.param("smollm2", marks=pytest.mark.thorough)])
def test_pipeline_equals_hf_with_tied_embeddings(ray_session, request, model):
    """A model with tied embeddings over PP=2 x TP=2: the first stage embeds, the last loads the
    embedding's tensor as its LM head; text and tokens equal HF's greedy ones. A tiny one with
    SmolLM2's layout in the fast profile, SmolLM2 (30 layers) in the thorough one."""
    from kvserve.engine import SamplingParams

    path = request.getfixturevalue({"tiny-tied": "tiny_tied", "smollm2": "smollm2_path"}[model])
    llm, group = pp_llm(path, 2, 2, max_model_len=256, max_num_seqs=4, num_kv_blocks=64)
    try:
        texts = ["The capital of France is", "def fibonacci(n):", "The three primary colors are"]
        prompts = [llm.tokenizer.encode(t) for t in texts]
        out = llm.generate(
            prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
        )
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in out] == hf_greedy(path, prompts, NEW_TOKENS)


def test_pipeline_refuses_what_it_does_not_run(ray_session, tiny4):
    from kvserve.engine import EngineConfig

    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 does not run with enable_lora"):
        EngineConfig(model=str(tiny4), pipeline_parallel_size=2, enable_lora=True)
    with pytest.raises(ValueError, match="'uni' runs one rank.*needs 'mp' .* or 'ray'"):
        EngineConfig(model=str(tiny4), pipeline_parallel_size=2, distributed_executor_backend="uni")
    with pytest.raises(ValueError, match="exceeds num_hidden_layers 4"):
        pp_llm(tiny4, 5)
