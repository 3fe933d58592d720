"""asyncio front of the engine: a background step loop, one queue per request, abort."""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine, chat_template_ids
from engine.model_loader import load_tokenizer
from engine.request import Request, RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("kvserve.async_engine")


class AsyncLLMEngine:
    """Streams outputs of concurrent requests from one :class:`LLMEngine`.

    The step loop is an asyncio task that runs each ``engine.step()`` in a worker thread
    (torch releases the GIL), so the event loop keeps serving while the model runs. New
    requests and aborts are applied between steps, on the event loop thread, so the
    scheduler is never touched by two threads at once. Prompts are tokenized with a
    tokenizer of the front's own (HF fast tokenizers are not safe to share across threads).
    """

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.tokenizer = load_tokenizer(engine.model_path)
        self._queues: dict[str, asyncio.Queue] = {}
        self._pending: list[Request] = []
        self._aborts: set[str] = set()
        self._wakeup: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-step")
        self.errored: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, executor_factory: Callable | None = None) -> "AsyncLLMEngine":
        return cls(LLMEngine(config, executor_factory))

    # ---- public API ------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return self.tokenizer.encode(prompt, add_special_tokens=True) if isinstance(prompt, str) else list(prompt)

    def apply_chat_template(self, messages: list[dict]) -> list[int]:
        """Token ids of a conversation under the chat template (see ``chat_template_ids``).

        Raises:
            ValueError: no chat template or malformed messages.
        """
        return chat_template_ids(self.tokenizer, messages)

    async def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                       request_id: str | None = None, priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yield a :class:`RequestOutput` after every step that gives this request a token;
        the last one has ``finished=True``. Closing or cancelling the iterator aborts the
        request and frees its KV blocks.

        Raises:
            ValueError: invalid prompt (raised before anything is queued).
            RuntimeError: the request failed inside the engine.
        """
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._queues:
            raise ValueError(f"request_id {request_id!r} is already running")
        prompt_text = prompt if isinstance(prompt, str) else None
        req = self.engine.make_request(request_id, self.tokenize(prompt), params, priority)
        req.prompt = prompt_text
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        self._pending.append(req)
        self._start()
        finished = False
        try:
            while True:
                out = await queue.get()
                if isinstance(out, BaseException):
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
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request (applied before the next step; its blocks return to the pool)."""
        self._aborts.add(request_id)
        if self._wakeup is not None:
            self._wakeup.set()

    def get_stats(self) -> dict[str, float]:
        stats = self.engine.get_stats()
        stats["num_pending_requests"] = len(self._pending)
        return stats

    async def shutdown(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        self._pool.shutdown(wait=True)
        self.engine.shutdown()

    # ---- the loop -----------------------------------------------------------
    def _start(self) -> None:
        if self._wakeup is None:
            self._wakeup = asyncio.Event()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wakeup.set()

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
        while True:
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
            except Exception as e:  # a failed step fails the requests in it, not the loop
                logger.exception("engine step failed")
                for rid in list(self.engine.scheduler.requests):
                    self.engine.fail_request(rid, f"engine step failed: {type(e).__name__}: {e}")
                    self._put(rid, RuntimeError(f"engine step failed: {e}"))
                continue
            for out in outputs:
                self._put(out.request_id, out)
            await asyncio.sleep(0)
