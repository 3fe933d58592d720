"""Sampling and stopping features of the engine on one tiny random-weight Llama (module fixture).

Random-weight models give arbitrary but deterministic greedy text, so text features (stop
strings, stop tokens) are checked against a reference run of the same request without the
feature; also ``max_tokens`` and ``max_model_len`` limits, prompts refused with nothing left
behind, seeds across batch mates, preemption and block size, priority order, logprobs against HF
transformers, a negative frequency penalty and prefix-cache hits. Penalties and EOS on a model
that echoes its input: ``test_penalties_and_eos.py``.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from _features_helpers import PREFIX, _has_repeat, assert_engine_empty, gen1, greedy
from kvserve.engine import LLM, SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog because"
_ids = itertools.count()


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path):
    llm = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        block_size=16,
        max_num_seqs=8,  # vs HF float32
        max_num_batched_tokens=256,
        num_kv_blocks=64,
        max_model_len=256,
    )
    yield llm
    llm.engine.shutdown()


def stream(llm, prompt, params):
    """Run one request through ``engine.step()``; returns all its outputs (last one finished)."""
    eng = llm.engine
    rid = f"stream-{next(_ids)}"
    eng.add_request(rid, prompt, params)
    outs = []
    for _ in range(10_000):
        outs += [o for o in eng.step() if o.request_id == rid]
        if outs and outs[-1].finished:
            return outs
    raise AssertionError("request never finished")


# --------------------------------------------------------------------------- stop strings / tokens


@pytest.fixture(scope="module")
def reference(tiny_llm, tokenizer):
    """Greedy 24-token reference output of PROMPT and a stop string spanning tokens k-1..k+1."""
    out = gen1(tiny_llm, PROMPT, greedy(max_tokens=24))
    ids, text = out.token_ids, out.text
    assert len(ids) == 24 and out.finish_reason == "length"
    assert text == tokenizer.decode(ids)
    ends = [len(tokenizer.decode(ids[:j])) for j in range(len(ids) + 1)]
    for k in range(4, 20):  # first k whose 3-token window gives a stop string not seen earlier
        start, end = ends[k] - 1, ends[k + 2]
        stop = text[start:end]
        if ends[k - 1] < start and ends[k] < end - 1 and text.find(stop) == start and stop.strip():
            return ids, text, stop, start, k + 2
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_spanning_tokens(tiny_llm, reference):
    ids, text, stop, start, n_tok = reference
    outs = stream(tiny_llm, PROMPT, greedy(max_tokens=24, stop=[stop]))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:start]
    assert final.token_ids == ids[:n_tok]  # stops at the token that completes the stop string
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text  # never streamed the stop string
    assert all(stop not in o.outputs[0].text for o in outs)
    assert_engine_empty(tiny_llm)


def test_stop_string_included_in_output(tiny_llm, reference):
    ids, text, stop, start, n_tok = reference
    outs = stream(tiny_llm, PROMPT, greedy(max_tokens=24, stop=stop, include_stop_str_in_output=True))
    final = outs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[: start + len(stop)]
    assert final.token_ids == ids[:n_tok]
    assert "".join(o.outputs[0].delta_text for o in outs) == final.text


def test_stop_string_on_the_last_allowed_token_is_a_stop(tiny_llm, reference):
    # the token that completes the stop string is also the max_tokens-th: the stop string wins
    # (as in vLLM, whose stop checker tests stop strings before the length limit)
    ids, text, stop, start, n_tok = reference
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=n_tok, stop=[stop]))
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == text[:start] and final.token_ids == ids[:n_tok]
    assert_engine_empty(tiny_llm)


def test_earliest_of_several_stop_strings_wins(tiny_llm, reference):
    ids, text, stop, start, n_tok = reference
    later = text[start + len(stop) : start + len(stop) + 3]
    assert later and text.find(later) >= start + len(stop)
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=24, stop=[later, stop, "\x00never"]))
    assert final.stop_reason == stop and final.text == text[:start]


def test_stop_token_ids(tiny_llm, reference):
    ids = reference[0]
    k = next(i for i in range(3, 20) if ids[i] not in ids[:i])
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=24, stop_token_ids=[ids[k], 48000]))
    assert final.finish_reason == "stop" and final.stop_reason == ids[k]
    assert final.token_ids == ids[: k + 1]
    # min_tokens defers the stop token
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=24, stop_token_ids=[ids[k]], min_tokens=k + 2))
    assert final.token_ids[:k] == ids[:k] and len(final.token_ids) >= k + 2
    assert ids[k] not in final.token_ids[: k + 2]
    if final.finish_reason == "stop":
        assert final.token_ids[-1] == ids[k]


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_gives_length(tiny_llm, reference, max_tokens):
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=max_tokens))
    assert final.finish_reason == "length" and final.stop_reason is None
    assert final.token_ids == reference[0][:max_tokens]


def test_output_capped_by_max_model_len(tiny_llm):
    n = tiny_llm.engine.max_model_len
    assert n == 256
    final = gen1(tiny_llm, list(range(1000, 1000 + n - 3)), greedy(max_tokens=None))
    assert final.finish_reason == "length" and len(final.token_ids) == 3
    final = gen1(tiny_llm, list(range(1000, 1000 + n - 1)), greedy(max_tokens=50))
    assert final.finish_reason == "length" and len(final.token_ids) == 1


def test_detokenize_false_gives_ids_only(tiny_llm, reference):
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=8, detokenize=False))
    assert final.token_ids == reference[0][:8] and final.text == "" and final.finish_reason == "length"
    assert tiny_llm.engine.output_processor.detokenizers == {}
    with pytest.raises(ValueError, match="^stop "):
        SamplingParams(stop=["x"], detokenize=False)


def test_prompt_too_long_rejected_and_nothing_left(tiny_llm):
    n = tiny_llm.engine.max_model_len
    for bad in (list(range(1000, 1000 + n)), list(range(1000, 1000 + n + 40))):
        with pytest.raises(ValueError, match="max_model_len"):
            tiny_llm.generate(["a fine prompt", bad], greedy(max_tokens=4), use_tqdm=False)
        assert_engine_empty(tiny_llm)
    with pytest.raises(ValueError, match="empty"):
        tiny_llm.generate([[]], greedy(), use_tqdm=False)
    with pytest.raises(ValueError):
        tiny_llm.generate([[1, 2, 10**6]], greedy(), use_tqdm=False)  # out of the vocabulary
    with pytest.raises(ValueError, match="sampling_params"):
        tiny_llm.generate(["a", "b"], [greedy()], use_tqdm=False)
    assert_engine_empty(tiny_llm)
    assert len(gen1(tiny_llm, "still serving", greedy(max_tokens=3)).token_ids) == 3


# --------------------------------------------------------------------------- seeds and batching


def test_seed_reproducible_across_batch_mates(tiny_llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=12)
    alone = gen1(tiny_llm, PROMPT, sp).token_ids
    mates = tiny_llm.generate(
        ["other prompt one", PROMPT, "another, longer prompt that takes more tokens to prefill", PROMPT],
        [
            SamplingParams(temperature=1.0, max_tokens=20),
            sp,
            greedy(max_tokens=5),
            SamplingParams(temperature=1.0, seed=99, max_tokens=12),
        ],
        use_tqdm=False,
    )
    assert mates[1].outputs[0].token_ids == alone
    assert mates[3].outputs[0].token_ids != alone  # another seed, another sample
    assert gen1(tiny_llm, PROMPT, sp).token_ids == alone


def test_unseeded_sampling_differs_from_greedy(tiny_llm, reference):
    outs = tiny_llm.generate([PROMPT] * 2, SamplingParams(temperature=1.0, max_tokens=12), use_tqdm=False)
    a, b = (o.outputs[0].token_ids for o in outs)
    assert a != b and a != reference[0][:12]


def test_preemption_and_block_size_do_not_change_outputs(tiny_llama_path, tiny_llm):
    """An 8-block pool of 4-token blocks forces preemption by recompute and chunked prefill;
    greedy and seeded outputs must equal those of the roomy engine."""
    prompts = [PROMPT, "Once upon a time in a land", "1, 2, 3, 4, 5, 6,"]
    params = [
        greedy(max_tokens=10),
        SamplingParams(temperature=1.0, seed=7, max_tokens=10),
        SamplingParams(temperature=0.8, top_k=50, seed=8, max_tokens=10),
    ]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(w) == 10 for w in want)
    small = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        block_size=4,
        num_kv_blocks=8,
        max_num_seqs=4,
        max_num_batched_tokens=8,
    )  # tiny_llm's dtype: equal token for token
    try:
        assert small.engine.max_model_len == 32
        got = [o.outputs[0].token_ids for o in small.generate(prompts, params, use_tqdm=False)]
        stats = small.get_stats()
        assert stats["num_preemptions"] > 0
        assert got == want
        assert_engine_empty(small)
    finally:
        small.engine.shutdown()


def test_priority_scheduling_order(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), max_num_seqs=1, num_kv_blocks=32, scheduling_policy="priority")
    try:
        outs = llm.generate(
            ["p zero", "p one", "p two", "p three"], greedy(max_tokens=2), use_tqdm=False, priority=[2, 0, 1, 0]
        )
        order = sorted(range(4), key=lambda i: outs[i].metrics.first_scheduled_time)
        assert order == [1, 3, 2, 0]
        assert all(o.outputs[0].finish_reason == "length" for o in outs)
        assert llm.get_stats()["max_running_batch"] == 1
    finally:
        llm.engine.shutdown()


# --------------------------------------------------------------------------- logprobs


def test_logprobs_match_reference_model(tiny_llm, tiny_llama_path, tokenizer):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama_path), dtype=torch.float32).eval()
    prompt_ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    # greedy, and sampled with temperature and a penalty: logprobs are the model's raw ones
    for k, sp in (
        (5, greedy(max_tokens=6, logprobs=5)),
        (3, SamplingParams(temperature=0.7, seed=5, frequency_penalty=1.5, max_tokens=6, logprobs=3)),
    ):
        final = gen1(tiny_llm, PROMPT, sp)
        assert final.logprobs is not None and len(final.logprobs) == 6
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + final.token_ids])).logits[0].float()
        ref = logits.log_softmax(-1)[len(prompt_ids) - 1 : -1]  # positions that predicted each output
        for pos, (tok, lp) in enumerate(zip(final.token_ids, final.logprobs)):
            assert tok in lp and k <= len(lp) <= k + 1
            assert all(v <= 0.0 for v in lp.values())
            assert math.log(sum(math.exp(v) for v in lp.values())) <= 1e-6
            if sp.greedy:
                assert lp[tok] == pytest.approx(max(lp.values()))  # greedy takes the most likely token
            for t, v in lp.items():
                assert v == pytest.approx(ref[pos, t].item(), abs=1e-4)
            top = sorted(lp.values(), reverse=True)[:k]
            assert top == pytest.approx(ref[pos].topk(k).values.tolist(), abs=1e-4)  # they are the top k
    final0 = gen1(tiny_llm, PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=4, logprobs=0))
    assert [list(d) for d in final0.logprobs] == [[t] for t in final0.token_ids]
    assert gen1(tiny_llm, PROMPT, greedy(max_tokens=2)).logprobs is None


# --------------------------------------------------------------------------- penalties and prefix-cache hits


def test_negative_frequency_penalty_encourages_repeats(tiny_llm, reference):
    assert not _has_repeat(reference[0][:10])
    out = gen1(tiny_llm, PROMPT, greedy(max_tokens=10, frequency_penalty=-2.0)).token_ids
    assert out[0] == reference[0][0] and out == [out[0]] * 10


def test_min_tokens_survives_prefix_cache_hits(tiny_llm):
    ref = gen1(tiny_llm, PREFIX, greedy(max_tokens=4)).token_ids
    assert ref[1] != ref[0]
    out = tiny_llm.generate([PREFIX], greedy(max_tokens=8, stop_token_ids=[ref[1]], min_tokens=1), use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == ref[:2] and out.outputs[0].finish_reason == "stop"


def test_prefix_cache_hit_gives_same_greedy_output(tiny_llm):
    prompt = list(range(3000, 3050))
    first = tiny_llm.generate([prompt], greedy(max_tokens=12), use_tqdm=False)[0]
    # a batch mixing a hit on the same prompt, a partial hit and a miss
    outs = tiny_llm.generate(
        [prompt, prompt[:20] + [5, 6, 7], prompt[:33] + [9] * 20], greedy(max_tokens=12), use_tqdm=False
    )
    assert first.num_cached_tokens == 0 and outs[0].num_cached_tokens == 48
    assert outs[0].outputs[0].token_ids == first.outputs[0].token_ids
    assert outs[1].num_cached_tokens == 16 and outs[2].num_cached_tokens == 32
    fresh = LLM(model=tiny_llm.engine.model_path, dtype="float32", num_kv_blocks=16, enable_prefix_caching=False)
    try:
        want = fresh.generate([p.prompt_token_ids for p in outs], greedy(max_tokens=12), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
        assert all(o.num_cached_tokens == 0 for o in want)
    finally:
        fresh.engine.shutdown()
