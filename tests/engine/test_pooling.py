"""Embeddings from a decoder (kvserve/engine/pooling.py) against HF transformers on the same weights:
the final hidden states pooled (last token, mean), through chunked prefill, prefix-cache hits,
preemption and batches shared with generating requests, every block back in the pool."""

import random

import pytest
import torch
from transformers import AutoModel

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.pooling import PoolingParams


def _hf_pooled(model, ids: list[int], pooling: str) -> torch.Tensor:
    with torch.no_grad():
        h = model(torch.tensor([ids])).last_hidden_state[0].float()
    v = h[-1] if pooling == "last" else h.mean(0)
    return torch.nn.functional.normalize(v, dim=0)


def _cos(a, b: torch.Tensor) -> float:
    return float(torch.dot(torch.tensor(a, dtype=torch.float32), b))


def _prompts(n: int, seed: int = 0, vocab: int = 49152) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(3, 70))] for _ in range(n)]


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_hidden_states_equal_hf_through_chunked_prefill(tiny_llama_path, pooling):
    prompts = _prompts(10)
    llm = LLM(str(tiny_llama_path), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4)  # chunks of <= 32
    got = llm.embed(prompts, pooling_type=pooling)
    hf = AutoModel.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    for ids, vec in zip(prompts, got):
        assert len(vec) == 64 and _cos(vec, _hf_pooled(hf, ids, pooling)) >= 0.9999
    raw = llm.embed(prompts[:1], pooling_type=pooling, normalize=False)[0]
    with torch.no_grad():
        h = hf(torch.tensor([prompts[0]])).last_hidden_state[0]
    ref = h[-1] if pooling == "last" else h.mean(0)
    assert torch.allclose(torch.tensor(raw), ref, atol=1e-4)  # unnormalised: the pooled state itself
    s = llm.get_stats()
    assert s["free_kv_blocks"] == s["num_kv_blocks"]


def test_smollm2_embeddings_equal_hf(smollm2_path):
    llm = LLM(dtype="float32", max_num_seqs=4)
    texts = ["The quick brown fox jumps over the lazy dog.", "Paris is the capital of France."]
    ids = [llm.tokenizer.encode(t) for t in texts]
    hf = AutoModel.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    for pooling in ("last", "mean"):
        for vec, x in zip(llm.embed(texts, pooling_type=pooling), ids):
            assert len(vec) == 576 and _cos(vec, _hf_pooled(hf, x, pooling)) >= 0.9999


def test_embedding_requests_share_steps_with_generation_and_the_prefix_cache(tiny_llama_path):
    """Generation in the same batches is unchanged; a prompt embedded twice (the second time a
    prefix-cache hit for last-token pooling; mean pooling computes every position again) gives
    the same vector; a small KV pool preempts requests and recomputes them; no block leaks."""
    prompts = _prompts(8, seed=1)
    gen_prompts = _prompts(4, seed=2)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    alone = LLM(str(tiny_llama_path), dtype="float32")
    expected = [o.outputs[0].token_ids for o in alone.generate(gen_prompts, params, use_tqdm=False)]
    hf = AutoModel.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()

    llm = LLM(
        str(tiny_llama_path),
        dtype="float32",
        num_kv_blocks=14,
        block_size=16,
        max_num_seqs=6,
        max_num_batched_tokens=48,
    )
    eng = llm.engine
    for i, p in enumerate(gen_prompts):
        eng.add_request(f"g{i}", p, params)
    for i, p in enumerate(prompts + prompts):  # each prompt twice
        eng.add_request(f"e{i}", p, pooling_params=PoolingParams("last" if i % 2 else "mean"))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[f"g{i}"].outputs[0].token_ids for i in range(4)] == expected
    n = len(prompts)
    for i in range(2 * n):
        out, pooling = done[f"e{i}"], "last" if i % 2 else "mean"
        assert out.error is None and out.outputs[0].token_ids == []
        assert _cos(out.pooled, _hf_pooled(hf, prompts[i % n], pooling)) >= 0.9999
    s = llm.get_stats()
    assert s["num_preemptions"] > 0  # the small pool made the scheduler preempt (and recompute)
    assert s["prefix_cache_hit_rate"] > 0  # last-token pooling reused cached blocks
    assert s["free_kv_blocks"] == s["num_kv_blocks"]


def test_an_input_may_fill_the_context_but_not_exceed_it(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), dtype="float32", max_model_len=64)
    [vec] = llm.embed([list(range(1, 65))])  # 64 tokens: the whole context, nothing generated
    assert len(vec) == 64
    with pytest.raises(ValueError, match="64"):
        llm.embed([list(range(1, 66))])
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams("cls")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,min_cos", [("float32", 0.9999), ("bfloat16", 0.99)])
def test_cuda_pooled_hidden_states_equal_hf(tiny_llama_path, dtype, min_cos):
    """On CUDA with the engine's default attention (Triton in bfloat16; torch in float32, whose
    Triton variants take minutes to compile) and CUDA graphs on for the generating requests
    beside them: pooled states equal HF's float32 ones (bfloat16: rounding allows cosine 0.99),
    and generation in the same engine keeps running."""
    prompts = _prompts(10)
    backend = "torch" if dtype == "float32" else None
    llm = LLM(
        str(tiny_llama_path),
        device="cuda",
        dtype=dtype,
        attention_backend=backend,
        max_num_batched_tokens=32,
        max_num_seqs=4,
        kv_cache_memory_bytes=1 << 28,
    )  # other tests' engines may live
    eng = llm.engine
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(f"g{i}", p, params)
    for pooling in ("last", "mean"):
        for i, p in enumerate(prompts):
            eng.add_request(f"{pooling}{i}", p, pooling_params=PoolingParams(pooling))
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    hf = AutoModel.from_pretrained(tiny_llama_path, dtype=torch.float32).eval()
    for pooling in ("last", "mean"):
        for i, ids in enumerate(prompts):
            out = done[f"{pooling}{i}"]
            assert out.error is None and _cos(out.pooled, _hf_pooled(hf, ids, pooling)) >= min_cos, (pooling, i)
    assert all(len(done[f"g{i}"].outputs[0].token_ids) == 24 for i in range(3))
    s = llm.get_stats()
    assert s["free_kv_blocks"] == s["num_kv_blocks"]
