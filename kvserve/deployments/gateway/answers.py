"""A generating request's answer as it leaves the pipeline: its chunks as they come
(:meth:`Answers.chunks`, a batch's prompts merged, each choice's newest chunk kept in
``Call.lasts``), the whole answer (:meth:`Answers.whole`) or a streaming response's body
(:meth:`Answers.sse`); and, when the answer ends however it ends, the key settled with the tokens
used and a complete answer stored in the response cache. The store is awaited before the
response ends (the whole body returned, ``data: [DONE]`` sent), so an identical request sent
after it always finds the entry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from kvserve.deployments.cache import ResponseCache
from kvserve.deployments.contract.streams import merge_streams
from kvserve.deployments.contract.types import GenerationChunk
from kvserve.deployments.gateway.call import Call
from kvserve.deployments.gateway.errors import failed, stream_error
from kvserve.deployments.gateway.streams import DONE, background, usage_of
from kvserve.deployments.limits.key_limits import KeyUse

logger = logging.getLogger("ray.serve")


class Answers:
    """Delivers, settles and stores answers (see the module docstring).

    Args:
        cache: the response cache complete answers go to (None: off).
        on_finish: called with ``(call, lasts, complete)`` when an answer ends, however it ends
            (the gateway's experiment samples and cache savings); it must not raise.
    """

    def __init__(self, cache: ResponseCache | None, on_finish=None):
        self.cache = cache
        self.on_finish = on_finish

    async def chunks(self, call: Call) -> AsyncIterator[tuple[int, GenerationChunk]]:
        """``(prompt index, chunk)`` of the call's streams as they come (a batch's prompts
        merged), each kept in ``call.lasts``; a failed generation raises its
        :class:`OpenAIError`."""
        if len(call.streams) == 1:
            async for chunk in call.streams[0].chunks():
                call.lasts[(0, chunk.index)] = chunk
                yield 0, chunk
            return
        async for p, chunk in merge_streams([s.chunks() for s in call.streams]):
            call.lasts[(p, chunk.index)] = chunk
            yield p, chunk

    async def whole(self, call: Call) -> dict[tuple[int, int], GenerationChunk]:
        """The whole answer, by ``(prompt index, choice index)``; the key is settled and a
        complete answer goes to the response cache.

        Raises:
            OpenAIError: the generation failed midway (the details are logged).
        """
        wholes = {(p, i): GenerationChunk(index=i) for p in range(len(call.streams)) for i in range(call.n)}
        complete = False
        try:
            async for p, chunk in self.chunks(call):
                wholes.setdefault((p, chunk.index), GenerationChunk(index=chunk.index)).extend(chunk)
            complete = True
            await self.store(call)
        except BaseException as e:
            call.cancel()
            if isinstance(e, Exception):
                raise failed(call.http_id, e) from None
            raise
        finally:
            self.finish(call, wholes, store=complete)
        return wholes

    async def sse(
        self, call: Call, events: AsyncIterator[bytes], done: bool = True, error=stream_error
    ) -> AsyncIterator[bytes]:
        """A streaming response's body: the endpoint's SSE ``events`` (rendered from
        :meth:`chunks`), then ``data: [DONE]``. A failure midway becomes an SSE error event
        (request id, no internals); a client that disconnects cancels the streams, which aborts
        the generation in the engine. At the end the key is settled from ``call.lasts`` and a
        complete answer goes to the response cache. ``done=False``: no ``[DONE]`` (the
        Responses API ends with its own event); ``error(request id, exception)``: the failure's
        event (default OpenAI's)."""
        complete = False
        try:
            async for event in events:
                yield event
            complete = True
            await self.store(call)
        except asyncio.CancelledError:
            call.cancel()
            logger.info("request %s: client disconnected mid-stream; generation aborted", call.http_id)
            raise
        except Exception as e:
            call.cancel()
            yield error(call.http_id, e)
        finally:
            call.cancel()
            await events.aclose()
            self.finish(call, call.lasts, store=complete)
        if done:
            yield DONE

    def finish(self, call: Call, lasts: dict[tuple[int, int], GenerationChunk], *, store: bool) -> None:
        """Settle the key's tokens from the last chunks and, when the answer completed
        (``store``), give it to the response cache."""
        self.settle_soon(call.use, lasts)
        if self.on_finish is not None:
            try:
                self.on_finish(call, lasts, store)
            except Exception as e:  # noqa: BLE001 -- bookkeeping never fails an answer
                logger.warning("request %s: recording its end failed (%s)", call.http_id, e)
        if store and self.cache is not None and call.look.store:
            self.cache.store_soon(call.look, [s.record or [] for s in call.streams], call.n)

    async def store(self, call: Call) -> None:
        """Store the call's complete answer in the response cache now (awaited, before the
        response ends; :meth:`ResponseCache.store`); a no-op when there is nothing to store."""
        if self.cache is not None and call.look.store:
            await self.cache.store(call.look, [s.record or [] for s in call.streams], call.n)

    @staticmethod
    def settle_soon(use: KeyUse, lasts: dict[tuple[int, int], GenerationChunk] | list[GenerationChunk]) -> None:
        """:meth:`KeyUse.settle` with the last chunks of the request's choices (keyed ``(prompt
        index, choice index)``; a list is one choice per prompt), in a task of its own (a
        cancelled response's cleanup must not await the limiter's Redis)."""
        if use.done:
            return
        if isinstance(lasts, list):
            lasts = {(k, 0): c for k, c in enumerate(lasts)}
        usage = usage_of(lasts)
        background(use.settle(usage.prompt_tokens, usage.completion_tokens))
