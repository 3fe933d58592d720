"""An ``LLMServer`` replica's half of KV-event routing: every ``interval_s`` it takes the engine's
KV cache event batches (one per step that changed the cache; ``kvserve/engine/kv_events.py``) and sends
them, with its load, to the application's hub (``kvserve/deployments/contract/kv_event_hub.py``) in one
Ray call. Quiet replicas still publish their load every ``heartbeat_s``. A hub that answers
``"resync"`` (new hub, or a gap in the numbering) gets a snapshot of the pool and the tier.

A failed publish is logged once per outage and retried with the next batches (a new hub is
looked up, or created, after a failure); the engine never waits for it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvserve.deployments.contract.kv_event_hub import ReplicaLoad, get_hub
from kvserve.deployments.replica.background import BackgroundLoop

logger = logging.getLogger("ray.serve")

#: Seconds between two publishes while the cache changes.
PUBLISH_INTERVAL_S = 0.05
#: Seconds between two publishes of a quiet replica (its load, and that it is alive).
HEARTBEAT_S = 1.0


class KVEventPublisher(BackgroundLoop):
    """Publishes one replica's KV events (see the module docstring); :meth:`start` and :meth:`stop`
    run the publishing.

    Args:
        engine: the replica's async front (``take_kv_events``, ``kv_cache_snapshot``, ``get_stats``).
        replica_id: this replica's Serve id (the router's name for it).
        app: the Serve application (its hub's name).
        hub: a hub to publish to (tests); default: the application's, looked up or created.
        listener: also shown every batch taken and every snapshot (``on_batches``, ``on_snapshot``:
            the cluster tier's connector, ``kv_cluster.py``), or None.
        layout: the KV layout of this replica's cluster-tier blocks, published with its load ("": none).
    """

    task_name = "kvserve-kv-publisher"

    def __init__(
        self,
        engine,
        replica_id: str,
        app: str,
        hub=None,
        interval_s: float = PUBLISH_INTERVAL_S,
        heartbeat_s: float = HEARTBEAT_S,
        listener=None,
        layout: str = "",
    ):
        self.engine, self.replica_id, self.app = engine, replica_id, app
        self.hub, self.listener, self.layout = hub, listener, layout
        self.interval_s, self.heartbeat_s = interval_s, heartbeat_s
        self._pending: list = []  # batches taken but not yet accepted by a hub
        self._seq = 0
        self._need_snapshot = True
        self._failing = False

    def _load(self) -> ReplicaLoad:
        s = self.engine.get_stats()
        return ReplicaLoad(
            int(s.get("num_waiting_uncached_tokens", s.get("num_waiting_prefill_tokens", 0))),
            int(s.get("num_running_requests", 0) + s.get("num_waiting_requests", 0) + s.get("num_pending_requests", 0)),
            layout=self.layout,
        )

    def _take(self) -> None:
        """Add the engine's new batches to those waiting (numbered ``_seq - len + 1 .. _seq``);
        batches a snapshot already covers are skipped; a gap (the engine dropped batches nobody
        took) means a snapshot."""
        seq, batches = self.engine.take_kv_events()
        first = seq - len(batches) + 1
        batches = [b for i, b in enumerate(batches, first) if i > self._seq]
        if not batches:
            return
        if self.listener is not None:
            self.listener.on_batches(batches)
        if seq - len(batches) != self._seq:
            self._pending.clear()
            self._need_snapshot = True
        self._pending += batches
        self._seq = seq

    async def publish_once(self) -> str:
        """Take the new batches and publish them (with a snapshot when the hub asked for one).
        Returns the hub's answer."""
        self._take()
        if len(self._pending) > 4096:  # the hub has been unreachable for long: start over from a snapshot
            self._pending.clear()
            self._need_snapshot = True
        snapshot = None
        if self._need_snapshot:
            snapshot = await self.engine.kv_cache_snapshot()
            if self.listener is not None:
                self.listener.on_snapshot(snapshot[1])
            start = self._seq - len(self._pending) + 1
            self._pending = [b for i, b in enumerate(self._pending, start) if i > snapshot[0]]
            self._seq = max(self._seq, snapshot[0])
        if self.hub is None:
            self.hub = await asyncio.to_thread(get_hub, self.app)
        answer = await self.hub.publish.remote(self.replica_id, self._seq, self._pending, self._load(), snapshot)
        if answer == "ok":
            self._pending = []
            self._need_snapshot = False
        else:
            self._need_snapshot = True
        return answer

    async def _run(self) -> None:
        last = 0.0
        while True:
            await asyncio.sleep(self.interval_s)
            now = time.monotonic()
            if not self._need_snapshot and not self._pending and now - last < self.heartbeat_s:
                self._take()
                if not self._pending:
                    continue
            try:
                if await self.publish_once() == "resync":
                    await self.publish_once()
                last = now
                if self._failing:
                    logger.info("KV events of replica %s: publishing again", self.replica_id)
                    self._failing = False
            except Exception as e:
                self.hub = None  # look it up (or create it) again next time
                self._need_snapshot = True
                if not self._failing:
                    logger.warning(
                        "KV events of replica %s: publishing failed (%s: %s); retrying",
                        self.replica_id,
                        type(e).__name__,
                        e,
                    )
                    self._failing = True
