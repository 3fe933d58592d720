"""Hardening of the engine against bad requests and broken executors, on the tiny Llama.

a. Validation: every SamplingParams value is rejected with a ValueError naming its field, or
   a request with it runs (property test over the whole parameter space).
b. Isolation: a request that fails inside a step fails alone; its batch mates produce
   exactly what they produce without it, and every KV block comes back.
c. A dead executor is a dead engine (EngineDeadError), a healthy one keeps serving.
d. Tokenization runs off the event loop.
e. Mixed steps (decodes + prefill) get a prefill cap sized from measured step times.
"""
from __future__ import annotations

import asyncio
import math
import time

import pytest
from tiny_models import run_async_engine
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import LLM, EngineConfig, SamplingParams
from engine.async_engine import EngineDeadError
from engine.layers.sampler import Sampler, SamplingRow
from engine.llm_engine import LLMEngine, chat_template_ids
from engine.step_isolation import StepFailedError
from engine.mixed_step_budget import MixedStepBudget
from engine.request import RequestStatus

VOCAB = 49152  # the tiny models use SmolLM2's tokenizer
TIMEOUT = 60
PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning was", "1, 2, 3,",
           "Hello there, how are", "A B C D E", "import torch\nimport", "The capital of France"]


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(model=str(path), block_size=16, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64,
               max_model_len=512)
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def assert_idle(engine: LLMEngine):
    assert engine.scheduler.requests == {} and not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_blocks
    kv.pool.check()


def run_all(engine: LLMEngine, reqs) -> dict:
    """Enqueue (request, ...) and step until all finish; returns {request_id: final output}."""
    for r in reqs:
        engine.enqueue(r)
    done = {}
    for _ in range(10_000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests never finished")


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


@pytest.mark.parametrize("field, value", [
    ("seed", 2**64), ("seed", -2**63 - 1), ("seed", 1.5), ("seed", True), ("top_k", True), ("top_k", 2.0),
    ("n", True), ("max_tokens", True), ("logprobs", 2.0), ("min_tokens", 1.0),
    ("temperature", math.nan), ("temperature", math.inf), ("top_p", math.nan), ("min_p", math.nan),
    ("presence_penalty", -math.inf), ("frequency_penalty", math.nan), ("repetition_penalty", math.inf),
    ("temperature", True), ("temperature", "1"), ("temperature", 2**2000), ("stop", 5), ("stop_token_ids", 7),
    ("stop_token_ids", [True]), ("stop_token_ids", [1.0]), ("ignore_eos", 1), ("detokenize", None),
])
def test_sampling_params_reject_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_probe_values_are_rejected_or_served(engine):
    """The hardening probe's values: seeds outside torch's range and out-of-vocabulary stop
    ids are rejected naming the field; a huge top_k and a top_p that rounds to 0 run."""
    for kw in (dict(seed=2**64), dict(seed=-2**63 - 1)):
        with pytest.raises(ValueError, match="^seed "):
            SamplingParams(**kw)
    for ids in ([10**7], [VOCAB], [5, 2**64]):
        with pytest.raises(ValueError, match="^stop_token_ids "):
            engine.make_request("x", [1, 2, 3], SamplingParams(stop_token_ids=ids, min_tokens=2))
    greedy = run_all(engine, [engine.make_request("g", PROMPTS[0], SamplingParams(temperature=0, max_tokens=6))])
    outs = run_all(engine, [
        engine.make_request("tk", PROMPTS[0], SamplingParams(top_k=2**64, seed=5, max_tokens=6)),
        engine.make_request("tk-off", PROMPTS[0], SamplingParams(top_k=-1, seed=5, max_tokens=6)),
        engine.make_request("tp", PROMPTS[0], SamplingParams(top_p=1e-300, max_tokens=6)),
        engine.make_request("tp2", PROMPTS[0], SamplingParams(top_p=5e-324, top_k=3, min_p=1.0, max_tokens=6)),
        engine.make_request("s-lo", PROMPTS[0], SamplingParams(seed=-2**63, max_tokens=6)),
        engine.make_request("s-neg", PROMPTS[0], SamplingParams(seed=-1, max_tokens=6)),
        engine.make_request("s-hi", PROMPTS[0], SamplingParams(seed=2**64 - 1, max_tokens=6)),
    ])
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


def test_sampler_restores_generators_when_it_raises():
    """A row that makes the draw raise (NaN logits) after a seeded row has drawn
    must leave that row's generator as it was, so a re-run of the step draws the same."""
    logits = torch.randn(2, 50)
    logits[1] = float("nan")
    gens = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
    before = [g.get_state().clone() for g in gens]
    rows = [SamplingRow(SamplingParams(seed=11), gens[0], [], [], []),
            SamplingRow(SamplingParams(seed=12), gens[1], [], [], [])]
    with pytest.raises(RuntimeError):
        Sampler()(logits, rows)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, before))
    want = Sampler()(logits[:1], rows[:1])[0]
    gens[0].set_state(before[0])
    assert Sampler()(logits[:1], rows[:1])[0] == want


# the whole SamplingParams space: values in range (boundaries, subnormals, huge ints where
# allowed) and wild ones of every type (out of range, NaN/inf, bool, float-for-int, None, str)
_HUGE = [2**64, 2**64 - 1, 2**63, 2**63 - 1, -2**63, -2**63 - 1, -2**64, 10**7, VOCAB, VOCAB - 1, 2**200]
_TINY = [5e-324, 1e-300, 1e-45, 1e-38, 1e-5, 1.00001e-5, 1 - 1e-12]
INTS = st.one_of(st.integers(-3, 40), st.integers(-2**70, 2**70), st.sampled_from(_HUGE), st.booleans(),
                 st.floats(allow_nan=True, allow_infinity=True), st.none(), st.text(max_size=2))
FLOATS = st.one_of(st.floats(-2.5, 11), st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
                   st.sampled_from([-0.0, math.nan, math.inf, -math.inf] + _TINY), st.integers(-2**70, 2**70),
                   st.booleans(), st.none())
TOKEN_IDS = st.one_of(st.integers(-2, 2**66), st.sampled_from(_HUGE), st.booleans(), st.floats(0, 10))


def unit(lo_open=False):
    """Floats in [0, 1] (or (0, 1]) with the boundaries and float32-underflowing values."""
    return st.one_of(st.floats(0, 1, exclude_min=lo_open), st.sampled_from(_TINY + [1.0]))


VALID = {
    "temperature": st.one_of(st.floats(0, 2), st.sampled_from([0, 1, 2] + _TINY)),
    "top_p": unit(lo_open=True), "min_p": unit(),
    "top_k": st.one_of(st.sampled_from([-1, 0, 1, 2, VOCAB - 1, VOCAB, 2**63, 2**64, 2**200]), st.integers(1, 2**70)),
    "max_tokens": st.one_of(st.none(), st.integers(0, 4), st.sampled_from([2**63, 2**64, 2**200])),
    "min_tokens": st.one_of(st.integers(0, 4), st.sampled_from([2**64, 2**200])),
    "stop": st.one_of(st.none(), st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=2)),
    "stop_token_ids": st.lists(st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([0, 2, 7, VOCAB - 1])),
                               max_size=4),
    "ignore_eos": st.booleans(),
    "seed": st.one_of(st.none(), st.integers(-2**63, 2**64 - 1), st.sampled_from([-2**63, -1, 0, 2**63, 2**64 - 1])),
    "presence_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, 2, 5e-324])),
    "frequency_penalty": st.one_of(st.floats(-2, 2), st.sampled_from([-2, 2, -5e-324])),
    "repetition_penalty": st.one_of(st.floats(0, 10, exclude_min=True), st.sampled_from([10] + _TINY)),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.integers(0, VOCAB - 1), st.one_of(
        st.floats(-100, 100), st.sampled_from([-100, 100, 0, 5e-324])), max_size=4)),
    "skip_special_tokens": st.booleans(), "include_stop_str_in_output": st.booleans(), "detokenize": st.booleans(),
}
WILD = {
    "n": INTS, "temperature": FLOATS, "top_p": FLOATS, "top_k": INTS, "min_p": FLOATS, "max_tokens": INTS,
    "min_tokens": INTS, "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2), INTS),
    "stop_token_ids": st.one_of(st.lists(TOKEN_IDS, min_size=1, max_size=4), INTS),
    "ignore_eos": INTS, "seed": st.one_of(st.integers(-2**64 - 2, 2**64 + 2), INTS),
    "presence_penalty": FLOATS, "frequency_penalty": FLOATS, "repetition_penalty": FLOATS, "logprobs": INTS,
    "prompt_logprobs": INTS, "logit_bias": st.one_of(st.dictionaries(TOKEN_IDS, FLOATS, max_size=3), INTS),
    "skip_special_tokens": INTS, "detokenize": INTS,
}
VALID_KW = st.fixed_dictionaries({}, optional=VALID)
ONE_WILD = st.sampled_from(sorted(WILD)).flatmap(lambda name: st.tuples(st.just(name), WILD[name]))
SAMPLING_KW = st.one_of(VALID_KW, st.builds(lambda d, nv: {**d, nv[0]: nv[1]}, VALID_KW, ONE_WILD),
                        st.fixed_dictionaries({}, optional=WILD))


def test_every_sampling_value_is_rejected_or_served(engine):
    """Property: each combination of values is rejected with ValueError (SamplingParams or
    make_request) or runs steps on the tiny model without error. Any other exception, an
    error output or a failed step is a bug. One engine serves every example."""
    counts = {"rejected": 0, "served": 0}
    prompt = [1, 2, 3, 2, 1, 7, 7, 7]  # repeats, so penalties have something to act on

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
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
    return [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) if i % 3 else
            SamplingParams(temperature=1.0, seed=100 + i, max_tokens=10, ignore_eos=True) for i in range(8)]


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
    want = run_all(engine, [engine.make_request(f"w{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=5))
                            for i in range(3)])
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
    assert all(r.status is RequestStatus.RUNNING and r.num_computed_tokens == 0 and not r.output_token_ids
               for r in reqs)
    for r in reqs:
        assert engine.fail_request(r.request_id, str(info.value)).outputs[0].finish_reason == "error"
    assert_idle(engine)
    got = run_all(engine, [engine.make_request(f"v{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=5))
                           for i in range(3)])
    assert [got[f"v{i}"].outputs[0].token_ids for i in range(3)] == [want[f"w{i}"].outputs[0].token_ids
                                                                        for i in range(3)]
    assert_idle(engine)


def test_llm_generate_leaves_nothing_behind_when_a_step_fails(tiny_llama_path):
    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=64, max_model_len=256)
    try:
        want = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        runner, llm.engine.executor.runner = llm.engine.executor.runner, None
        try:
            with pytest.raises(StepFailedError):
                llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        finally:
            llm.engine.executor.runner = runner
        assert_idle(llm.engine)
        got = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    finally:
        llm.engine.shutdown()


# --------------------------------------------------------------------------- async: isolation, dead engine


def arun(coro_fn, path, **kw):
    """Run ``coro_fn(async_engine)`` on a fresh engine over ``path``, then shut it down."""
    return run_async_engine(coro_fn, make_engine(path, **kw), TIMEOUT)


async def collect(agen):
    return [o async for o in agen]


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

        tasks = [asyncio.create_task(collect(eng.generate(PROMPTS[i], greedy, request_id=f"s{i}")))
                 for i in range(5)]
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


def test_dead_executor_kills_the_engine(tiny_llama_path):
    async def body(eng):
        assert not eng.is_running
        eng.check_health()  # fine before the first request
        started = asyncio.Event()
        seen = {}

        async def stream(i):
            n = 0
            try:
                async for _ in eng.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True),
                                            request_id=f"d{i}"):
                    n += 1
                    seen[i] = n
                    if len(seen) == 3:
                        started.set()
            except EngineDeadError as e:
                return e
            return None

        tasks = [asyncio.create_task(stream(i)) for i in range(3)]
        await started.wait()
        assert eng.is_running
        eng.engine.executor.runner = None  # the worker is gone: every step fails, the health check too
        errors = await asyncio.gather(*tasks)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert all(n < 200 for n in seen.values())
        assert isinstance(eng.errored, EngineDeadError)
        with pytest.raises(EngineDeadError, match="runner is gone"):
            eng.check_health()
        t0 = time.perf_counter()
        with pytest.raises(EngineDeadError):  # at once, before tokenizing or queueing
            await eng.generate("hello", SamplingParams(max_tokens=2)).__anext__()
        assert time.perf_counter() - t0 < 0.5
        for _ in range(100):
            if not eng.is_running:
                break
            await asyncio.sleep(0.01)
        assert not eng.is_running
        assert eng.engine.scheduler.requests == {}  # every request was failed
        return True

    assert arun(body, tiny_llama_path)


def test_mark_dead_and_loop_death_are_engine_death(tiny_llama_path):
    async def body(eng):
        agen = eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
        await agen.__anext__()
        eng.mark_dead(TimeoutError("worker 1 did not answer"))
        with pytest.raises(EngineDeadError, match="worker 1"):
            await collect(agen)
        with pytest.raises(EngineDeadError):
            eng.check_health()
        return True

    assert arun(body, tiny_llama_path)

    async def body2(eng):
        await collect(eng.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2)))
        eng.engine.has_unfinished_requests = None  # an engine bug: the loop itself raises
        agen = eng.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=2))
        with pytest.raises(EngineDeadError, match="loop"):
            await collect(agen)
        assert not eng.is_running
        with pytest.raises(EngineDeadError, match="loop"):
            eng.check_health()
        return True

    assert arun(body2, tiny_llama_path)


def test_healthy_executor_failure_fails_the_step_only(tiny_llama_path):
    """Every request fails alone in one step, but the executor is healthy: those requests
    fail, the engine stays up and serves the next request."""
    async def body(eng):
        execute = eng.engine.executor.execute_model
        state = {"broken": False}

        def maybe_broken(sched):
            if state["broken"] and sched.requests:
                raise RuntimeError("transient")
            return execute(sched)

        eng.engine.executor.execute_model = maybe_broken
        streams = [eng.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
                   for i in range(2)]
        for s in streams:
            await s.__anext__()
        state["broken"] = True
        for s in streams:
            with pytest.raises(RuntimeError, match="transient"):
                await collect(s)
        state["broken"] = False
        eng.check_health()
        assert eng.errored is None
        outs = await collect(eng.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=3)))
        return outs

    outs = arun(body, tiny_llama_path)
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3


# --------------------------------------------------------------------------- d. tokenization off the loop


def test_tokenization_does_not_stall_the_event_loop(tiny_llama_path):
    text = "The quick brown fox jumps over the lazy dog. " * 30000  # ~1.35 MB, ~300k tokens

    async def body(eng):
        loop = asyncio.get_running_loop()
        # another stream runs while the huge prompt is tokenized
        tokens_during = []
        big_running = asyncio.Event()

        async def streamer():
            async for o in eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True,
                                                                    detokenize=False), request_id="bg"):
                if big_running.is_set():
                    tokens_during.append(loop.time())
        bg = asyncio.create_task(streamer())
        while eng.engine.scheduler.requests.get("bg") is None:
            await asyncio.sleep(0.01)

        lag = {"max": 0.0}
        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                t = loop.time()
                await asyncio.sleep(0.01)
                lag["max"] = max(lag["max"], loop.time() - t - 0.01)

        tick = asyncio.create_task(ticker())
        big_running.set()
        t0 = loop.time()
        with pytest.raises(ValueError, match="max_model_len"):  # too long, found after tokenizing it
            await collect(eng.generate(text, SamplingParams(max_tokens=1)))
        took = loop.time() - t0
        stop.set()
        await tick
        n_during = len(tokens_during)
        bg.cancel()
        msgs = [{"role": "user", "content": "hi there"}]
        ids = await eng.apply_chat_template(msgs)
        return took, lag["max"], n_during, ids, eng.tokenizer, msgs

    took, max_lag, n_during, ids, tok, msgs = arun(body, tiny_llama_path)
    assert took > 0.3, took  # tokenizing took long enough to matter
    assert max_lag < took / 4 and max_lag < 0.25, (max_lag, took)
    assert n_during >= 5  # the other stream kept getting tokens
    assert ids == chat_template_ids(tok, msgs)


# --------------------------------------------------------------------------- e. mixed-step prefill budget


def test_mixed_step_budget_from_step_times():
    b = MixedStepBudget(slowdown=3.0, max_tokens=2048)
    assert b.tokens == 256  # nothing measured yet
    b.record(2048 * 1.6e-3, 2048, 0)  # a prefill-only step: 1.6 ms per token
    assert b.tokens == 256  # no decode-only step yet
    for _ in range(20):
        b.record(0.05, 0, 8)  # decode-only steps of 50 ms
    assert math.isclose(b.decode_s, 0.05)
    assert b.tokens == int(2 * 0.05 / 1.6e-3)  # 62 tokens take 2 x 50 ms more than a decode step
    # mixed steps with a fixed overhead E of 30 ms: the budget converges to steps of 3 x D
    for _ in range(60):
        n = b.tokens
        b.record(0.05 + 0.03 + n * 1.6e-3, n, 8)
    assert abs((0.05 + 0.03 + b.tokens * 1.6e-3) / 0.05 - 3.0) < 0.1
    fast = MixedStepBudget(slowdown=3.0, max_tokens=512)
    fast.record(0.001, 2048, 0)
    fast.record(0.005, 0, 8)
    assert fast.tokens == 512  # clamped to the step budget
    slow = MixedStepBudget(slowdown=1.5, max_tokens=512)
    slow.record(20.0, 100, 0)
    slow.record(0.005, 0, 8)
    assert slow.tokens == slow.min_tokens == 8  # at least min_tokens, so prefills progress


def test_mixed_step_cap_keeps_outputs_and_bounds_prefill(tiny_llama_path):
    """A long prompt arriving while two streams decode is chunked at the cap in steps that
    carry decodes; greedy outputs equal those of the uncapped engine."""
    long_prompt = list(range(1000, 1300))
    outs = {}
    for cap in (0, 16):
        eng = make_engine(tiny_llama_path, mixed_step_prefill_tokens=cap, enable_prefix_caching=False)
        try:
            steps = []
            schedule = eng.scheduler.schedule

            def recording(schedule=schedule, steps=steps):
                out = schedule()
                steps.append([(len(sr.token_ids), sr.new is None and len(sr.token_ids) == 1) for sr in out.requests])
                return out

            eng.scheduler.schedule = recording
            for i in range(2):
                eng.add_request(f"s{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            eng.step()
            eng.step()
            got = run_all(eng, [eng.make_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=4))])
            outs[cap] = {k: v.outputs[0].token_ids for k, v in got.items()}
            mixed = [s for s in steps if any(d for _, d in s)]
            prefill = [sum(n for n, d in s if not d) for s in mixed]
            if cap:
                assert max(prefill) == 16 and sum(prefill) == 300
            else:
                assert max(prefill) == 254  # the whole budget after the two decodes
        finally:
            eng.shutdown()
    assert outs[0] == outs[16]


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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_without_memory_for_a_kv_cache_is_refused(tiny_llama_path):
    """A second engine in a process whose first one took half the GPU, asking for 30 %: no
    memory is left under its gpu_memory_utilization, so it is a ValueError that says so (never a
    one-block engine that refuses every prompt); the first engine keeps serving."""
    import gc

    first = LLM(str(tiny_llama_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.5, enforce_eager=True)
    assert first.engine.max_model_len == first.engine.hf_config.max_position_embeddings
    with pytest.raises(ValueError, match="no GPU memory left for the KV cache.*gpu_memory_utilization 0.3"):
        LLM(str(tiny_llama_path), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=True)
    out = first.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 8
    del first, out
    gc.collect()
    torch.cuda.empty_cache()
