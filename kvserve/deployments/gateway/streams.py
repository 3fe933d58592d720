"""A request's stream of :class:`~kvserve.deployments.contract.types.GenerationChunk` from a replica,
and the Server-Sent Events the gateway writes (OpenAI's chunk format, ``data: [DONE]`` last;
nothing buffered or delayed on the way)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from openai.types import CompletionUsage
from openai.types.completion_usage import PromptTokensDetails
from pydantic import BaseModel

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.types import GenerationChunk

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}

_BACKGROUND: set[asyncio.Task] = set()  # tasks in flight (referenced until done)


def background(coro, context=None) -> None:
    """Run ``coro`` in a task the gateway keeps a reference to until it ends (settling a key's
    tokens after a response, refreshing a model's revision)."""
    task = asyncio.get_running_loop().create_task(coro, context=context)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


def sse(obj: BaseModel | dict) -> bytes:
    """One Server-Sent Event; an OpenAI model is written with the fields we set (no nulls
    for fields kvserve never fills, such as tool calls)."""
    body = (
        obj.model_dump_json(exclude_unset=True)
        if isinstance(obj, BaseModel)
        else json.dumps(obj, separators=(",", ":"), ensure_ascii=False)
    )
    return b"data: " + body.encode() + b"\n\n"


#: Seconds a request whose own stream ended waits for the rest of its chunks on the channel.
CHANNEL_GRACE_S = 10.0


def stream_incomplete() -> OpenAIError:
    """The error of an answer whose stream lost chunks or ended before its last one (a channel
    or replica gone mid-stream): the client gets it (an SSE error event once the stream has
    started) instead of an answer with a hole, and nothing is cached."""
    return OpenAIError(
        "the model server's stream of this answer was cut off before it ended (part of it is "
        "missing); retry the request",
        503,
        "server_error",
        code="stream_incomplete",
    )


class ChunkStream:
    """One request's chunks (``n`` choices interleaved, each ending with its own finished
    chunk), with the first already fetched (so bad input fails as an HTTP error before any
    byte of a streaming response is sent). ``record``, when a list, collects every chunk for
    the response cache.

    ``channel``: ``(queue, on_close)`` when the first chunk said the rest comes on the
    gateway's channel (:mod:`kvserve.deployments.gateway.channels`): the chunks are then read from
    ``queue``, into which the request's own stream is pumped too (it carries an error, or the
    rest when the channel ended); ``on_close`` runs once at the end.

    No hole is ever passed on: the replica numbers every chunk of a request
    (``GenerationChunk.seq``), chunks that came on the two streams are put back in that order,
    and a stream that ends with a chunk missing, or before every choice finished, raises
    :func:`stream_incomplete` (``ordered=False``: a cached answer's replay, not numbered by a
    replica)."""

    def __init__(self, gen, first: GenerationChunk, n: int = 1, on_end=None, channel=None, ordered: bool = True):
        self.gen, self.first, self.left = gen, first, n - first.finished
        self.done = False
        self.on_end = on_end  # called once when the stream ends (finished, failed or cancelled)
        self.record: list[GenerationChunk] | None = None
        self.channel = channel
        self.ordered = ordered
        self.next_seq = first.seq + 1  # the seq of the chunk that must come next
        self._pump: asyncio.Task | None = None
        if self.left == 0:
            self._end()

    def _end(self) -> None:
        self.done = True
        on_end, self.on_end = self.on_end, None
        if on_end is not None:
            on_end()
        if self.channel is not None:
            _, on_close = self.channel
            self.channel = None
            on_close()

    async def _rest(self) -> AsyncIterator[GenerationChunk]:
        """The chunks after the first, in ``seq`` order: from the request's own stream, or from
        the channel's queue (with the own stream pumped into it; after the own stream ends, the
        channel has :data:`CHANNEL_GRACE_S` seconds to bring what is left). The pump runs until
        the own stream ends by itself (the replica ends it once the channel took the last
        chunk), or :meth:`cancel` cancels that stream. A chunk with an error is passed on at
        once, whatever came before it.

        Raises:
            OpenAIError: :func:`stream_incomplete` for a gap on the own stream alone.
        """
        if self.channel is None:
            async for chunk in self.gen:
                if self.ordered and chunk.error is None:
                    if chunk.seq != self.next_seq:  # one stream keeps order: a chunk never came
                        raise stream_incomplete()
                    self.next_seq += 1
                yield chunk
            return
        queue, _ = self.channel
        ended = object()

        async def pump():
            try:
                async for chunk in self.gen:
                    queue.put_nowait(chunk)
            except asyncio.CancelledError:
                if asyncio.current_task().cancelling():  # this pump was cancelled
                    raise
                queue.put_nowait(RuntimeError("the replica's stream was cancelled"))
            except BaseException as e:  # whatever ends the stream ends the reader too
                queue.put_nowait(e if isinstance(e, Exception) else RuntimeError(repr(e)))
            finally:
                queue.put_nowait(ended)

        self._pump = asyncio.get_running_loop().create_task(pump())
        own_stream_open = True
        early: dict[int, GenerationChunk] = {}  # chunks that came before one they follow
        while True:
            try:
                item = await (queue.get() if own_stream_open else asyncio.wait_for(queue.get(), CHANNEL_GRACE_S))
            except TimeoutError:
                return  # what is still missing never came: chunks() raises
            if item is ended:
                own_stream_open = False
            elif isinstance(item, Exception):
                raise item
            elif item.error is not None:
                yield item
            elif item.seq >= self.next_seq:  # (an older seq would be a copy: never sent, never passed on)
                early[item.seq] = item
                while self.next_seq in early:
                    self.next_seq += 1
                    yield early.pop(self.next_seq - 1)

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The chunks; one with ``error`` (e.g. the request ran past the server's
        ``request_timeout_s``, or the engine stopped) raises it as an :class:`OpenAIError`, and
        so does a stream that lost a chunk or ended before its last (:func:`stream_incomplete`)."""
        if self.record is not None:
            self.record.append(self.first)
        yield self.first
        if self.done:
            return
        async for chunk in self._rest():
            if chunk.error is not None:
                self._end()
                raise OpenAIError.of(chunk.error)
            self.left -= chunk.finished
            if self.left == 0:
                self._end()
            if self.record is not None:
                self.record.append(chunk)
            yield chunk
            if self.done:
                return
        self._end()  # the replica's stream ended without the last choice's finished chunk
        raise stream_incomplete()

    @classmethod
    def replay(cls, chunks: list[GenerationChunk], n: int) -> "ChunkStream":
        """A stream of a cached answer's chunks (the response cache's hit)."""

        async def rest():
            for c in chunks[1:]:
                yield c

        return cls(rest(), chunks[0], n, ordered=False)

    def cancel(self) -> None:
        """Stop the replica's generation (a no-op once the stream ended)."""
        if not self.done:
            self._end()
            try:
                self.gen.cancel()
            except Exception:
                pass


def usage_of(lasts: dict[tuple[int, int], GenerationChunk]) -> CompletionUsage:
    """Usage of a request's choices, keyed ``(prompt index, choice index)``: each prompt's
    tokens counted once (its ``n`` choices share it), every choice's output tokens, the
    prefix-cache hits of each prompt's first choice."""
    prompts: dict[int, tuple[int, int]] = {}
    out = 0
    for (p, i), c in sorted(lasts.items()):
        if p not in prompts:
            prompts[p] = (c.num_prompt_tokens, c.num_cached_tokens)
        out += c.num_output_tokens
    n_prompt, n_cached = sum(n for n, _ in prompts.values()), sum(k for _, k in prompts.values())
    return CompletionUsage(
        prompt_tokens=n_prompt,
        completion_tokens=out,
        total_tokens=n_prompt + out,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=n_cached),
    )
