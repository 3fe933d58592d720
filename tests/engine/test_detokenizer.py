"""The incremental detokenizer (``kvserve/engine/detokenizer.py``) on SmolLM2's tokenizer: multi-byte
characters split over tokens never stream a replacement character, stop strings and special
tokens, and a property test that the deltas add up to the decoded text."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.engine import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer


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
