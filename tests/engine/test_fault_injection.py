"""Fault injection (``tests/faults.py``) into the engine's hooks, on a tiny random-weight Llama in float32.

Each per-request hook of ``LLMEngine.step`` (proposer, draft-length policy, grammar fill and
advance, detokenization and stop strings, logprobs, prompt logprobs, output assembly) raises on
one request of a batch: that request alone fails (or, for a proposer, goes on without drafts,
its output unchanged); the others produce what they produce without the fault; every KV block
comes back. Broken stat and request loggers affect nobody. A draft-model proposer that fails
turns drafting off for the one request that fails alone, and a timer that returns NaN, negative
or enormous step times changes no output. The fuzzer that arms these faults at random, over
random configurations and request streams, is ``test_engine_fuzz.py``.
"""

from __future__ import annotations

import math
import time

import pytest

from _robustness_helpers import DTYPE, MAX_MODEL_LEN, STRUCTURED, assert_idle, greedy_verdict
from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from faults import DRAFTING_HOOKS, FAILING_HOOKS, HOOKS, LOGGER_HOOKS, Faults


def _batch(engine: LLMEngine, tag: str, hook: str):
    """Four greedy requests with every per-request hook live: repetitive prompts (n-gram
    drafts), logprobs, prompt logprobs, a stop string that does not occur; a grammar for the
    grammar hooks (such requests do not draft)."""
    grammar = hook.startswith("grammar")
    prompts = ["la la la la la la la la", "1 2 3 1 2 3 1 2 3 1 2 3", "a b a b a b a b a b", "the cat the cat the cat"]
    params = [
        SamplingParams(
            temperature=0.0,
            max_tokens=12,
            ignore_eos=True,
            logprobs=2,
            prompt_logprobs=1,
            stop=["@@@@"],
            structured_outputs=STRUCTURED[2] if grammar else None,
        )
        for _ in prompts
    ]
    return [engine.make_request(f"{tag}{i}", p, params[i]) for i, p in enumerate(prompts)]


def _run(engine, reqs):
    for r in reqs:
        engine.enqueue(r)
    done = {}
    for _ in range(1000):
        for out in engine.step():
            assert out.request_id not in done, f"{out.request_id} produced output after it ended"
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests never finished")


@pytest.fixture(scope="module")
def spec_engine(tiny_llama_path):
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_path),
            dtype=DTYPE,
            block_size=8,
            max_num_seqs=8,
            max_num_batched_tokens=128,
            num_kv_blocks=64,
            max_model_len=MAX_MODEL_LEN,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
        )
    )
    yield eng
    eng.shutdown()


@pytest.mark.parametrize("hook", HOOKS)
def test_a_hook_that_raises_affects_one_request(spec_engine, hook):
    eng = spec_engine
    want = _run(eng, _batch(eng, f"ref-{hook}-", hook))
    assert_idle(eng)
    drafts0 = eng.speculator.counts["num_draft_tokens"]
    proposer, policy_fn = eng.speculator.proposer, eng.speculator.policy.draft_length
    loggers = (list(eng.stat_loggers), list(eng.request_loggers))
    faults = Faults(eng)
    try:
        reqs = _batch(eng, f"run-{hook}-", hook)
        victim = reqs[2].request_id
        if hook in LOGGER_HOOKS:
            faults.break_loggers()
        else:
            faults.arm_future(hook, lambda r: r.request_id == victim)
        got = _run(eng, reqs)
    finally:
        eng.speculator.proposer, eng.enqueue = proposer, LLMEngine.enqueue.__get__(eng)
        eng.speculator.policy.draft_length = policy_fn
        eng.stat_loggers[:], eng.request_loggers[:] = loggers
    assert faults.fired, f"the {hook} fault never fired"
    if hook not in LOGGER_HOOKS:
        assert {rid for _, rid in faults.fired} == {victim}
    for i in range(4):
        out, ref = got[f"run-{hook}-{i}"], want[f"ref-{hook}-{i}"]
        c = out.outputs[0]
        if hook in FAILING_HOOKS and i == 2:
            assert c.finish_reason == "error" and "injected fault" in out.error, (c.finish_reason, out.error)
            continue
        assert out.error is None and c.finish_reason == ref.outputs[0].finish_reason
        assert greedy_verdict(c.token_ids, ref.outputs[0].token_ids, ref.outputs[0].logprobs) in ("equal", "tie")
        assert len(c.logprobs) == len(c.token_ids) and len(out.prompt_logprobs) == len(out.prompt_token_ids)
    if hook in DRAFTING_HOOKS:
        assert eng.speculator.counts["num_draft_tokens"] > drafts0  # the others still drafted
    assert_idle(eng)


def test_a_failing_draft_model_turns_drafting_off_for_that_request(tiny_llama_path, tmp_path):
    """The draft-model proposer runs a batch; when it raises, each request is retried alone
    and only the one that fails alone loses its drafts (a draft model of the same weights
    drafts what the target picks, so outputs must equal the reference's)."""
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_llama_path),
            dtype=DTYPE,
            block_size=8,
            max_num_seqs=8,
            num_kv_blocks=64,
            max_model_len=MAX_MODEL_LEN,
            speculative_config={
                "method": "draft_model",
                "model": str(tiny_llama_path),
                "num_speculative_tokens": 2,
                "adaptive": False,
            },
        )
    )
    try:
        want = _run(eng, _batch(eng, "ref", "propose"))
        faults = Faults(eng)
        reqs = _batch(eng, "run", "propose")
        faults.arm_future("propose", lambda r: r.request_id == "run1")
        got = _run(eng, reqs)
        assert {rid for _, rid in faults.fired} == {"run1"}
        for i in range(4):
            assert got[f"run{i}"].error is None
            assert got[f"run{i}"].outputs[0].token_ids == want[f"ref{i}"].outputs[0].token_ids
        assert reqs[1].spec_disabled and not any(r.spec_disabled for r in reqs if r is not reqs[1])
        assert eng.speculator.proposer.shadows == {}
        assert_idle(eng)
    finally:
        eng.shutdown()


def test_step_survives_a_broken_timer(spec_engine):
    """Step times that are NaN, negative or enormous feed the draft-length policy and the
    mixed-step budget; the engine goes on and outputs do not change."""
    eng = spec_engine
    want = _run(eng, _batch(eng, "tref", "propose"))
    values = iter([math.nan, -5.0, 1e300, 0.0, math.inf, -math.inf] * 1000)
    eng.clock = lambda: next(values)
    try:
        got = _run(eng, _batch(eng, "trun", "propose"))
    finally:
        eng.clock = time.monotonic
    for i in range(4):
        assert got[f"trun{i}"].outputs[0].token_ids == want[f"tref{i}"].outputs[0].token_ids
    assert_idle(eng)
