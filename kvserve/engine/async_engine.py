"""asyncio front of the engine: a background step loop, one queue per request, abort."""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from kvserve.engine.config import EngineConfig
from kvserve.engine.input_processor import InputProcessor, parse_prompt, prompt_cache_salt
from kvserve.engine.llm_engine import LLMEngine
from kvserve.engine.step_isolation import StepFailedError
from kvserve.engine.model_loader import load_tokenizer
from kvserve.engine.request import Request, RequestOutput
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.tokenizer_pool import TokenizerPool

logger = logging.getLogger("kvserve.async_engine")


class EngineDeadError(RuntimeError):
    """The engine can serve no more requests: its executor failed (a worker process is gone,
    the device broke) or its step loop died. Every request in it ends with this error and
    every later :meth:`AsyncLLMEngine.generate` raises it at once; the engine (the replica)
    must be replaced."""


def step_thread(prefix: str = "kvserve-step") -> ThreadPoolExecutor:
    """A single-thread executor to build and step an engine in, with torch's intra-op thread
    count carried over (a new thread starts at ``OMP_NUM_THREADS``, which Ray sets to 1)."""
    import torch

    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=prefix, initializer=torch.set_num_threads, initargs=(torch.get_num_threads(),)
    )


class AsyncLLMEngine:
    """Streams outputs of concurrent requests from one :class:`LLMEngine`.

    The step loop is an asyncio task that runs each ``engine.step()`` in a worker thread
    (torch releases the GIL), so the event loop keeps serving while the model runs. New
    requests and aborts are applied between steps, on the event loop thread, so the
    scheduler is never touched by two threads at once. Prompts are tokenized (and chat
    templates applied) in a :class:`~kvserve.engine.tokenizer_pool.TokenizerPool` (two lanes of
    threads, each thread with a tokenizer of its own: HF fast tokenizers are not safe to share
    across threads), so a huge prompt stalls neither the event loop nor the other prompts'
    tokenization; the engine's ``make_request`` (grammar, adapter) still runs one at a time.

    Failures: a request that fails alone inside a step ends with a ``RuntimeError`` on its
    stream only (the engine isolates it). A step failure no request explains makes the loop
    ask the executor's ``check_health()`` (in the step thread): if the executor is healthy,
    that step's requests fail with ``RuntimeError`` and the loop goes on; if not, the engine
    is dead (:class:`EngineDeadError`, see :attr:`errored`).
    """

    def __init__(self, engine: LLMEngine, step_pool: ThreadPoolExecutor | None = None):
        self.engine = engine
        self.tokenizer = load_tokenizer(engine.model_path)
        #: The engine's :class:`InputProcessor` over copies of this front's tokenizer (one per
        #: tokenizer thread; ``self.tokenizer`` itself is the event loop's, for decoding):
        #: prompt parsing, chat templates and validation for the serving layer.
        self.input_processor: InputProcessor = engine.input_processor.with_tokenizer(self.tokenizer, keep_base=True)
        self._init_front()
        self._tok_pool.warm(lambda: self.input_processor.tokenizer)  # per-thread copies made now
        # the single thread that runs engine.step() (from_config passes the one that built it)
        self._pool = step_pool or ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")

    def _init_front(self) -> None:
        """The front's request bookkeeping, shared by the in-process front and the engine core
        process's (:class:`kvserve.engine.core_client.MPAsyncLLMEngine`)."""
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[Request] = []
        self._aborts: set[str] = set()
        self._tokenizing: set[str] = set()  # ids whose prompt is in the tokenizer thread
        self._aborted_early: set[str] = set()  # ... and that were aborted meanwhile
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        # tokenizer threads in two lanes: a large prompt queues only behind large ones (tokenizer_pool.py)
        self._tok_pool = TokenizerPool()
        self._make_lock = threading.Lock()  # engine.make_request (grammar, adapter): one at a time
        self._closed = False
        #: a tier outside the engine (``kvserve.engine.kv_connector.KVConnector``): each new request is
        #: shown to it, once tokenized, before it is queued (None: no such tier)
        self.kv_connector = None
        self.errored: EngineDeadError | None = None
        """The :class:`EngineDeadError` that killed the engine, or None while it is usable."""

    @classmethod
    def from_config(cls, config: EngineConfig, executor_factory: Callable | None = None) -> "AsyncLLMEngine":
        """Build the :class:`LLMEngine` in the step thread, which then runs every step.

        On CPU the model's thread pools belong to the thread that calls into them (OpenMP keeps
        one worker team per calling thread): a model loaded and warmed up on one thread and
        stepped on another decodes measurably slower, so load, warm-up and steps share one
        thread here.

        Raises:
            whatever :class:`LLMEngine` raises (bad config, model that does not load).
        """
        pool = step_thread()
        try:
            engine = pool.submit(LLMEngine, config, executor_factory).result()
        except BaseException:
            pool.shutdown(wait=False)
            raise
        return cls(engine, step_pool=pool)

    # ---- public API ------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        """The step loop task exists and has not ended (it starts with the first request)."""
        return self._task is not None and not self._task.done()

    def check_health(self) -> None:
        """Cheap, non-blocking liveness check (does not ask the executor).

        Raises:
            EngineDeadError: the engine is dead (:attr:`errored`), its step loop ended with an
                exception, or it was shut down.
        """
        if self.errored is not None:
            raise self._dead_error()
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        t = self._task
        if t is not None and t.done() and not t.cancelled() and t.exception() is not None:
            raise EngineDeadError(f"the engine step loop died: {t.exception()!r}") from t.exception()

    async def check_health_async(self, timeout_s: float = 30.0) -> None:
        """:meth:`check_health`, then the executor's own probe (``check_health_async`` of a
        distributed executor: every worker answers within ``timeout_s`` seconds). A failed
        probe kills the engine (:meth:`mark_dead`); a slow one fails itself only.

        Raises:
            EngineDeadError: the engine is dead, or a worker's probe failed (it is gone).
            TimeoutError: a worker did not answer within ``timeout_s`` (the engine lives on).
        """
        self.check_health()
        probe = getattr(self.engine.executor, "check_health_async", None)
        if probe is None:
            return
        try:
            await probe(timeout_s)
        except TimeoutError:  # slow is not dead: this probe fails, the engine and its requests go on
            raise TimeoutError(f"a worker did not answer a health check within {timeout_s:g} s") from None
        except Exception as e:
            self.mark_dead(e, "a worker is not answering")
            raise self._dead_error() from e

    # ---- what the serving layer reads (never the engine's internals) ------------------
    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def hf_config(self):
        """The model's Hugging Face config (``transformers.PretrainedConfig``: hidden size, vocabulary...)."""
        return self.engine.hf_config

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output, tokens."""
        return self.engine.max_model_len

    def add_lora(self, lora_request) -> None:
        """Load a LoRA adapter (a :class:`kvserve.engine.lora.LoRARequest`) into the engine
        (blocking: call it off the event loop).

        Raises:
            ValueError: LoRA is off, or the adapter does not load or fit the model.
        """
        self.engine.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload adapter ``lora_int_id`` (blocking); False if it was not loaded."""
        return self.engine.remove_lora(lora_int_id)

    @property
    def model_path(self) -> str:
        return self.engine.model_path

    @property
    def executor(self):
        """The engine's executor (e.g. a ``RayWorkerGroup`` for its placement info)."""
        return self.engine.executor

    def add_stat_logger(self, log: Callable, on_finished: Callable | None = None) -> None:
        """Call ``log(IterationStats)`` after every step that runs the model (in the step thread),
        and ``on_finished(FinishedRequestStats)`` for every request that leaves the engine
        (finished, aborted or failed; in the step thread or the event loop's)."""
        if log is not None:
            self.engine.stat_loggers.append(log)
        if on_finished is not None:
            self.engine.request_loggers.append(on_finished)

    def mark_dead(self, cause: BaseException, reason: str = "the engine is dead") -> None:
        """Declare the engine dead because of ``cause`` (e.g. a worker that did not answer a
        health probe): fails every request with :class:`EngineDeadError` (message
        ``"{reason}: {type(cause).__name__}: {cause}"``) and refuses new ones. Idempotent.
        Call on the event loop thread."""
        if self.errored is not None:
            return
        err = EngineDeadError(f"{reason}: {type(cause).__name__}: {cause}")
        err.__cause__ = cause
        logger.error("%s", err)
        self.errored = err
        pending, self._pending = self._pending, []
        for req in pending:
            self._put(req.request_id, self._dead_error())
        if not (self._task is not None and not self._task.done() and self._task is not asyncio.current_task()):
            # no step in flight: the scheduler is ours to touch (else the loop cleans up)
            self._fail_all_in_engine(str(err))
        for rid in list(self._queues):
            self._put(rid, self._dead_error())
        if self._wakeup is not None:
            self._wakeup.set()  # a loop waiting for work wakes up and exits

    def tokenize(self, prompt: str | list[int] | dict) -> list[int]:
        """Token ids of ``prompt`` in any of :func:`kvserve.engine.input_processor.parse_prompt`'s forms
        (a string, token ids, ``{"prompt": ...}`` or ``{"prompt_token_ids": [...]}``); blocking:
        :meth:`generate` runs it off the event loop.

        Raises:
            ValueError: a malformed prompt.
        """
        return self.input_processor.tokenize(prompt)

    async def encode(self, prompt: str | list[int] | dict) -> list[int]:
        """Token ids of a prompt in any form of :func:`kvserve.engine.input_processor.parse_prompt`,
        computed in the tokenizer thread (the serving layer counts them before admitting a request).

        Raises:
            ValueError: a malformed prompt.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tok_pool, self.input_processor.tokenize, prompt)

    async def apply_chat_template(
        self, messages: list[dict], tools: list[dict] | None = None, template_kwargs: dict | None = None
    ) -> list[int]:
        """Token ids of a conversation (and its ``tools``) under the chat template, tools and
        tool calls written for a template that does not render them
        (:meth:`InputProcessor.chat_template_ids`; ``template_kwargs``: more template variables),
        computed in the tokenizer thread.

        Raises:
            ValueError: no chat template or malformed messages.
        """
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._tok_pool,
            functools.partial(self.input_processor.chat_template_ids, messages, tools, template_kwargs=template_kwargs),
        )

    async def generate(
        self,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request=None,
        pooling_params=None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield a :class:`RequestOutput` after every step that gives this request a token;
        the last one has ``finished=True``. Closing or cancelling the iterator aborts the
        request and frees its KV blocks. The prompt is tokenized and validated in the
        tokenizer thread before anything is queued; ``lora_request`` (an
        :class:`kvserve.engine.lora.LoRARequest`) is loaded there too, on first use.
        ``pooling_params`` (:class:`kvserve.engine.pooling.PoolingParams`): an embedding request, whose
        one (final) output carries ``pooled`` (see :meth:`embed`).

        Raises:
            EngineDeadError: the engine is dead (at once, or while the request runs).
            ValueError: invalid prompt or parameters (raised before anything is queued).
            RuntimeError: the request failed inside the engine.
        """
        self.check_health()
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue  # reserves the id while the prompt is tokenized
        queued = finished = False
        try:
            loop = asyncio.get_running_loop()
            self._tokenizing.add(request_id)
            try:
                req = await loop.run_in_executor(
                    self._tok_pool,
                    self._make_request,
                    request_id,
                    prompt,
                    params,
                    priority,
                    lora_request,
                    pooling_params,
                )
                if self.kv_connector is not None and pooling_params is None:
                    await self.kv_connector.before_add(req)  # bounded; never raises
            finally:
                self._tokenizing.discard(request_id)
            self.check_health()  # the engine may have died while we tokenized
            self._pending.append(req)
            queued = True
            if request_id in self._aborted_early:  # ends the stream with an "abort" output
                self.abort(request_id)
            self._start()
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
                    finished = True
                    raise out
                if out.error is not None:
                    finished = True
                    raise RuntimeError(f"request {request_id} failed: {out.error}")
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            self._aborted_early.discard(request_id)
            if queued and not finished:
                self.abort(request_id)

    async def embed(
        self,
        prompt: str | list[int] | dict,
        pooling_params,
        request_id: str | None = None,
        priority: int = 0,
        lora_request=None,
    ) -> RequestOutput:
        """The final output of an embedding request (``pooled``: float32 values of length
        ``hidden_size``), batched with the other requests of each step, nothing generated.

        Raises:
            as :meth:`generate`.
        """
        async for out in self.generate(prompt, None, request_id, priority, lora_request, pooling_params):
            if out.finished:
                return out
        raise RuntimeError(f"request {request_id}: the engine gave no final output")

    def abort(self, request_id: str) -> None:
        """Abort a request (applied before the next step; its blocks return to the pool). A
        request still being tokenized is aborted as soon as it is queued."""
        if request_id in self._tokenizing:
            self._aborted_early.add(request_id)
        self._aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def take_kv_events(self) -> tuple[int, list]:
        """The engine's KV cache events since the last call (:meth:`LLMEngine.take_kv_events`:
        ``(seq of the last batch, batches)``; ``(0, [])`` with ``enable_kv_cache_events`` off)."""
        return self.engine.take_kv_events()

    async def kv_cache_snapshot(self) -> tuple[int, object]:
        """What the KV pool and host tier hold (:meth:`LLMEngine.kv_cache_snapshot`), taken on
        the step thread between two steps."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.kv_cache_snapshot)

    async def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (:meth:`LLMEngine.reset_prefix_cache`), between two steps;
        False while requests are in the engine."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.reset_prefix_cache)

    async def export_kv_blocks(self, block_hashes: list[int]) -> list:
        """Copies of cached pool blocks (:meth:`LLMEngine.export_kv_blocks`), taken on the step
        thread between two steps."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.export_kv_blocks, block_hashes)

    async def import_kv_blocks(self, blocks: list) -> int:
        """Blocks into the host tier (:meth:`LLMEngine.import_kv_blocks`), between two steps.

        Raises:
            ValueError: no host tier, or blocks of another layout.
        """
        return await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.import_kv_blocks, blocks)

    def get_stats(self) -> dict[str, float]:
        stats = self.engine.get_stats()
        stats["num_pending_requests"] = len(self._pending)
        return stats

    async def shutdown(self) -> None:
        await self._stop_loop()
        self._pool.shutdown(wait=True)
        self._tok_pool.shutdown(wait=True)
        self.engine.shutdown()

    # ---- helpers ------------------------------------------------------------
    async def _stop_loop(self) -> None:
        """Refuse new requests and end the loop task (shutdown's first half)."""
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    def _make_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None,
        priority: int,
        lora_request=None,
        pooling_params=None,
    ) -> Request:
        """Tokenize and validate (runs in the tokenizer thread; touches no scheduler state)."""
        ids = self.tokenize(prompt)  # in this lane's thread, with its own tokenizer
        with self._make_lock:
            req = self.engine.make_request(
                request_id, ids, params, priority, lora_request=lora_request, pooling_params=pooling_params
            )
        req.prompt = parse_prompt(prompt)[0]
        req.cache_salt = prompt_cache_salt(prompt)
        return req

    def _dead_error(self) -> EngineDeadError:
        """A fresh :class:`EngineDeadError` like :attr:`errored` (one per raise site)."""
        err = EngineDeadError(str(self.errored))
        err.__cause__ = self.errored.__cause__
        return err

    def _fail_all_in_engine(self, message: str) -> None:
        for rid in list(self.engine.scheduler.requests):
            self.engine.fail_request(rid, message)

    # ---- the loop -----------------------------------------------------------
    def _start(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
            self._task.add_done_callback(self._on_loop_done)
        self._wakeup.set()

    def _on_loop_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("engine step loop died", exc_info=task.exception())
            self.mark_dead(task.exception(), "the engine step loop died")

    def _apply_pending(self) -> None:
        pending, self._pending = self._pending, []
        for req in pending:  # aborted ones too: the abort below then ends their stream
            try:
                self.engine.enqueue(req)
            except Exception as e:
                self._put(req.request_id, e)
        aborts, self._aborts = self._aborts, set()
        for rid in aborts:
            out = self.engine.abort_request(rid)
            if out is not None:  # a caller still reading the stream gets a final "abort" output
                self._put(rid, out)

    def _put(self, request_id: str, item) -> None:
        q = self._queues.get(request_id)
        if q is not None:
            q.put_nowait(item)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while self.errored is None:
            self._apply_pending()
            if not self.engine.has_unfinished_requests():
                self._wakeup.clear()
                if not self._pending and not self._aborts:
                    await self._wakeup.wait()
                continue
            try:
                outputs = await loop.run_in_executor(self._pool, self.engine.step)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # not attributable to one request (those fail inside step())
                logger.exception("engine step failed")
                await self._after_failed_step(e)
                continue
            for out in outputs:
                self._put(out.request_id, out)
            # No yield here: the next step starts in the step thread at once, and the streams
            # woken above run their per-token work (chunks, Serve messages) on the event loop
            # while it computes, instead of before it.
        self._fail_all_in_engine(str(self.errored))  # died while a step ran

    async def _after_failed_step(self, error: Exception) -> None:
        """A step failed for all its requests: a dead executor kills the engine; a healthy one
        means the step's requests (all requests if the step is unknown) fail alone."""
        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, self.engine.executor.check_health)
        except Exception as dead:
            self.mark_dead(dead, "the executor failed its health check after a failed step")
            return
        ids = error.request_ids if isinstance(error, StepFailedError) else list(self.engine.scheduler.requests)
        msg = f"engine step failed: {type(error).__name__}: {error}"
        for rid in ids:
            self.engine.fail_request(rid, msg)
            self._put(rid, RuntimeError(msg))
