"""Penalties and EOS on a tiny tied-embedding Llama that echoes its last input token (module
fixture), which makes repetition (and so penalties) and EOS easy to provoke: EOS stops unless
ignored or before ``min_tokens``; frequency, presence and repetition penalties; logprobs stay the
model's raw ones under penalties; penalties see the whole history after a prefix-cache hit.
"""

from __future__ import annotations

from collections import Counter

import pytest

from _features_helpers import PREFIX, _has_repeat, assert_engine_empty, gen1, greedy
from kvserve.engine import LLM
from tiny_models import make_tiny_model

ECHO_PROMPT = "Hello there, how are you"  # the tied model repeats " you" (token 346) forever
ECHO_TOKEN = 346


@pytest.fixture(scope="module")
def echo_llm(tmp_path_factory):
    """Tied-embedding tiny Llama whose EOS is " you": greedy on ECHO_PROMPT emits EOS first."""
    path = make_tiny_model(
        tmp_path_factory.mktemp("tiny_echo"), arch="llama", tie_word_embeddings=True, eos_token_id=ECHO_TOKEN
    )
    llm = LLM(model=str(path), block_size=16, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64)
    assert ECHO_TOKEN in llm.engine.eos_token_ids
    yield llm
    llm.engine.shutdown()


def test_eos_stops_and_ignore_eos(echo_llm):
    final = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=12))
    assert final.token_ids == [ECHO_TOKEN] and final.finish_reason == "stop" and final.stop_reason is None
    final = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=12, ignore_eos=True))
    assert final.token_ids == [ECHO_TOKEN] * 12 and final.finish_reason == "length"
    final = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=12, min_tokens=3))
    assert len(final.token_ids) >= 3 and ECHO_TOKEN not in final.token_ids[:3]
    assert_engine_empty(echo_llm)


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


def test_repetition_penalty_covers_prompt_tokens(echo_llm, tokenizer):
    prompt_ids = set(tokenizer.encode(ECHO_PROMPT, add_special_tokens=True))
    assert ECHO_TOKEN in prompt_ids
    out = gen1(echo_llm, ECHO_PROMPT, greedy(max_tokens=10, ignore_eos=True, repetition_penalty=10.0)).token_ids
    assert not prompt_ids & set(out) and not _has_repeat(out)


def test_penalties_survive_prefix_cache_hits(echo_llm):
    """A prefix-cache hit starts the request past position 0; the sampler must still see the
    whole history (regression: after a hit, penalties saw a shifted token list)."""
    echo_llm.generate([PREFIX], greedy(max_tokens=1), use_tqdm=False)  # fill the prefix cache
    for sp in (
        greedy(max_tokens=8, frequency_penalty=2.0, ignore_eos=True),
        greedy(max_tokens=8, presence_penalty=2.0, ignore_eos=True),
        greedy(max_tokens=8, repetition_penalty=10.0, ignore_eos=True),
    ):
        out = echo_llm.generate([PREFIX], sp, use_tqdm=False)[0]
        assert out.num_cached_tokens == 32
        assert not _has_repeat(out.outputs[0].token_ids), sp
        if sp.repetition_penalty != 1.0:
            assert not set(PREFIX) & set(out.outputs[0].token_ids)
