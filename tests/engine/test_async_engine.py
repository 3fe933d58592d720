"""AsyncLLMEngine: streaming, batching of concurrent callers, cancellation and abort, errors.

Each test runs its own event loop (``asyncio.run``) around a fresh AsyncLLMEngine on the tiny
Llama; every wait is bounded so that a hang fails the test instead of blocking the run.
"""

from __future__ import annotations

import asyncio

import pytest
from tiny_models import run_async_engine

from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.async_engine import AsyncLLMEngine
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.request import RequestStatus

PROMPTS = ["The quick brown fox", "Once upon a time", "In the beginning was", "1, 2, 3,"]
TIMEOUT = 60


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(
        model=str(path), block_size=16, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64, max_model_len=512
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def run(coro_fn, path, **kw):
    """Run ``coro_fn(async_engine)`` on a fresh engine over ``path``, then shut it down."""
    return run_async_engine(coro_fn, make_engine(path, **kw), TIMEOUT)


def offline(engine: LLMEngine, prompt, params):
    rid = f"offline-{prompt}"
    engine.add_request(rid, prompt, params)
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out.outputs[0]


async def wait_until_idle(eng: AsyncLLMEngine, timeout=10.0):
    """Poll until no request is left in the engine and every KV block is free."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while loop.time() < end:
        s = eng.get_stats()
        if (
            not eng.engine.scheduler.requests
            and s["num_pending_requests"] == 0
            and s["free_kv_blocks"] == s["num_kv_blocks"]
        ):
            eng.engine.scheduler.kv.pool.check()
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {eng.engine.scheduler.requests}, {eng.get_stats()}")


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    """Offline greedy outputs of PROMPTS (plain, and with a stop string)."""
    engine = make_engine(tiny_llama_path)
    plain = [offline(engine, p, SamplingParams(temperature=0, max_tokens=12)) for p in PROMPTS]
    stop = plain[0].text[5:9]
    stopped = offline(engine, PROMPTS[0], SamplingParams(temperature=0, max_tokens=12, stop=stop))
    assert stopped.finish_reason == "stop" and len(stopped.text) < len(plain[0].text)
    engine.shutdown()
    return plain, stop, stopped


def test_stream_matches_offline(tiny_llama_path, reference):
    plain, stop, stopped = reference

    async def body(eng):
        results = []
        for params, want in (
            (SamplingParams(temperature=0, max_tokens=12), plain[0]),
            (SamplingParams(temperature=0, max_tokens=12, stop=stop), stopped),
        ):
            outs = [out async for out in eng.generate(PROMPTS[0], params)]
            results.append((outs, want))
        await wait_until_idle(eng)
        return results

    for outs, want in run(body, tiny_llama_path):
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert all(len(o.outputs[0].delta_token_ids) == 1 for o in outs)  # one update per token
        assert "".join(o.outputs[0].delta_text for o in outs) == want.text
        acc = ""
        for o in outs:
            acc += o.outputs[0].delta_text
            assert o.outputs[0].text == acc  # cumulative text is what was streamed so far
        final = outs[-1].outputs[0]
        assert final.token_ids == want.token_ids and final.finish_reason == want.finish_reason
        assert len(outs) == len(want.token_ids)


def test_concurrent_requests_are_batched(tiny_llama_path, reference):
    plain = reference[0]

    async def body(eng):
        async def consume(i):
            outs = [
                o
                async for o in eng.generate(
                    PROMPTS[i], SamplingParams(temperature=0, max_tokens=12), request_id=f"c{i}"
                )
            ]
            return outs[-1]

        finals = await asyncio.gather(*(consume(i) for i in range(len(PROMPTS))))
        await wait_until_idle(eng)
        return finals, eng.get_stats()

    finals, stats = run(body, tiny_llama_path)
    assert [f.request_id for f in finals] == [f"c{i}" for i in range(len(PROMPTS))]
    assert [f.outputs[0].token_ids for f in finals] == [p.token_ids for p in plain]
    assert [f.outputs[0].text for f in finals] == [p.text for p in plain]
    assert stats["max_running_batch"] >= 2
    assert stats["num_steps"] < sum(len(p.token_ids) for p in plain)  # steps were shared


def test_break_out_of_stream_aborts(tiny_llama_path):
    async def body(eng):
        got, req = 0, None
        async for out in eng.generate(
            PROMPTS[1], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), request_id="brk"
        ):
            req = req or eng.engine.scheduler.requests["brk"]
            got += 1
            if got == 3:
                break
        assert req.block_table  # still holding blocks right after the break
        await wait_until_idle(eng)
        # the engine keeps serving
        outs = [o async for o in eng.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4))]
        await wait_until_idle(eng)
        return req, outs

    req, outs = run(body, tiny_llama_path)
    assert req.status is RequestStatus.FINISHED_ABORTED
    assert req.num_output_tokens < 400 and req.block_table == []
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4


def test_cancelled_consumer_task_aborts(tiny_llama_path):
    async def body(eng):
        started = asyncio.Event()
        holder = {}

        async def consume():
            async for _ in eng.generate(
                PROMPTS[3], SamplingParams(temperature=0, max_tokens=400, ignore_eos=True), request_id="cancel-me"
            ):
                holder.setdefault("req", eng.engine.scheduler.requests.get("cancel-me"))
                started.set()

        other = asyncio.create_task(
            collect(eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)))
        )
        task = asyncio.create_task(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        outs = await other  # a batch mate is unaffected
        await wait_until_idle(eng)
        return holder["req"], outs

    req, outs = run(body, tiny_llama_path)
    assert req.status is RequestStatus.FINISHED_ABORTED and req.num_output_tokens < 400
    assert outs[-1].outputs[0].finish_reason == "length" and len(outs[-1].outputs[0].token_ids) == 20


async def collect(agen):
    return [o async for o in agen]


def test_abort_by_request_id(tiny_llama_path):
    async def body(eng):
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
        await asyncio.wait_for(task, 10)  # the consumer's stream ends, it does not hang
        await wait_until_idle(eng)
        # aborting a request that is still pending (never stepped) ends its stream too
        agen = eng.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=400), request_id="early")
        first = asyncio.create_task(agen.__anext__())
        await asyncio.sleep(0)  # let generate() queue the request
        eng.abort("early")
        early = [await asyncio.wait_for(first, 10)] + await asyncio.wait_for(collect(agen), 10)
        await wait_until_idle(eng)
        eng.abort("unknown-id")  # harmless
        return outs, early

    outs, early = run(body, tiny_llama_path)
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert len(outs[-1].outputs[0].token_ids) < 400
    assert early[-1].finished and early[-1].outputs[0].finish_reason == "abort"


def test_bad_request_fails_alone(tiny_llama_path, reference):
    plain = reference[0]

    async def body(eng):
        good = asyncio.create_task(
            collect(eng.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=12), request_id="good"))
        )
        await asyncio.sleep(0)
        with pytest.raises(ValueError, match="max_model_len"):
            async for _ in eng.generate(list(range(100, 100 + 600)), SamplingParams(max_tokens=4)):
                pass
        with pytest.raises(ValueError, match="request_id"):  # duplicate of a running request
            async for _ in eng.generate("x", SamplingParams(max_tokens=4), request_id="good"):
                pass
        outs = await good
        await wait_until_idle(eng)
        return outs

    outs = run(body, tiny_llama_path, max_model_len=512)
    assert outs[-1].outputs[0].token_ids == plain[2].token_ids


def test_failed_step_fails_its_requests_and_engine_recovers(tiny_llama_path, reference):
    plain = reference[0]

    async def body(eng):
        runner_exec = eng.engine.executor.execute_model
        calls = {"n": 0}

        def flaky(sched):
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("boom")
            return runner_exec(sched)

        eng.engine.executor.execute_model = flaky
        with pytest.raises(RuntimeError, match="boom"):
            await collect(eng.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=12)))
        await wait_until_idle(eng)
        return await collect(eng.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12)))

    outs = run(body, tiny_llama_path)
    assert outs[-1].outputs[0].token_ids == plain[3].token_ids


def test_stat_loggers_see_every_model_step(tiny_llama_path):
    """The engine reports each step's token counts to its stat loggers (the serving layer's
    rates, capacities and the autoscaler read these, not a wrapped executor)."""
    eng = make_engine(tiny_llama_path, max_num_batched_tokens=32, mixed_step_prefill_tokens=0)
    seen = []
    eng.stat_loggers.append(seen.append)
    eng.add_request("a", list(range(1000, 1040)), SamplingParams(max_tokens=3, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    eng.shutdown()
    # 40 prompt tokens in chunks of 32 + 8 (the second samples), then 2 decode steps
    assert [(m.num_prefill_tokens, m.num_decode_tokens, m.num_sampled) for m in seen] == [
        (32, 0, 0),
        (8, 0, 1),
        (0, 1, 1),
        (0, 1, 1),
    ]
    assert all(m.end >= m.start and m.num_running == 1 and m.num_waiting == 0 for m in seen)


def test_vllm_prompt_forms(tiny_llama_path):
    """`{"prompt": ...}` and `{"prompt_token_ids": [...]}` (vLLM's TextPrompt / TokensPrompt)
    give the same tokens as a plain string / id list, in LLM.generate and the async engine."""
    from kvserve.engine import LLM

    llm = LLM(model=str(tiny_llama_path), num_kv_blocks=32)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    ids = llm.engine.tokenize("The capital of France is")
    try:
        plain = llm.generate(["The capital of France is", ids], greedy, use_tqdm=False)
        forms = llm.generate(
            [{"prompt": "The capital of France is"}, {"prompt_token_ids": ids}], greedy, use_tqdm=False
        )
        single = llm.generate({"prompt_token_ids": ids}, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in forms] == [o.outputs[0].token_ids for o in plain]
        assert single[0].outputs[0].token_ids == plain[1].outputs[0].token_ids
        assert forms[0].prompt == "The capital of France is" and forms[1].prompt is None
        for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"text": "a"}, {"prompt": 5}, {}):
            with pytest.raises(ValueError, match="prompt"):
                llm.generate(bad, greedy, use_tqdm=False)
    finally:
        llm.engine.shutdown()

    async def run():
        eng = AsyncLLMEngine(make_engine(tiny_llama_path))
        try:
            outs = [o async for o in eng.generate({"prompt_token_ids": ids}, greedy)]
            return outs[-1].outputs[0].token_ids
        finally:
            await eng.shutdown()

    assert asyncio.run(run()) == plain[1].outputs[0].token_ids
