"""The cluster tier's directory: which KV blocks Ray's object store holds for a model, under
which object, owned by which replica; least recently used first, within a byte budget.

Pure Python, no Ray: the event hub (``kvserve/deployments/contract/kv_event_hub.py``) keeps one and
wraps its methods as actor calls; the objects are opaque here (Ray ``ObjectRef``\\ s, each in a
one-element list so that Ray passes the reference rather than the value).

A block is keyed by ``(layout, hash)``: the layout (:func:`kv_layout`) names the model, its
weights (revision, quantization, A/B variant) and the shape of its KV (dtype, block size,
parallel layout), since the chained hash names only tokens (with adapter and salt);
two models in one application never share blocks. Entries go when the budget needs room (LRU),
when a replica reports an object lost, and with their owner: an object dies with the process
that put it, so a replica that is dropped takes its entries along.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from kvserve.engine.kv_events import MEDIUM_CLUSTER, BlockRemoved, BlockStored, KVEventBatch


def kv_layout(
    model: str,
    dtype: str,
    kv_cache_dtype: str,
    block_size: int,
    tp: int,
    pp: int,
    revision: str = "",
    quantization: str | None = None,
    variant: str = "",
) -> str:
    """The name of a KV layout: blocks move only between engines of the same one. Besides the
    KV's shape (dtype, KV dtype, block size, parallel layout) it names what the KV's values
    depend on: the weights' ``revision`` (a rolling update's new weights never load the old
    ones' KV), the weights' ``quantization`` and the A/B ``variant``. A LoRA adapter's name and
    version are in its blocks' hashes (their chain's root), so they need no place here."""
    return (
        f"{model}|rev:{revision}|q:{quantization or 'none'}|var:{variant}|{dtype}|{kv_cache_dtype}"
        f"|bs{block_size}|tp{tp}|pp{pp}"
    )


def cluster_holder(layout: str) -> str:
    """The name under which the index lists the cluster tier's blocks of ``layout`` (as if it
    were a replica holding them in medium ``cluster``)."""
    return f"cluster/{layout}"


@dataclass
class ClusterEntry:
    """One block in the cluster tier.

    Attributes:
        ref: ``[ObjectRef]`` of the block's shards (``KVBlockCopy.shards``).
        meta: ``(parent hash, token ids, block size, LoRA id)``.
        nbytes: the block's bytes (every rank's).
        owner: the replica that put it (the object lives as long as that process).
        digest: SHA-256 of the block's bytes (``kvserve.engine.kv_offload.block_digest``), which
            an importer checks before it loads them.
    """

    ref: list
    meta: tuple
    nbytes: int
    owner: str
    digest: bytes | None = None


class ClusterDirectory:
    """``(layout, hash) -> ClusterEntry``, LRU, at most ``budget_bytes`` (the largest budget any
    replica asked for: they share one tier)."""

    def __init__(self) -> None:
        self.entries: OrderedDict[tuple[str, int], ClusterEntry] = OrderedDict()
        self.nbytes = 0
        self.budget_bytes = 0
        #: counters: blocks put, blocks evicted for room, blocks dropped as lost or with their owner
        self.num_put = self.num_evicted = self.num_dropped = 0

    def __len__(self) -> int:
        return len(self.entries)

    def put(
        self, owner: str, layout: str, budget_bytes: int, blocks: list[tuple]
    ) -> tuple[list[int], dict[str, KVEventBatch]]:
        """Add ``blocks`` (``(hash, meta, nbytes, [ref], digest)``) put by ``owner``; blocks held already
        are kept as they are (and marked used). Returns the hashes added and the events for the
        index: ``{holder: batch}`` (:func:`cluster_holder`; evictions may concern other layouts)."""
        import time

        self.budget_bytes = max(self.budget_bytes, int(budget_bytes))
        added, events = [], {}
        for h, meta, nbytes, ref, *digest in blocks:
            key = (layout, h)
            if key in self.entries:
                self.entries.move_to_end(key)
                continue
            self.entries[key] = ClusterEntry(ref, tuple(meta), int(nbytes), owner, digest[0] if digest else None)
            self.nbytes += int(nbytes)
            self.num_put += 1
            added.append(h)
            parent, tokens, bs, lora_id = meta
            self._batch(events, layout).events.append(
                BlockStored([h], parent, list(tokens), bs, lora_id, MEDIUM_CLUSTER)
            )
        while self.nbytes > self.budget_bytes and self.entries:
            (lay, h), e = self.entries.popitem(last=False)
            self.nbytes -= e.nbytes
            self.num_evicted += 1
            self._removed(events, lay, h)
        for batch in events.values():
            batch.ts = time.time()
        return added, events

    def lookup(self, layout: str, hashes: list[int]) -> list[tuple[int, tuple, list, bytes | None]]:
        """``(hash, meta, [ref], digest)`` of the leading run of ``hashes`` the tier holds (marked used)."""
        out = []
        for h in hashes:
            e = self.entries.get((layout, h))
            if e is None:
                break
            self.entries.move_to_end((layout, h))
            out.append((h, e.meta, e.ref, e.digest))
        return out

    def drop(
        self, layout: str | None, hashes: list[int] | None = None, owner: str | None = None
    ) -> dict[str, KVEventBatch]:
        """Remove ``hashes`` of ``layout`` (objects found lost), or every block of ``owner`` (gone).
        Returns the events for the index."""
        if owner is not None:
            keys = [k for k, e in self.entries.items() if e.owner == owner]
        else:
            keys = [(layout, h) for h in hashes or () if (layout, h) in self.entries]
        events: dict[str, KVEventBatch] = {}
        for key in keys:
            self.nbytes -= self.entries.pop(key).nbytes
            self.num_dropped += 1
            self._removed(events, *key)
        return events

    @staticmethod
    def _batch(events: dict, layout: str) -> KVEventBatch:
        return events.setdefault(cluster_holder(layout), KVEventBatch(0.0))

    def _removed(self, events: dict, layout: str, h: int) -> None:
        batch = self._batch(events, layout)
        last = batch.events[-1] if batch.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(h)
        else:
            batch.events.append(BlockRemoved([h], MEDIUM_CLUSTER))

    def stats(self) -> dict[str, int]:
        return {
            "blocks": len(self.entries),
            "bytes": self.nbytes,
            "budget_bytes": self.budget_bytes,
            "put": self.num_put,
            "evicted": self.num_evicted,
            "dropped": self.num_dropped,
        }
