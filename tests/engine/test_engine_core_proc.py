"""The engine core process (kvserve/engine/engine_core.py) behind MPAsyncLLMEngine (kvserve/engine/core_client.py):
the same streams as the in-process engine, aborts that free the core's blocks, errors that reach
the caller as the in-process engine raises them, stats and stat loggers from the core's
messages, and a core that dies taking only its own requests with it.

One core serves the module (its event loop runs in a thread of its own); every wait is bounded.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvserve.engine.core_client import MPAsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning was", "1, 2, 3,"]
TIMEOUT = 60


def config(path, **kw) -> EngineConfig:
    cfg = dict(
        model=str(path),
        block_size=16,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        num_kv_blocks=64,
        max_model_len=512,
        dtype="float32",
    )
    cfg.update(kw)
    return EngineConfig(**cfg)


class LoopThread:
    """An event loop in a daemon thread; ``run(coro)`` waits (bounded) for its result."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coro, timeout=TIMEOUT):
        return asyncio.run_coroutine_threadsafe(asyncio.wait_for(coro, timeout), self.loop).result(timeout + 5)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


async def collect(agen):
    return [o async for o in agen]


async def wait_until_idle(eng, timeout=10.0):
    """Until the core reports no request and every KV block free."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        s = eng.get_stats()
        if (
            s["num_running_requests"] == 0
            and s["num_waiting_requests"] == 0
            and s["num_pending_requests"] == 0
            and s["free_kv_blocks"] == s["num_kv_blocks"]
            and not eng._in_core
        ):
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.get_stats()}, in core: {list(eng._in_core)}")


@pytest.fixture(scope="module")
def core(tiny_llama_path):
    lt = LoopThread()
    eng = lt.run(asyncio.to_thread(MPAsyncLLMEngine.from_config, config(tiny_llama_path, enable_lora=True), None, 2))
    try:
        yield lt, eng
    finally:
        lt.run(eng.shutdown())
        lt.close()
        assert not eng.core.proc.is_alive()


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """The in-process AsyncLLMEngine's outputs: each prompt greedy, and prompt 0 with a stop string."""

    async def body():
        eng = AsyncLLMEngine(LLMEngine(config(tiny_llama_path)))
        try:
            plain = [await collect(eng.generate(p, SamplingParams(temperature=0, max_tokens=12))) for p in PROMPTS]
            stop = plain[0][-1].outputs[0].text[5:9]
            stopped = await collect(eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=stop)))
            return plain, stop, stopped
        finally:
            await eng.shutdown()

    return asyncio.run(body())


def _stream(outs):
    """What a client sees of a stream: per output, the deltas, the cumulative tokens, finish reason."""
    return [
        (
            o.outputs[0].delta_text,
            o.outputs[0].delta_token_ids,
            o.outputs[0].token_ids,
            o.finished,
            o.outputs[0].finish_reason,
            o.outputs[0].stop_reason,
        )
        for o in outs
    ]


def test_streams_equal_the_in_process_engine(core, reference):
    lt, eng = core
    plain, stop, stopped = reference
    assert eng.core.proc.pid != os.getpid() and eng.core.proc.is_alive()
    if sys.platform.startswith("linux"):  # named for top / ps and the benchmarks' CPU split
        assert Path(f"/proc/{eng.core.proc.pid}/comm").read_text().strip() == "kvserve-core"

    async def body():
        concurrent = await asyncio.gather(
            *(collect(eng.generate(p, SamplingParams(temperature=0, max_tokens=12))) for p in PROMPTS)
        )
        with_stop = await collect(eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=stop)))
        return concurrent, with_stop, await wait_until_idle(eng)

    concurrent, with_stop, stats = lt.run(body())
    for got, want in zip(concurrent, plain):
        assert [o.outputs[0].token_ids for o in got][-1] == want[-1].outputs[0].token_ids
        assert got[-1].outputs[0].text == want[-1].outputs[0].text
        assert got[-1].prompt_token_ids == want[-1].prompt_token_ids and got[-1].prompt == want[-1].prompt
    assert _stream(with_stop) == _stream(stopped)
    assert with_stop[-1].outputs[0].finish_reason == "stop"
    assert stats["max_running_batch"] >= 2  # the concurrent requests shared steps in the core


def test_aborts_free_the_cores_blocks(core):
    lt, eng = core

    async def body():
        got = 0
        async for _ in eng.generate(
            PROMPTS[1], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), request_id="brk"
        ):
            got += 1
            if got == 3:
                busy = eng.get_stats()
                break
        after_break = await wait_until_idle(eng)

        outs = []

        async def consume():
            async for o in eng.generate(
                PROMPTS[0], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), request_id="victim"
            ):
                outs.append(o)

        task = asyncio.create_task(consume())
        while len(outs) < 2:
            await asyncio.sleep(0.005)
        eng.abort("victim")
        await asyncio.wait_for(task, 10)
        # a request aborted before it reached the core ends too
        agen = eng.generate(PROMPTS[2], SamplingParams(max_tokens=400), request_id="early")
        first = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0)
        eng.abort("early")
        early = [await asyncio.wait_for(first, 10)] + await collect(agen)
        eng.abort("unknown-id")  # harmless
        return busy, after_break, outs, early, await wait_until_idle(eng)

    busy, after_break, outs, early, idle = lt.run(body())
    assert busy["free_kv_blocks"] < busy["num_kv_blocks"]  # the core held blocks for it
    assert after_break["free_kv_blocks"] == after_break["num_kv_blocks"]
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400
    assert early[-1].finished and early[-1].outputs[0].finish_reason == "abort"
    assert idle["num_running_requests"] == 0


def test_bad_requests_raise_as_in_process(core, reference):
    lt, eng = core
    plain = reference[0]

    async def body():
        good = asyncio.create_task(
            collect(eng.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12), request_id="good"))
        )
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="max_model_len"):  # the front's validation
            await collect(eng.generate(list(range(100, 700)), SamplingParams(max_tokens=4)))
        with pytest.raises(ValueError, match="request_id"):
            await collect(eng.generate("x", SamplingParams(max_tokens=4), request_id="good"))
        with pytest.raises(ValueError):  # the core's grammar compiler refuses it
            await collect(eng.generate("x", SamplingParams(max_tokens=4, structured_outputs={"regex": "(unclosed"})))
        with pytest.raises(ValueError):  # the core does not load the adapter
            from kvserve.engine.lora import LoRARequest

            await collect(eng.generate("x", SamplingParams(max_tokens=4), lora_request=LoRARequest("a", 1, "/nope")))
        outs = await good
        await wait_until_idle(eng)
        return outs

    assert lt.run(body())[-1].outputs[0].token_ids == plain[2][-1].outputs[0].token_ids


def test_stat_loggers_get_the_cores_steps(core):
    lt, eng = core
    steps, finished = [], []

    async def body():
        eng.add_stat_logger(steps.append, finished.append)
        try:
            before = eng.get_stats()["num_steps"]
            await collect(
                eng.generate(list(range(1000, 1040)), SamplingParams(max_tokens=3, ignore_eos=True), request_id="stats")
            )
            return before, (await wait_until_idle(eng))["num_steps"]
        finally:
            eng.engine.stat_loggers.remove(steps.append)
            eng.engine.request_loggers.remove(finished.append)

    before, after = lt.run(body())
    assert len(steps) == after - before == 3  # one prefill step, two decode steps
    assert [(m.num_prefill_tokens, m.num_sampled) for m in steps] == [(40, 1), (0, 1), (0, 1)]
    assert [f.num_generation_tokens for f in finished] == [3] and finished[0].finish_reason == "length"


def test_a_config_the_engine_refuses_raises_in_the_front(tiny_llama_path):
    with pytest.raises(ValueError, match="max_model_len"):
        MPAsyncLLMEngine.from_config(config(tiny_llama_path, max_model_len=4096))


def test_a_dead_core_fails_its_requests_and_refuses_new_ones(tiny_llama_path):
    async def body():
        eng = await asyncio.to_thread(MPAsyncLLMEngine.from_config, config(tiny_llama_path), None, 1)
        try:
            outs = []

            async def consume():
                async for o in eng.generate(PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True)):
                    outs.append(o)
                    if len(outs) == 2:
                        os.kill(eng.core.proc.pid, signal.SIGKILL)

            with pytest.raises(EngineDeadError):
                await consume()
            with pytest.raises(EngineDeadError):
                await collect(eng.generate(PROMPTS[1], SamplingParams(max_tokens=4)))
            with pytest.raises(EngineDeadError):
                eng.check_health()
            return outs
        finally:
            await eng.shutdown()

    outs = asyncio.run(asyncio.wait_for(body(), TIMEOUT))
    # outputs the core sent before SIGKILL landed may still arrive after it (a fast decode step
    # had a third one on the way, full suite at 58bbdf5); none may say the request finished
    assert len(outs) >= 2 and not any(o.finished for o in outs)
