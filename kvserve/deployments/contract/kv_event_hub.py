"""Where an application's replicas publish their KV cache events and its routers read them: one
Ray actor per Serve application (``KVEventHub``, named ``kv-event-hub/<app>``), created by the
first replica that publishes.

* Replicas (:class:`kvserve.deployments.replica.kv_publisher.KVEventPublisher`) call :meth:`KVEventHubCore.publish`
  at most every ``publish_interval_s`` with every step's batch since their last call (numbered by
  the engine) and their load; one Ray call carries many steps, none is per block. A replica whose
  numbering has a gap (the hub restarted, batches were dropped) is answered ``"resync"`` and
  sends a snapshot of its pool and tier.
* Routers (:class:`kvserve.deployments.routing.kv_router.KVAwareRouter`) call :meth:`KVEventHubCore.pull`
  with their cursor and get the changes since (or the whole index, when their cursor is older
  than the hub's log or from another hub), so each router keeps a local copy and a routing
  decision never waits on a Ray call.
* A replica that has not published for ``replica_ttl_s`` (gone, or its publisher stopped) is
  dropped from the index.

It also keeps the cluster tier's directory (:class:`~kvserve.deployments.contract.kv_cluster_directory.ClusterDirectory`:
which blocks Ray's object store holds, under which object; ``kvserve/deployments/replica/kv_cluster.py``
puts and fetches them) and lists those blocks in its index under one holder per KV layout, so
routers see them as events of medium ``cluster``.

If the hub dies (its actor is owned by the replica that created it), the next publish or pull
gets a new one: replicas resync, routers reload. Until then routers route on what they have. The
cluster tier's directory goes with it (its objects are freed once nothing refers to them).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from kvserve.deployments.contract.adapters import REGISTRY_NAMESPACE
from kvserve.deployments.contract.kv_cluster_directory import ClusterDirectory
from kvserve.deployments.contract.kv_index import KVBlockIndex
from kvserve.engine.kv_events import KVEventBatch

#: Changes kept for routers that pull (older cursors get the whole index).
LOG_SIZE = 4096
#: Seconds without a publish after which a replica is dropped.
REPLICA_TTL_S = 10.0


@dataclass
class ReplicaLoad:
    """A replica's load when it last published: prompt tokens waiting to be computed (past the
    prefixes its pool and tier hold), requests running or waiting, and the wall-clock time of the
    publish (seconds since the epoch); ``layout``: the KV layout of its cluster-tier blocks
    (``kv_cluster_directory.kv_layout``; empty: no cluster tier)."""

    waiting_tokens: int = 0
    running_requests: int = 0
    ts: float = 0.0
    layout: str = ""


@dataclass
class PullReply:
    """What a router gets from :meth:`KVEventHubCore.pull`.

    Attributes:
        hub_id: this hub's identity (a new hub: reload).
        cursor: pass it to the next pull.
        changes: ``(replica, kind, payload)`` since the router's cursor: ``("batch", KVEventBatch)``,
            ``("replace", KVEventBatch)`` (a snapshot), ``("drop", None)``; None when ``dump`` is set.
        dump: the whole index (:meth:`KVBlockIndex.dump`), for a router that is new or too far behind.
        loads: every replica's :class:`ReplicaLoad`.
    """

    hub_id: str
    cursor: int
    changes: list | None = None
    dump: dict | None = None
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)


class KVEventHubCore:
    """The hub's state and logic, without Ray (the actor wraps it; tests drive it directly).

    Args:
        log_size: changes kept for routers' pulls.
        replica_ttl_s: seconds of silence after which a replica is dropped.
        clock: wall-clock seconds (tests pass a fake).
    """

    def __init__(self, log_size: int = LOG_SIZE, replica_ttl_s: float = REPLICA_TTL_S, clock=time.time):
        import uuid

        self.hub_id = uuid.uuid4().hex
        self.index = KVBlockIndex()
        self.seq: dict[str, int] = {}  # replica -> number of the last batch applied
        self.loads: dict[str, ReplicaLoad] = {}
        self.log: deque[tuple[int, str, str, KVEventBatch | None]] = deque(maxlen=log_size)
        self.version = 0
        self.replica_ttl_s, self.clock = replica_ttl_s, clock
        self.cluster = ClusterDirectory()

    def _record(self, replica: str, kind: str, payload) -> None:
        self.version += 1
        self.log.append((self.version, replica, kind, payload))

    def publish(
        self,
        replica: str,
        seq: int,
        batches: list[KVEventBatch],
        load: ReplicaLoad,
        snapshot: tuple[int, KVEventBatch] | None = None,
    ) -> str:
        """A replica's batches numbered ``seq - len(batches) + 1 .. seq`` (each step's events; the
        numbering is the engine's), its load, and optionally a snapshot ``(its seq, batch)`` to
        start from. Batches at or below what the hub applied are skipped.

        Returns:
            ``"ok"``, or ``"resync"``: the hub has not seen this replica, or a batch is missing;
            nothing was applied: send a snapshot.
        """
        load.ts = self.clock()
        self.loads[replica] = load
        if snapshot is not None:
            snap_seq, snap = snapshot
            self.index.replace(replica, snap)
            self.seq[replica] = snap_seq
            self._record(replica, "replace", snap)
        last = self.seq.get(replica)
        if last is None:
            return "resync"
        first = seq - len(batches) + 1
        if first > last + 1:
            return "resync"
        for n, batch in enumerate(batches, first):
            if n > last:
                self.index.apply(replica, batch)
                self._record(replica, "batch", batch)
        self.seq[replica] = max(last, seq)
        self._expire()
        return "ok"

    def _expire(self) -> None:
        now = self.clock()
        for r, load in list(self.loads.items()):
            if now - load.ts > self.replica_ttl_s:
                self.forget(r)

    def forget(self, replica: str) -> None:
        """Drop ``replica`` from the index, and the cluster-tier blocks it owns (they die with it)."""
        self.loads.pop(replica, None)
        self.seq.pop(replica, None)
        self.index.drop(replica)
        self._record(replica, "drop", None)
        self._cluster_events(self.cluster.drop(None, owner=replica))

    # ---- the cluster tier's directory ----------------------------------------------------
    def _cluster_events(self, events: dict) -> None:
        for holder, batch in events.items():
            if batch.events:
                self.index.apply(holder, batch)
                self._record(holder, "batch", batch)

    def cluster_put(self, replica: str, layout: str, budget_bytes: int, blocks: list) -> tuple[str, list[int]]:
        """``replica`` put ``blocks`` (``(hash, meta, nbytes, [ObjectRef], digest)``) of ``layout`` in the
        object store (:meth:`ClusterDirectory.put`). Returns this hub's id (a replica that sees a
        new one puts again what it put before) and the hashes added."""
        added, events = self.cluster.put(replica, layout, budget_bytes, blocks)
        self._cluster_events(events)
        return self.hub_id, added

    def cluster_lookup(self, layout: str, hashes: list[int]) -> list:
        """``(hash, meta, [ObjectRef], digest)`` of the leading run of ``hashes`` in the cluster tier."""
        return self.cluster.lookup(layout, hashes)

    def cluster_drop(self, layout: str, hashes: list[int]) -> None:
        """A replica found these blocks' objects lost (or their bytes not matching their digest): forget them."""
        self._cluster_events(self.cluster.drop(layout, hashes))

    def cluster_stats(self) -> dict[str, int]:
        """The cluster tier's size and counters (:meth:`ClusterDirectory.stats`)."""
        return self.cluster.stats()

    def pull(self, hub_id: str | None, cursor: int) -> PullReply:
        """The changes after ``cursor`` for a router that last saw hub ``hub_id`` (None: a new
        router), or the whole index when it cannot be brought up to date from the log."""
        self._expire()
        oldest = self.log[0][0] if self.log else self.version + 1
        if hub_id != self.hub_id or cursor > self.version or cursor < oldest - 1:
            return PullReply(self.hub_id, self.version, dump=self.index.dump(), loads=dict(self.loads))
        changes = [(r, kind, payload) for v, r, kind, payload in self.log if v > cursor]
        return PullReply(self.hub_id, self.version, changes=changes, loads=dict(self.loads))


def hub_name(app: str) -> str:
    return f"kv-event-hub/{app}"


def get_hub(app: str, create: bool = True):
    """The Ray actor handle of ``app``'s hub (created, owned by this process, when none is alive
    and ``create``); None when there is none and ``create`` is False.

    Raises:
        RuntimeError: not connected to Ray.
    """
    import ray

    name = hub_name(app)
    try:
        return ray.get_actor(name, namespace=REGISTRY_NAMESPACE)
    except ValueError:
        if not create:
            return None
    actor = ray.remote(num_cpus=0, max_concurrency=1)(KVEventHubCore)
    return actor.options(name=name, namespace=REGISTRY_NAMESPACE, get_if_exists=True).remote()
