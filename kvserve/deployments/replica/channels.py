"""One stream per gateway replica that carries all of its requests' chunks, batched per engine step
(issue 41, item 2: vLLM sends one message per step from its engine core to its front; Serve would
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
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from kvserve.deployments.contract.types import GenerationChunk

#: Seconds without a chunk and without a request on it after which a channel ends.
CHANNEL_IDLE_S = 2.0


class _Outbox:
    """The chunks waiting for one gateway's channel, by channel key; ``reader`` counts the channel
    streams that took it over (only the newest one reads)."""

    def __init__(self):
        self.pending: dict[str, list[GenerationChunk]] = {}
        self.ready = asyncio.Event()
        self.reader = 0
        self.closed = False

    def put(self, key: str, chunk: GenerationChunk) -> None:
        self.pending.setdefault(key, []).append(chunk)
        self.ready.set()

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
            batch, self.pending = self.pending, {}
            if batch:
                yield batch


class GatewayChannels:
    """A replica's open channels, one per gateway replica (see the module docstring).

    Args:
        idle_s: seconds after which an unused channel ends (:data:`CHANNEL_IDLE_S`).
    """

    def __init__(self, idle_s: float = CHANNEL_IDLE_S):
        self.idle_s = idle_s
        self._boxes: dict[str, _Outbox] = {}
        self.num_messages = 0
        self.num_chunks = 0

    def stats(self) -> dict[str, int]:
        """``gateway_channels`` open now; ``channel_messages`` sent and ``channel_chunks`` they
        carried since start (chunks per message: how many requests' tokens one message batched)."""
        return {"gateway_channels": len(self._boxes), "channel_messages": self.num_messages,
                "channel_chunks": self.num_chunks}

    async def serve(self, gateway_id: str, replica_id: str | None = None
                    ) -> AsyncIterator[dict[str, list[GenerationChunk]] | dict[str, str]]:
        """The channel of ``gateway_id``: a hello first, ``{"replica": replica_id}`` (the gateway
        then knows it is open, and where), then the batches. A second channel of the same gateway takes the outbox over
        (with what it holds); the first ends."""
        box = self._boxes.get(gateway_id)
        if box is None or box.closed:
            box = self._boxes[gateway_id] = _Outbox()
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
                box.closed = True
                if self._boxes.get(gateway_id) is box:
                    del self._boxes[gateway_id]

    async def route(self, chunks: AsyncIterator[GenerationChunk], channel: tuple[str, str] | None,
                    replica_id: str) -> AsyncIterator[GenerationChunk]:
        """A request's chunks as its own stream yields them: all of them when its gateway has no
        channel open here; else the first (``via_channel`` set), with the rest going to the
        channel under the request's key. Every first chunk names this replica (``replica``), so
        the gateway can open a channel to it. If the channel ends while the request runs, the
        rest comes on the request's own stream again."""
        box = self._boxes.get(channel[0]) if channel is not None else None
        first = True
        async for chunk in chunks:
            if first:
                first = False
                chunk.replica = replica_id
                if box is not None and not box.closed and not chunk.finished:
                    chunk.via_channel = True
                else:
                    box = None
                yield chunk
            elif box is not None and not box.closed:
                box.put(channel[1], chunk)
            else:
                yield chunk
