"""A cluster-wide index of KV blocks: block hash -> the replicas that hold it, in which tier, kept
from the replicas' KV cache events (``kvserve/engine/kv_events.py``).

The engine names a block by its chained prefix hash, so a request's prefix is found by walking
its own chained hashes (:func:`request_hashes`) and, per replica, counting the leading blocks
the replica holds: first in its KV pool, then, continuing, in its host tier; the same walk the
engine's scheduler does (``KVCacheManager.get_computed_blocks``, then ``get_offloaded_blocks``),
so the index predicts what each replica would reuse. Past those, the run may continue in the
cluster tier (``kvserve/deployments/replica/kv_cluster.py``), which the hub lists under a holder of its
own per KV layout (``kv_cluster_directory.cluster_holder``) and every replica of that layout can
load from. The idea is llm-d's KV-cache indexer
(precise prefix-cache scoring); the code is ours.

Pure Python, no Ray: the router (``kvserve/deployments/routing/kv_router.py``) and the event hub
(``kvserve/deployments/contract/kv_event_hub.py``) both keep one.
"""

from __future__ import annotations

from kvserve.engine.kv_cache_manager import chain_hashes
from kvserve.engine.kv_events import (
    MEDIUM_CLUSTER,
    MEDIUM_HOST,
    MEDIUM_POOL,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)


def request_hashes(
    token_ids: list[int], block_size: int, max_blocks: int, root: int, cache_salt: str | None = None
) -> list[int]:
    """The chained hashes of the first full blocks of a prompt (at most ``max_blocks``, and
    never its last token's block: the engine always computes one token), exactly as the engine
    names them (:func:`~kvserve.engine.kv_cache_manager.chain_hashes`): from ``root`` (the
    engine's, or :func:`~kvserve.engine.kv_cache_manager.request_root` of a LoRA adapter's
    prompts), ``cache_salt`` in the first block."""
    return chain_hashes(token_ids, block_size, min((len(token_ids) - 1) // block_size, max_blocks), root, cache_salt)


class KVBlockIndex:
    """Block hash -> ``{replica id: set of mediums}``, and each replica's blocks.

    Not thread-safe: use it from one thread (an event loop)."""

    def __init__(self) -> None:
        self.where: dict[int, dict[str, set[str]]] = {}
        self.blocks: dict[str, set[int]] = {}  # replica id -> hashes it holds (any medium)

    def __len__(self) -> int:
        return len(self.where)

    @property
    def replicas(self) -> list[str]:
        return list(self.blocks)

    def apply(self, replica: str, batch: KVEventBatch) -> None:
        """Apply one replica's batch of events, in order."""
        mine = self.blocks.setdefault(replica, set())
        for e in batch.events:
            if isinstance(e, BlockStored):
                for h in e.block_hashes:
                    self.where.setdefault(h, {}).setdefault(replica, set()).add(e.medium)
                    mine.add(h)
            elif isinstance(e, BlockRemoved):
                for h in e.block_hashes:
                    holders = self.where.get(h)
                    mediums = holders.get(replica) if holders else None
                    if mediums is None:
                        continue
                    mediums.discard(e.medium)
                    if not mediums:
                        del holders[replica]
                        mine.discard(h)
                        if not holders:
                            del self.where[h]
            elif isinstance(e, AllBlocksCleared):
                self.drop(replica)
                mine = self.blocks.setdefault(replica, set())

    def replace(self, replica: str, snapshot: KVEventBatch) -> None:
        """Forget what ``replica`` held and take its snapshot (``BlockStored`` events) instead."""
        self.drop(replica)
        self.apply(replica, snapshot)

    def drop(self, replica: str) -> None:
        """Forget ``replica`` (gone, restarted, or cleared its cache)."""
        for h in self.blocks.pop(replica, ()):
            holders = self.where.get(h)
            if holders is not None:
                holders.pop(replica, None)
                if not holders:
                    del self.where[h]

    def match(
        self,
        hashes: list[int],
        replicas: list[str],
        pending: dict[int, str] | None = None,
        cluster: dict[str, str] | None = None,
    ) -> dict[str, tuple[int, int, int]]:
        """For each of ``replicas``: ``(pool blocks, host blocks, cluster blocks)`` it would reuse
        of a request whose chained hashes are ``hashes``: the leading run in its pool, then the
        run that continues in its host tier, then the run that continues in the cluster tier
        (see the module docstring). ``pending``: blocks a replica is about to hold (hash ->
        replica: a request just sent there computes them), counted as in its pool. ``cluster``:
        replica -> the holder of its layout's cluster-tier blocks (none: no cluster run)."""
        out = {}
        pending = pending or {}
        cluster = cluster or {}
        for r in replicas:
            pool = host = far = 0
            tier = cluster.get(r)
            for h in hashes:
                holders = self.where.get(h, {})
                mediums = holders.get(r)
                if not host and not far and ((mediums and MEDIUM_POOL in mediums) or pending.get(h) == r):
                    pool += 1
                elif not far and mediums and MEDIUM_HOST in mediums:
                    host += 1
                elif tier is not None and MEDIUM_CLUSTER in holders.get(tier, ()):
                    far += 1
                else:
                    break
            out[r] = (pool, host, far)
        return out

    def dump(self) -> dict[str, list[tuple[int, str]]]:
        """Everything, as ``{replica: [(hash, medium), ...]}`` (for a router that starts)."""
        out: dict[str, list[tuple[int, str]]] = {r: [] for r in self.blocks}
        for h, holders in self.where.items():
            for r, mediums in holders.items():
                out[r].extend((h, m) for m in mediums)
        return out

    @classmethod
    def load(cls, dump: dict[str, list[tuple[int, str]]]) -> "KVBlockIndex":
        """The index of a :meth:`dump`."""
        index = cls()
        for r, pairs in dump.items():
            index.blocks[r] = set()
            for h, m in pairs:
                index.where.setdefault(h, {}).setdefault(r, set()).add(m)
                index.blocks[r].add(h)
        return index
