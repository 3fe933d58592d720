"""The front of an engine core process (vLLM V1's ``AsyncLLM`` over ``AsyncMPClient``, our code):
:class:`MPAsyncLLMEngine` is an :class:`~kvserve.engine.async_engine.AsyncLLMEngine` whose engine steps in
a child process (:mod:`kvserve.engine.engine_core`), so nothing the serving process does with the GIL can
stall a step.

The front tokenizes and validates prompts (its own :class:`~kvserve.engine.input_processor.InputProcessor`,
in the tokenizer thread), sends new requests and aborts to the core in one message per event-loop
turn, and a reader thread receives the core's one message per step and hands it to the event
loop, which fans the outputs out to the per-request streams and calls the stat loggers.
"""

from __future__ import annotations

import asyncio
import builtins
import concurrent.futures
import itertools
import logging
import multiprocessing
import threading
from collections import deque
from collections.abc import Callable

from kvserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvserve.engine.config import EngineConfig
from kvserve.engine.engine_core import REJECTION_TYPES, CoreInfo, EngineCoreOutputs, run_engine_core
from kvserve.engine.input_processor import InputProcessor, parse_prompt, prompt_cache_salt
from kvserve.engine.llm_engine import KV_EVENT_BACKLOG
from kvserve.engine.model_loader import load_config, load_tokenizer
from kvserve.engine.request import Request

logger = logging.getLogger("kvserve.core_client")

#: Seconds to wait for the core to leave after ``shutdown`` before it is terminated.
SHUTDOWN_GRACE_S = 10.0


def _remote_error(name: str, bad_input: bool, message: str) -> Exception:
    """The front's exception for one the core raised: the same built-in type, else ``ValueError``
    for a ``ValueError`` subclass, else ``RuntimeError``."""
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = ValueError if bad_input else RuntimeError
    return cls(message)


class EngineCoreProcess:
    """A running core process and its pipe: start, blocking utility calls, stop.

    Args:
        config: the engine's configuration (one rank: the core runs the in-process executor).
        torch_num_threads: torch's intra-op threads in the core (None: torch's default there).

    Raises:
        (constructor) the engine's own error if it does not build in the core (a ``ValueError``
        for a bad config, the same built-in type for the others it can name, else
        ``RuntimeError``), or ``RuntimeError`` if the process dies first.
    """

    def __init__(self, config: EngineConfig, torch_num_threads: int | None = None):
        ctx = multiprocessing.get_context("spawn")  # nothing inherited: torch's pools, locks, Ray's state
        self.conn, child = ctx.Pipe(duplex=True)
        self._send_lock = threading.Lock()
        self._stop_lock = threading.Lock()  # stop() runs from mark_dead's thread and shutdown at once
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._ids = itertools.count()
        self.proc = ctx.Process(
            target=run_engine_core, args=(child, config, torch_num_threads), name="kvserve-engine-core", daemon=True
        )
        self.proc.start()
        child.close()
        try:
            self.info: CoreInfo = self._wait_ready()
        except BaseException:
            self.stop(grace_s=0)
            raise

    def _wait_ready(self) -> CoreInfo:
        while not self.conn.poll(0.5):
            if not self.proc.is_alive():
                raise RuntimeError(f"the engine core process exited while starting (exit code {self.proc.exitcode})")
        try:
            msg = self.conn.recv()
        except (EOFError, OSError) as e:
            raise RuntimeError(f"the engine core process exited while starting (exit code {self.proc.exitcode})") from e
        if msg[0] == "error":
            _, name, bad_input, message, tb = msg
            logger.error("the engine did not build in its core process:\n%s", tb)
            raise _remote_error(name, bad_input, message)
        return msg[1]

    def send(self, msg: tuple) -> None:
        """Send one message (any thread).

        Raises:
            EngineDeadError: the pipe is closed (the core is gone).
        """
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, ValueError) as e:
            raise EngineDeadError(f"the engine core process is gone: {e}") from e

    def call(self, method: str, *args, timeout_s: float | None = None):
        """Run ``method`` of :data:`kvserve.engine.engine_core.CALLS` in the core; blocking (call it from a
        worker thread on an event loop).

        Raises:
            the core's exception of the same built-in type (``ValueError`` ...), else RuntimeError;
            TimeoutError: no answer within ``timeout_s`` seconds;
            EngineDeadError: the core is gone.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._ids)
        self._calls[cid] = fut
        try:
            self.send(("call", cid, method, args))
            return fut.result(timeout_s)
        except concurrent.futures.TimeoutError as e:
            raise TimeoutError(f"the engine core did not answer {method} within {timeout_s}s") from e
        finally:
            self._calls.pop(cid, None)

    async def call_async(self, method: str, *args, timeout_s: float | None = None):
        """:meth:`call` without a thread: await the core's answer on the event loop.

        Raises:
            as :meth:`call`.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        cid = next(self._ids)
        self._calls[cid] = fut
        try:
            self.send(("call", cid, method, args))
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout_s)
        except TimeoutError as e:
            raise TimeoutError(f"the engine core did not answer {method} within {timeout_s}s") from e
        finally:
            self._calls.pop(cid, None)

    def answer(self, call_id: int, ok: bool, value) -> None:
        """A ``("result", ...)`` message arrived (reader thread)."""
        fut = self._calls.pop(call_id, None)
        if fut is None:
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(_remote_error(*value))

    def fail_calls(self, error: BaseException) -> None:
        """The core is gone: every waiting call raises ``error``."""
        for cid in list(self._calls):
            fut = self._calls.pop(cid, None)
            if fut is not None and not fut.done():
                fut.set_exception(error)

    def stop(self, grace_s: float = SHUTDOWN_GRACE_S) -> None:
        """Ask the core to leave, wait up to ``grace_s`` seconds, then terminate (and kill) it.
        Idempotent, and safe from several threads at once (one stops, the others wait for it)."""
        with self._stop_lock:
            self._stop(grace_s)

    def _stop(self, grace_s: float) -> None:
        if self.proc.is_alive() and grace_s > 0:
            try:
                self.send(("shutdown",))
            except EngineDeadError:
                pass
            self.proc.join(grace_s)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


class CoreProxy:
    """What the serving layer reads of the engine (``async_engine.engine``) when the engine is in
    a core process: its facts (config, model folder, lengths, HF config, tokenizer) and the calls
    that reach the core (adapters, stats, health)."""

    def __init__(self, core: EngineCoreProcess, tokenizer):
        info = core.info
        self.core = core
        self.config: EngineConfig = info.config
        self.model_path: str = info.model_path
        self.max_model_len: int = info.max_model_len
        self.eos_token_ids: set[int] = info.eos_token_ids
        self.hf_config = load_config(info.model_path)
        self.tokenizer = tokenizer
        self.input_processor = InputProcessor(
            tokenizer,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            max_model_len=info.max_model_len,
            enable_lora=info.config.enable_lora,
        )
        #: called with each step's :class:`~kvserve.engine.stats.IterationStats` (on the event loop)
        self.stat_loggers: list[Callable] = []
        #: called with each :class:`~kvserve.engine.stats.FinishedRequestStats` (on the event loop)
        self.request_loggers: list[Callable] = []
        self.executor = self  # ``executor.check_health()``: the core's executor answers
        #: :meth:`LLMEngine.get_stats` of the core after its latest step (set by the front)
        self.stats: dict[str, float] = dict(info.stats)
        self._kv_batches: deque = deque(maxlen=KV_EVENT_BACKLOG)  # KV event batches from the core's outputs
        self._kv_seq = 0
        self._kv_lock = threading.Lock()

    def add_kv_events(self, seq: int, batches: list) -> None:
        """Batches up to number ``seq`` arrived from the core (the front's reader)."""
        with self._kv_lock:
            self._kv_batches.extend(batches)
            self._kv_seq = seq

    def take_kv_events(self) -> tuple[int, list]:
        """As :meth:`LLMEngine.take_kv_events`, from what the core sent."""
        with self._kv_lock:
            out = list(self._kv_batches)
            self._kv_batches.clear()
            return self._kv_seq, out

    def kv_cache_snapshot(self) -> tuple[int, object]:
        """As :meth:`LLMEngine.kv_cache_snapshot`, taken in the core between two steps (blocking;
        the batches up to its seq arrive before it)."""
        return self.core.call("kv_cache_snapshot")

    def export_kv_blocks(self, block_hashes: list[int]) -> list:
        """As :meth:`LLMEngine.export_kv_blocks`, in the core between two steps (blocking)."""
        return self.core.call("export_kv_blocks", block_hashes)

    def import_kv_blocks(self, blocks: list) -> int:
        """As :meth:`LLMEngine.import_kv_blocks`, in the core between two steps (blocking)."""
        return self.core.call("import_kv_blocks", blocks)

    def reset_prefix_cache(self) -> bool:
        """As :meth:`LLMEngine.reset_prefix_cache`, in the core between two steps (blocking)."""
        return self.core.call("reset_prefix_cache")

    def get_stats(self) -> dict[str, float]:
        """The core's :meth:`LLMEngine.get_stats` after its latest step (a copy)."""
        return dict(self.stats)

    def add_lora(self, lora_request) -> None:
        """Load an adapter in the core (blocking; see ``LLMEngine.add_lora``).

        Raises:
            ValueError: LoRA is off or the adapter does not load.
        """
        self.core.call("add_lora", lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter in the core (blocking; see ``LLMEngine.remove_lora``)."""
        return self.core.call("remove_lora", lora_int_id)

    def check_health(self, timeout_s: float | None = 30.0) -> None:
        """The core's executor answers its health check (blocking).

        Raises:
            EngineDeadError, TimeoutError, or the executor's error.
        """
        self.core.call("check_health", timeout_s=timeout_s)


class MPAsyncLLMEngine(AsyncLLMEngine):
    """:class:`AsyncLLMEngine`'s interface over an engine core process (:mod:`kvserve.engine.engine_core`).

    Same streams, aborts, errors and stats as the in-process engine; what differs:

    * ``engine`` is a :class:`CoreProxy` (no scheduler to reach into);
    * :meth:`get_stats` is the core's snapshot after its latest step (:meth:`CoreProxy.get_stats`,
      plus the front's pending);
    * stat loggers run on the event loop, from the step's message;
    * the engine dies (:class:`EngineDeadError` for every request) when the core process exits
      or its executor fails its health check; a core slow to answer :meth:`check_health_async`
      fails that probe only (``TimeoutError``), never the engine.

    Build it with :meth:`from_config`. One rank only: a tensor- or pipeline-parallel engine's
    ranks are processes already (its executor's), so it steps in the serving process.
    """

    def __init__(self, core: EngineCoreProcess):  # noqa: D107 (no super().__init__: there is no LLMEngine here)
        self.core = core
        self.tokenizer = load_tokenizer(core.info.model_path)
        self.engine = CoreProxy(core, self.tokenizer)
        self.input_processor = self.engine.input_processor  # built over self.tokenizer
        self.input_processor.keep_base_tokenizer()  # the tokenizer threads' copies; self.tokenizer the loop's
        self._init_front()
        self._tok_pool.warm(lambda: self.input_processor.tokenizer)  # per-thread copies made now
        #: request id -> (prompt token ids, prompt text) of requests sent to the core
        self._in_core: dict[str, tuple[list[int], str | None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._broken_loggers: set[int] = set()
        self._health_probe: asyncio.Future | None = None  # the core's health call in flight (shared)
        self._reader = threading.Thread(target=self._read, name="kvserve-core-outputs", daemon=True)
        self._reader.start()

    @classmethod
    def from_config(
        cls, config: EngineConfig, executor_factory: Callable | None = None, torch_num_threads: int | None = None
    ) -> "MPAsyncLLMEngine":
        """Start a core process that builds the engine of ``config`` and wait until it is ready.

        Raises:
            ValueError: ``executor_factory`` given or more than one rank (the core builds its own
                in-process executor); and what :class:`EngineCoreProcess` raises.
        """
        if executor_factory is not None or config.tensor_parallel_size * config.pipeline_parallel_size > 1:
            raise ValueError("an engine core process runs one rank with its own executor")
        return cls(EngineCoreProcess(config, torch_num_threads))

    # ---- what differs from the in-process front --------------------------------------------
    async def kv_cache_snapshot(self) -> tuple[int, object]:
        """As :meth:`AsyncLLMEngine.kv_cache_snapshot`, from the core (batches up to its seq may
        still be on their way to :meth:`take_kv_events`: skip them by number)."""
        return await asyncio.to_thread(self.engine.kv_cache_snapshot)

    async def reset_prefix_cache(self) -> bool:
        return await asyncio.to_thread(self.engine.reset_prefix_cache)

    async def export_kv_blocks(self, block_hashes: list[int]) -> list:
        return await asyncio.to_thread(self.engine.export_kv_blocks, block_hashes)

    async def import_kv_blocks(self, blocks: list) -> int:
        return await asyncio.to_thread(self.engine.import_kv_blocks, blocks)

    def check_health(self) -> None:
        """As :meth:`AsyncLLMEngine.check_health`, and the core process is alive.

        Raises:
            EngineDeadError: the engine is dead, shut down, or its process exited.
        """
        if self.errored is None and not self._closed and not self.core.proc.is_alive():
            self.mark_dead(RuntimeError(f"exit code {self.core.proc.exitcode}"), "the engine core process exited")
        super().check_health()

    async def check_health_async(self, timeout_s: float = 30.0) -> None:
        """:meth:`check_health`, then the core's executor answers its health check within
        ``timeout_s`` seconds. The core answers it in a thread that does nothing else (never
        behind a grammar compile or an adapter load). Concurrent probes share one call to the
        core, so a flood of ``/health`` probes costs the core one check.

        Only a real failure kills the engine: the core process gone, or its executor's check
        raising. A core that is merely slow to answer fails this probe alone (``TimeoutError``);
        the engine and its requests go on (Serve's periodic check, which waits longer, fails
        too if the core stays silent, and Serve then replaces the replica).

        Raises:
            EngineDeadError: the engine is dead (now or found dead by this probe).
            TimeoutError: the core did not answer within ``timeout_s`` (the engine lives on).
        """
        self.check_health()
        loop = asyncio.get_running_loop()
        probe = self._health_probe
        if probe is None or probe.done() or probe.get_loop() is not loop:
            probe = self._health_probe = loop.create_task(self.core.call_async("check_health"))
            probe.add_done_callback(lambda t: t.cancelled() or t.exception())  # read: no "never retrieved" warning
        try:
            await asyncio.wait_for(asyncio.shield(probe), timeout_s)
        except TimeoutError:
            raise TimeoutError(
                f"the engine core did not answer a health check within {timeout_s:g} s "
                f"(busy, not dead: its requests go on)"
            ) from None
        except EngineDeadError as e:
            self.check_health()  # the process exited: the reader marks it dead
            self.mark_dead(e, "the engine core process is gone")
            raise self._dead_error() from e
        except Exception as e:  # the executor's own check raised: a real failure
            self.mark_dead(e, "the engine core's executor failed its health check")
            raise self._dead_error() from e

    def mark_dead(self, cause: BaseException, reason: str = "the engine is dead") -> None:
        """As :meth:`AsyncLLMEngine.mark_dead`; the core process is stopped too."""
        if self.errored is not None:
            return
        super().mark_dead(cause, reason)
        self._in_core.clear()
        self.core.fail_calls(self._dead_error())
        threading.Thread(target=self.core.stop, kwargs={"grace_s": 0}, daemon=True).start()

    async def shutdown(self) -> None:
        await self._stop_loop()
        await asyncio.to_thread(self.core.stop)
        self._tok_pool.shutdown(wait=True)

    def _make_request(
        self, request_id: str, prompt, params, priority: int, lora_request=None, pooling_params=None
    ) -> Request:
        """Tokenize and validate in the front (tokenizer thread); the core compiles the grammar
        and loads the adapter."""
        req = self.input_processor.process_inputs(
            request_id, prompt, params, priority=priority, lora_request=lora_request, pooling_params=pooling_params
        )
        req.prompt = parse_prompt(prompt)[0]
        req.cache_salt = prompt_cache_salt(prompt)
        return req

    def _fail_all_in_engine(self, message: str) -> None:
        """Nothing to do here: the core's requests end with the core (see :meth:`mark_dead`)."""

    # ---- sending: one message per event-loop turn --------------------------------------------
    def _start(self) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
        super()._start()

    async def _run(self) -> None:
        while self.errored is None:
            await self._wakeup.wait()
            self._wakeup.clear()
            adds, self._pending = self._pending, []
            aborts, self._aborts = self._aborts, set()
            for req in adds:
                self._in_core[req.request_id] = (req.prompt_token_ids, req.prompt)
            aborts = [rid for rid in aborts if rid in self._in_core]
            if adds or aborts:
                self.core.send(("inputs", adds, aborts))

    # ---- receiving: the reader thread, then the event loop ------------------------------------
    def _read(self) -> None:
        conn = self.core.conn
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                err = EngineDeadError("the engine core process is gone")
                self.core.fail_calls(err)
                if not self._closed:
                    self._on_loop(
                        self.mark_dead,
                        RuntimeError(f"exit code {self.core.proc.exitcode}"),
                        "the engine core process exited",
                    )
                return
            kind = msg[0]
            if kind == "outputs":
                self._on_loop(self._on_outputs, msg[1])
            elif kind == "result":
                self.core.answer(*msg[1:])
            elif kind == "dead":
                self._on_loop(self.mark_dead, RuntimeError(msg[1]), "the engine core died")

    def _on_loop(self, fn, *args) -> None:
        loop = self._loop
        if loop is None:  # no request was ever sent: nothing waits on the loop
            fn(*args)
            return
        try:
            loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed
            pass

    def _on_outputs(self, out: EngineCoreOutputs) -> None:
        for rid, kind, message in out.rejected:
            self._in_core.pop(rid, None)
            cls = REJECTION_TYPES.get(kind, RuntimeError)
            self._put(
                rid, cls(message) if cls is not RuntimeError else RuntimeError(f"request {rid} failed: {message}")
            )
        for o in out.outputs:
            prompt = self._in_core.get(o.request_id)
            if prompt is None:
                continue
            o.prompt_token_ids, o.prompt = prompt
            if o.finished:
                del self._in_core[o.request_id]
            self._put(o.request_id, o)
        for rid in out.unknown_aborts:
            self._in_core.pop(rid, None)
        self.engine.stats = out.stats or self.engine.stats
        if out.kv_events[1]:
            self.engine.add_kv_events(*out.kv_events)
        self._log(self.engine.stat_loggers, out.iteration_stats)
        self._log(self.engine.request_loggers, out.finished_stats)

    def _log(self, loggers: list[Callable], items: list) -> None:
        for item in items:
            for log in loggers:
                try:
                    log(item)
                except Exception:
                    if id(log) not in self._broken_loggers:
                        self._broken_loggers.add(id(log))
                        logger.exception("stat logger %r failed (logged once)", log)
