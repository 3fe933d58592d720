"""The engine never dies from a request, a timing or a setting (tiny random-weight Llama, float32).

1. Fault injection (``tests/faults.py``): each per-request hook of ``LLMEngine.step`` (proposer,
   draft-length policy, grammar fill and advance, detokenization and stop strings, logprobs,
   prompt logprobs, output assembly) raises on one request of a batch: that request alone fails
   (or, for a proposer, goes on without drafts, its output unchanged); the others produce what
   they produce without the fault; every KV block comes back. Broken stat and request loggers
   affect nobody.
2. Property-based fuzzing (hypothesis, stateful): random engine configurations (block size,
   ``max_num_seqs``, token budget, KV pools small enough to preempt, prefix caching, mixed-step
   caps, n-gram speculation adaptive or not, fp8 KV cache, int8 weights, attention backend,
   scheduling policy, LoRA with one or two adapter slots for three PEFT adapters) x random
   request streams (arrivals, aborts mid-flight, priorities, stop strings and stop ids,
   ``max_tokens`` 0/1/large/None, ``min_tokens``, logprobs, prompt logprobs, seeds, penalties,
   structured outputs, repetitive n-gram-friendly and shared-prefix prompts, LoRA adapters,
   embedding (pooling) requests, faults injected into a random request's hook) x a fake clock
   that feeds noise (jumps back, stalls, NaN) to every timing-driven policy. Each configuration
   also starts with one short request per per-request hook it has (the drafting hooks only with
   speculation), its parameters made to reach that hook (a grammar for the grammar hooks,
   logprobs, prompt logprobs, detokenization, no grammar for the drafting hooks) and its fault
   armed after 0-2 good calls; those requests are never aborted, so the hook is reached.
   After every step: ``step()`` raised nothing, the engine's requests are exactly those not yet
   ended, block reference counts equal the block tables' references. At the end: every request
   ended exactly once, the pool is whole, only requests whose fault fired failed, each greedy
   request's tokens equal those of a reference engine (no speculation, no prefix caching, one
   roomy configuration, same weights, adapters and KV dtype, float32), up to a near-tie in the
   reference's logits (top-2 log-probability gap below :data:`TIE`, by KV dtype) where batching may round
   either way, and each embedding equals the reference engine's (cosine at least
   :data:`POOL_COS`).
   Across the run every fault kind of :data:`faults.HOOKS` must have fired at least once, or
   the test fails (a fuzzer whose faults never fire checks nothing).
3. The same request streams through :class:`engine.async_engine.AsyncLLMEngine` (a smaller
   hypothesis test): concurrent streams read to the end, cancelled by the client after their
   first output, aborted by the server after their first output, or embedding requests, some
   with a fault armed. Every stream's deltas add up to its tokens and it ends once (an
   ``abort`` output, a ``RuntimeError`` for a fired fault and only then); greedy tokens and
   embeddings equal the reference's; afterwards the engine is idle with every block back.
4. Tensor and pipeline parallelism (Ray actors, gloo): the fuzzer of 2. over TP=2 / PP=2
   configurations, opt-in (``KVSERVE_FUZZ_PARALLEL=1``; skipped otherwise: it starts Ray and
   takes minutes).

Budget: ``KVSERVE_FUZZ_EXAMPLES`` engine configurations (default 10 in the fast test profile,
20 in the thorough one, ``tests/helpers.py``; derandomized: the same examples every run) of
``KVSERVE_FUZZ_STEPS`` rules each (default 25); the async test ``KVSERVE_FUZZ_ASYNC_EXAMPLES``
(default 3, thorough 6); the parallel one ``KVSERVE_FUZZ_PARALLEL_EXAMPLES`` (default 4). A
longer, randomized run:
``KVSERVE_FUZZ_EXAMPLES=400 KVSERVE_FUZZ_RANDOM=1 make test PYTEST_ARGS=tests/engine/test_engine_robustness.py``
(``KVSERVE_FUZZ_SHRINK=1`` shrinks a failure to a minimal example).
The totals (with each hook's armed and fired counts) are printed (``-s``) and written to
``$KVSERVE_FUZZ_REPORT`` when set, with their provenance (``benchmarks.common.Results``: commit,
machine, command, load average before and after).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import os
import random
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from engine.pooling import PoolingParams
from faults import DRAFTING_HOOKS, FAILING_HOOKS, HOOKS, LOGGER_HOOKS, Faults
from helpers import sized
from tiny_models import run_async_engine

#: How far below the reference's best log-probability a greedy token may be where it parts
#: from the reference (a near tie), by KV cache dtype: float32 rounding differs with batch
#: composition, chunking and attention backend. None: not compared token for token. With fp8,
#: a chunk attends to its own tokens' exact K/V and to earlier chunks' (and prefix-cache hits')
#: float8 K/V, so where a prompt was cut (which depends on what else is scheduled) moves the
#: logits by float8's noise, and the random tiny model's distributions are so flat that such
#: noise reorders its top-5 (seen: a first token outside the one-chunk reference's top-5).
#: float8 accuracy is checked where the schedule is known: tests/engine/test_kv_fp8.py (HF
#: replaying the engine's schedule with float8 rounding, token for token; SmolLM2's answers and
#: perplexity; an adapter's K/V not clamped).
TIE = {"auto": 1e-4, "fp8": None}
#: Least cosine similarity of an embedding to the reference engine's (float32; chunked prefill,
#: prefix-cache hits and batch composition round differently), by KV cache dtype: with fp8, a
#: prompt prefilled in chunks attends to its earlier chunks' float8 K/V, where the reference's
#: one-chunk prefill attends to them unquantized, and where a prompt is cut depends on what
#: else is scheduled (on timing, in the async engine). With random LoRA adapters (deltas of the
#: order of the weights, far from a trained adapter's) at 1- to 4-token chunks it fell to 0.967,
#: so for fp8 this only catches gross faults (another request's rows or adapter: cosine near
#: 0); float8 accuracy is test_kv_fp8's (an adapter's embedding at 4-token chunks >= 0.999).
POOL_COS = {"auto": 0.9999, "fp8": 0.9}
#: What :func:`greedy_verdict` may say of a fuzzed request.
OK_VERDICTS = ("equal", "tie", "not compared")
MAX_MODEL_LEN = 64
EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", sized(10, 20)))
STEPS = int(os.environ.get("KVSERVE_FUZZ_STEPS", "25"))
ASYNC_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_ASYNC_EXAMPLES", sized(3, 6)))
PARALLEL = os.environ.get("KVSERVE_FUZZ_PARALLEL") == "1"
PARALLEL_EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_PARALLEL_EXAMPLES", "4"))
RANDOM = os.environ.get("KVSERVE_FUZZ_RANDOM") == "1"
#: Shrink a failing example (minutes; off by default so a failing CI run ends quickly).
SHRINK = os.environ.get("KVSERVE_FUZZ_SHRINK") == "1"
#: Every test here compares with a float32 reference: ``dtype="auto"`` would pick bfloat16 on a
#: CPU with native bf16.
DTYPE = "float32"
#: Hooks armed on one request (the others are engine-wide: :data:`faults.LOGGER_HOOKS`).
REQUEST_HOOKS = FAILING_HOOKS + DRAFTING_HOOKS
#: Adapters of the LoRA configurations (``tests/engine/test_lora.py``'s three, at most rank 16).
NUM_ADAPTERS = 3

STRUCTURED = [{"json_object": True}, {"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-z]{1,8}( [a-z]{1,8}){0,4}"}]
TEXTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4, 5, 6,", "def f(x):\n    return",
         "la la la la la la la", "Hello! How are you today?"]


# ------------------------------------------------------------------------------ shared helpers
def greedy_verdict(got: list[int], ref: list[int], ref_logprobs: list[dict[int, float]],
                   tie: float | None = TIE["auto"]) -> str:
    """Compare a greedy request's tokens with the reference's: ``"equal"`` (``got`` is a
    prefix of ``ref``), ``"tie"`` (they part where ``got``'s token is among the reference's
    top-5 there and its log-probability is within ``tie`` of the reference's best, :data:`TIE`),
    ``"not compared"`` (``tie`` None), or a description of the first real difference."""
    if tie is None:
        return "not compared"
    for i, t in enumerate(got):
        if i >= len(ref):
            return f"longer than the reference ({len(got)} > {len(ref)} tokens)"
        if t != ref[i]:
            lp = ref_logprobs[i]
            gap = max(lp.values()) - lp[t] if t in lp else math.inf
            if gap < tie:
                TOTALS["largest tie gap"] = max(TOTALS["largest tie gap"], gap)
                return "tie"
            return f"token {i}: {t} != reference {ref[i]} (log-probability {gap:.3g} below the reference's best)"
    return "equal"


def cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    return sum(x * y for x, y in zip(a, b)) / (na * nb) if na and nb else 0.0


def check_against_reference(rid: str, cfg: dict, out, pooling: str | None, ref, detail: str = "") -> None:
    """One fuzzed request's output ``out`` against the reference's ``ref`` (its pooled vector
    when ``pooling`` is set, else its greedy ``(token_ids, logprobs)``), under the bounds of
    ``cfg``'s KV dtype (:data:`POOL_COS`, :data:`TIE`), counted in :data:`TOTALS` (with the
    least embedding cosine per KV dtype); ``detail`` is added to a failure's message."""
    kv = cfg["kv_cache_dtype"]
    if pooling is not None:
        cos = cosine(out.pooled, ref)
        key = f"least embedding cosine ({kv} KV)"
        TOTALS[key] = min(TOTALS.get(key, 1.0), cos)
        TOTALS["embeddings equal (cosine)"] += 1
        assert cos >= POOL_COS[kv], f"{rid} ({cfg}): embedding cosine {cos} to the reference's{detail}"
        return
    verdict = greedy_verdict(out.outputs[0].token_ids, *ref, tie=TIE[kv])
    TOTALS[f"greedy {verdict if verdict in OK_VERDICTS else 'different'}"] += 1
    assert verdict in OK_VERDICTS, f"{rid} ({cfg}): {verdict}{detail}"


def reference_params(p: SamplingParams) -> SamplingParams:
    """What the reference runs for a greedy request: the same tokens-shaping fields, top-5
    logprobs (:func:`greedy_verdict`), no stop strings (those only cut the output), no detokenization."""
    return SamplingParams(temperature=0.0, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=5,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty, structured_outputs=p.structured_outputs,
                          detokenize=False)


class Reference:
    """Reference engines (one per quantization x KV dtype x LoRA on/off), each a roomy float32
    configuration with no speculation and no prefix caching and a slot for every adapter;
    results cached by prompt, adapter and parameters (or pooling type)."""

    def __init__(self, model: str):
        self.model, self.engines, self.cache = model, {}, {}

    def _engine(self, setup: tuple) -> LLMEngine:
        if setup not in self.engines:
            quantization, kv_cache_dtype, lora = setup
            self.engines[setup] = LLMEngine(EngineConfig(
                model=self.model, dtype=DTYPE, block_size=16, max_num_seqs=32, max_num_batched_tokens=1024,
                num_kv_blocks=160, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False,
                quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                **({"enable_lora": True, "max_loras": NUM_ADAPTERS, "max_lora_rank": 16} if lora else {})))
        return self.engines[setup]

    @staticmethod
    def setup_of(cfg: dict) -> tuple:
        """The reference engine a fuzzed configuration is compared with: ``(quantization,
        kv_cache_dtype, LoRA enabled)``."""
        return cfg["quantization"], cfg["kv_cache_dtype"], bool(cfg.get("enable_lora"))

    @staticmethod
    def key(prompt_ids, p: SamplingParams | None, lora=None, pooling: str | None = None) -> tuple:
        adapter = lora.lora_name if lora is not None else None
        if pooling is not None:
            return (tuple(prompt_ids), adapter, "pooling", pooling)
        r = reference_params(p)
        return (tuple(prompt_ids), adapter, r.max_tokens, r.min_tokens, tuple(r.stop_token_ids), r.ignore_eos,
                r.presence_penalty, r.frequency_penalty, r.repetition_penalty,
                json.dumps(r.structured_outputs, sort_keys=True))

    def run(self, setup: tuple, wanted: list[tuple]) -> list:
        """For each ``(prompt_ids, params, lora_request, pooling_type)`` of ``wanted``: the
        reference's ``(token_ids, logprobs)`` (greedy generation) or pooled vector (a pooling
        type given) under ``setup`` = ``(quantization, kv_cache_dtype, lora enabled)``."""
        eng = self._engine(setup)
        todo = {}
        for ids, p, lora, pooling in wanted:
            k = setup + self.key(ids, p, lora, pooling)
            if k not in self.cache and k not in todo:
                rid = f"ref{len(self.cache) + len(todo)}"
                todo[k] = eng.add_request(rid, list(ids), None if pooling else reference_params(p), lora_request=lora,
                                          pooling_params=PoolingParams(pooling) if pooling else None)
        ids_of = {req.request_id: k for k, req in todo.items()}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    assert out.error is None, out.error
                    c = out.outputs[0]
                    self.cache[ids_of[out.request_id]] = (
                        out.pooled if out.pooled is not None else (list(c.token_ids), list(c.logprobs)))
        return [self.cache[setup + self.key(ids, p, lora, pooling)] for ids, p, lora, pooling in wanted]

    def close(self):
        for e in self.engines.values():
            e.shutdown()


def assert_idle(engine: LLMEngine):
    assert engine.scheduler.requests == {} and not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    kv.check([])
    assert kv.pool.num_free_blocks == kv.num_blocks


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    ref = Reference(str(tiny_llama_path))
    yield ref
    ref.close()


@pytest.fixture(scope="module")
def lora_requests(tiny_llama_path, tmp_path_factory):
    """Three PEFT adapters of the tiny model (``tests/engine/test_lora.py``'s: ranks 8, 4 and
    16, different target modules, one rsLoRA), as ``LoRARequest`` objects."""
    from engine.lora import LoRARequest
    from tests.engine.test_lora import ADAPTERS, make_adapter

    root = tmp_path_factory.mktemp("fuzz_adapters")
    out = [LoRARequest(name, i + 1, str(make_adapter(tiny_llama_path, root / name, r, a, t, rs, seed=i)))
           for i, (name, r, a, t, rs) in enumerate(ADAPTERS)]
    assert len(out) == NUM_ADAPTERS
    return out
# ------------------------------------------------------------------------------ 1. fault injection
def _batch(engine: LLMEngine, tag: str, hook: str):
    """Four greedy requests with every per-request hook live: repetitive prompts (n-gram
    drafts), logprobs, prompt logprobs, a stop string that does not occur; a grammar for the
    grammar hooks (such requests do not draft)."""
    grammar = hook.startswith("grammar")
    prompts = ["la la la la la la la la", "1 2 3 1 2 3 1 2 3 1 2 3", "a b a b a b a b a b", "the cat the cat the cat"]
    params = [SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2, prompt_logprobs=1,
                             stop=["@@@@"], structured_outputs=STRUCTURED[2] if grammar else None)
              for _ in prompts]
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
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype=DTYPE, block_size=8, max_num_seqs=8,
                                 max_num_batched_tokens=128, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                     "adaptive": False}))
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
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype=DTYPE, block_size=8, max_num_seqs=8,
                                 num_kv_blocks=64, max_model_len=MAX_MODEL_LEN,
                                 speculative_config={"method": "draft_model", "model": str(tiny_llama_path),
                                                     "num_speculative_tokens": 2, "adaptive": False}))
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


# ------------------------------------------------------------------------------ 2. fuzzing
class NoisyClock:
    """Seconds for the engine's timing-driven policies: mostly ordinary step times, sometimes
    no time at all, a jump back, a stall of days, or NaN/inf."""

    def __init__(self, seed: int):
        self.rng, self.t = random.Random(seed), 1000.0

    def __call__(self) -> float:
        r = self.rng.random()
        if r < 0.55:
            self.t += self.rng.uniform(1e-4, 0.05)
        elif r < 0.65:
            pass
        elif r < 0.75:
            self.t -= self.rng.uniform(0.0, 10.0)
        elif r < 0.8:
            self.t += 1e6
        elif r < 0.83:
            return math.nan
        elif r < 0.85:
            return math.inf
        else:
            self.t += self.rng.uniform(0.0, 2.0)
        return self.t


token_ids = st.integers(3, 3000)
prompts = st.one_of(
    st.lists(token_ids, min_size=1, max_size=40),
    st.builds(lambda unit, reps: (unit * reps)[:48], st.lists(token_ids, min_size=1, max_size=5), st.integers(2, 12)),
    st.builds(lambda i, tail: [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177][:4 * (i + 1)] + tail,
              st.integers(0, 3), st.lists(token_ids, max_size=6)),
    st.sampled_from(TEXTS),
)
#: An adapter index (None: the base model); used only by LoRA configurations.
adapters = st.one_of(st.none(), st.integers(0, NUM_ADAPTERS - 1))
#: A pooling type (None: a generating request): one request in five embeds its prompt.
poolings = st.one_of(st.none(), st.none(), st.none(), st.none(), st.sampled_from(["last", "mean"]))


@st.composite
def sampling_params(draw) -> SamplingParams:
    greedy = draw(st.booleans()) or draw(st.booleans())  # 3 in 4 greedy: those are checked against the reference
    max_tokens = draw(st.one_of(st.sampled_from([0, 1, 2, 5, 16, 64]), st.none()))
    detokenize = draw(st.sampled_from([True, True, True, False]))
    return SamplingParams(
        temperature=0.0 if greedy else draw(st.sampled_from([0.5, 1.0, 1.5])),
        top_p=1.0 if greedy else draw(st.sampled_from([1.0, 0.9, 1e-9])),
        top_k=-1 if greedy else draw(st.sampled_from([-1, 1, 5])),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**32))),
        max_tokens=max_tokens,
        min_tokens=min(draw(st.sampled_from([0, 0, 2])), 64 if max_tokens is None else max_tokens),
        stop=draw(st.one_of(st.none(), st.lists(st.sampled_from(["a", "the", " ", "\n", "ing", "la la"]), max_size=2)))
        if detokenize else None,
        stop_token_ids=draw(st.one_of(st.none(), st.lists(token_ids, max_size=2))),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 3))),
        prompt_logprobs=draw(st.one_of(st.none(), st.none(), st.integers(0, 2))),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, 0.5])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 1.3])),
        detokenize=detokenize,
        structured_outputs=draw(st.one_of(st.none(), st.none(), st.none(), st.sampled_from(STRUCTURED))),
    )


def reaching(hook: str, p: SamplingParams, after: int, most: int | None = None) -> SamplingParams:
    """``p`` changed just enough that its request calls ``hook`` more than ``after`` times:
    no EOS, stop string or stop id ends it first, ``max_tokens`` leaves room (for a drafting
    hook, room for drafts; at most ``most``, which must leave that room), and it asks for what
    the hook serves (a grammar for the grammar hooks and none for the drafting hooks, which
    grammar requests skip; logprobs; prompt logprobs; detokenization for the detokenizer's
    hooks)."""
    max_tokens = max(p.max_tokens or 0, after + 4)
    if most is not None:
        max_tokens = min(max_tokens, max(most, after + 4))
    kw = dict(ignore_eos=True, stop=None, stop_token_ids=None, max_tokens=max_tokens,
              min_tokens=min(p.min_tokens, max_tokens))
    if hook.startswith("grammar"):
        kw["structured_outputs"] = STRUCTURED[0] if p.structured_outputs in (None, STRUCTURED[1]) \
            else p.structured_outputs  # the three-way choice may end after one token
    elif hook in DRAFTING_HOOKS:
        kw["structured_outputs"] = None
    elif hook == "logprobs":
        kw["logprobs"] = 1 if p.logprobs is None else p.logprobs
    elif hook == "prompt_logprobs":
        kw["prompt_logprobs"] = 1 if p.prompt_logprobs is None else p.prompt_logprobs
    elif hook in ("detokenize", "output"):
        kw["detokenize"] = True
    return dataclasses.replace(p, **kw)


def _focus_after(hook: str):
    """Good calls before a focus hook's fault raises: 0-2 (mid-stream), but 0 for the hooks a
    request may call only once or twice (a grammar may end early, prompt logprobs may come in
    one chunk)."""
    return st.just(0) if hook.startswith("grammar") or hook == "prompt_logprobs" else st.integers(0, 2)


@st.composite
def configs(draw, parallel: bool = False) -> dict:
    """An engine configuration plus what the example does with it: ``focus`` (the hooks the
    example's first requests are armed in: every per-request hook, the drafting ones only with
    speculation), ``sentinels`` (those requests: a prompt of at most 16 tokens, params that
    reach the hook with at most 8 output tokens, adapter, good calls before the fault),
    ``broken_loggers``, ``spare_blocks``. LoRA excludes speculation (the engine refuses the
    pair). ``parallel``: tensor- or pipeline-parallel (PP: no LoRA, speculation or fp8 KV)."""
    cfg = {
        "block_size": draw(st.sampled_from([4, 8, 16])),
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.sampled_from([4, 8, 16, 33, 64, 256])),
        "spare_blocks": draw(st.integers(0, 24)),
        "enable_prefix_caching": draw(st.booleans()),
        "mixed_step_prefill_tokens": draw(st.one_of(st.none(), st.just(0), st.integers(1, 24))),
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        "kv_cache_dtype": draw(st.sampled_from(["auto", "auto", "fp8"])),
        "quantization": draw(st.sampled_from([None, None, None, "int8"])),
        "attention_backend": draw(st.sampled_from([None, "torch"])),
        "broken_loggers": draw(st.booleans()),
    }
    pp = 1
    if parallel:
        tp, pp = draw(st.sampled_from([(2, 1), (1, 2), (2, 2)]))
        cfg.update(tensor_parallel_size=tp, pipeline_parallel_size=pp)
        if pp > 1:
            cfg["kv_cache_dtype"] = "auto"
    lora = pp == 1 and draw(st.sampled_from([False, False, True]))
    spec = st.builds(
        lambda k, adaptive, lo, hi: {"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive,
                                     "prompt_lookup_min": min(lo, hi), "prompt_lookup_max": max(lo, hi)},
        st.integers(1, 5), st.booleans(), st.integers(1, 3), st.integers(1, 4))
    if lora or pp > 1:
        cfg["speculative_config"] = None
    else:
        cfg["speculative_config"] = draw(st.one_of(st.none(), spec))
    focus = REQUEST_HOOKS if cfg["speculative_config"] else FAILING_HOOKS
    if lora:
        cfg.update(enable_lora=True, max_loras=draw(st.integers(1, 2)), max_lora_rank=16)
    cfg["focus"], cfg["sentinels"] = focus, []
    for hook in focus:
        prompt, params, after = draw(prompts), draw(sampling_params()), draw(_focus_after(hook))
        cfg["sentinels"].append((prompt[:16], reaching(hook, params, after, most=8), draw(adapters) if lora else None,
                                 after))
    return cfg


TOTALS = Counter()
ARMED = Counter()  # hook -> faults armed
FIRED = Counter()  # hook -> faults that raised (distinct requests; per configuration for the stat logger)


def count_fired(faults: Faults) -> None:
    """Add what ``faults`` raised to :data:`FIRED`: once per (hook, request)."""
    for hook, _ in set(faults.fired):
        FIRED[hook] += 1


class EngineMachine(RuleBasedStateMachine):
    """One engine configuration per example; rules add, abort, poison and step requests."""

    model_path: str = ""
    reference: Reference | None = None
    lora_requests: list = []
    executor_factory = None  # None: in-process; the parallel profile's makes Ray worker groups

    @initialize(cfg=configs(), clock_seed=st.integers(0, 2**32))
    def build(self, cfg, clock_seed):
        self._build(cfg, clock_seed)

    def _build(self, cfg, clock_seed):
        t0 = time.monotonic()
        cfg = dict(cfg)
        spare, broken = cfg.pop("spare_blocks"), cfg.pop("broken_loggers")
        focus, sentinels = cfg.pop("focus"), cfg.pop("sentinels")
        per_seq = -(-MAX_MODEL_LEN // cfg["block_size"])
        self.engine = LLMEngine(EngineConfig(model=self.model_path, dtype=DTYPE, max_model_len=MAX_MODEL_LEN,
                                             num_kv_blocks=per_seq + spare, **cfg), self.executor_factory)
        self.engine.clock = NoisyClock(clock_seed)
        self.faults = Faults(self.engine)
        if broken:
            self.faults.break_loggers()
            ARMED.update(LOGGER_HOOKS)
        self.cfg = cfg
        self.in_flight: dict[str, object] = {}  # request id -> Request
        self.all_requests: dict[str, object] = {}  # every request added
        self.ended: dict[str, object] = {}  # request id -> final RequestOutput
        self.poisoned: dict[str, str] = {}  # request id -> hook
        self.sentinels: set[str] = set()  # the focus hooks' requests: never aborted
        self.n = 0
        TOTALS["configurations"] += 1
        TOTALS["build seconds"] += round(time.monotonic() - t0, 1)
        TOTALS["speculative configurations"] += cfg["speculative_config"] is not None
        TOTALS["LoRA configurations"] += bool(cfg.get("enable_lora"))
        for hook, (prompt, params, adapter, after) in zip(focus, sentinels):
            rid = self._add(prompt, params, 0, adapter, None, (hook, after))
            if rid is not None:
                self.sentinels.add(rid)
                TOTALS["focus requests"] += 1

    def _add(self, prompt, params, priority, adapter, pooling, fault) -> str | None:
        """Add one request (``adapter``: an index into :attr:`lora_requests`, used when LoRA is
        on; ``pooling``: a pooling type, or None to generate); arm ``fault`` = ``(hook, good
        calls)`` on it. Returns its id, or None when the engine refused it (ValueError)."""
        rid = f"r{self.n}"
        self.n += 1
        lora = self.lora_requests[adapter] if adapter is not None and self.cfg.get("enable_lora") else None
        try:
            req = self.engine.add_request(rid, prompt, params, priority=priority, lora_request=lora,
                                          pooling_params=PoolingParams(pooling) if pooling else None)
        except ValueError:  # e.g. a prompt of max_model_len tokens
            TOTALS["requests refused (ValueError)"] += 1
            return None
        self.in_flight[rid] = self.all_requests[rid] = req
        TOTALS["requests"] += 1
        TOTALS["LoRA requests"] += lora is not None
        TOTALS["pooling requests"] += pooling is not None
        if fault is not None and self.faults.poison(req, fault[0], after=fault[1]):
            self.poisoned[rid] = fault[0]
            ARMED[fault[0]] += 1
        return rid

    @rule(new=st.lists(st.tuples(prompts, sampling_params(), st.integers(-2, 2), adapters, poolings,
                                  st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(REQUEST_HOOKS),
                                                                            st.integers(0, 6)))),
                        min_size=1, max_size=4))
    def add(self, new):
        """Add 1-4 requests (some embedding requests, some under an adapter); some with a fault
        armed in one of their hooks (raising after 0-6 good calls)."""
        for prompt, params, priority, adapter, pooling, fault in new:
            self._add(prompt, params, priority, adapter, pooling, fault)

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self._record(self.engine.step())  # must never raise
            TOTALS["steps"] += 1
            self.check_pool()

    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        live = sorted(r for r in self.in_flight if r not in self.sentinels)
        if not live:
            return
        rid = live[pick % len(live)]
        out = self.engine.abort_request(rid)
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
        self._record([out])
        assert self.engine.abort_request(rid) is None  # aborting twice is a no-op
        TOTALS["aborts"] += 1

    @rule(pick=st.integers(0, 10**6), hook=st.sampled_from(REQUEST_HOOKS))
    def poison(self, pick, hook):
        live = sorted(r for r in self.in_flight if r not in self.poisoned)
        if not live:
            return
        rid = live[pick % len(live)]
        if self.faults.poison(self.in_flight[rid], hook):
            self.poisoned[rid] = hook
            ARMED[hook] += 1

    def _record(self, outs):
        for out in outs:
            rid = out.request_id
            assert rid not in self.ended, f"{rid} produced an output after it ended"
            assert rid in self.in_flight, f"output for unknown request {rid}"
            if out.finished:
                self.ended[rid] = out
                self.in_flight.pop(rid)

    @invariant()
    def requests_are_those_not_ended(self):
        if hasattr(self, "engine"):
            assert set(self.engine.scheduler.requests) == set(self.in_flight)

    def check_pool(self):
        self.engine.scheduler.kv.check(self.engine.scheduler.requests.values())

    def teardown(self):
        if not hasattr(self, "engine"):
            return
        try:
            for _ in range(5000):
                if not self.engine.has_unfinished_requests():
                    break
                self._record(self.engine.step())
                TOTALS["steps"] += 1
            else:
                raise AssertionError(f"requests never finished: {sorted(self.in_flight)}")
            assert not self.in_flight, f"requests left the engine without a final output: {sorted(self.in_flight)}"
            assert_idle(self.engine)
            count_fired(self.faults)
            self.check_outputs()
        finally:
            self.engine.shutdown()

    def check_outputs(self):
        fired = {rid for hook, rid in self.faults.fired if hook not in LOGGER_HOOKS}
        TOTALS["focus requests whose fault fired"] += len(self.sentinels & fired)
        compare = []  # (rid, out, pooling type or None)
        for rid, out in self.ended.items():
            c, hook, req = out.outputs[0], self.poisoned.get(rid), self.all_requests[rid]
            TOTALS[f"finish {c.finish_reason}"] += 1
            if c.finish_reason == "error":
                assert hook in FAILING_HOOKS and rid in fired, f"{rid} failed without a fault: {out.error}"
                continue
            assert out.error is None, (rid, out.error)
            if req.pooling is not None:
                if c.finish_reason == "abort":
                    continue
                assert c.token_ids == [] and out.pooled is not None, (rid, c, out.pooled)
                assert len(out.pooled) == self.engine.hf_config.hidden_size, rid
                compare.append((rid, out, req.pooling.pooling_type))
                continue
            assert out.pooled is None, rid
            p = req.params
            if p.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids), (rid, len(c.logprobs), len(c.token_ids))
            if p.prompt_logprobs is not None and c.finish_reason != "abort":
                plp = out.prompt_logprobs
                assert plp is not None and len(plp) == len(out.prompt_token_ids) and plp[0] is None
                assert all(tok in d for tok, d in zip(out.prompt_token_ids[1:], plp[1:])), rid
            if c.finish_reason == "length":
                assert len(c.token_ids) == req.max_output_tokens, rid
            if p.temperature == 0.0 and c.finish_reason in ("length", "stop"):
                compare.append((rid, out, None))
        t0 = time.monotonic()
        refs = self.reference.run(Reference.setup_of(self.cfg), [(out.prompt_token_ids, self.all_requests[rid].params,
                                           self.all_requests[rid].lora_request, pooling)
                                          for rid, out, pooling in compare])
        TOTALS["reference seconds"] += round(time.monotonic() - t0, 1)
        for (rid, out, pooling), ref in zip(compare, refs):
            req = self.all_requests[rid]
            check_against_reference(rid, self.cfg, out, pooling, ref, f"; prompt {out.prompt_token_ids}, adapter "
                                    f"{getattr(req.lora_request, 'lora_name', None)}, {req.params}")


def _report(suffix: str, prov, extra: dict | None = None) -> dict:
    """The run's totals and each hook's armed and fired counts, printed, and written with their
    provenance (``prov``: a ``benchmarks.common.Results``, whose ``stamp`` adds the commit, the
    machine, the command and the load average before and after) to ``$KVSERVE_FUZZ_REPORT`` when
    that is set (``suffix``: appended to the file's stem, for the async and parallel tests)."""
    report = {"budget": {"examples": EXAMPLES, "steps": STEPS, "async_examples": ASYNC_EXAMPLES,
                         "parallel_examples": PARALLEL_EXAMPLES, "randomized": RANDOM},
              "totals": dict(sorted(TOTALS.items())),
              "faults armed": {h: ARMED[h] for h in HOOKS}, "faults fired": {h: FIRED[h] for h in HOOKS},
              **(extra or {})}
    print(f"\nengine fuzz{suffix}:", json.dumps(report, indent=1))
    if os.environ.get("KVSERVE_FUZZ_REPORT"):
        path = Path(os.environ["KVSERVE_FUZZ_REPORT"])
        path = path.with_name(path.stem + suffix + path.suffix)
        path.write_text(json.dumps(prov.stamp(report), indent=1) + "\n")
    return report


def _provenance():
    """A ``benchmarks.common.Results`` of this file, made when a test starts: the commit, the
    exact command (with the ``KVSERVE_FUZZ_*`` variables it ran under) and the load average."""
    root = Path(__file__).resolve().parents[2]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    from benchmarks.common import Results

    prov = Results(__file__, ())
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("KVSERVE_FUZZ_"))
    prov.command = f"{env} {prov.command}".strip()
    return prov


def _run_fuzzer(machine, examples: int, model_path, reference, lora_requests, suffix: str) -> None:
    """Run the state machine ``machine`` (on ``model_path``, compared with ``reference``, with
    ``lora_requests``) for ``examples`` configurations of :data:`STEPS` rules from fresh totals,
    then print and write its report (``suffix``: see :func:`_report`)."""
    machine.model_path, machine.reference, machine.lora_requests = str(model_path), reference, lora_requests
    prov = _provenance()
    for c in (TOTALS, ARMED, FIRED):
        c.clear()
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=STEPS, deadline=None, derandomize=not RANDOM,
        database=None, phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK else ()),
        suppress_health_check=list(HealthCheck)))
    _report(suffix, prov)


def _check_coverage() -> None:
    """Fail when a fault kind never fired in the run: the fuzzer would have checked nothing
    about it."""
    never = [h for h in HOOKS if FIRED[h] == 0]
    assert not never, (f"fault kinds that never fired in {TOTALS['configurations']} configurations: {never} "
                       f"(armed: {dict(ARMED)})")


def test_fuzz_engine(tiny_llama_path, reference, lora_requests):
    """The stateful fuzzer (module docstring, 2.): besides each example's checks, every fault
    kind fired, LoRA and embedding requests ran and were compared with the reference."""
    _run_fuzzer(EngineMachine, EXAMPLES, tiny_llama_path, reference, lora_requests, "")
    _check_coverage()
    assert TOTALS["configurations"] >= min(EXAMPLES, 10) and TOTALS["greedy equal"] > 0
    assert TOTALS["LoRA configurations"] > 0 and TOTALS["LoRA requests"] > 0
    assert TOTALS["embeddings equal (cosine)"] > 0


# ------------------------------------------------------------------------------ 3. the async engine
#: What a stream does: read to its end, be cancelled by its client after its first output, be
#: aborted by the server (``AsyncLLMEngine.abort``) after its first output, or embed its prompt.
KINDS = ["read", "read", "cancel", "abort", "embed"]
_fault = st.tuples(st.sampled_from(FAILING_HOOKS), st.integers(0, 2))


def _client(kind, fault=st.one_of(st.none(), _fault)):
    """One client: ``(prompt, params, kind, adapter, pooling, fault, delay)``."""
    return st.tuples(prompts, sampling_params(), kind, adapters, st.sampled_from(["last", "mean"]), fault,
                     st.integers(0, 3))


#: An example's clients in a drawn order: up to four of any kind, and one of each kind the run
#: must cover (a cancel, an abort, an embedding and a read with a fault), so that a run of a few
#: examples covers them whatever the draws (with three, CI once drew no cancel at all).
streams = st.builds(lambda drawn, covering: drawn + list(covering),
                    st.lists(_client(st.sampled_from(KINDS)), max_size=4),
                    st.tuples(_client(st.just("cancel")), _client(st.just("abort")), _client(st.just("embed")),
                              _client(st.just("read"), _fault))).flatmap(st.permutations)


def _outlasting(p: SamplingParams, max_tokens: int) -> SamplingParams:
    """``p`` made to give more than one output: no EOS, stop or grammar ends it before
    ``max_tokens`` tokens (the drafting hooks' :func:`reaching` does just that)."""
    return reaching("propose", p, max_tokens - 4)


async def _stream(eng, rid: str, prompt, params, kind: str, lora, pooling: str, delay: int) -> tuple:
    """One client of ``eng``: ``(outputs, exception)``; ``exception`` is the RuntimeError the
    stream ended with (a failed request), or the ValueError that refused it."""
    await asyncio.sleep(0.002 * delay)
    outs = []
    try:
        if kind == "embed":
            return [await eng.embed(prompt, PoolingParams(pooling), request_id=rid, lora_request=lora)], None
        stream = eng.generate(prompt, params, request_id=rid, lora_request=lora)
        try:
            async for out in stream:
                outs.append(out)
                if len(outs) == 1 and not out.finished and kind == "cancel":
                    break  # the client goes away: closing the stream aborts the request
                if len(outs) == 1 and not out.finished and kind == "abort":
                    eng.abort(rid)
        finally:
            await stream.aclose()
    except (RuntimeError, ValueError) as e:
        return outs, e
    return outs, None


async def _until_idle(eng, timeout_s: float = 60.0) -> None:
    """Until every stream's abort is applied and the engine holds no request."""
    deadline = time.monotonic() + timeout_s
    while eng.get_stats()["num_pending_requests"] or eng.engine.has_unfinished_requests():
        assert time.monotonic() < deadline, "the async engine never became idle"
        await asyncio.sleep(0.01)


def _check_async_example(cfg: dict, wanted: list, results: list, faults: Faults, reference: Reference) -> None:
    """The checks of one async example (module docstring, 3.)."""
    fired = {rid for _, rid in faults.fired}
    compare = []
    for (rid, prompt, params, kind, lora, pooling, fault), (outs, error) in zip(wanted, results):
        TOTALS[f"streams: {kind}"] += 1
        if isinstance(error, ValueError):  # refused before anything was queued (e.g. a prompt too long)
            assert not outs, rid
            TOTALS["streams refused (ValueError)"] += 1
            continue
        if error is not None:
            assert fault is not None and rid in fired and "injected fault" in str(error), (rid, fault, error)
            TOTALS["streams failed by their fault"] += 1
            continue
        assert outs and all(not o.finished for o in outs[:-1]), f"{rid}: output after the final one"
        last = outs[-1]
        assert last.error is None, (rid, last.error)
        if kind == "embed":
            assert last.finished and len(last.pooled) == 64, rid
            compare.append((rid, last, pooling))
            continue
        c = last.outputs[0]
        deltas = [t for o in outs for t in o.outputs[0].delta_token_ids]
        assert deltas == c.token_ids, f"{rid}: the stream's deltas {deltas} do not add up to {c.token_ids}"
        if kind == "cancel":
            assert not last.finished, rid  # cancelled after its first output, before its end
            TOTALS["streams cancelled mid-stream"] += 1
        else:
            assert last.finished, rid
            TOTALS["streams aborted mid-stream"] += c.finish_reason == "abort"
        if params.temperature == 0.0:
            compare.append((rid, last, None))
    by_id = {w[0]: w for w in wanted}
    refs = reference.run(Reference.setup_of(cfg), [(out.prompt_token_ids, by_id[rid][2], by_id[rid][4], pooling)
                                                   for rid, out, pooling in compare])
    for (rid, out, pooling), ref in zip(compare, refs):
        check_against_reference(rid, cfg, out, pooling, ref)


def test_fuzz_async_engine(tiny_llama_path, reference, lora_requests):
    """The fuzzer's configurations and requests through ``AsyncLLMEngine`` (module docstring,
    3.); across the run some stream was cancelled and some aborted mid-stream, some failed by
    its fault, some embedded and some greedy one equalled the reference."""
    prov = _provenance()
    for c in (TOTALS, ARMED, FIRED):
        c.clear()

    @settings(max_examples=ASYNC_EXAMPLES, deadline=None, derandomize=not RANDOM, database=None,
              phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK else ()),
              suppress_health_check=list(HealthCheck))
    @given(cfg=configs(), drawn=streams)
    def run(cfg, drawn):
        cfg = {k: v for k, v in cfg.items() if k not in ("focus", "sentinels", "broken_loggers", "spare_blocks")}
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_path), dtype=DTYPE, max_model_len=MAX_MODEL_LEN,
                                        num_kv_blocks=-(-MAX_MODEL_LEN // cfg["block_size"]) + 8, **cfg))
        faults = Faults(engine)
        wanted = []
        for i, (prompt, params, kind, adapter, pooling, fault, delay) in enumerate(drawn):
            rid = f"a{i}"
            lora = lora_requests[adapter] if adapter is not None and cfg.get("enable_lora") else None
            if kind in ("cancel", "abort"):
                params, fault = _outlasting(params, 8 if kind == "cancel" else 16), None
            elif kind == "embed":
                fault = None
            elif fault is not None:
                hook = fault[0]
                after = 0 if hook.startswith("grammar") or hook == "prompt_logprobs" else fault[1]
                params, fault = reaching(hook, params, after), (hook, after)
                faults.arm_future(hook, lambda r, rid=rid: r.request_id == rid, after)
                ARMED[fault[0]] += 1
            wanted.append((rid, prompt, params, kind, lora, pooling, fault))
            TOTALS["LoRA requests"] += lora is not None

        async def drive(eng):
            results = await asyncio.gather(*(_stream(eng, rid, prompt, params, kind, lora, pooling, delay)
                                             for (rid, prompt, params, kind, lora, pooling, _), (*_, delay)
                                             in zip(wanted, drawn)))
            await _until_idle(eng)
            assert_idle(eng.engine)
            return results

        TOTALS["configurations"] += 1
        results = run_async_engine(drive, engine, timeout_s=300)
        count_fired(faults)
        _check_async_example(cfg, wanted, results, faults, reference)

    run()
    _report("_async", prov)
    for what in ("streams cancelled mid-stream", "streams aborted mid-stream", "streams failed by their fault",
                 "embeddings equal (cosine)", "greedy equal", "LoRA requests"):
        assert TOTALS[what] > 0, f"no {what} in {TOTALS['configurations']} async examples: {dict(TOTALS)}"


# ------------------------------------------------------------------------------ 4. TP / PP (opt-in)
@pytest.fixture(scope="module")
def ray_for_parallel(tmp_path_factory):
    """A local Ray (8 logical CPUs, token auth with a token of this run only), or the one this
    session already runs; skips unless ``KVSERVE_FUZZ_PARALLEL=1``."""
    if not PARALLEL:
        pytest.skip("tensor/pipeline-parallel fuzzing is opt-in (KVSERVE_FUZZ_PARALLEL=1): it starts Ray actors "
                    "and takes minutes")
    if "RAY_AUTH_TOKEN_PATH" not in os.environ:
        os.environ.pop("RAY_AUTH_TOKEN", None)
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(tmp_path_factory.mktemp("ray_auth") / "auth_token")
    from cluster.ray_auth import ensure_local_auth

    ensure_local_auth()
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    yield
    if started:
        ray.shutdown()


class ParallelEngineMachine(EngineMachine):
    """:class:`EngineMachine` over TP=2, PP=2 or both: each rank a Ray actor (gloo)."""

    @initialize(cfg=configs(parallel=True), clock_seed=st.integers(0, 2**32))
    def build(self, cfg, clock_seed):
        self._build(cfg, clock_seed)

    @staticmethod
    def executor_factory(config, model_path):
        from cluster.worker_group import RayWorkerGroup

        return RayWorkerGroup(config, model_path, num_cpus=1, torch_num_threads=1, timeout_s=120,
                              collective_timeout_s=120)


def test_fuzz_engine_parallel(ray_for_parallel, tiny_llama_path, reference, lora_requests):
    """The stateful fuzzer over tensor- and pipeline-parallel configurations (module
    docstring, 4.): the same checks, against the same single-process reference; some fault
    fired and some greedy request equalled the reference."""
    _run_fuzzer(ParallelEngineMachine, PARALLEL_EXAMPLES, tiny_llama_path, reference, lora_requests, "_parallel")
    assert TOTALS["configurations"] == PARALLEL_EXAMPLES and TOTALS["greedy equal"] > 0
    assert sum(FIRED.values()) > 0, f"no fault fired (armed: {dict(ARMED)})"
