"""The engine core process: one :class:`LLMEngine` stepping in a process of its own (vLLM V1's
``EngineCoreProc``, our code).

Why a process: in the serving replica every streamed token's Python work (Serve's replica loop,
per-stream messages, metrics) runs on the event loop, and while it holds the GIL the thread that
steps the model waits for it between two torch ops, with the CPU's OpenMP threads idle. A core
process has a GIL of its own: the replica's Python never stalls a step.

What runs where:

* **Front** (:class:`kvserve.engine.core_client.MPAsyncLLMEngine`, in the replica): prompt parsing,
  tokenization and validation (``InputProcessor``), the per-request streams, stat loggers.
* **Core** (this module, a ``spawn`` child): the scheduler, the model and sampler, grammars,
  LoRA slots, detokenization and stop strings (:class:`kvserve.engine.output_processor.OutputProcessor`
  stays beside the scheduler, which acts on the stop strings it finds in the same step; vLLM
  finds them in its front and aborts afterwards, a step late).

The core's threads: the **step loop** (the main thread); the **input thread**, which only
receives messages and hands them on, so an abort or a new request is never queued behind slow
work; the **health thread**, which answers ``check_health`` calls and does nothing else; and
the pools of slow work a request brings (:class:`~kvserve.engine.bounded_pool.BoundedPool`):
grammar compiles (``StructuredOutputs.compile_pool``: bounded queue, ``compile_timeout_s``
deadline) and adapter loads (:attr:`EngineCore.adapter_pool`, which also runs ``add_lora`` /
``remove_lora`` calls, in order). A request whose grammar compiles or adapter loads waits in
:attr:`EngineCore.preparing`; it enters the scheduler when ready, is refused alone when its
grammar fails, is over a limit, runs past the deadline or finds a pool full, and an abort
meanwhile ends it at once (an ``abort`` output; the late compile result is ignored).

The wire (one duplex ``multiprocessing`` pipe, pickled tuples):

* front -> core: ``("inputs", adds, aborts)`` (a list of :class:`~kvserve.engine.request.Request` made by
  the front's ``InputProcessor``, and request ids), ``("call", call_id, method, args)`` (the
  utility calls of :data:`CALLS`), ``("shutdown",)``.
* core -> front: ``("ready", CoreInfo)`` once, then **one** ``("outputs", EngineCoreOutputs)``
  per step (and one after inputs that produced outputs without a step: aborts, rejections,
  requests refused after their compile),
  ``("result", call_id, ok, value)`` per call, and ``("dead", message)`` before it exits
  because the engine is broken.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import threading
import traceback
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field

from kvserve.engine.bounded_pool import BoundedPool, PoolFullError
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.step_isolation import StepFailedError

logger = logging.getLogger("kvserve.engine_core")

#: Utility calls the front may make (``("call", id, method, args)``), answered off the step loop
#: (safe while a step runs: the in-process engine runs the same calls from worker threads):
#: ``check_health`` in the health thread, ``add_lora`` / ``remove_lora`` in the adapter pool (in
#: order), ``get_stats`` in the input thread.
CALLS = frozenset({"add_lora", "remove_lora", "check_health", "get_stats"})
#: Adapter loads (a request's, or ``add_lora`` calls) waiting for the adapter thread; more are refused.
MAX_QUEUED_ADAPTER_LOADS = 64
#: How the core names a refusal's error (``EngineCoreOutputs.rejected``) and what the front raises.
REJECTION_TYPES = {"ValueError": ValueError, "PoolFullError": PoolFullError, "RuntimeError": RuntimeError}
#: Calls answered from the step loop, between two steps (they read or change the scheduler's state).
STEP_CALLS = frozenset({"kv_cache_snapshot", "reset_prefix_cache", "export_kv_blocks", "import_kv_blocks"})


@dataclass
class CoreInfo:
    """What the front needs from the built engine (sent once, in ``("ready", info)``).

    Attributes:
        config: the engine's :class:`~kvserve.engine.config.EngineConfig` with ``dtype`` resolved.
        model_path: the model folder the core loaded.
        max_model_len: longest prompt + output, tokens.
        eos_token_ids: the ids that end generation.
        vocab_size: rows of the embedding.
        stats: :meth:`LLMEngine.get_stats` right after start.
        pid: the core process's id.
    """

    config: object
    model_path: str
    max_model_len: int
    eos_token_ids: set[int]
    vocab_size: int
    stats: dict[str, float]
    pid: int


@dataclass
class EngineCoreOutputs:
    """Everything one step (or one batch of inputs) produced, in one message (vLLM's
    ``EngineCoreOutputs``).

    Attributes:
        outputs: a :class:`~kvserve.engine.request.RequestOutput` per request that got tokens,
            finished, failed or was aborted, with ``prompt_token_ids`` emptied (the front holds
            them) and ``prompt`` None.
        rejected: ``(request_id, error type, message)`` of requests the core refused before they
            entered the scheduler; the type is a key of :data:`REJECTION_TYPES`: ``ValueError``
            (a grammar that does not compile, is over a size limit or ran past the compile
            deadline, an adapter that does not load), ``PoolFullError`` (a compile or adapter
            queue is full), else ``RuntimeError``; the front raises that type.
        unknown_aborts: aborted ids the core did not hold (finished before the abort arrived).
        iteration_stats: the step's :class:`~kvserve.engine.stats.IterationStats` (for the front's stat
            loggers), empty when no model step ran.
        finished_stats: :class:`~kvserve.engine.stats.FinishedRequestStats` of requests that left.
        stats: :meth:`LLMEngine.get_stats` after the step.
        kv_events: ``(seq, batches)`` of :meth:`LLMEngine.take_kv_events` (``(0, [])`` with
            events off or none new).
    """

    outputs: list = field(default_factory=list)
    rejected: list[tuple[str, str, str]] = field(default_factory=list)
    unknown_aborts: list[str] = field(default_factory=list)
    iteration_stats: list = field(default_factory=list)
    finished_stats: list = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    kv_events: tuple = (0, [])

    def __bool__(self) -> bool:
        return bool(
            self.outputs
            or self.rejected
            or self.unknown_aborts
            or self.iteration_stats
            or self.finished_stats
            or self.kv_events[1]
        )


def _slim(out):
    """``out`` without what the front already has (the prompt's ids and text)."""
    return dataclasses.replace(out, prompt_token_ids=[], prompt=None)


def _rejection(request_id: str, error: BaseException) -> tuple[str, str, str]:
    """An ``EngineCoreOutputs.rejected`` entry for ``error``."""
    kind = (
        "PoolFullError"
        if isinstance(error, PoolFullError)
        else "ValueError"
        if isinstance(error, ValueError)
        else "RuntimeError"
    )
    return request_id, kind, str(error)


class _Preparing:
    """A request whose grammar compiles or whose adapter loads (:attr:`EngineCore.preparing`)."""

    __slots__ = ("req", "future", "pool")

    def __init__(self, req):
        self.req = req
        self.future: Future | None = None  # the stage now running
        self.pool: BoundedPool | None = None  # ... and its pool (to cancel it)


class EngineCore:
    """The core's loop over one :class:`~kvserve.engine.llm_engine.LLMEngine`: apply the inputs that
    arrived, step while requests are unfinished, send one :class:`EngineCoreOutputs` per step;
    block on the inbox when idle (no busy wait: an idle core costs no CPU).

    Args:
        engine: the built engine (its stat and request loggers are taken over here).
        conn: the core's end of the pipe (``send``/``recv`` of pickled tuples).

    A failed step follows :class:`~kvserve.engine.async_engine.AsyncLLMEngine`'s rule: if the executor
    still passes its health check the step's requests fail alone, otherwise the core sends
    ``("dead", message)`` and stops.
    """

    def __init__(self, engine, conn):
        self.engine, self.conn = engine, conn
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        #: requests whose grammar compiles or adapter loads, by id (not yet in the scheduler)
        self.preparing: dict[str, _Preparing] = {}
        self._prep_lock = threading.RLock()  # a stage may end inside submit (its callback runs at once)
        #: adapter loads (requests' and ``add_lora`` / ``remove_lora`` calls): one thread, in order
        self.adapter_pool = BoundedPool(
            "adapter load", 1, MAX_QUEUED_ADAPTER_LOADS, max_abandoned=0, limit_name="MAX_QUEUED_ADAPTER_LOADS"
        )
        self._health_calls: queue.SimpleQueue = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._iteration: list = []
        self._finished: list = []
        engine.stat_loggers.append(self._iteration.append)
        engine.request_loggers.append(self._finished.append)
        self._stopping = False

    # ---- the pipe ---------------------------------------------------------------------
    def send(self, msg: tuple) -> None:
        with self._send_lock:
            self.conn.send(msg)

    def read_inputs(self) -> None:
        """The input thread: receive messages and hand them on (nothing slow runs here): new
        requests without a grammar or adapter, and aborts, to the step loop; the others to
        their pools (:meth:`_prepare`); ``check_health`` to the health thread, adapter calls to
        the adapter pool, step calls to the step loop. Ends (and stops the loop) when the
        front's end closes."""
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the front is gone
                self._health_calls.put(None)
                self.inbox.put(("shutdown",))
                return
            kind = msg[0]
            if kind == "inputs":
                _, adds, aborts = msg
                ready, rejected = [], []
                for req in adds:
                    if req.params.structured_outputs is None and req.lora_request is None:
                        ready.append(req)
                        continue
                    try:
                        self._prepare(req)
                    except Exception as e:  # over a limit, a pool full: refused alone, at once
                        rejected.append(_rejection(req.request_id, e))
                for rid in aborts:
                    req = self._stop_preparing(rid)
                    if req is not None:  # it enters and leaves at once: an "abort" output, blocks never taken
                        req.grammar = None
                        ready.append(req)
                self.inbox.put(("inputs", ready, aborts, rejected))
            elif kind == "call":
                _, call_id, method, args = msg
                if method in STEP_CALLS:
                    self.inbox.put(msg)
                elif method == "check_health":
                    self._health_calls.put(call_id)
                elif method in ("add_lora", "remove_lora"):
                    try:
                        fut = self.adapter_pool.submit(getattr(self.engine, method), *args)
                    except PoolFullError as e:
                        self._reply(call_id, None, e)
                        continue
                    fut.add_done_callback(lambda f, cid=call_id: self._reply(cid, *_outcome(f)))
                elif method in CALLS:
                    self._reply(call_id, *_outcome_of(getattr(self.engine, method), *args))
                else:
                    self._reply(call_id, None, ValueError(f"unknown engine core call {method!r}"))
            elif kind == "shutdown":
                self._health_calls.put(None)
                self.inbox.put(msg)
                return

    def answer_health(self) -> None:
        """The health thread: answer each ``check_health`` call with the executor's own check,
        nothing else (never behind a compile, an adapter load or the input thread's work)."""
        while True:
            call_id = self._health_calls.get()
            if call_id is None:
                return
            self._reply(call_id, *_outcome_of(self.engine.executor.check_health))

    def _reply(self, call_id: int, value, error: BaseException | None) -> None:
        if error is None:
            reply = ("result", call_id, True, value)
        else:
            reply = ("result", call_id, False, (type(error).__name__, isinstance(error, ValueError), str(error)))
        try:
            self.send(reply)
        except (OSError, ValueError):  # the front is gone
            pass

    # ---- requests with slow work: grammar compile, adapter load -----------------------------
    def _prepare(self, req) -> None:
        """Start ``req``'s grammar compile (then its adapter load) in their pools; it enters
        the step loop when both are done (:meth:`_done`).

        Raises:
            ValueError: a spec over a size limit; PoolFullError: a full queue (nothing started).
        """
        p = _Preparing(req)
        with self._prep_lock:
            self.preparing[req.request_id] = p
        try:
            if req.params.structured_outputs is not None:
                so = self.engine.structured_outputs
                self._stage(
                    p,
                    so.compile_pool,
                    so.submit_request_grammar(req.params.structured_outputs, req.params.reasoning_end_token_ids),
                    "grammar",
                )
            else:
                self._load_adapter(p)
        except BaseException:
            with self._prep_lock:
                self.preparing.pop(req.request_id, None)
            raise

    def _stage(self, p: _Preparing, pool: BoundedPool, fut: Future, stage: str) -> None:
        p.future, p.pool = fut, pool
        fut.add_done_callback(lambda f: self._done(p, f, stage))

    def _load_adapter(self, p: _Preparing) -> None:
        self._stage(p, self.adapter_pool, self.adapter_pool.submit(self.engine.add_lora, p.req.lora_request), "adapter")

    def _done(self, p: _Preparing, fut: Future, stage: str) -> None:
        """A stage of ``p`` ended (in a pool's thread, its deadline watchdog's, or the input
        thread's cancel): hand the request on, or refuse it; ignored if it was aborted meanwhile."""
        rid = p.req.request_id
        try:
            value, error = fut.result(), None
        except CancelledError:
            return  # aborted: _stop_preparing took it
        except Exception as e:
            value, error = None, e
        if error is None and stage == "grammar":
            p.req.grammar = value
            if p.req.lora_request is not None:
                try:
                    with self._prep_lock:
                        if self.preparing.get(rid) is not p:
                            return
                        self._load_adapter(p)
                    return
                except PoolFullError as e:
                    error = e
        with self._prep_lock:
            if self.preparing.get(rid) is not p:
                return  # aborted meanwhile: the late result is dropped
            del self.preparing[rid]
            if error is None:
                self.inbox.put(("inputs", [p.req], [], []))
            else:
                p.req.grammar = None
                self.inbox.put(("inputs", [], [], [_rejection(rid, error)]))

    def _stop_preparing(self, request_id: str):
        """The request ``request_id`` if it was preparing (its stage is stopped: a queued job
        dropped, a running one left to finish unheard), else None."""
        with self._prep_lock:
            p = self.preparing.pop(request_id, None)
        if p is None:
            return None
        if p.future is not None:
            p.pool.cancel(p.future)
        return p.req

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Step until ``("shutdown",)`` or the front is gone."""
        threading.Thread(target=self.read_inputs, name="kvserve-core-inputs", daemon=True).start()
        threading.Thread(target=self.answer_health, name="kvserve-core-health", daemon=True).start()
        eng = self.engine
        while not self._stopping:
            out = EngineCoreOutputs()
            self._apply(self.inbox.get() if not eng.has_unfinished_requests() else None, out)
            while True:  # everything else that has arrived, without waiting
                try:
                    self._apply(self.inbox.get_nowait(), out)
                except queue.Empty:
                    break
            if self._stopping:
                break
            if eng.has_unfinished_requests():
                if not self._step(out):
                    return
            self._flush(out)
        self.adapter_pool.shutdown()
        eng.shutdown()

    def _apply(self, msg: tuple | None, out: EngineCoreOutputs) -> None:
        if msg is None:
            return
        if msg[0] == "shutdown":
            self._stopping = True
            return
        if msg[0] == "call":  # a STEP_CALLS method, between two steps
            _, call_id, method, args = msg
            try:
                reply = ("result", call_id, True, getattr(self.engine, method)(*args))
            except Exception as e:
                reply = ("result", call_id, False, (type(e).__name__, isinstance(e, ValueError), str(e)))
            self._flush(out)  # the events up to the snapshot's seq go before the answer
            out.__init__()
            self.send(reply)
            return
        _, ready, aborts, rejected = msg
        eng = self.engine
        out.rejected += rejected
        for req in ready:
            try:
                eng.enqueue(req)
            except Exception as e:
                out.rejected.append(_rejection(req.request_id, e))
        for rid in aborts:
            final = eng.abort_request(rid)
            if final is None:
                out.unknown_aborts.append(rid)
            else:
                out.outputs.append(final)

    def _step(self, out: EngineCoreOutputs) -> bool:
        """One step into ``out``; False when the engine is dead (``("dead", ...)`` sent)."""
        eng = self.engine
        try:
            out.outputs += eng.step()
            return True
        except Exception as error:
            logger.exception("engine step failed")
            try:
                eng.executor.check_health()
            except Exception as dead:
                self.send(
                    ("dead", f"the executor failed its health check after a failed step: {type(dead).__name__}: {dead}")
                )
                return False
            ids = error.request_ids if isinstance(error, StepFailedError) else list(eng.scheduler.requests)
            msg = f"engine step failed: {type(error).__name__}: {error}"
            for rid in ids:
                final = eng.fail_request(rid, msg)
                if final is not None:
                    out.outputs.append(final)
            return True

    def _merge_events(self, prev: tuple) -> tuple:
        seq, batches = self.engine.take_kv_events()
        return (seq, prev[1] + batches) if batches else prev

    def _flush(self, out: EngineCoreOutputs) -> None:
        out.kv_events = self._merge_events(out.kv_events)
        out.iteration_stats, self._iteration[:] = list(self._iteration), []
        out.finished_stats, self._finished[:] = list(self._finished), []
        if not out:
            return
        out.outputs = [_slim(o) for o in out.outputs]
        out.stats = self.engine.get_stats()
        self.send(("outputs", out))


def _outcome(fut: Future) -> tuple:
    """``(value, None)`` or ``(None, exception)`` of a resolved future."""
    try:
        return fut.result(), None
    except BaseException as e:  # noqa: BLE001 (sent to the front)
        return None, e


def _outcome_of(fn, *args) -> tuple:
    """``(fn(*args), None)`` or ``(None, exception)``."""
    try:
        return fn(*args), None
    except Exception as e:
        return None, e


#: The core process's title (``/proc/PID/comm``, what ``top`` and ``ps -o comm`` show); vLLM's is
#: ``VLLM::EngineCore``, but a Linux title holds 15 bytes.
PROCESS_TITLE = "kvserve-core"


def set_process_title(title: str) -> bool:
    """Name this process ``title`` (at most 15 bytes) for ``top``, ``ps -o comm`` and the
    benchmarks that split CPU time by process, with ``prctl(PR_SET_NAME)``; Linux only, best
    effort. Returns whether it was set."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(15, title.encode()[:15], 0, 0, 0) == 0  # 15: PR_SET_NAME
    except (OSError, AttributeError):
        return False


def run_engine_core(conn, config, torch_num_threads: int | None = None) -> None:
    """The core process's entry point (``multiprocessing`` ``spawn`` target): build the engine
    on this (main) thread, which then runs every step, send ``("ready", CoreInfo)`` (or
    ``("error", type name, is a ValueError, message, traceback)`` if it does not build), then loop.

    Args:
        conn: the core's end of a duplex ``multiprocessing.Pipe``.
        config: :class:`~kvserve.engine.config.EngineConfig` (one rank: the in-process executor).
        torch_num_threads: torch's intra-op threads (None: torch's default for this process).
    """
    set_process_title(PROCESS_TITLE)  # before torch starts its threads, which inherit the name
    import torch

    if torch_num_threads:
        torch.set_num_threads(torch_num_threads)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        engine = LLMEngine(config)
        info = CoreInfo(
            engine.config,
            engine.model_path,
            engine.max_model_len,
            set(engine.eos_token_ids),
            engine.hf_config.vocab_size,
            engine.get_stats(),
            os.getpid(),
        )
    except BaseException as e:
        conn.send(("error", type(e).__name__, isinstance(e, ValueError), str(e), traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", info))
    EngineCore(engine, conn).run()
    conn.close()
