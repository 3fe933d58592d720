"""The engine never dies from a request, a timing or a setting (tiny random-weight Llama).

1. Fault injection (``tests/faults.py``): each per-request hook of ``LLMEngine.step`` (proposer,
   draft-length policy, grammar fill and advance, detokenization and stop strings, logprobs,
   prompt logprobs, output assembly) raises on one request of a batch: that request alone fails
   (or, for a proposer, goes on without drafts, its output unchanged); the others produce what
   they produce without the fault; every KV block comes back. Broken stat and request loggers
   affect nobody.
2. Property-based fuzzing (hypothesis, stateful): random engine configurations (block size,
   ``max_num_seqs``, token budget, KV pools small enough to preempt, prefix caching, mixed-step
   caps, n-gram speculation adaptive or not, fp8 KV cache, int8 weights, attention backend,
   scheduling policy) x random request streams (arrivals, aborts mid-flight, priorities, stop
   strings and stop ids, ``max_tokens`` 0/1/large/None, ``min_tokens``, logprobs, prompt logprobs,
   seeds, penalties, structured outputs, repetitive n-gram-friendly and shared-prefix prompts,
   faults injected into a random request's hook) x a fake clock that feeds noise (jumps back,
   stalls, NaN) to every timing-driven policy. After every step: ``step()`` raised nothing, the
   engine's requests are exactly those not yet ended, block reference counts equal the block
   tables' references. At the end: every request ended exactly once, the pool is whole, and each
   greedy request's tokens equal those of a reference engine (no speculation, no prefix caching,
   one roomy configuration, same weights and KV dtype), up to a near-tie in the reference's
   logits (top-2 log-probability gap below :data:`TIE`) where batching may round either way.

Budget: ``KVSERVE_FUZZ_EXAMPLES`` engine configurations (default 20, derandomized: the same
examples every run) of ``KVSERVE_FUZZ_STEPS`` rules each (default 25); a longer, randomized run:
``KVSERVE_FUZZ_EXAMPLES=400 KVSERVE_FUZZ_RANDOM=1 make test PYTEST_ARGS=tests/engine/test_engine_robustness.py``
(``KVSERVE_FUZZ_SHRINK=1`` shrinks a failure to a minimal example).
The totals are printed (``-s``) and written to ``$KVSERVE_FUZZ_REPORT`` when set.
"""
from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine
from faults import DRAFTING_HOOKS, FAILING_HOOKS, HOOKS, LOGGER_HOOKS, Faults

#: Top-2 log-probability gap of the reference below which either token may be argmax
#: (float32 rounding differs with batch composition, chunking and attention backend).
TIE = 1e-4
MAX_MODEL_LEN = 64
EXAMPLES = int(os.environ.get("KVSERVE_FUZZ_EXAMPLES", "20"))
STEPS = int(os.environ.get("KVSERVE_FUZZ_STEPS", "25"))
RANDOM = os.environ.get("KVSERVE_FUZZ_RANDOM") == "1"
#: Shrink a failing example (minutes; off by default so a failing CI run ends quickly).
SHRINK = os.environ.get("KVSERVE_FUZZ_SHRINK") == "1"

STRUCTURED = [{"json_object": True}, {"choice": ["yes", "no", "maybe so"]}, {"regex": "[a-z]{1,8}( [a-z]{1,8}){0,4}"}]
TEXTS = ["The quick brown fox", "Once upon a time there was", "1, 2, 3, 4, 5, 6,", "def f(x):\n    return",
         "la la la la la la la", "Hello! How are you today?"]


# ------------------------------------------------------------------------------ shared helpers
def greedy_verdict(got: list[int], ref: list[int], ref_logprobs: list[dict[int, float]]) -> str:
    """Compare a greedy request's tokens with the reference's: ``"equal"`` (``got`` is a
    prefix of ``ref``), ``"tie"`` (they part where the reference's top-2 gap is below
    :data:`TIE`), or a description of the first real difference."""
    for i, t in enumerate(got):
        if i >= len(ref):
            return f"longer than the reference ({len(got)} > {len(ref)} tokens)"
        if t != ref[i]:
            top = sorted(ref_logprobs[i].values(), reverse=True)[:2]
            if len(top) == 2 and top[0] - top[1] < TIE:
                return "tie"
            return f"token {i}: {t} != reference {ref[i]} (reference top-2 gap {top[0] - top[1]:.3g})"
    return "equal"


def reference_params(p: SamplingParams) -> SamplingParams:
    """What the reference runs for a greedy request: the same tokens-shaping fields, top-2
    logprobs, no stop strings (those only cut the output), no detokenization."""
    return SamplingParams(temperature=0.0, max_tokens=p.max_tokens, min_tokens=p.min_tokens,
                          stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, logprobs=2,
                          presence_penalty=p.presence_penalty, frequency_penalty=p.frequency_penalty,
                          repetition_penalty=p.repetition_penalty, structured_outputs=p.structured_outputs,
                          detokenize=False)


class Reference:
    """Reference engines (one per quantization x KV dtype), each a roomy configuration with
    no speculation and no prefix caching; results cached by prompt and parameters."""

    def __init__(self, model: str):
        self.model, self.engines, self.cache = model, {}, {}

    def _engine(self, quantization, kv_cache_dtype) -> LLMEngine:
        key = (quantization, kv_cache_dtype)
        if key not in self.engines:
            self.engines[key] = LLMEngine(EngineConfig(
                model=self.model, block_size=16, max_num_seqs=32, max_num_batched_tokens=1024, num_kv_blocks=160,
                max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False, quantization=quantization,
                kv_cache_dtype=kv_cache_dtype))
        return self.engines[key]

    @staticmethod
    def key(prompt_ids, p: SamplingParams) -> tuple:
        r = reference_params(p)
        return (tuple(prompt_ids), r.max_tokens, r.min_tokens, tuple(r.stop_token_ids), r.ignore_eos,
                r.presence_penalty, r.frequency_penalty, r.repetition_penalty,
                json.dumps(r.structured_outputs, sort_keys=True))

    def run(self, quantization, kv_cache_dtype, wanted: list[tuple[list[int], SamplingParams]]) -> list[tuple]:
        """``(token_ids, logprobs)`` of each ``(prompt_ids, params)``."""
        eng = self._engine(quantization, kv_cache_dtype)
        todo = {}
        for ids, p in wanted:
            k = (quantization, kv_cache_dtype) + self.key(ids, p)
            if k not in self.cache and k not in todo:
                todo[k] = eng.add_request(f"ref{len(self.cache) + len(todo)}", list(ids), reference_params(p))
        ids_of = {req.request_id: k for k, req in todo.items()}
        while eng.has_unfinished_requests():
            for out in eng.step():
                if out.finished:
                    assert out.error is None, out.error
                    c = out.outputs[0]
                    self.cache[ids_of[out.request_id]] = (list(c.token_ids), list(c.logprobs))
        return [self.cache[(quantization, kv_cache_dtype) + self.key(ids, p)] for ids, p in wanted]

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
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_path), block_size=8, max_num_seqs=8,
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
    proposer, policy_fn = eng.proposer, eng.draft_policy.draft_length
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
        eng.proposer, eng.enqueue = proposer, LLMEngine.enqueue.__get__(eng)
        eng.draft_policy.draft_length = policy_fn
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
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_path), block_size=8, max_num_seqs=8, num_kv_blocks=64,
                                 max_model_len=MAX_MODEL_LEN,
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
        assert eng.proposer.shadows == {}
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


configs = st.fixed_dictionaries({
    "block_size": st.sampled_from([4, 8, 16]),
    "max_num_seqs": st.integers(1, 6),
    "max_num_batched_tokens": st.sampled_from([4, 8, 16, 33, 64, 256]),
    "spare_blocks": st.integers(0, 24),
    "enable_prefix_caching": st.booleans(),
    "mixed_step_prefill_tokens": st.one_of(st.none(), st.just(0), st.integers(1, 24)),
    "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    "speculative_config": st.one_of(st.none(), st.builds(
        lambda k, adaptive, lo, hi: {"method": "ngram", "num_speculative_tokens": k, "adaptive": adaptive,
                                     "prompt_lookup_min": min(lo, hi), "prompt_lookup_max": max(lo, hi)},
        st.integers(1, 5), st.booleans(), st.integers(1, 3), st.integers(1, 4))),
    "kv_cache_dtype": st.sampled_from(["auto", "auto", "fp8"]),
    "quantization": st.sampled_from([None, None, None, "int8"]),
    "attention_backend": st.sampled_from([None, "torch"]),
    "broken_loggers": st.booleans(),
})

token_ids = st.integers(3, 3000)
prompts = st.one_of(
    st.lists(token_ids, min_size=1, max_size=40),
    st.builds(lambda unit, reps: (unit * reps)[:48], st.lists(token_ids, min_size=1, max_size=5), st.integers(2, 12)),
    st.builds(lambda i, tail: [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177][:4 * (i + 1)] + tail,
              st.integers(0, 3), st.lists(token_ids, max_size=6)),
    st.sampled_from(TEXTS),
)


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


TOTALS = Counter()


class EngineMachine(RuleBasedStateMachine):
    """One engine configuration per example; rules add, abort, poison and step requests."""

    model_path: str = ""
    reference: Reference | None = None

    @initialize(cfg=configs, clock_seed=st.integers(0, 2**32))
    def build(self, cfg, clock_seed):
        t0 = time.monotonic()
        cfg = dict(cfg)
        spare, broken = cfg.pop("spare_blocks"), cfg.pop("broken_loggers")
        per_seq = -(-MAX_MODEL_LEN // cfg["block_size"])
        self.engine = LLMEngine(EngineConfig(model=self.model_path, max_model_len=MAX_MODEL_LEN,
                                             num_kv_blocks=per_seq + spare, **cfg))
        self.engine.clock = NoisyClock(clock_seed)
        self.faults = Faults(self.engine)
        if broken:
            self.faults.break_loggers()
        self.cfg = cfg
        self.in_flight: dict[str, object] = {}  # request id -> Request
        self.all_requests: dict[str, object] = {}  # every request added
        self.ended: dict[str, object] = {}  # request id -> final RequestOutput
        self.poisoned: dict[str, str] = {}  # request id -> hook
        self.n = 0
        TOTALS["configurations"] += 1
        TOTALS["build seconds"] += round(time.monotonic() - t0, 1)
        TOTALS["speculative configurations"] += cfg["speculative_config"] is not None

    def _record(self, outs):
        for out in outs:
            rid = out.request_id
            assert rid not in self.ended, f"{rid} produced an output after it ended"
            assert rid in self.in_flight, f"output for unknown request {rid}"
            if out.finished:
                self.ended[rid] = out
                self.in_flight.pop(rid)

    @rule(new=st.lists(st.tuples(prompts, sampling_params(), st.integers(-2, 2),
                                  st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(DRAFTING_HOOKS + FAILING_HOOKS),
                                                                            st.integers(0, 6)))),
                        min_size=1, max_size=4))
    def add(self, new):
        """Add 1-4 requests; some with a fault armed in one of their hooks (raising after 0-6
        good calls)."""
        for prompt, params, priority, fault in new:
            rid = f"r{self.n}"
            self.n += 1
            try:
                req = self.engine.add_request(rid, prompt, params, priority=priority)
            except ValueError:  # e.g. a prompt of max_model_len tokens
                TOTALS["requests refused (ValueError)"] += 1
                continue
            self.in_flight[rid] = self.all_requests[rid] = req
            TOTALS["requests"] += 1
            if fault is not None and self.faults.poison(req, fault[0], after=fault[1]):
                self.poisoned[rid] = fault[0]
                TOTALS["faults armed"] += 1

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            self._record(self.engine.step())  # must never raise
            TOTALS["steps"] += 1
            self.check_pool()

    @rule(pick=st.integers(0, 10**6))
    def abort(self, pick):
        if not self.in_flight:
            return
        rid = sorted(self.in_flight)[pick % len(self.in_flight)]
        out = self.engine.abort_request(rid)
        assert out is not None and out.finished and out.outputs[0].finish_reason == "abort"
        self._record([out])
        assert self.engine.abort_request(rid) is None  # aborting twice is a no-op
        TOTALS["aborts"] += 1

    @rule(pick=st.integers(0, 10**6), hook=st.sampled_from(DRAFTING_HOOKS + FAILING_HOOKS))
    def poison(self, pick, hook):
        live = sorted(r for r in self.in_flight if r not in self.poisoned)
        if not live:
            return
        rid = live[pick % len(live)]
        if self.faults.poison(self.in_flight[rid], hook):
            self.poisoned[rid] = hook
            TOTALS["faults armed"] += 1

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
            self.check_outputs()
        finally:
            self.engine.shutdown()

    def check_outputs(self):
        fired = {rid for hook, rid in self.faults.fired if hook not in LOGGER_HOOKS}
        TOTALS["faults fired"] += len(fired)
        greedy = []
        for rid, out in self.ended.items():
            c, hook = out.outputs[0], self.poisoned.get(rid)
            TOTALS[f"finish {c.finish_reason}"] += 1
            if hook is not None:
                TOTALS[f"faults fired: {hook}"] += rid in fired
            if c.finish_reason == "error":
                assert hook in FAILING_HOOKS and rid in fired, f"{rid} failed without a fault: {out.error}"
                continue
            p = self.params_of(rid)
            if p.logprobs is not None:
                assert len(c.logprobs) == len(c.token_ids), (rid, len(c.logprobs), len(c.token_ids))
            if p.prompt_logprobs is not None and c.finish_reason != "abort":
                plp = out.prompt_logprobs
                assert plp is not None and len(plp) == len(out.prompt_token_ids) and plp[0] is None
                assert all(tok in d for tok, d in zip(out.prompt_token_ids[1:], plp[1:])), rid
            if c.finish_reason == "length":
                assert len(c.token_ids) == self.max_output_tokens(rid), rid
            if p.temperature == 0.0 and c.finish_reason in ("length", "stop"):
                greedy.append((rid, out))
        t0 = time.monotonic()
        refs = self.reference.run(self.cfg["quantization"], self.cfg["kv_cache_dtype"],
                                  [(out.prompt_token_ids, self.params_of(rid)) for rid, out in greedy])
        TOTALS["reference seconds"] += round(time.monotonic() - t0, 1)
        for (rid, out), (ref_ids, ref_lps) in zip(greedy, refs):
            verdict = greedy_verdict(out.outputs[0].token_ids, ref_ids, ref_lps)
            TOTALS[f"greedy {verdict if verdict in ('equal', 'tie') else 'different'}"] += 1
            assert verdict in ("equal", "tie"), f"{rid} ({self.cfg}): {verdict}"

    def params_of(self, rid):
        return self.all_requests[rid].params

    def max_output_tokens(self, rid):
        return self.all_requests[rid].max_output_tokens


def test_fuzz_engine(tiny_llama_path, reference):
    EngineMachine.model_path = str(tiny_llama_path)
    EngineMachine.reference = reference
    TOTALS.clear()
    run_state_machine_as_test(EngineMachine, settings=settings(
        max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, derandomize=not RANDOM,
        database=None, phases=(Phase.explicit, Phase.generate) + ((Phase.shrink,) if SHRINK else ()),
        suppress_health_check=list(HealthCheck)))
    report = dict(sorted(TOTALS.items()))
    print("\nengine fuzz:", json.dumps(report, indent=1))
    if os.environ.get("KVSERVE_FUZZ_REPORT"):
        with open(os.environ["KVSERVE_FUZZ_REPORT"], "w") as f:
            json.dump(report, f, indent=1)
    assert TOTALS["configurations"] >= min(EXAMPLES, 10) and TOTALS["greedy equal"] > 0
