"""One stream per gateway replica that carries all of its requests' chunks, batched per engine step
(as vLLM sends one message per step from its engine core to its front; Serve would
otherwise carry every token of every request as a message of its own).

How a request uses it: the gateway opens ``LLMServer.channel(gateway_id, replica_id)`` on each
replica it streams from (its router sends the call to that replica), and names its channel on each
:class:`~kvserve.deployments.contract.types.GenerateRequest` (``channel``). A replica with that gateway's
channel open sends the request's first chunk on the request's own stream, marked ``via_channel``,
and every later chunk into the channel's outbox; the channel yields whatever the outbox holds as
one message: ``{channel key: [chunks]}``. The request's own stream stays open until it finishes
(Serve keeps counting it, and cancelling it still aborts the request). A request whose gateway has
no channel here streams on its own, as before.

A channel ends when no request has used it for :data:`CHANNEL_IDLE_S` seconds (so a replica that is
draining is not held by it) or when the gateway goes away; the gateway opens it again on demand.

No chunk is dropped here: every chunk a request sends carries its place in the stream
(``GenerationChunk.seq``); the outbox is bounded (:data:`CHANNEL_MAX_PENDING_CHUNKS`: a request
waits for room, so the engine's stream slows to the channel's pace instead of losing chunks);
chunks still in the outbox when its channel ends go back to their request's own stream, ahead of
the rest; and a request's own stream ends only once the channel has taken its last chunk. A
batch the channel took but never delivered (the gateway's end went away under it) is the only
loss left, and the gateway sees it as a gap in ``seq`` (:mod:`kvserve.deployments.gateway.streams`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvserve.deployments.contract.types import GenerationChunk

#: Seconds without a chunk and without a request on it after which a channel ends.
CHANNEL_IDLE_S = 2.0
#: Chunks one gateway's outbox holds at most; a request with a chunk for a full outbox waits.
CHANNEL_MAX_PENDING_CHUNKS = 4096


class _Outbox:
    """The chunks waiting for one gateway's channel, by channel key, at most ``max_pending`` of
    them; ``reader`` counts the channel streams that took it over (only the newest one reads).
    Requests waiting on it (for room, for their chunks to be taken) wake on every change."""

    def __init__(self, max_pending: int = CHANNEL_MAX_PENDING_CHUNKS):
        self.pending: dict[str, list[GenerationChunk]] = {}
        self.num_pending = 0
        self.max_pending = max_pending
        self.ready = asyncio.Event()
        self._changed = asyncio.Event()  # set (and replaced) on every change waiters look at
        self.reader = 0
        self.closed = False

    async def put(self, key: str, chunk: GenerationChunk) -> bool:
        """Queue ``chunk`` for the channel once there is room; False (nothing queued) when the
        channel ended first."""
        await self._until(lambda: self.closed or self.num_pending < self.max_pending)
        if self.closed:
            return False
        self.pending.setdefault(key, []).append(chunk)
        self.num_pending += 1
        self.ready.set()
        return True

    async def flushed(self, key: str) -> list[GenerationChunk]:
        """Wait until the channel took every chunk of ``key``; ``[]`` then, or, when the channel
        ended first, the chunks it left (to go on the request's own stream)."""
        await self._until(lambda: self.closed or key not in self.pending)
        return self.take_back(key)

    def take_back(self, key: str) -> list[GenerationChunk]:
        """Remove and return the chunks of ``key`` not yet taken by the channel."""
        left = self.pending.pop(key, [])
        self.num_pending -= len(left)
        return left

    async def _until(self, condition) -> None:
        while not condition():
            await self._changed.wait()

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def close(self) -> None:
        """The channel ended: requests with chunks here take them back."""
        self.closed = True
        self._notify()

    async def batches(self, idle_s: float, reader: int) -> AsyncIterator[dict[str, list[GenerationChunk]]]:
        """Everything put since the last batch, once there is something; ends after ``idle_s``
        seconds with nothing put (a request still running then sends the rest of its chunks on
        its own stream: nothing is lost, and its last channel chunk left ``idle_s`` seconds
        before), or when a newer reader took the outbox over."""
        while self.reader == reader:
            try:
                await asyncio.wait_for(self.ready.wait(), idle_s)
            except TimeoutError:
                if not self.pending:  # the next chunk of a request still running goes on its own stream
                    return
                continue
            if self.reader != reader:
                return
            self.ready.clear()
            batch, self.pending, self.num_pending = self.pending, {}, 0
            if batch:
                self._notify()  # room again, and these keys' chunks are on their way
                yield batch


class GatewayChannels:
    """A replica's open channels, one per gateway replica (see the module docstring).

    Args:
        idle_s: seconds after which an unused channel ends (:data:`CHANNEL_IDLE_S`).
        max_pending: chunks each gateway's outbox holds at most (:data:`CHANNEL_MAX_PENDING_CHUNKS`).
    """

    def __init__(self, idle_s: float = CHANNEL_IDLE_S, max_pending: int = CHANNEL_MAX_PENDING_CHUNKS):
        self.idle_s, self.max_pending = idle_s, max_pending
        self._boxes: dict[str, _Outbox] = {}
        self.num_messages = 0
        self.num_chunks = 0

    def stats(self) -> dict[str, int]:
        """``gateway_channels`` open now; ``channel_messages`` sent and ``channel_chunks`` they
        carried since start (chunks per message: how many requests' tokens one message batched)."""
        return {
            "gateway_channels": len(self._boxes),
            "channel_messages": self.num_messages,
            "channel_chunks": self.num_chunks,
        }

    async def serve(
        self, gateway_id: str, replica_id: str | None = None
    ) -> AsyncIterator[dict[str, list[GenerationChunk]] | dict[str, str]]:
        """The channel of ``gateway_id``: a hello first, ``{"replica": replica_id}`` (the gateway
        then knows it is open, and where), then the batches. A second channel of the same gateway takes the outbox over
        (with what it holds); the first ends."""
        box = self._boxes.get(gateway_id)
        if box is None or box.closed:
            box = self._boxes[gateway_id] = _Outbox(self.max_pending)
        box.reader += 1
        reader = box.reader
        box.ready.set()  # wakes an older reader, which then leaves
        try:
            yield {"replica": replica_id}
            async for batch in box.batches(self.idle_s, reader):
                self.num_messages += 1
                self.num_chunks += sum(map(len, batch.values()))
                yield batch
        finally:
            if box.reader == reader:  # the newest reader leaves: the channel is gone
                if self._boxes.get(gateway_id) is box:
                    del self._boxes[gateway_id]
                box.close()  # its requests take what it holds back to their own streams

    async def route(
        self, chunks: AsyncIterator[GenerationChunk], channel: tuple[str, str] | None, replica_id: str
    ) -> AsyncIterator[GenerationChunk]:
        """A request's chunks as its own stream yields them, each numbered (``seq``, from 0):
        all of them when its gateway has no channel open here; else the first (``via_channel``
        set), with the rest going to the channel under the request's key, and the own stream
        ending only once the channel took the last of them. If the channel ends while the
        request runs, the chunks it had not taken and every later one come on the request's own
        stream, in order. Every first chunk names this replica (``replica``), so the gateway can
        open a channel to it."""
        box = self._boxes.get(channel[0]) if channel is not None else None
        seq = 0
        try:
            async for chunk in chunks:
                chunk.seq, seq = seq, seq + 1
                if chunk.seq == 0:
                    chunk.replica = replica_id
                    if box is not None and not box.closed and not chunk.finished:
                        chunk.via_channel = True
                    else:
                        box = None
                    yield chunk
                elif box is not None and await box.put(channel[1], chunk):
                    continue
                else:
                    if box is not None:  # the channel ended: what it left first, then this one
                        for c in box.take_back(channel[1]):
                            yield c
                        box = None
                    yield chunk
            if box is not None:
                for c in await box.flushed(channel[1]):
                    yield c
                box = None
        finally:
            if box is not None:  # the request stopped early (cancelled): its chunks go nowhere
                box.take_back(channel[1])
