"""Per-step work sized by the request (issue 63): stop strings bounded and matched in one regex
search per step (``kvserve/engine/detokenizer.py``), ``logit_bias`` bounded and kept as tensors
built once at admission (``kvserve/engine/input_batch.py``, ``kvserve/engine/layers/sampler.py``),
and a lone surrogate in a prompt a ``ValueError`` of the engine's Python API."""

from __future__ import annotations

import random

import pytest
import torch

from kvserve.engine import SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.input_batch import update_states
from kvserve.engine.input_processor import InputProcessor, encode_prompt
from kvserve.engine.layers.sampler import apply_logit_bias
from kvserve.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from kvserve.engine.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput


# ---------------------------------------------------------------------------- stop strings
def reference_stops(texts: list[str], stops: list[str], include: bool) -> tuple[str | None, str]:
    """The old matcher (a ``str.find`` per stop string per step, the smallest index kept, ties
    to the earlier string) over the text after each step: ``(stop, final text)``."""
    hold_back = max(len(s) for s in stops) - 1
    before = 0
    for text in texts:
        if len(text) == before:
            continue
        best = None
        for s in stops:
            i = text.find(s, max(0, before - hold_back))
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is not None:
            i, s = best
            return s, text[: i + len(s) if include else i]
        before = len(text)
    return None, texts[-1] if texts else ""


def test_one_pass_matcher_equals_the_per_string_search(tokenizer):
    """Random texts and stop lists (substrings of the text, overlapping, sharing prefixes, regex
    metacharacters, one spanning many tokens, several tokens per update as with drafts): the
    stop string found, the text kept and the streamed deltas are the old matcher's."""
    rng = random.Random(63)
    alphabet = list("ab.*+?()[]|\\^$ {}") + ["é", "世", "😀", "\n"]
    prompt = tokenizer.encode("Say:", add_special_tokens=True)
    cases = 0
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        ids = tokenizer.encode(text, add_special_tokens=False)
        full = tokenizer.decode(ids)
        stops = []
        for _ in range(rng.randint(1, 8)):
            if rng.random() < 0.8 and full:
                i = rng.randrange(len(full))
                stops.append(full[i : i + rng.randint(1, 6)])
            else:
                stops.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))))
        include = rng.random() < 0.5
        # the text after each update, from a detokenizer without stop strings
        plain = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
        chunks, j = [], 0
        while j < len(ids):
            k = rng.randint(1, 3)
            chunks.append(ids[j : j + k])
            j += k
        texts = []
        for c in chunks:
            plain.update(c)
            texts.append(plain.text)
        want_stop, want_text = reference_stops(texts, stops, include)
        params = SamplingParams(stop=stops, include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, prompt, params)
        got_stop, deltas = None, []
        for c in chunks:
            got_stop = detok.update(c)
            deltas.append(detok.delta(finished=got_stop is not None))
            if got_stop is not None:
                break
        if got_stop is None:
            deltas.append(detok.delta(finished=True))
        assert (got_stop, detok.text) == (want_stop, want_text), (text, stops, include)
        assert "".join(deltas) == want_text
        cases += want_stop is not None
    assert cases > 100  # most cases stop somewhere


class _CountingPattern:
    """A compiled pattern that counts its searches (the thing counted, not replaced: it delegates)."""

    def __init__(self, pattern):
        self.pattern, self.searches = pattern, 0

    def search(self, *args):
        self.searches += 1
        return self.pattern.search(*args)


@pytest.mark.parametrize("n_stops", [1, MAX_STOP_STRINGS])
def test_one_regex_search_per_step_whatever_the_number_of_stop_strings(tokenizer, n_stops):
    """The work per step does not grow with the stop list: one compiled alternation of all the
    strings, searched once per update that added text (counted, not timed)."""
    stops = [f"zq{i:03d}x" for i in range(n_stops)]
    detok = IncrementalDetokenizer(tokenizer, [1], SamplingParams(stop=stops))
    assert sorted(detok.matcher.pattern.pattern.split("|")) == sorted(stops)  # one pattern holds every string
    counter = detok.matcher.pattern = _CountingPattern(detok.matcher.pattern)
    ids = tokenizer.encode("hello there, a plain text with no stop in it " * 3, add_special_tokens=False)
    grew = 0
    for t in ids:
        before = len(detok.text)
        assert detok.update([t]) is None
        grew += len(detok.text) > before
    assert grew > 20 and counter.searches == grew


def test_stop_string_limits_are_value_errors():
    SamplingParams(stop=["s"] * MAX_STOP_STRINGS, detokenize=True)
    SamplingParams(stop=["x" * MAX_STOP_STRING_CHARS])
    with pytest.raises(ValueError, match=rf"^stop has {MAX_STOP_STRINGS + 1} strings; at most {MAX_STOP_STRINGS}"):
        SamplingParams(stop=["s"] * (MAX_STOP_STRINGS + 1))
    with pytest.raises(ValueError, match=rf"^stop strings must be at most {MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=["x" * (MAX_STOP_STRING_CHARS + 1)])


def test_stop_token_ids_are_bounded_and_looked_up_in_a_set():
    from kvserve.engine.request import Request
    from kvserve.engine.sampling_params import MAX_STOP_TOKEN_IDS

    SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    with pytest.raises(ValueError, match=rf"^stop_token_ids has {MAX_STOP_TOKEN_IDS + 1} ids; at most "):
        SamplingParams(stop_token_ids=list(range(MAX_STOP_TOKEN_IDS + 1)))
    req = Request("r", [1, 2], SamplingParams(stop_token_ids=[7, 9], max_tokens=5), eos_token_ids={0})
    assert req.stop_token_ids == {7, 9}
    for tok, stops in ((5, False), (9, True)):
        req.all_token_ids.append(tok)
        assert req.check_stop_token() is stops
    assert req.stop_reason == 9


# ---------------------------------------------------------------------------- logit_bias
def test_logit_bias_tensors_are_built_once_and_add_exactly_the_bias():
    """Rows from the runner's real admission path (``update_states``): the bias tensors are
    the same objects at every step (built at admission, not rebuilt from the dict), and the
    logits after :func:`apply_logit_bias` equal ``logits + bias`` at the biased ids of each row,
    rows without a bias untouched."""
    rng = random.Random(7)
    vocab = 500
    params = [
        SamplingParams(logit_bias={t: rng.uniform(-100, 100) for t in rng.sample(range(vocab), k)})
        for k in (MAX_LOGIT_BIAS // 4, 1, 0, 37)
    ]
    states, pooling = {}, set()
    sched = SchedulerOutput(
        requests=[
            ScheduledRequest(f"r{i}", [5, 6, 7], 0, [0], True, new=NewRequestData(f"r{i}", [5, 6, 7], p))
            for i, p in enumerate(params)
        ]
    )
    rows = update_states(states, pooling, sched, torch.device("cpu"), {0})
    first = [r.logit_bias for r in rows]
    assert first[2] is None and all(isinstance(t[0], torch.Tensor) for t in first if t is not None)
    step2 = SchedulerOutput(requests=[ScheduledRequest(f"r{i}", [9], 3, [0], True) for i in range(len(params))])
    rows = update_states(states, pooling, step2, torch.device("cpu"), {0})
    assert all(a is b for a, b in zip(first, (r.logit_bias for r in rows)))  # built once per request
    logits = torch.randn(len(rows), vocab)
    want = logits.clone()
    for i, p in enumerate(params):
        for t, b in (p.logit_bias or {}).items():
            want[i, t] += b
    apply_logit_bias(logits, rows)
    torch.testing.assert_close(logits, want, rtol=0, atol=1e-5)


def test_logit_bias_limit_and_vocabulary(tokenizer):
    bias = {t: 1.0 for t in range(MAX_LOGIT_BIAS)}
    assert len(SamplingParams(logit_bias=bias).logit_bias) == MAX_LOGIT_BIAS
    with pytest.raises(ValueError, match=rf"^logit_bias has {MAX_LOGIT_BIAS + 1} entries; at most {MAX_LOGIT_BIAS}"):
        SamplingParams(logit_bias={**bias, MAX_LOGIT_BIAS: 1.0})
    proc = InputProcessor(tokenizer, vocab_size=100, eos_token_ids={0}, max_model_len=64)
    with pytest.raises(ValueError, match=r"^logit_bias keys must be token ids in \[0, 100\)"):
        proc.process_inputs("r", [1, 2], SamplingParams(logit_bias={100: 1.0}))


# ---------------------------------------------------------------------------- lone surrogates
def test_lone_surrogate_in_a_prompt_is_a_value_error(tokenizer):
    """The tokenizer raises a TypeError on such text (a 500 upstream); the engine's API names it."""
    proc = InputProcessor(tokenizer, vocab_size=len(tokenizer), eos_token_ids={0}, max_model_len=64)
    with pytest.raises(ValueError, match=r"^prompt holds a lone surrogate \(U\+D800 at character 3\)"):
        proc.process_inputs("r", "hi \ud800 there")
    with pytest.raises(ValueError, match="^prompt holds a lone surrogate"):
        encode_prompt(tokenizer, {"prompt": "\udfff"})
    with pytest.raises(ValueError, match="^messages holds a lone surrogate"):
        proc.chat_template_ids([{"role": "user", "content": "a\udc00"}])
    assert proc.tokenize("a pair is fine \U0001f600") == encode_prompt(tokenizer, "a pair is fine \U0001f600")


# ---------------------------------------------------------------------------- tokenizer lanes
def test_a_large_prompt_does_not_hold_up_small_ones():
    """While a job with a large prompt runs (held on an event, not timed), small prompts' jobs
    run to completion in the other lane; large jobs queue behind each other."""
    import threading

    from kvserve.engine.tokenizer_pool import TokenizerPool

    pool = TokenizerPool(workers=1, large_workers=1, large_chars=1000)
    release, started = threading.Event(), threading.Event()

    def work(prompt, hold=False):
        if hold:
            started.set()
            assert release.wait(60)
        return len(prompt), threading.current_thread().name

    try:
        big = pool.submit(work, "x" * 5000, hold=True)
        assert started.wait(60)
        small = [pool.submit(work, "hi") for _ in range(5)]
        chat = pool.submit(work, [{"role": "user", "content": "short"}])
        assert [f.result(timeout=60)[0] for f in small] == [2] * 5 and chat.result(timeout=60)[0] == 1
        assert not big.done()  # still held: the small ones did not wait for it
        big2 = pool.submit(work, ["y" * 600, "z" * 600])  # over the limit in total: the large lane
        assert not big2.done()
        release.set()
        assert big.result(timeout=60)[1].startswith("kvserve-tokenize-large")
        assert big2.result(timeout=60)[1].startswith("kvserve-tokenize-large")
        assert small[0].result()[1].startswith("kvserve-tokenize-small")
    finally:
        release.set()
        pool.shutdown()


def test_each_thread_tokenizes_with_its_own_tokenizer(tokenizer):
    import threading

    proc = InputProcessor(tokenizer, vocab_size=len(tokenizer), eos_token_ids={0}, max_model_len=64)
    seen, barrier = [], threading.Barrier(3)

    def use():
        tok = proc.tokenizer
        barrier.wait(60)  # all three alive at once: no id reuse
        seen.append(tok)
        assert proc.tokenizer is tok and proc.tokenize("hello") == tokenizer.encode("hello")

    threads = [threading.Thread(target=use) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(t) for t in seen}) == 3 and sum(t is tokenizer for t in seen) <= 1


def test_a_prompt_too_long_by_its_bytes_is_refused_before_tokenizing(tokenizer):
    """SmolLM2's tokenizer is byte-level BPE without a normalizer: a token covers at most its
    longest vocabulary entry's bytes, so more bytes than ``max_model_len`` times that cannot fit;
    such a prompt never reaches the tokenizer."""
    from kvserve.engine.input_processor import PromptTooLongError, max_token_bytes

    per = max_token_bytes(tokenizer)
    longest = max(len(t) for t in tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False))
    assert per is not None and per >= longest
    proc = InputProcessor(tokenizer, vocab_size=len(tokenizer), eos_token_ids={0}, max_model_len=64)
    encodes = []
    real = proc.tokenizer.encode
    proc.tokenizer.encode = lambda *a, **k: encodes.append(1) or real(*a, **k)
    with pytest.raises(PromptTooLongError, match=rf"more than 64 tokens .*at most {per} bytes"):
        proc.tokenize("a" * (per * 64 + 1))
    with pytest.raises(PromptTooLongError):
        proc.process_inputs("r", "é" * (per * 32 + 1))
    with pytest.raises(PromptTooLongError):
        proc.chat_template_ids([{"role": "user", "content": "b" * (per * 64)}])
    assert encodes == []
    # the bound is sound: the longest possible tokens, back to back, fit when the bytes do
    ids = tokenizer.encode(" " * (per * 64 - 1000), add_special_tokens=False)
    assert len(ids) * per >= per * 64 - 1000


def test_warm_starts_every_lane_thread_and_runs_the_set_up_once_in_each():
    # the front warms its tokenizer pool at start (each thread's tokenizer copy): the first
    # requests' TTFT does not pay for them (the A/B report's TTFT p95, test_experiment_report_live)
    import threading

    from kvserve.engine.tokenizer_pool import TokenizerPool

    seen, lock = [], threading.Lock()

    def set_up():
        with lock:
            seen.append(threading.get_ident())

    pool = TokenizerPool(workers=3, large_workers=2)
    try:
        pool.warm(set_up)
        assert len(seen) == 5 and len(set(seen)) == 5
        # later jobs run in those threads: no thread is started (and set up) on a request's path
        assert {pool.submit(threading.get_ident).result() for _ in range(20)} <= set(seen)
    finally:
        pool.shutdown()


# ---------------------------------------------------------------------------- long prompts
def test_a_prompt_far_over_the_context_is_refused_after_tokenizing_a_prefix_only(tokenizer):
    """A prompt just under the byte bound (which check_prompt_bytes lets through) but far over
    ``max_model_len`` in tokens is refused once its prefix of ``PREFIX_CHARS_PER_TOKEN *
    max_model_len`` characters is counted: the tokenizer never sees the whole text."""
    from kvserve.engine.input_processor import PREFIX_CHARS_PER_TOKEN, PromptTooLongError

    proc = InputProcessor(tokenizer, vocab_size=len(tokenizer), eos_token_ids={0}, max_model_len=64)
    per = proc.max_token_bytes
    text = ("the quick brown fox jumps over the lazy dog " * (per * 64 // 44 + 1))[: per * 64 - 200]
    seen = []
    real = proc.tokenizer.encode
    proc.tokenizer.encode = lambda t, *a, **k: seen.append(len(t)) or real(t, *a, **k)
    for call in (
        lambda: proc.tokenize(text),
        lambda: proc.process_inputs("r", text),
        lambda: proc.chat_template_ids([{"role": "user", "content": text}]),
    ):
        seen.clear()
        with pytest.raises(PromptTooLongError, match=r"more than 64 tokens \(its first \d+ characters alone"):
            call()
        assert seen and max(seen) <= PREFIX_CHARS_PER_TOKEN * 64 < len(text) // 9  # a ninth of it, at most
    # a text over the prefix length that fits (15 characters per token) is counted by its
    # prefix, then tokenized whole: the result is the tokenizer's own
    fits = " administration" * 60
    assert len(fits) > PREFIX_CHARS_PER_TOKEN * 64 and len(real(fits, add_special_tokens=True)) < 64
    seen.clear()
    assert proc.tokenize(fits) == real(fits, add_special_tokens=True)
    assert len(seen) == 2 and seen[0] <= PREFIX_CHARS_PER_TOKEN * 64 and seen[1] == len(fits)


_PIECES = [
    "a",
    "b",
    "Z",
    "é",
    "字",
    "🙂",
    "7",
    "42",
    "1234",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\r\n",
    "'s",
    "'ll",
    ",",
    ".",
    "!?",
    "-",
    "_",
    "(",
    ")",
    "\u00a0",
    "\u3000",
    "<|im_start|>",
    "<|endoftext|>",
    "don",
    "word",
]


def test_the_prefix_rule_never_refuses_a_prompt_that_fits(tokenizer):
    """Soundness of check_prompt_prefix over many random texts of letters, digits, runs of every
    kind of whitespace, contractions, punctuation, non-Latin scripts, emoji and special tokens:
    whenever it refuses, the whole text really has more than ``max_model_len`` tokens (HF's
    own count, special tokens included)."""
    from kvserve.engine.input_processor import PREFIX_CHARS_PER_TOKEN, PromptTooLongError

    rng = random.Random(63)
    procs = {
        n: InputProcessor(tokenizer, vocab_size=len(tokenizer), eos_token_ids={0}, max_model_len=n)
        for n in (2, 3, 5, 8)
    }
    refused = 0
    for _ in range(3000):
        n = rng.choice(list(procs))
        # mostly long runs of one or two pieces (many chars per token: the prefix rule's case)
        pool = rng.sample(_PIECES, rng.choice([1, 2, 3, 6]))
        text = "".join(rng.choice(pool) for _ in range(rng.randint(1, 8 * PREFIX_CHARS_PER_TOKEN * n)))
        try:
            procs[n].check_prompt_prefix(text)
        except PromptTooLongError:
            refused += 1
            assert len(tokenizer.encode(text, add_special_tokens=True)) > n, repr(text)
    assert refused > 300  # the rule was exercised, not only skipped


def test_the_large_lane_runs_at_the_lowest_cpu_priority():
    """The large lane's threads run at nice 19 (so a big prompt's tokenizing takes no core the
    engine wants); the small lane's at the process's own priority."""
    import os
    import threading
    import sys

    from kvserve.engine.tokenizer_pool import LARGE_LANE_NICE, TokenizerPool

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread nice values are Linux's")

    def nice():
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    base = os.getpriority(os.PRIO_PROCESS, 0)
    pool = TokenizerPool(workers=1, large_workers=2, large_chars=10)
    try:
        assert pool.submit(nice).result() == base  # no text: the small lane
        assert pool.submit(lambda _t: nice(), "x" * 11).result() == LARGE_LANE_NICE == 19
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == base  # the caller unchanged
    finally:
        pool.shutdown()
    plain = TokenizerPool(large_chars=10, large_nice=None)
    try:
        assert plain.submit(lambda _t: nice(), "x" * 11).result() == base
    finally:
        plain.shutdown()
