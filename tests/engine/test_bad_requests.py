"""Bad requests against one tiny-Llama engine (a module fixture that every test here shares).

a. Validation against the model: seeds outside torch's range and out-of-vocabulary stop ids are
   rejected with a ValueError naming the field, a huge top_k and a top_p that rounds to 0 run;
   every SamplingParams value is rejected with a ValueError naming its field, or a request with
   it runs (property test over the whole parameter space). The checks of SamplingParams alone are
   ``test_sampling_params_validation.py``.
b. Isolation: a request that fails inside a step fails alone (engine and async engine); its batch
   mates produce exactly what they produce without it, and every KV block comes back. A failure
   that no request can be blamed for raises StepFailedError and the engine serves on.
c. The default mixed-step prefill budget is measured from the engine's step times (the budget
   itself: ``test_mixed_step_budget.py``).
"""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _hardening_helpers import PROMPTS, arun, assert_idle, collect, make_engine, run_all
from kvserve.engine import LLM, EngineConfig, SamplingParams
from kvserve.engine.mixed_step_budget import MixedStepBudget
from kvserve.engine.request import RequestStatus
from kvserve.engine.step_isolation import StepFailedError
from helpers import FUZZ_RANDOM

VOCAB = 49152  # the tiny models use SmolLM2's tokenizer


def smuggle(params: SamplingParams, min_tokens: int = 3) -> SamplingParams:
    """A real bad value past validation: a stop token id far outside the vocabulary that
    min_tokens makes the sampler mask (IndexError inside the model step)."""
    params.stop_token_ids = [10**7]
    params.min_tokens = min_tokens
    return params


@pytest.fixture(scope="module")
def engine(tiny_llama_path):
    eng = make_engine(tiny_llama_path)
    yield eng
    eng.shutdown()


# --------------------------------------------------------------------------- a. validation


def test_probe_values_are_rejected_or_served(engine):
    """The hardening probe's values: seeds outside torch's range and out-of-vocabulary stop
    ids are rejected naming the field; a huge top_k and a top_p that rounds to 0 run."""
    for kw in (dict(seed=2**64), dict(seed=-(2**63) - 1)):
        with pytest.raises(ValueError, match="^seed "):
            SamplingParams(**kw)
    for ids in ([10**7], [VOCAB], [5, 2**64]):
        with pytest.raises(ValueError, match="^stop_token_ids "):
            engine.make_request("x", [1, 2, 3], SamplingParams(stop_token_ids=ids, min_tokens=2))
    greedy = run_all(engine, [engine.make_request("g", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))])
    outs = run_all(
        engine,
        [
            engine.make_request("tk", PROMPTS[0], SamplingParams(top_k=2**64, seed=5, max_tokens=6)),
            engine.make_request("tk-off", PROMPTS[0], SamplingParams(top_k=-1, seed=5, max_tokens=6)),
            engine.make_request("tp", PROMPTS[0], SamplingParams(top_p=1e-300, max_tokens=6)),
            engine.make_request("tp2", PROMPTS[0], SamplingParams(top_p=5e-324, top_k=3, min_p=1.0, max_tokens=6)),
            engine.make_request("s-lo", PROMPTS[0], SamplingParams(seed=-(2**63), max_tokens=6)),
            engine.make_request("s-neg", PROMPTS[0], SamplingParams(seed=-1, max_tokens=6)),
            engine.make_request("s-hi", PROMPTS[0], SamplingParams(seed=2**64 - 1, max_tokens=6)),
        ],
    )
    assert all(o.error is None and len(o.outputs[0].token_ids) == 6 for o in outs.values())
    ids = {k: o.outputs[0].token_ids for k, o in outs.items()}
    assert ids["tk"] == ids["tk-off"]  # top_k above the vocabulary = no top-k
    assert ids["tp"] == ids["tp2"] == greedy["g"].outputs[0].token_ids  # only the most likely token is left
    assert ids["s-neg"] == ids["s-hi"]  # torch reads seed -1 as 2**64 - 1 (documented)
    assert_idle(engine)


def test_make_request_checks_against_the_model(engine):
    with pytest.raises(ValueError, match="^stop_token_ids "):
        engine.make_request("x", [1, 2], SamplingParams(stop_token_ids=[VOCAB]))
    with pytest.raises(ValueError, match="^stop_token_ids "):  # min_tokens would forbid every token
        engine.make_request("x", [1, 2], SamplingParams(stop_token_ids=list(range(VOCAB)), min_tokens=1))
    with pytest.raises(ValueError, match="^priority "):
        engine.make_request("x", [1, 2], SamplingParams(), priority=1.5)
    with pytest.raises(ValueError, match="prompt token ids"):
        engine.make_request("x", [1, -2], SamplingParams())
    engine.make_request("x", [1, 2], SamplingParams(stop_token_ids=[VOCAB - 1], min_tokens=1))  # in range: fine


# the whole SamplingParams space: values in range (boundaries, subnormals, huge ints where
# allowed) and wild ones of every type (out of range, NaN/inf, bool, float-for-int, None, str)
_HUGE = [2**64, 2**64 - 1, 2**63, 2**63 - 1, -(2**63), -(2**63) - 1, -(2**64), 10**7, VOCAB, VOCAB - 1, 2**200]
_TINY = [5e-324, 1e-300, 1e-45, 1e-38, 1e-5, 1.00001e-5, 1 - 1e-12]
INTS = st.one_of(
    st.integers(-3, 40),
    st.integers(-(2**70), 2**70),
    st.sampled_from(_HUGE),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.none(),
    st.text(max_size=2),
)
FLOATS = st.one_of(
    st.floats(-2.5, 11),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([-0.0, math.nan, math.inf, -math.inf] + _TINY),
    st.integers(-(2**70), 2**70),
    st.booleans(),
    st.none(),
)
TOKEN_IDS = st.one_of(st.integers(-2, 2**66), st.sampled_from(_HUGE), st.booleans(), st.floats(0, 10))


def unit(lo_open=False):
    """Floats in [0, 1] (or (0, 1]) with the boundaries and float32-underflowing values."""
    return st.one_of(st.floats(0, 1, exclude_min=lo_open), st.sampled_from(_TINY + [1.0]))


VALID = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2] + _TINY)),
    "top_p": unit(lo_open=True),
    "min_p": unit(),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, 2**63, 2**64, 2**200]), st.integers(1, 2**70)),
    "max_tokens": st.one_of(st.none(), st.integers(0, 4), st.sampled_from([2**63, 2**64, 2**200])),
    "min_tokens": st.one_of(st.integers(0, 4), st.sampled_from([2**64, 2**200])),
    "stop": st.one_of(
        st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)
    ),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, 2, 7, VOCAB - 1])), max_size=4),
    "ignore_eos": st.booleans(),
    "seed": st.one_of(
        st.none(), st.integers(-(2**63), 2**64 - 1), st.sampled_from([-(2**63), -1, 0, 2**63, 2**64 - 1])
    ),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, 2, 5e-324])),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, 2, -5e-324])),
    "repetition_penalty": st.one_of(st.floats(0, 10, exclude_min=True), st.sampled_from([10] + _TINY)),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "logit_bias": st.one_of(
        st.none(),
        st.dictionaries(
            st.integers(0, VOCAB - 1),
            st.one_of(st.floats(-100, 100), st.sampled_from([-100, 100, 0, 5e-324])),
            max_size=4,
        ),
    ),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "detokenize": st.booleans(),
}
WILD = {
    "n": INTS,
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "min_p": FLOATS,
    "max_tokens": INTS,
    "min_tokens": INTS,
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), INTS),
    "stop_token_ids": st.one_of(st.lists(TOKEN_IDS, min_size=1, max_size=4), INTS),
    "ignore_eos": INTS,
    "seed": st.one_of(st.integers(-(2**64) - 2, 2**64 + 2), INTS),
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "repetition_penalty": FLOATS,
    "logprobs": INTS,
    "prompt_logprobs": INTS,
    "logit_bias": st.one_of(st.dictionaries(TOKEN_IDS, FLOATS, max_size=3), INTS),
    "skip_special_tokens": INTS,
    "detokenize": INTS,
}
VALID_KW = st.fixed_dictionaries({}, optional=VALID)
ONE_WILD = st.sampled_from(sorted(WILD)).flatmap(lambda name: st.tuples(st.just(name), WILD[name]))
SAMPLING_KW = st.one_of(
    VALID_KW, st.builds(lambda d, nv: {**d, nv[0]: nv[1]}, VALID_KW, ONE_WILD), st.fixed_dictionaries({}, optional=WILD)
)


def test_every_sampling_value_is_rejected_or_served(engine):
    """Property: each combination of values is rejected with ValueError (SamplingParams or
    make_request) or runs steps on the tiny model without error. Any other exception, an
    error output or a failed step is a bug. One engine serves every example."""
    counts = {"rejected": 0, "served": 0}
    prompt = [1, 2, 3, 2, 1, 7, 7, 7]  # repeats, so penalties have something to act on

    @settings(
        max_examples=300,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=not FUZZ_RANDOM,
        database=None,
    )
    @given(SAMPLING_KW)
    def check(kw):
        try:
            params = SamplingParams(**kw)
            req = engine.make_request("prop", prompt, params)
        except ValueError:
            counts["rejected"] += 1
            return
        engine.enqueue(req)
        outs = []
        try:
            for _ in range(3):
                outs += [o for o in engine.step() if o.request_id == "prop"]
                if outs and outs[-1].finished:
                    break
        finally:
            engine.abort_request("prop")
            engine.step()  # retire it in the runner too
        assert outs and (outs[0].outputs[0].token_ids or params.max_tokens == 0), f"no token for {params}"
        assert all(o.error is None for o in outs), f"{params}: {outs[-1].error}"
        assert all(0 <= t < VOCAB for t in outs[-1].outputs[0].token_ids)
        assert_idle(engine)
        counts["served"] += 1

    check()
    assert counts["served"] >= 60 and counts["rejected"] >= 60, counts  # both sides were explored


# --------------------------------------------------------------------------- b. isolation


def _batch_params():
    """Greedy and seeded requests (re-runs of a step must not change what seeds draw)."""
    return [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
        if i % 3
        else SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True)
        for i in range(8)
    ]


def test_poisoned_requests_fail_alone_in_a_batch_of_eight(engine):
    params = _batch_params()
    want = run_all(engine, [engine.make_request(f"ref{i}", p, params[i]) for i, p in enumerate(PROMPTS)])
    assert_idle(engine)
    calls = {"n": 0}
    execute = engine.executor.execute_model

    def counted(sched):  # a pass-through that counts the model calls
        calls["n"] += 1
        return execute(sched)

    engine.executor.execute_model = counted
    try:
        poison = {2, 6}
        params = _batch_params()
        reqs = [engine.make_request(f"run{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
        for i in poison:
            smuggle(reqs[i].params)  # after validation, as a bug would
        got = run_all(engine, reqs)
    finally:
        engine.executor.execute_model = execute
    for i in range(8):
        out = got[f"run{i}"]
        if i in poison:
            assert out.error is not None and "IndexError" in out.error
            assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        else:
            assert out.error is None and out.outputs[0].finish_reason == "length"
            assert out.outputs[0].token_ids == want[f"ref{i}"].outputs[0].token_ids
    assert calls["n"] > 10  # 9 decode steps + the bisection's re-runs of the first
    assert_idle(engine)
    engine.step()  # the runner drops the state of the finished requests
    assert engine.executor.runner.states == {}


def test_unattributable_failure_raises_step_failed_error(engine):
    """Every request fails alone too: nothing is updated, StepFailedError names the step's
    requests; the caller fails them and the engine serves on once the executor works."""
    want = run_all(
        engine,
        [engine.make_request(f"w{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=5)) for i in range(3)],
    )
    reqs = [engine.make_request(f"u{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=5)) for i in range(3)]
    for r in reqs:
        engine.enqueue(r)
    runner, engine.executor.runner = engine.executor.runner, None  # every call fails
    try:
        with pytest.raises(StepFailedError) as info:
            engine.step()
    finally:
        engine.executor.runner = runner
    assert sorted(info.value.request_ids) == ["u0", "u1", "u2"]
    assert isinstance(info.value.__cause__, AttributeError)
    assert all(
        r.status is RequestStatus.RUNNING and r.num_computed_tokens == 0 and not r.output_token_ids for r in reqs
    )
    for r in reqs:
        assert engine.fail_request(r.request_id, str(info.value)).outputs[0].finish_reason == "error"
    assert_idle(engine)
    got = run_all(
        engine,
        [engine.make_request(f"v{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=5)) for i in range(3)],
    )
    assert [got[f"v{i}"].outputs[0].token_ids for i in range(3)] == [
        want[f"w{i}"].outputs[0].token_ids for i in range(3)
    ]
    assert_idle(engine)


def test_async_poisoned_stream_fails_alone(tiny_llama_path, engine):
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = run_all(engine, [engine.make_request(f"a{i}", PROMPTS[i], greedy) for i in range(6)])

    async def body(eng):
        poison = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

        async def poisoned():
            n = 0
            async for _ in eng.generate(PROMPTS[5], poison, request_id="poison"):
                n += 1
                if n == 3:
                    smuggle(poison, min_tokens=100)  # the next step's sampler fails for this request only
            return n

        tasks = [asyncio.create_task(collect(eng.generate(PROMPTS[i], greedy, request_id=f"s{i}"))) for i in range(5)]
        with pytest.raises(RuntimeError, match="IndexError"):
            await poisoned()
        outs = await asyncio.gather(*tasks)
        while eng.engine.has_unfinished_requests():
            await asyncio.sleep(0.01)
        return outs, eng

    outs, eng = arun(body, tiny_llama_path)
    for i, o in enumerate(outs):
        assert o[-1].finished and o[-1].outputs[0].token_ids == want[f"a{i}"].outputs[0].token_ids
    assert eng.errored is None
    assert_idle(eng.engine)


# --------------------------------------------------------------------------- c. the mixed-step budget


def test_auto_budget_is_the_default(tiny_llama_path, engine):
    assert engine.config.mixed_step_prefill_tokens is None and engine.mixed_budget is not None
    engine.add_request("auto-budget", list(range(1000, 1040)), SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished_requests():  # a prefill step, then decode-only steps
        engine.step()
    assert engine.mixed_budget.decode_s is not None and engine.mixed_budget.seconds_per_prefill_token
    engine.step()  # the scheduler takes the budget's measured cap at the start of a step
    assert engine.scheduler.mixed_prefill_tokens == engine.mixed_budget.tokens
    assert engine.mixed_budget.min_tokens <= engine.mixed_budget.tokens <= engine.config.max_num_batched_tokens
    with pytest.raises(ValueError, match="mixed_step_prefill_tokens"):
        EngineConfig(mixed_step_prefill_tokens=-1)
    with pytest.raises(ValueError, match="mixed_step_slowdown"):
        EngineConfig(mixed_step_slowdown=1.0)
    # with CUDA graphs a mixed step runs eagerly beside replayed decode steps: no measured cap
    assert MixedStepBudget.for_config(EngineConfig(device="cuda")) is None
    assert MixedStepBudget.for_config(EngineConfig(device="cuda", enforce_eager=True)) is not None
    assert MixedStepBudget.for_config(EngineConfig(device="cpu", mixed_step_prefill_tokens=0)) is None
    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=16, mixed_step_prefill_tokens=64)
    try:
        assert llm.engine.scheduler.mixed_prefill_tokens == 64 and llm.engine.mixed_budget is None
    finally:
        llm.engine.shutdown()
