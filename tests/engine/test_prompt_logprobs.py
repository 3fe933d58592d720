"""prompt_logprobs, max_tokens=0 and logit_bias against Hugging Face transformers.

The reference is ``AutoModelForCausalLM`` in float32 on the same token ids: prompt logprobs
must equal its ``log_softmax`` at every position (the actual token and the top-k), whether the
prompt runs in one step, in chunks (a prompt longer than ``max_num_batched_tokens``), after a
prefix of it is in the prefix cache, or after preemption by recompute.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import run_async_engine

from kvserve.engine import LLM, SamplingParams
from kvserve.engine import prompt_logprobs as prompt_logprobs_mod
from kvserve.engine.config import EngineConfig
from kvserve.engine.llm_engine import LLMEngine

SHORT = "The capital of France is"
LONG = (
    "Water boils at one hundred degrees Celsius at sea level, but at the top of a high mountain the air "
    "pressure is lower, so it boils at a lower temperature. That is why cooking pasta in the Alps takes "
    "longer than in Naples. Mountaineers carry pressure cookers for the same reason, and bakers adjust "
    "their recipes when they move to Denver. The physics is simple: a liquid boils when its vapour "
    "pressure equals the pressure of the air around it, and vapour pressure rises with temperature."
)
BUDGET = 64  # max_num_batched_tokens: LONG (~100 tokens) is prefilled in chunks


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    llm = LLM(
        model=str(smollm2_path),
        dtype="float32",
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=BUDGET,
        num_kv_blocks=40,
    )
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def hf(smollm2_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm2_path), dtype=torch.float32).eval()


def ref_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """HF float32 log_softmax ``[len(ids), vocab]``; row p predicts the token at p + 1."""
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def check_prompt_logprobs(plp, ids, ref, k):
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for q in range(1, len(ids)):
        d = plp[q]
        assert ids[q] in d, f"position {q}: actual token missing"
        assert d[ids[q]] == pytest.approx(ref[q - 1, ids[q]].item(), abs=1e-4), f"position {q}"
        vals, top = ref[q - 1].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
        assert set(d) == set(top.tolist()) | {ids[q]}, f"position {q}: top-{k} ids differ"
        for t, v in zip(top.tolist(), vals.tolist()):
            assert d[t] == pytest.approx(v, abs=1e-4)


def assert_idle(llm):
    s = llm.get_stats()
    assert s["free_kv_blocks"] == s["num_kv_blocks"], "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()


def run_steps(eng: LLMEngine, rid, ids, params) -> list:
    eng.add_request(rid, ids, params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


# --------------------------------------------------------------------------- prompt_logprobs


@pytest.mark.slow
@pytest.mark.parametrize("k", [0, 5])
def test_short_prompt_matches_hf(llm, hf, k):
    ids = llm.tokenizer.encode(SHORT)
    outs = run_steps(llm.engine, f"short-{k}", ids, greedy(max_tokens=3, prompt_logprobs=k, ignore_eos=True))
    first, final = outs[0], outs[-1]
    assert len(outs) == 3 and first.outputs[0].token_ids and final.finished
    check_prompt_logprobs(final.prompt_logprobs, ids, ref_logprobs(hf, ids), k)
    assert first.prompt_logprobs == final.prompt_logprobs  # on the first output with a token too
    assert outs[1].prompt_logprobs is None  # not repeated on every stream chunk
    assert_idle(llm)


@pytest.mark.slow
def test_chunked_prompt_matches_hf(llm, hf, monkeypatch):
    monkeypatch.setattr(prompt_logprobs_mod, "PROMPT_LOGPROBS_SLICE", 24)  # several logits slices per chunk too
    ids = llm.tokenizer.encode(LONG)
    assert len(ids) > 1.5 * BUDGET
    steps0 = llm.engine.stats.num_steps
    outs = run_steps(llm.engine, "long", ids, greedy(max_tokens=1, prompt_logprobs=3))
    assert llm.engine.stats.num_steps - steps0 == -(-len(ids) // BUDGET)  # really chunked
    assert len(outs) == 1 and outs[0].finished
    check_prompt_logprobs(outs[0].prompt_logprobs, ids, ref_logprobs(hf, ids), 3)
    assert_idle(llm)


@pytest.mark.slow
def test_prefix_cache_hit_still_returns_every_position(llm, hf):
    prefix = llm.tokenizer.encode(LONG)[:40]
    ids = prefix + llm.tokenizer.encode(" So what about tea?")
    llm.generate([prefix], greedy(max_tokens=1), use_tqdm=False)  # prefix now in the cache
    control = llm.generate([ids], greedy(max_tokens=1), use_tqdm=False)[0]
    assert control.num_cached_tokens >= 32  # a request without prompt_logprobs hits the cache
    out = llm.generate([ids], greedy(max_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0
    check_prompt_logprobs(out.prompt_logprobs, ids, ref_logprobs(hf, ids), 2)
    assert out.outputs[0].token_ids == control.outputs[0].token_ids
    assert_idle(llm)


@pytest.mark.slow
def test_preemption_keeps_one_entry_per_position(llm, hf):
    """A request preempted (by recompute) in the middle of its chunked prefill and again while
    decoding recomputes its prompt: one entry per position, the first value kept, still HF's."""
    eng = llm.engine
    ids = llm.tokenizer.encode(LONG)
    eng.add_request("pre", ids, greedy(max_tokens=4, prompt_logprobs=2, ignore_eos=True))
    req = eng.scheduler.requests["pre"]
    outs = eng.step()  # first chunk
    assert not outs and req.num_computed_tokens == BUDGET
    first = req.prompt_logprobs[1]
    assert first is not None and req.prompt_logprobs[BUDGET] is not None and req.prompt_logprobs[BUDGET + 1] is None
    eng.scheduler._preempt(req)
    while req.num_output_tokens < 2:
        outs += [o for o in eng.step() if o.request_id == "pre"]
    eng.scheduler._preempt(req)
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == "pre"]
    assert req.metrics.num_preemptions == 2 and len(outs[-1].outputs[0].token_ids) == 4
    assert outs[-1].prompt_logprobs[1] is first  # keyed by position: the recompute did not replace it
    check_prompt_logprobs(outs[-1].prompt_logprobs, ids, ref_logprobs(hf, ids), 2)
    assert outs[0].prompt_logprobs == outs[-1].prompt_logprobs
    assert_idle(llm)


@pytest.mark.slow
def test_without_prompt_logprobs_none(llm):
    out = llm.generate([SHORT], greedy(max_tokens=2), use_tqdm=False)[0]
    assert out.prompt_logprobs is None


# --------------------------------------------------------------------------- max_tokens=0


@pytest.mark.slow
def test_max_tokens_zero_prompt_only(llm, hf):
    ids = llm.tokenizer.encode(LONG)
    gen0 = llm.engine.stats.num_generated_tokens
    outs = run_steps(llm.engine, "zero", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert len(outs) == 1
    o = outs[0]
    assert o.finished and o.outputs[0].finish_reason == "length"
    assert o.outputs[0].token_ids == [] and o.outputs[0].text == "" and o.outputs[0].delta_token_ids == []
    check_prompt_logprobs(o.prompt_logprobs, ids, ref_logprobs(hf, ids), 0)
    assert llm.engine.stats.num_generated_tokens == gen0
    assert_idle(llm)
    # offline class, mixed with ordinary requests
    res = llm.generate([SHORT, LONG], [SamplingParams(max_tokens=0), greedy(max_tokens=2)], use_tqdm=False)
    assert res[0].outputs[0].token_ids == [] and res[0].outputs[0].finish_reason == "length"
    assert len(res[1].outputs[0].token_ids) == 2
    assert_idle(llm)


def test_max_tokens_zero_async_engine(tiny_llama_path):
    eng = LLMEngine(
        EngineConfig(model=str(tiny_llama_path), block_size=16, num_kv_blocks=32, max_num_batched_tokens=16)
    )

    async def go(aeng):
        outs = [o async for o in aeng.generate(list(range(5, 45)), SamplingParams(max_tokens=0, prompt_logprobs=1))]
        return outs, aeng.get_stats()

    outs, stats = run_async_engine(go, eng)
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].token_ids == [] and outs[0].outputs[0].finish_reason == "length"
    assert len(outs[0].prompt_logprobs) == 40 and all(d is not None for d in outs[0].prompt_logprobs[1:])
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"] and stats["num_generated_tokens"] == 0


def test_max_tokens_zero_validation():
    SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="^min_tokens "):
        SamplingParams(max_tokens=0, min_tokens=1)
    with pytest.raises(ValueError, match="^max_tokens "):
        SamplingParams(max_tokens=-1)


# --------------------------------------------------------------------------- logit_bias


@pytest.mark.parametrize(
    "value",
    [
        {-1: 1.0},
        {1: 100.5},
        {1: -101},
        {1: math.nan},
        {1: math.inf},
        {True: 1.0},
        {1.0: 1.0},
        {"1": 1.0},
        {1: "x"},
        {1: True},
        [1, 2],
        "x",
    ],
)
def test_logit_bias_validation(value):
    with pytest.raises(ValueError, match="^logit_bias "):
        SamplingParams(logit_bias=value)


def test_logit_bias_normalized():
    assert SamplingParams(logit_bias={3: 1, 5: -100}).logit_bias == {3: 1.0, 5: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None


@pytest.mark.slow
def test_logit_bias_out_of_vocab_rejected(llm):
    vocab = llm.engine.hf_config.vocab_size
    with pytest.raises(ValueError, match="^logit_bias "):
        llm.engine.make_request("bad", SHORT, SamplingParams(logit_bias={vocab: 1.0}))
    llm.engine.make_request("ok", SHORT, SamplingParams(logit_bias={vocab - 1: 1.0}))


@pytest.mark.slow
def test_logit_bias_greedy(llm, hf):
    ids = llm.tokenizer.encode(SHORT)
    base = llm.generate([ids], greedy(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].outputs[0]
    forced_tok = 1234
    assert forced_tok not in base.token_ids
    forced = llm.generate(
        [ids], greedy(max_tokens=3, ignore_eos=True, logprobs=0, logit_bias={forced_tok: 100}), use_tqdm=False
    )[0].outputs[0]
    assert forced.token_ids == [forced_tok] * 3
    # logprobs stay the model's raw distribution, not the biased one
    assert forced.logprobs[0][forced_tok] == pytest.approx(ref_logprobs(hf, ids)[-1, forced_tok].item(), abs=1e-4)
    assert forced.logprobs[0][forced_tok] < -5
    banned = llm.generate([ids], greedy(max_tokens=1, logit_bias={base.token_ids[0]: -100}), use_tqdm=False)[0].outputs[
        0
    ]
    assert banned.token_ids[0] != base.token_ids[0]
    assert_idle(llm)


@pytest.mark.slow
def test_logit_bias_rows_do_not_leak(llm):
    prompts = ["The quick brown fox", SHORT, "def fibonacci(n):", "Once upon a time"]
    plain = greedy(max_tokens=4, ignore_eos=True, logprobs=2)
    base = llm.generate(prompts, plain, use_tqdm=False)
    # the biased rows ban what the unbiased rows pick: a bias applied to the wrong row shows
    ban = {t: -100.0 for o in base for t in o.outputs[0].token_ids}
    params = [
        plain,
        greedy(max_tokens=4, ignore_eos=True, logit_bias=ban),
        plain,
        SamplingParams(temperature=0.8, seed=3, max_tokens=4, ignore_eos=True, logit_bias=ban),
    ]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    for i in (0, 2):
        assert mixed[i].outputs[0].token_ids == base[i].outputs[0].token_ids
        for got, want in zip(mixed[i].outputs[0].logprobs, base[i].outputs[0].logprobs):
            assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
    for i in (1, 3):
        assert not set(mixed[i].outputs[0].token_ids) & set(ban)
    assert_idle(llm)
