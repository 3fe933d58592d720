"""Nothing a request sends can stall its engine: grammar compiles and adapter loads run in
bounded pools of their own (kvserve/engine/bounded_pool.py), never in the engine core's input
thread; a compile past ``compile_timeout_s`` fails its request alone; specs over a size limit
are refused before anything compiles; health checks are answered by a thread that does nothing
else, and a slow answer fails that probe only, never the engine.

Real components throughout: the real engine on the tiny test model, xgrammar compiling real
grammars (a 4 KB regex that takes xgrammar seconds: byte bounds alone cannot bound a compile),
the core in a real process. The one test hook (``XgrammarBackend.before_compile``) holds a
compile on an event so that "while a compile runs" is an event, not a guess about time.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import threading

import pytest

from kvserve.engine import EngineConfig, SamplingParams
from kvserve.engine.bounded_pool import BoundedPool, DeadlineExceededError, PoolFullError
from kvserve.engine.core_client import MPAsyncLLMEngine
from kvserve.engine.engine_core import EngineCore
from kvserve.engine.grammar_spec import GrammarLimits, check_limits
from kvserve.engine.llm_engine import LLMEngine

from tests.engine.test_engine_core_proc import LoopThread, collect, wait_until_idle

#: A 4 KB regex that xgrammar takes seconds to compile (~8 s on two cores): 199 alternatives of
#: counted repeats; far under every size limit.
SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 200)) + ")"
WAIT = 60  # bound of every wait (a hang fails the test instead of hanging it)


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


# ---- limits and the pool ------------------------------------------------------------------
def test_specs_over_a_size_limit_are_refused_naming_the_limit():
    lim = GrammarLimits(
        max_choices=3, max_choice_bytes=10, max_regex_bytes=8, max_grammar_bytes=20, max_json_schema_bytes=30
    )
    cases = [
        ({"choice": ["a", "b", "c", "d"]}, "max_choices"),
        ({"choice": ["aaaaaa", "bbbbbb"]}, "max_choice_bytes"),
        ({"regex": "[a-z]{1,99}x"}, "max_regex_bytes"),
        ({"grammar": 'root ::= "' + "x" * 20 + '"'}, "max_grammar_bytes"),
        ({"json": {"type": "object", "properties": {"name": {"type": "string"}}}}, "max_json_schema_bytes"),
    ]
    for spec, key in cases:
        with pytest.raises(ValueError, match=key):
            check_limits(spec, lim)
    check_limits({"choice": ["a", "b"]}, lim)  # within: nothing raised
    check_limits({"json_object": True}, lim)
    with pytest.raises(ValueError, match="max_choicez"):
        GrammarLimits.from_dict({"max_choicez": 1})
    with pytest.raises(ValueError, match="structured_outputs_config"):
        EngineConfig(structured_outputs_config={"compile_timeout_s": -1})


def test_pool_deadline_frees_the_caller_and_the_slot_and_a_full_queue_refuses():
    """A job that never returns (held on an event) fails at its deadline, its thread is replaced
    (the next job runs though the first still runs), abandoned threads are capped, and a full
    queue refuses at once."""
    pool = BoundedPool("grammar compile", workers=1, max_queued=1, max_abandoned=1, limit_name="max_queued_compiles")
    hold = threading.Event()
    try:
        stuck = pool.submit(hold.wait, deadline_s=0.05, deadline_message="past 0.05 s (compile_timeout_s)")
        with pytest.raises(DeadlineExceededError, match="compile_timeout_s"):
            stuck.result(WAIT)
        assert pool.submit(lambda: "next").result(WAIT) == "next"  # a fresh thread took the slot
        stuck2 = pool.submit(hold.wait, deadline_s=0.05)
        with pytest.raises(DeadlineExceededError):
            stuck2.result(WAIT)
        assert pool.stats()["abandoned"] == 2  # the cap (1) reached: no thread for new work now ...
        queued = pool.submit(lambda: "after")
        with pytest.raises(PoolFullError, match="max_queued_compiles"):  # ... and the bounded queue refuses
            pool.submit(lambda: "refused")
        hold.set()  # the stuck jobs return (their results ignored): a thread rejoins and runs the queue
        assert queued.result(WAIT) == "after"
    finally:
        hold.set()
        pool.shutdown()


# ---- the engine core, in a thread of this process, a compile held on an event ---------------
@pytest.fixture
def core_in_thread(tiny_llama_path):
    """An :class:`EngineCore` over a real engine, stepping in a thread, spoken to over a real
    pipe as the front speaks to it; its compiles of the regex ``held`` wait on ``hold``."""
    eng = LLMEngine(config(tiny_llama_path, structured_outputs_config={"compile_timeout_s": 30}))
    front, end = multiprocessing.Pipe(duplex=True)
    core = EngineCore(eng, end)
    hold, entered = threading.Event(), threading.Event()

    def before_compile(spec):
        if spec.get("regex") == "held":
            entered.set()
            assert hold.wait(WAIT)

    eng.structured_outputs.before_compile = before_compile
    th = threading.Thread(target=core.run, daemon=True)
    th.start()
    try:
        yield eng, core, front, hold, entered
    finally:
        hold.set()
        front.send(("shutdown",))
        th.join(WAIT)


def _req(eng, rid, spec=None, max_tokens=8):
    return eng.input_processor.process_inputs(
        rid, [1, 2, 3, 4], SamplingParams(max_tokens=max_tokens, temperature=0.0, structured_outputs=spec)
    )


def _recv_until(front, pred):
    """Messages from the core until ``pred(msg)``; all of them."""
    got = []
    while True:
        assert front.poll(WAIT), f"the core sent nothing for {WAIT} s; so far {got}"
        got.append(front.recv())
        if pred(got[-1]):
            return got


def _finished(msg, rid):
    return msg[0] == "outputs" and any(o.request_id == rid and o.finished for o in msg[1].outputs)


def test_core_serves_health_and_other_requests_while_a_compile_runs_and_an_abort_frees_it(core_in_thread):
    eng, core, front, hold, entered = core_in_thread
    front.send(("inputs", [_req(eng, "slow", {"regex": "held"})], []))
    assert entered.wait(WAIT)  # its compile is running now, and stays running until hold is set
    front.send(("call", 7, "check_health", ()))
    front.send(("inputs", [_req(eng, "plain", max_tokens=12)], []))
    msgs = _recv_until(front, lambda m: _finished(m, "plain"))
    assert ("result", 7, True, None) in msgs  # health answered while the compile was held
    assert [o for m in msgs if m[0] == "outputs" for o in m[1].outputs if o.request_id == "plain"][-1].error is None
    assert "slow" in core.preparing and not hold.is_set()  # ... and it still is
    front.send(("inputs", [], ["slow"]))  # the client went away during the compile
    msg = _recv_until(front, lambda m: _finished(m, "slow"))[-1]
    [out] = [o for o in msg[1].outputs if o.request_id == "slow"]
    assert out.outputs[0].finish_reason == "abort" and "slow" not in core.preparing  # it left the engine
    stats = msg[1].stats
    assert stats["num_running_requests"] == stats["num_waiting_requests"] == 0
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
    hold.set()  # the late compile result is ignored; a new grammar request compiles and runs
    front.send(("inputs", [_req(eng, "after", {"choice": ["yes", "no"]})], []))
    msgs = _recv_until(front, lambda m: _finished(m, "after"))
    [out] = [o for m in msgs if m[0] == "outputs" for o in m[1].outputs if o.request_id == "after" and o.finished]
    assert out.error is None and out.outputs[0].text in ("yes", "no")
    assert "slow" not in {o.request_id for m in msgs if m[0] == "outputs" for o in m[1].outputs}


def test_core_fails_a_compile_past_its_deadline_alone(tiny_llama_path):
    """Held past ``compile_timeout_s``: that request alone is refused (a ValueError naming the
    limit), the step loop and the next requests go on though its thread still runs."""
    eng = LLMEngine(config(tiny_llama_path, structured_outputs_config={"compile_timeout_s": 2.0, "compile_workers": 1}))
    # the next request's grammar compiled once before (xgrammar's cache, and the tokenizer's
    # automaton built): its compile below takes milliseconds, far inside the deadline however
    # loaded the machine is (the held one alone reaches it)
    eng.structured_outputs.compile({"regex": "(yes|no)"})
    front, end = multiprocessing.Pipe(duplex=True)
    core = EngineCore(eng, end)
    hold = threading.Event()
    eng.structured_outputs.before_compile = lambda spec: spec.get("regex") == "held" and hold.wait(WAIT)
    th = threading.Thread(target=core.run, daemon=True)
    th.start()
    try:
        front.send(("inputs", [_req(eng, "slow", {"regex": "held"})], []))
        msg = _recv_until(front, lambda m: m[0] == "outputs" and m[1].rejected)[-1]
        [(rid, kind, message)] = msg[1].rejected
        assert (rid, kind) == ("slow", "ValueError") and "compile_timeout_s" in message and "of 2 s" in message
        assert not hold.is_set() and "slow" not in core.preparing
        front.send(("inputs", [_req(eng, "next", {"regex": "(yes|no)"})], []))  # one worker, still stuck: a fresh one
        msgs = _recv_until(front, lambda m: _finished(m, "next") or (m[0] == "outputs" and m[1].rejected))
        assert not any(m[1].rejected for m in msgs if m[0] == "outputs")
    finally:
        hold.set()
        front.send(("shutdown",))
        th.join(WAIT)


# ---- the core in its own process, a real large grammar ---------------------------------------
@pytest.fixture(scope="module")
def mp_core(tiny_llama_path):
    lt = LoopThread()
    eng = lt.run(
        asyncio.to_thread(
            MPAsyncLLMEngine.from_config,
            config(tiny_llama_path, structured_outputs_config={"compile_timeout_s": 1.0}),
            None,
            2,
        )
    )
    try:
        yield lt, eng
    finally:
        os.kill(eng.core.proc.pid, signal.SIGCONT)  # in case a test stopped it
        lt.run(eng.shutdown())
        lt.close()


def test_a_real_slow_grammar_stalls_nothing_and_fails_alone_at_its_deadline(mp_core):
    lt, eng = mp_core

    async def main():
        loop = asyncio.get_running_loop()
        slow = loop.create_task(
            collect(eng.generate("x", SamplingParams(max_tokens=8, structured_outputs={"regex": SLOW_REGEX}), "slow"))
        )
        plain = [
            loop.create_task(collect(eng.generate(p, SamplingParams(max_tokens=24, temperature=0.0), f"p{i}")))
            for i, p in enumerate(["The quick brown fox", "Once upon a time"])
        ]
        await eng.check_health_async(timeout_s=5.0)  # answered beside the compile (it took the input thread before)
        outs = await asyncio.gather(*plain)
        with pytest.raises(ValueError, match="compile_timeout_s") as err:
            await slow
        assert "1 s" in str(err.value)
        # the compile's thread still runs (xgrammar cannot be stopped); other grammars compile beside it
        [*_, last] = await collect(
            eng.generate(
                "y",
                SamplingParams(max_tokens=4, temperature=0.0, structured_outputs={"choice": ["yes", "no"]}),
                "small",
            )
        )
        await eng.check_health_async(timeout_s=5.0)
        await wait_until_idle(eng)
        return outs, last

    outs, last = lt.run(main())
    assert all(o[-1].finished and o[-1].outputs[0].finish_reason == "length" for o in outs)
    assert last.outputs[0].text in ("yes", "no")
    assert eng.errored is None and eng.core.proc.is_alive()


async def _until_stopped(pid: int) -> None:
    """Until every thread of process ``pid`` is stopped (a signal is delivered asynchronously)."""
    for _ in range(10_000):
        states = {
            open(f"/proc/{pid}/task/{t}/stat").read().rsplit(")", 1)[1].split()[0]
            for t in os.listdir(f"/proc/{pid}/task")
        }
        if states <= {"T", "t"}:
            return
        await asyncio.sleep(0.001)
    raise AssertionError(f"process {pid} did not stop: {states}")


def test_a_slow_health_answer_fails_that_probe_only(mp_core):
    """The core process stopped (SIGSTOP): a probe times out, the engine is not marked dead,
    and the request in flight finishes once the core runs again."""
    lt, eng = mp_core

    async def main():
        stream = eng.generate("Hello there", SamplingParams(max_tokens=16, temperature=0.0), "inflight")
        first = await anext(stream)
        os.kill(eng.core.proc.pid, signal.SIGSTOP)
        await _until_stopped(eng.core.proc.pid)
        try:
            with pytest.raises(TimeoutError, match="busy, not dead"):
                await eng.check_health_async(timeout_s=0.5)
            assert eng.errored is None
        finally:
            os.kill(eng.core.proc.pid, signal.SIGCONT)
        rest = [o async for o in stream]
        await eng.check_health_async(timeout_s=10.0)
        return first, rest

    first, rest = lt.run(main())
    assert rest[-1].finished and rest[-1].error is None and rest[-1].outputs[0].finish_reason == "length"
    assert eng.errored is None and eng.core.proc.is_alive()
