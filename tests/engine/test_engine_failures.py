"""Failures below the requests, on the tiny Llama: a step that raises leaves the sampler's seeded
generators as they were and ``LLM.generate`` nothing behind; a dead executor is a dead engine
(EngineDeadError for every stream, new requests refused at once), a healthy executor's failure
fails that step's requests only; a CUDA engine left no GPU memory for a KV cache is refused.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from _hardening_helpers import PROMPTS, arun, assert_idle, collect
from kvserve.engine import LLM, SamplingParams
from kvserve.engine.async_engine import EngineDeadError
from kvserve.engine.layers.sampler import Sampler, SamplingRow
from kvserve.engine.step_isolation import StepFailedError


def test_sampler_restores_generators_when_it_raises():
    """A row that makes the draw raise (NaN logits) after a seeded row has drawn
    must leave that row's generator as it was, so a re-run of the step draws the same."""
    logits = torch.randn(2, 50)
    logits[1] = float("nan")
    gens = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(12)]
    before = [g.get_state().clone() for g in gens]
    rows = [
        SamplingRow(SamplingParams(seed=11), gens[0], [], [], []),
        SamplingRow(SamplingParams(seed=12), gens[1], [], [], []),
    ]
    with pytest.raises(RuntimeError):
        Sampler()(logits, rows)
    assert all(torch.equal(g.get_state(), s) for g, s in zip(gens, before))
    want = Sampler()(logits[:1], rows[:1])[0]
    gens[0].set_state(before[0])
    assert Sampler()(logits[:1], rows[:1])[0] == want


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


# --------------------------------------------------------------------------- a dead engine


def test_dead_executor_kills_the_engine(tiny_llama_path):
    async def body(eng):
        assert not eng.is_running
        eng.check_health()  # fine before the first request
        started = asyncio.Event()
        seen = {}

        async def stream(i):
            n = 0
            try:
                async for _ in eng.generate(
                    PROMPTS[i], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), request_id=f"d{i}"
                ):
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
        made = []  # the tokenizer thread's work (tokenize, validate, build the request)
        real_make = eng._make_request
        eng._make_request = lambda *a, **kw: made.append(a) or real_make(*a, **kw)
        with pytest.raises(EngineDeadError):  # at once, before tokenizing or queueing
            await eng.generate("hello", SamplingParams(max_tokens=2), request_id="late").__anext__()
        assert made == [] and "late" not in eng._queues and "late" not in eng.engine.scheduler.requests
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
        streams = [
            eng.generate(PROMPTS[i], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)) for i in range(2)
        ]
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


# --------------------------------------------------------------------------- no memory for a KV cache


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
