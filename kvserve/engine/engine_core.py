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
  finds them in its front and aborts afterwards, a step late). Grammar compilation and adapter
  loads run in the core's input thread, off the step loop, as the in-process engine runs them
  in its tokenizer thread.

The wire (one duplex ``multiprocessing`` pipe, pickled tuples):

* front -> core: ``("inputs", adds, aborts)`` (a list of :class:`~kvserve.engine.request.Request` made by
  the front's ``InputProcessor``, and request ids), ``("call", call_id, method, args)`` (the
  utility calls of :data:`CALLS`), ``("shutdown",)``.
* core -> front: ``("ready", CoreInfo)`` once, then **one** ``("outputs", EngineCoreOutputs)``
  per step (and one after inputs that produced outputs without a step: aborts, rejections),
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
from dataclasses import dataclass, field

from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.step_isolation import StepFailedError

logger = logging.getLogger("kvserve.engine_core")

#: Utility calls the front may make (``("call", id, method, args)``), answered from the core's
#: input thread (they are safe to run while a step runs: the in-process engine runs the same
#: calls from worker threads).
CALLS = frozenset({"add_lora", "remove_lora", "check_health", "get_stats"})
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
        rejected: ``(request_id, bad_input, message)`` of requests the core refused before they
            entered the scheduler; ``bad_input``: the error was a ``ValueError`` (a grammar that
            does not compile, an adapter that does not load), the front raises one.
        unknown_aborts: aborted ids the core did not hold (finished before the abort arrived).
        iteration_stats: the step's :class:`~kvserve.engine.stats.IterationStats` (for the front's stat
            loggers), empty when no model step ran.
        finished_stats: :class:`~kvserve.engine.stats.FinishedRequestStats` of requests that left.
        stats: :meth:`LLMEngine.get_stats` after the step.
        kv_events: ``(seq, batches)`` of :meth:`LLMEngine.take_kv_events` (``(0, [])`` with
            events off or none new).
    """

    outputs: list = field(default_factory=list)
    rejected: list[tuple[str, bool, str]] = field(default_factory=list)
    unknown_aborts: list[str] = field(default_factory=list)
    iteration_stats: list = field(default_factory=list)
    finished_stats: list = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    kv_events: tuple = (0, [])

    def __bool__(self) -> bool:
        return bool(self.outputs or self.rejected or self.unknown_aborts or self.iteration_stats
                    or self.finished_stats or self.kv_events[1])


def _slim(out):
    """``out`` without what the front already has (the prompt's ids and text)."""
    return dataclasses.replace(out, prompt_token_ids=[], prompt=None)


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
        """The input thread: receive messages, do the off-loop work of new requests (grammar
        compile, adapter load) and answer calls; hand the rest to the step loop. Ends (and
        stops the loop) when the front's end closes."""
        eng = self.engine
        while True:
            try:
                msg = self.conn.recv()
            except (EOFError, OSError):  # the front is gone
                self.inbox.put(("shutdown",))
                return
            kind = msg[0]
            if kind == "inputs":
                _, adds, aborts = msg
                ready, rejected = [], []
                for req in adds:
                    try:
                        if req.params.structured_outputs is not None:
                            req.grammar = eng.structured_outputs.request_grammar(req.params.structured_outputs,
                                req.params.reasoning_end_token_ids)
                        if req.lora_request is not None:
                            eng.add_lora(req.lora_request)
                        ready.append(req)
                    except Exception as e:
                        rejected.append((req.request_id, isinstance(e, ValueError), str(e)))
                self.inbox.put(("inputs", ready, aborts, rejected))
            elif kind == "call":
                _, call_id, method, args = msg
                if method in STEP_CALLS:
                    self.inbox.put(msg)
                    continue
                try:
                    if method not in CALLS:
                        raise ValueError(f"unknown engine core call {method!r}")
                    value = (eng.executor.check_health() if method == "check_health"
                             else getattr(eng, method)(*args))
                    reply = ("result", call_id, True, value)
                except Exception as e:
                    reply = ("result", call_id, False, (type(e).__name__, isinstance(e, ValueError), str(e)))
                self.send(reply)
            elif kind == "shutdown":
                self.inbox.put(msg)
                return

    # ---- the loop ---------------------------------------------------------------------
    def run(self) -> None:
        """Step until ``("shutdown",)`` or the front is gone."""
        threading.Thread(target=self.read_inputs, name="kvserve-core-inputs", daemon=True).start()
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
                out.rejected.append((req.request_id, isinstance(e, ValueError), str(e)))
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
                self.send(("dead", f"the executor failed its health check after a failed step: "
                                   f"{type(dead).__name__}: {dead}"))
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
        info = CoreInfo(engine.config, engine.model_path, engine.max_model_len, set(engine.eos_token_ids),
                        engine.hf_config.vocab_size, engine.get_stats(), os.getpid())
    except BaseException as e:
        conn.send(("error", type(e).__name__, isinstance(e, ValueError), str(e), traceback.format_exc()))
        conn.close()
        return
    conn.send(("ready", info))
    EngineCore(engine, conn).run()
    conn.close()
