"""KV cache events: what an engine's prefix cache gained and lost, in vLLM's ``KVEventBatch``
vocabulary (``vllm/distributed/kv_events.py``: ``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``), so a router can know which prefixes each replica holds instead of guessing.

A block is named by its chained prefix hash (:func:`kvserve.engine.kv_cache_manager.hash_block`), which
is equal for equal token prefixes in every process (a hash of ints and tuples of ints, which
Python does not salt). ``medium`` says which tier holds it: :data:`MEDIUM_POOL` (the engine's
KV pool, on the device), :data:`MEDIUM_HOST` (the host tier, ``kvserve/engine/kv_offload.py``),
:data:`MEDIUM_CLUSTER` (the serving layer's cluster tier, which the hub reports, not an engine). The
events of one engine step form one :class:`KVEventBatch`.

Plain dataclasses of ints, strings and lists: they pickle across the engine core's pipe and
Ray calls.
"""

from __future__ import annotations

from dataclasses import dataclass, field

#: The engine's KV pool (GPU memory on CUDA, the pool's memory on CPU).
MEDIUM_POOL = "pool"
#: The per-replica host tier below the pool (pinned host memory on CUDA, a second store on CPU).
MEDIUM_HOST = "host"
#: The cluster tier in Ray's object store, shared by the replicas of a model
#: (``kvserve/deployments/replica/kv_cluster.py``); its events come from the application's hub.
MEDIUM_CLUSTER = "cluster"
MEDIUMS = (MEDIUM_POOL, MEDIUM_HOST, MEDIUM_CLUSTER)


@dataclass
class BlockStored:
    """Consecutive full blocks of one request entered ``medium``.

    Attributes:
        block_hashes: the blocks' chained hashes, in prefix order.
        parent_block_hash: the hash of the block before the first one (None: the first block of
            a prompt; the chain of a LoRA adapter's prompts starts from the adapter's own root).
        token_ids: the blocks' tokens, ``len(block_hashes) * block_size`` ids.
        block_size: tokens per block.
        lora_id: the adapter's ``lora_int_id`` when the blocks hold its KV, else None.
        medium: :data:`MEDIUM_POOL` or :data:`MEDIUM_HOST`.
    """

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str = MEDIUM_POOL


@dataclass
class BlockRemoved:
    """Blocks that left ``medium`` (evicted to make room, or dropped)."""

    block_hashes: list[int]
    medium: str = MEDIUM_POOL


@dataclass
class AllBlocksCleared:
    """Every block of every medium was dropped (a prefix-cache reset): forget this engine's blocks."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventBatch:
    """The events of one engine step, in the order they happened.

    Attributes:
        ts: wall-clock time of the step, seconds since the epoch.
        events: the step's events.
    """

    ts: float
    events: list[KVCacheEvent] = field(default_factory=list)


class KVEventRecorder:
    """Collects the events of the step in progress (the block pool and the tiers append to it);
    the engine takes them once per step with :meth:`take`. Consecutive ``BlockRemoved`` of one
    medium are merged into one event."""

    def __init__(self) -> None:
        self._events: list[KVCacheEvent] = []

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        lora_id: int | None,
        medium: str = MEDIUM_POOL,
    ) -> None:
        if hashes:
            self._events.append(BlockStored(list(hashes), parent, list(token_ids), block_size, lora_id, medium))

    def removed(self, block_hash: int, medium: str = MEDIUM_POOL) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved) and last.medium == medium:
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], medium))

    def cleared(self) -> None:
        self._events.append(AllBlocksCleared())

    def take(self, ts: float) -> KVEventBatch | None:
        """The events since the last call as one batch (None: none happened)."""
        if not self._events:
            return None
        events, self._events = self._events, []
        return KVEventBatch(ts, events)
