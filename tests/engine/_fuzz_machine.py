"""The stateful fuzzer of ``test_engine_fuzz.py``: a clock that feeds noise to the timing-driven
policies (:class:`NoisyClock`), hypothesis strategies for prompts, sampling parameters and engine
configurations (:func:`configs`), :func:`reaching` (parameters that reach a hook), and
:class:`EngineMachine`, whose rules add, abort, poison and step requests and whose teardown checks
every output against the reference engine."""

from __future__ import annotations

import dataclasses
import math
import random
import time

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from _robustness_helpers import (
    ARMED,
    DTYPE,
    MAX_MODEL_LEN,
    NUM_ADAPTERS,
    STRUCTURED,
    TOTALS,
    Reference,
    assert_idle,
    check_against_reference,
    count_fired,
    one_chunk_schedule,
)
from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.pooling import PoolingParams
from faults import DRAFTING_HOOKS, FAILING_HOOKS, LOGGER_HOOKS, Faults

#: Hooks armed on one request (the others are engine-wide: :data:`faults.LOGGER_HOOKS`).
REQUEST_HOOKS = FAILING_HOOKS + DRAFTING_HOOKS

TEXTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "1, 2, 3, 4, 5, 6,",
    "def f(x):\n    return",
    "la la la la la la la",
    "Hello! How are you today?",
]


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
    st.builds(
        lambda i, tail: [11, 22, 33, 44, 55, 66, 77, 88, 99, 111, 122, 133, 144, 155, 166, 177][: 4 * (i + 1)] + tail,
        st.integers(0, 3),
        st.lists(token_ids, max_size=6),
    ),
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
        if detokenize
        else None,
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
    kw = dict(
        ignore_eos=True, stop=None, stop_token_ids=None, max_tokens=max_tokens, min_tokens=min(p.min_tokens, max_tokens)
    )
    if hook.startswith("grammar"):
        kw["structured_outputs"] = (
            STRUCTURED[0] if p.structured_outputs in (None, STRUCTURED[1]) else p.structured_outputs
        )  # the three-way choice may end after one token
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
        lambda k, adaptive, lo, hi: {
            "method": "ngram",
            "num_speculative_tokens": k,
            "adaptive": adaptive,
            "prompt_lookup_min": min(lo, hi),
            "prompt_lookup_max": max(lo, hi),
        },
        st.integers(1, 5),
        st.booleans(),
        st.integers(1, 3),
        st.integers(1, 4),
    )
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
        cfg["sentinels"].append(
            (prompt[:16], reaching(hook, params, after, most=8), draw(adapters) if lora else None, after)
        )
    return cfg


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
        self.engine = LLMEngine(
            EngineConfig(
                model=self.model_path, dtype=DTYPE, max_model_len=MAX_MODEL_LEN, num_kv_blocks=per_seq + spare, **cfg
            ),
            self.executor_factory,
        )
        self.engine.clock = NoisyClock(clock_seed)
        self.steps: dict[str, list[tuple[int, int]]] = {}  # request id -> its slices (start, tokens)
        schedule = self.engine.scheduler.schedule

        def recording():
            out = schedule()
            for r in out.requests:
                self.steps.setdefault(r.request_id, []).append((r.start, len(r.token_ids)))
            return out

        self.engine.scheduler.schedule = recording
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
            req = self.engine.add_request(
                rid,
                prompt,
                params,
                priority=priority,
                lora_request=lora,
                pooling_params=PoolingParams(pooling) if pooling else None,
            )
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

    @rule(
        new=st.lists(
            st.tuples(
                prompts,
                sampling_params(),
                st.integers(-2, 2),
                adapters,
                poolings,
                st.one_of(st.none(), st.none(), st.tuples(st.sampled_from(REQUEST_HOOKS), st.integers(0, 6))),
            ),
            min_size=1,
            max_size=4,
        )
    )
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
        refs = self.reference.run(
            Reference.setup_of(self.cfg),
            [
                (out.prompt_token_ids, self.all_requests[rid].params, self.all_requests[rid].lora_request, pooling)
                for rid, out, pooling in compare
            ],
        )
        TOTALS["reference seconds"] += round(time.monotonic() - t0, 1)
        for (rid, out, pooling), ref in zip(compare, refs):
            req = self.all_requests[rid]
            check_against_reference(
                rid,
                self.cfg,
                out,
                pooling,
                ref,
                f"; prompt {out.prompt_token_ids}, adapter "
                f"{getattr(req.lora_request, 'lora_name', None)}, {req.params}, steps "
                f"{self.steps.get(rid)}",
                same_schedule=one_chunk_schedule(self.steps.get(rid), len(out.prompt_token_ids)),
            )
