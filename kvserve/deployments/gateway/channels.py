"""The gateway's end of the replicas' channels (the replica's end and the protocol:
:mod:`kvserve.deployments.replica.channels`): one stream per (model, replica) that brings every chunk after
the first of this gateway replica's requests there, batched per engine step, instead of one Serve
message per chunk and request.

:class:`ChannelHub` names each request's channel key on its way out (``GenerateRequest.channel``),
holds a queue per key, opens a channel to each replica a first chunk names (its router sends the
call to that replica: ``LLMServer.channel``), and hands each arriving batch's chunks to their
queues. A request's chunks go to exactly one place: the channel when its first chunk says
``via_channel``, else its own stream (so correctness never rests on which replica a channel call
reached).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time

logger = logging.getLogger("ray.serve")

#: Seconds a channel call may take to be answered by its replica before it is given up.
OPEN_TIMEOUT_S = 10.0
#: Seconds during which a channel call that Serve's own router sent to another replica is not
#: made again for the same replica.
RETRY_UNTARGETED_S = 30.0


class ChannelHub:
    """One gateway replica's channels (see the module docstring).

    Args:
        streaming_handles: served model name -> the model's streaming ``LLMServer`` handle.
        enabled: False sends no channel key (every request streams on its own).
    """

    def __init__(self, streaming_handles: dict, enabled: bool = True):
        self.gateway_id = f"gw-{os.getpid()}-{os.urandom(4).hex()}"
        self.handles, self.enabled = streaming_handles, enabled
        self._queues: dict[str, asyncio.Queue] = {}
        self._open: dict[tuple[str, str], asyncio.Task] = {}
        self._keys = itertools.count()
        self._untargeted: dict[tuple[str, str], float] = {}  # (model, replica) a channel call missed, when

    def register(self) -> tuple[tuple[str, str], asyncio.Queue] | None:
        """A new channel key and its queue, for one request (None when channels are off)."""
        if not self.enabled:
            return None
        key = f"{next(self._keys):x}"
        q = self._queues[key] = asyncio.Queue()
        return (self.gateway_id, key), q

    def unregister(self, key: str) -> None:
        """The request's stream ended: chunks still arriving for ``key`` are dropped."""
        self._queues.pop(key, None)

    def saw(self, model: str, replica_id: str | None) -> None:
        """A first chunk came from ``replica_id`` of ``model``: open a channel to it unless one is open."""
        if replica_id is None or not self.enabled or model not in self.handles:
            return
        k = (model, replica_id)
        if k not in self._open and time.monotonic() - self._untargeted.get(k, -1e9) > RETRY_UNTARGETED_S:
            self._open[k] = asyncio.get_running_loop().create_task(self._run(k))

    async def _run(self, k: tuple[str, str]) -> None:
        model, replica_id = k
        gen = self.handles[model].channel.remote(self.gateway_id, replica_id)
        try:
            async with asyncio.timeout(OPEN_TIMEOUT_S):
                hello = await gen.__anext__()
            if hello.get("replica") != replica_id:  # Serve's own router sent it elsewhere: used there until it ends
                self._untargeted[k] = time.monotonic()
                logger.info(
                    "channel to %s replica %s reached replica %s (no targeting router)",
                    model,
                    replica_id,
                    hello.get("replica"),
                )
            async for batch in gen:
                for key, chunks in batch.items():
                    q = self._queues.get(key)
                    if q is not None:
                        for c in chunks:
                            q.put_nowait(c)
        except (asyncio.CancelledError, StopAsyncIteration):
            pass
        except Exception as e:  # the replica is gone, or refused the call: requests still stream on their own
            logger.info("channel to %s replica %s ended: %s", model, replica_id, type(e).__name__)
        finally:
            gen.cancel()
            self._open.pop(k, None)
