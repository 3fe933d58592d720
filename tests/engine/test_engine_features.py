"""Sampling and stopping features of the engine, on tiny random-weight models.

Random-weight models give arbitrary but deterministic greedy text, so text features (stop
strings, stop tokens) are checked against a reference run of the same request without the
feature. A tiny model with tied embeddings echoes its last input token, which makes
repetition (and so penalties) and EOS easy to provoke.
"""
from __future__ import annotations

import itertools
import math
from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from engine.model_loader import load_tokenizer
from tiny_models import make_tiny_model

PROMPT = "The quick brown fox jumps over the lazy dog because"
ECHO_PROMPT = "Hello there, how are you"  # the tied model repeats " you" (token 346) forever
ECHO_TOKEN = 346
_ids = itertools.count()


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), dtype="float32", block_size=16, max_num_seqs=8,  # vs HF float32
              max_num_batched_tokens=256, num_kv_blocks=64, max_model_len=256)
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def echo_llm(tmp_path_factory):
    """Tied-embedding tiny Llama whose EOS is " you": greedy on ECHO_PROMPT emits EOS first."""
    path = make_tiny_model(tmp_path_factory.mktemp("tiny_echo"), arch="llama", tie_word_embeddings=True,
                           eos_token_id=ECHO_TOKEN)
    llm = LLM(model=str(path), block_size=16, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64)
    assert ECHO_TOKEN in llm.engine.eos_token_ids
    yield llm
    llm.engine.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return load_tokenizer(tiny_llama_path)


def gen1(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


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


def assert_engine_empty(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.requests == {} and eng.output_processor.detokenizers == {}
    assert eng.scheduler.kv.pool.num_free_blocks == eng.scheduler.kv.num_blocks
    eng.scheduler.kv.pool.check()


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
    assert final.text == text[:start + len(stop)]
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
    later = text[start + len(stop):start + len(stop) + 3]
    assert later and text.find(later) >= start + len(stop)
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=24, stop=[later, stop, "\x00never"]))
    assert final.stop_reason == stop and final.text == text[:start]


def test_stop_token_ids(tiny_llm, reference):
    ids = reference[0]
    k = next(i for i in range(3, 20) if ids[i] not in ids[:i])
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=24, stop_token_ids=[ids[k], 48000]))
    assert final.finish_reason == "stop" and final.stop_reason == ids[k]
    assert final.token_ids == ids[:k + 1]
    # min_tokens defers the stop token
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=24, stop_token_ids=[ids[k]], min_tokens=k + 2))
    assert final.token_ids[:k] == ids[:k] and len(final.token_ids) >= k + 2
    assert ids[k] not in final.token_ids[:k + 2]
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


def test_eos_stops_and_ignore_eos(echo_llm):
    final = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=12))
    assert final.token_ids == [ECHO_TOKEN] and final.finish_reason == "stop" and final.stop_reason is None
    final = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=12, ignore_eos=True))
    assert final.token_ids == [ECHO_TOKEN] * 12 and final.finish_reason == "length"
    final = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=12, min_tokens=3))
    assert len(final.token_ids) >= 3 and ECHO_TOKEN not in final.token_ids[:3]
    assert_engine_empty(echo_llm)


# --------------------------------------------------------------------------- validation


@pytest.mark.parametrize("field, value", [
    ("n", 2), ("temperature", -0.1), ("temperature", 2.5), ("top_p", 0.0), ("top_p", 1.5),
    ("top_k", -2), ("top_k", 2.5), ("min_p", -0.1), ("min_p", 1.5), ("max_tokens", -1), ("max_tokens", -3),
    ("max_tokens", 2.5), ("min_tokens", -1), ("presence_penalty", 2.5), ("presence_penalty", -2.5),
    ("frequency_penalty", 3.0), ("frequency_penalty", -2.1), ("repetition_penalty", 0.0),
    ("repetition_penalty", 11.0), ("logprobs", -1), ("logprobs", 21), ("stop", [""]), ("stop", [3]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
])
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_over_max_tokens_invalid():
    with pytest.raises(ValueError, match="^min_tokens "):
        SamplingParams(max_tokens=2, min_tokens=3)


def test_detokenize_false_gives_ids_only(tiny_llm, reference):
    final = gen1(tiny_llm, PROMPT, greedy(max_tokens=8, detokenize=False))
    assert final.token_ids == reference[0][:8] and final.text == "" and final.finish_reason == "length"
    assert tiny_llm.engine.output_processor.detokenizers == {}
    with pytest.raises(ValueError, match="^stop "):
        SamplingParams(stop=["x"], detokenize=False)


@pytest.mark.parametrize("kw", [
    dict(temperature=0.0), dict(temperature=2.0), dict(top_p=1.0), dict(top_k=0), dict(top_k=-1),
    dict(min_p=1.0), dict(max_tokens=None), dict(max_tokens=1, min_tokens=1), dict(presence_penalty=-2.0),
    dict(frequency_penalty=2.0), dict(repetition_penalty=10.0), dict(logprobs=0), dict(logprobs=20),
    dict(stop="x"), dict(stop_token_ids=[0]),
])
def test_boundary_sampling_params_are_valid(kw):
    sp = SamplingParams(**kw)
    if "stop" in kw:
        assert sp.stop == ["x"]


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
        [SamplingParams(temperature=1.0, max_tokens=20), sp, greedy(max_tokens=5),
         SamplingParams(temperature=1.0, seed=99, max_tokens=12)], use_tqdm=False)
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
    params = [greedy(max_tokens=10), SamplingParams(temperature=1.0, seed=7, max_tokens=10),
              SamplingParams(temperature=0.8, top_k=50, seed=8, max_tokens=10)]
    want = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(w) == 10 for w in want)
    small = LLM(model=str(tiny_llama_path), dtype="float32", block_size=4, num_kv_blocks=8, max_num_seqs=4,
                max_num_batched_tokens=8)  # tiny_llm's dtype: equal token for token
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
        outs = llm.generate(["p zero", "p one", "p two", "p three"], greedy(max_tokens=2), use_tqdm=False,
                            priority=[2, 0, 1, 0])
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
    for k, sp in ((5, greedy(max_tokens=6, logprobs=5)),
                  (3, SamplingParams(temperature=0.7, seed=5, frequency_penalty=1.5, max_tokens=6, logprobs=3))):
        final = gen1(tiny_llm, PROMPT, sp)
        assert final.logprobs is not None and len(final.logprobs) == 6
        with torch.no_grad():
            logits = hf(torch.tensor([prompt_ids + final.token_ids])).logits[0].float()
        ref = logits.log_softmax(-1)[len(prompt_ids) - 1:-1]  # positions that predicted each output
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


# --------------------------------------------------------------------------- penalties


def _has_repeat(ids):
    return len(set(ids)) < len(ids)


def test_frequency_and_presence_penalties(echo_llm):
    base = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=10, ignore_eos=True)).token_ids
    assert base == [ECHO_TOKEN] * 10
    for kw in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0)):
        out = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=10, ignore_eos=True, **kw)).token_ids
        assert out[0] == ECHO_TOKEN and not _has_repeat(out), kw  # penalties act on output tokens only
    # a mild penalty: the presence penalty stays constant, the frequency penalty grows with the count
    pres = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=10, ignore_eos=True, presence_penalty=0.5)).token_ids
    freq = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=10, ignore_eos=True, frequency_penalty=0.5)).token_ids
    assert pres[0] == freq[0] == ECHO_TOKEN and pres[1] == freq[1]
    assert max(Counter(freq).values()) < max(Counter(pres).values())


def test_logprobs_are_raw_under_penalties(echo_llm):
    """The penalty keeps the echo model from repeating, but the returned logprobs are the
    model's own: the token it wanted (the previous one) stays the most likely."""
    out = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=6, ignore_eos=True, frequency_penalty=2.0, logprobs=2))
    ids = out.token_ids
    assert not _has_repeat(ids)
    for pos in range(1, 6):
        lp = out.logprobs[pos]
        assert ids[pos] in lp and max(lp, key=lp.get) == ids[pos - 1]


def test_negative_frequency_penalty_encourages_repeats(tiny_llm, reference):
    assert not _has_repeat(reference[0][:10])
    out = gen1(tiny_llm, PROMPT, greedy(max_tokens=10, frequency_penalty=-2.0)).token_ids
    assert out[0] == reference[0][0] and out == [out[0]] * 10


def test_repetition_penalty_covers_prompt_tokens(echo_llm, tokenizer):
    prompt_ids = set(tokenizer.encode(ECHO_PROMPT, add_special_tokens=True))
    assert ECHO_TOKEN in prompt_ids
    out = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=10, ignore_eos=True, repetition_penalty=10.0)).token_ids
    assert not prompt_ids & set(out) and not _has_repeat(out)


PREFIX = list(range(1000, 1040))  # 40 tokens: a later request can reuse 2 full blocks


def test_penalties_survive_prefix_cache_hits(echo_llm):
    """A prefix-cache hit starts the request past position 0; the sampler must still see the
    whole history (regression: after a hit, penalties saw a shifted token list)."""
    echo_llm.generate([PREFIX], greedy(max_tokens=1), use_tqdm=False)  # fill the prefix cache
    for sp in (greedy(max_tokens=8, frequency_penalty=2.0, ignore_eos=True),
               greedy(max_tokens=8, presence_penalty=2.0, ignore_eos=True),
               greedy(max_tokens=8, repetition_penalty=10.0, ignore_eos=True)):
        out = echo_llm.generate([PREFIX], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 32
        assert not _has_repeat(out.outputs[0].token_ids), sp
        if sp.repetition_penalty != 1.0:
            assert not set(PREFIX) & set(out.outputs[0].token_ids)


def test_min_tokens_survives_prefix_cache_hits(tiny_llm):
    ref = gen1(tiny_llm, PREFIX, greedy(max_tokens=4)).token_ids
    assert ref[1] != ref[0]
    out = tiny_llm.generate([PREFIX], greedy(max_tokens=8, stop_token_ids=[ref[1]], min_tokens=1),
                            use_tqdm=False)[0]
    assert out.num_cached_tokens == 32
    assert out.outputs[0].token_ids == ref[:2] and out.outputs[0].finish_reason == "stop"


def test_prefix_cache_hit_gives_same_greedy_output(tiny_llm):
    prompt = list(range(3000, 3050))
    first = tiny_llm.generate([prompt], greedy(max_tokens=12), use_tqdm=False)[0]
    # a batch mixing a hit on the same prompt, a partial hit and a miss
    outs = tiny_llm.generate([prompt, prompt[:20] + [5, 6, 7], prompt[:33] + [9] * 20],
                             greedy(max_tokens=12), use_tqdm=False)
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


# --------------------------------------------------------------------------- incremental detokenizer

TRICKY = "Hello 世界! 😀🎉 naïve café – ok 👩‍👩‍👧 Ελληνικά, ₿ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢."


def feed(tokenizer, prompt_ids, out_ids, params=None):
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params or SamplingParams())
    deltas, stop = [], None
    for t in out_ids:
        stop = detok.update([t])
        deltas.append(detok.delta(finished=stop is not None))
        if stop is not None:
            break
    if stop is None:
        deltas.append(detok.delta(finished=True))
    return deltas, stop, detok


def test_detokenizer_multibyte_one_token_at_a_time(tokenizer):
    ids = tokenizer.encode(TRICKY, add_special_tokens=False)
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)  # some characters span several tokens
    deltas, stop, _ = feed(tokenizer, tokenizer.encode("Say:", add_special_tokens=True), ids)
    assert stop is None
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == TRICKY


def test_detokenizer_stop_string_and_special_tokens(tokenizer):
    ids = tokenizer.encode(TRICKY, add_special_tokens=False)
    deltas, stop, detok = feed(tokenizer, [1], ids, SamplingParams(stop=["🎉 naïve", "never"]))
    assert stop == "🎉 naïve" and "".join(deltas) == "Hello 世界! 😀"
    assert not any("\ufffd" in d for d in deltas)
    eos = tokenizer.eos_token_id
    hello = tokenizer.encode("Hello there", add_special_tokens=False)
    deltas, _, _ = feed(tokenizer, [1], hello + [eos])
    assert "".join(deltas) == "Hello there"
    deltas, _, _ = feed(tokenizer, [1], hello + [eos], SamplingParams(skip_special_tokens=False))
    assert "".join(deltas) == "Hello there" + tokenizer.decode([eos]) == "Hello there<|im_end|>"


PIECES = st.sampled_from(list("ab yz.,\n\t") + list("éüß") + list("世界中文") + ["😀", "🎉", "👍🏽", "👩\u200d👧", "𝔘"])
TEXTS = st.lists(PIECES, min_size=1, max_size=20).map("".join)


@settings(max_examples=60, deadline=None)
@given(prompt=TEXTS, text=TEXTS)
def test_detokenizer_property(tokenizer, prompt, text):
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=True)
    ids = tokenizer.encode(text, add_special_tokens=False)
    deltas, _, _ = feed(tokenizer, prompt_ids, ids)
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
