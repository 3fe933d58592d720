"""The host tier below the KV pool (vLLM's KV offloading, ``--kv-offloading-size``; our code).

When the pool evicts a cached prefix block to reuse it, the block is copied out to a larger,
slower store instead of being dropped; a later request whose prefix continues past the pool's
hits into the tier gets those blocks loaded back into fresh pool blocks instead of recomputing
them. A block loaded back is the same bytes that were saved (no compression), so outputs with
the tier equal outputs without it.

The work is split as the KV pool's is: bookkeeping in the scheduler's process
(:class:`HostKVTier`: which hash lives in which slot, LRU over slots, the step's copies), the
bytes beside the KV tensors in every rank (:class:`HostKVStore`: the same slots on every rank,
each holding its own share of the layers and heads). The copies of a step travel in its
``SchedulerOutput`` (:class:`KVTransfer`) and run before the forward: saves first (they read
pool blocks this step may overwrite), then loads (they may fill a block a save just read).

Backends (``kv_offloading_backend``):

* ``native``: host memory (pinned on CUDA). The copies run before the step's forward, in
  its time (on CUDA: not measured; asynchronous saves off the step's critical path are not
  done yet).
* ``mmap``: a memory-mapped file under ``kv_offloading_path`` (or the temp dir): the store can
  exceed RAM; the page cache keeps what fits.

Blocks also leave and enter the engine whole, for a tier outside it (the serving layer's cluster
tier, ``kvserve/deployments/replica/kv_cluster.py``): :meth:`LLMEngine.export_kv_blocks
<kvserve.engine.llm_engine.LLMEngine.export_kv_blocks>` reads cached pool blocks out as
:class:`KVBlockCopy` (each rank's share as raw bytes), and ``import_kv_blocks`` writes copies into
host-tier slots (:meth:`HostKVTier.insert`), from where the scheduler loads them as it loads any
host-tier block. Bytes, not values: a block imported is bit-identical to the one exported.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from kvserve.engine.kv_events import MEDIUM_HOST, KVEventRecorder

BACKENDS = ("native", "mmap")


@dataclass
class KVTransfer:
    """One step's copies between the pool and the host tier.

    Attributes:
        saves: ``(pool block id, tier slot)`` pairs: copy the block into the slot.
        loads: ``(tier slot, pool block id)`` pairs: copy the slot into the block.
    """

    saves: list[tuple[int, int]] = field(default_factory=list)
    loads: list[tuple[int, int]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


def bytes_per_block(hf_config, block_size: int, kv_element_size: int) -> int:
    """K+V bytes of one block over the whole model (all layers, all KV heads: the sum over the
    ranks of a tensor/pipeline-parallel engine), as vLLM counts ``kv_offloading_size``."""
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * block_size * kv_element_size


def num_slots(size_gib: float | None, block_bytes: int) -> int:
    """Blocks of ``block_bytes`` (:func:`bytes_per_block`) the tier holds for ``size_gib`` GiB (0: no tier)."""
    return int(size_gib * (1 << 30)) // block_bytes if size_gib else 0


@dataclass
class KVBlockCopy:
    """One cached block out of an engine, to go into another engine's host tier.

    Attributes:
        block_hash: the block's chained prefix hash (``kvserve.engine.kv_cache_manager.hash_block``).
        meta: ``(parent hash, token ids, block size, LoRA id)`` as the KV events report it.
        shards: one array per rank (rank order), dtype ``uint8``, of that rank's K and V of the
            block: ``[layers, 2, block_size, kv_heads, head_dim]`` elements of the pool's dtype,
            as raw bytes (:func:`read_blocks`).
    """

    block_hash: int
    meta: tuple
    shards: list
    #: :func:`block_digest` of ``shards`` as the exporter computed it (None: not computed)
    digest: bytes | None = None

    @property
    def nbytes(self) -> int:
        return sum(int(s.nbytes) for s in self.shards)

    def verified(self) -> bool:
        """Whether ``shards`` still hash to ``digest`` (False without a digest): bytes that were
        corrupted or swapped on their way (the object store, its spill files, another replica)
        are recomputed, never loaded."""
        return self.digest is not None and block_digest(self.shards) == self.digest


def block_digest(shards: list) -> bytes:
    """SHA-256 over a block's bytes (``KVBlockCopy.shards``: one ``uint8`` array per rank), each
    shard length-prefixed (8 bytes, big-endian) so that a byte moved between ranks changes it.
    32 bytes; ~1-2 GB/s on one core (hashlib's SHA-256, which releases the GIL)."""
    import hashlib

    import numpy as np

    h = hashlib.sha256(b"kvserve-kv-bytes\0")
    for s in shards:
        a = np.ascontiguousarray(s)
        h.update(int(a.nbytes).to_bytes(8, "big"))
        h.update(memoryview(a).cast("B"))
    return h.digest()


def read_blocks(caches, block_ids: list[int]):
    """The K and V of pool blocks ``block_ids`` of one rank, as bytes.

    Args:
        caches: the rank's pool, one ``(K, V)`` pair per layer, each ``[num_blocks, block_size,
            kv_heads, head_dim]``.
        block_ids: pool blocks to read.

    Returns:
        A numpy ``uint8`` array ``[len(block_ids), block bytes]`` (host memory), row ``i`` holding
        block ``block_ids[i]`` as ``[layers, 2, block_size, kv_heads, head_dim]``.
    """
    import torch

    idx = torch.tensor(block_ids, device=caches[0][0].device)
    out = torch.stack([torch.stack([k[idx], v[idx]], 1) for k, v in caches], 1)  # [n, layers, 2, bs, h, d]
    return out.cpu().contiguous().view(torch.uint8).reshape(len(block_ids), -1).numpy()


class HostKVTier:
    """The scheduler's side of the host tier: hash -> slot, LRU (least recently used first),
    and the copies the current step needs (:meth:`take`).

    Args:
        num_slots: blocks the tier holds (>= 1).
        events: where ``BlockStored`` / ``BlockRemoved`` of medium ``host`` go (None: nowhere).

    Raises:
        ValueError: ``num_slots`` below 1.
    """

    def __init__(self, num_slots: int, events: KVEventRecorder | None = None):
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        self.num_slots = num_slots
        self.events = events
        self.lru: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.meta: dict[int, tuple] = {}  # block hash -> (parent hash, token ids, block size, LoRA id)
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self._pending = KVTransfer()
        self._pinned: set[int] = set()  # slots this step's loads read: never overwritten before they run
        #: hashes that came from outside the engine (:meth:`insert`) and are still here
        self.imported: set[int] = set()
        #: counters (blocks): saved into the tier, loaded back, inserted from outside, loaded
        #: back of those inserted
        self.num_saved = self.num_loaded = self.num_imported = self.num_imported_loaded = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.lru

    def __len__(self) -> int:
        return len(self.lru)

    def save(self, block_id: int, block_hash: int, meta: tuple | None = None) -> None:
        """The pool is evicting cached block ``block_id`` (hash ``block_hash``): copy it into a
        slot (the least recently used one when full; nothing when every slot is pinned by this
        step's loads). ``meta``: ``(parent hash, token ids, block size, LoRA id)`` for the event."""
        if block_hash in self.lru:
            self.lru.move_to_end(block_hash)
            return
        slot = self._claim(block_hash, meta)
        if slot is not None:
            self._pending.saves.append((block_id, slot))
            self.num_saved += 1

    def insert(self, block_hash: int, meta: tuple) -> int | None:
        """Make room for a block coming from outside the engine (:class:`KVBlockCopy`): the slot
        its bytes go to (the caller writes them before the next step), most recently used, or
        None when the tier holds it already or every slot is pinned."""
        if block_hash in self.lru:
            return None
        slot = self._claim(block_hash, meta)
        if slot is not None:
            self.imported.add(block_hash)
            self.num_imported += 1
        return slot

    def discard(self, hashes: list[int]) -> None:
        """Drop blocks whose slots hold nothing valid (an :meth:`insert` whose bytes were never
        written), each with a ``BlockRemoved``; their slots are free again."""
        for h in hashes:
            slot = self.lru.pop(h, None)
            if slot is None:
                continue
            self.meta.pop(h, None)
            self.imported.discard(h)
            self.free_slots.append(slot)
            if self.events is not None:
                self.events.removed(h, MEDIUM_HOST)

    def _claim(self, block_hash: int, meta: tuple | None) -> int | None:
        """A slot for ``block_hash`` (free, else the least recently used unpinned one's, whose
        block is dropped with a ``BlockRemoved``), recorded with a ``BlockStored``; None when
        every slot is pinned."""
        if self.free_slots:
            slot = self.free_slots.pop()
        else:
            victim = next((h for h, s in self.lru.items() if s not in self._pinned), None)
            if victim is None:
                return None
            slot = self.lru.pop(victim)
            self.meta.pop(victim, None)
            self.imported.discard(victim)
            if self.events is not None:
                self.events.removed(victim, MEDIUM_HOST)
        self.lru[block_hash] = slot
        if meta is not None:
            self.meta[block_hash] = meta
        if self.events is not None and meta is not None:
            parent, tokens, block_size, lora_id = meta
            self.events.stored([block_hash], parent, tokens, block_size, lora_id, MEDIUM_HOST)
        return slot

    def pin(self, hashes: list[int]) -> None:
        """Keep the slots of ``hashes`` (about to be loaded this step) from being overwritten by
        this step's saves, and mark them recently used."""
        for h in hashes:
            self._pinned.add(self.lru[h])
            self.lru.move_to_end(h)

    def load(self, block_hash: int, block_id: int) -> None:
        """Copy the tier's block ``block_hash`` into pool block ``block_id`` before this step's forward."""
        self._pending.loads.append((self.lru[block_hash], block_id))
        self.num_loaded += 1
        self.num_imported_loaded += block_hash in self.imported

    def take(self) -> KVTransfer:
        """This step's copies (the scheduler puts them in its ``SchedulerOutput``); unpins."""
        out, self._pending = self._pending, KVTransfer()
        self._pinned.clear()
        return out

    def clear(self) -> None:
        """Drop every block (a prefix-cache reset); the caller records ``AllBlocksCleared``."""
        self.lru.clear()
        self.meta.clear()
        self.imported.clear()
        self.free_slots = list(range(self.num_slots - 1, -1, -1))
        self._pinned.clear()

    def check(self) -> None:
        """Assert the tier's invariants (tests): every slot is either free or holds one hash."""
        used = list(self.lru.values())
        assert len(set(used)) == len(used), "two hashes in one slot"
        assert not set(used) & set(self.free_slots), "a slot both free and used"
        assert len(used) + len(self.free_slots) == self.num_slots, "slots leaked"
        assert self.imported <= self.lru.keys(), "an imported hash the tier does not hold"


def _reserve_disk(fd: int, nbytes: int, folder: str) -> None:
    """Make sure the file ``fd`` (in ``folder``) holds ``nbytes`` of real disk blocks before it is
    memory-mapped: a sparse file on a full disk maps fine and kills the process with SIGBUS at
    the first write of a page it cannot back. Checks the free space (``os.statvfs``: blocks free
    to unprivileged users) and then allocates the blocks (``os.posix_fallocate``; a file system
    without it, ``EOPNOTSUPP``/``EINVAL``, keeps the free-space check alone).

    Raises:
        OSError: ``ENOSPC`` naming the folder, the bytes needed and the bytes free.
    """
    import errno

    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    msg = (
        f"the mmap KV tier (kv_offloading_backend='mmap') needs {nbytes} bytes in {folder!r} but "
        f"{free} bytes are free there: set kv_offloading_path to a bigger disk, lower "
        f"kv_offloading_size, or use kv_offloading_backend='native'"
    )
    if nbytes > free:
        raise OSError(errno.ENOSPC, msg)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, msg) from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)):
            raise


class HostKVStore:
    """A rank's bytes of the host tier: K and V of ``num_slots`` blocks for each of its layers,
    shaped like its pool blocks ``[num_slots, block_size, kv_heads, head_dim]`` (the pool's
    dtype, float8 included).

    Args:
        caches: the rank's pool, one ``(K, V)`` pair per layer, each ``[num_blocks, block_size,
            kv_heads, head_dim]``.
        num_slots: blocks in the tier (the same on every rank).
        backend: ``native`` (host memory, pinned when the pool is on CUDA) or ``mmap`` (a file
            in ``path``, the temp dir by default, unlinked at once: it lives as long as the store;
            its blocks are reserved on the disk first, :func:`_reserve_disk`, so a full disk is an
            error here and never a SIGBUS when a page is first written).

    Raises:
        ValueError: an unknown backend or ``num_slots`` below 1.
        OSError: (``ENOSPC``) the mmap backend's disk cannot hold the tier.
    """

    def __init__(self, caches, num_slots: int, backend: str = "native", path: str | None = None):
        import torch

        if backend not in BACKENDS:
            raise ValueError(f"kv_offloading_backend must be one of {BACKENDS}, got {backend!r}")
        if num_slots < 1:
            raise ValueError(f"the host KV tier needs at least one slot, got {num_slots}")
        k0 = caches[0][0]
        self.device = k0.device
        shape = (len(caches), 2, num_slots, *k0.shape[1:])
        numel = 1
        for d in shape:
            numel *= d
        if backend == "mmap":
            nbytes = numel * k0.element_size()
            fd, name = tempfile.mkstemp(prefix="kvserve-kv-tier-", dir=path)
            try:
                _reserve_disk(fd, nbytes, os.path.dirname(name))
                os.close(fd)
                fd = -1
                flat = torch.from_file(name, shared=True, size=nbytes, dtype=torch.uint8)
            finally:
                if fd >= 0:
                    os.close(fd)
                os.unlink(name)
            self.data = flat.view(k0.dtype).view(shape)
        else:
            self.data = torch.empty(shape, dtype=k0.dtype, pin_memory=self.device.type == "cuda")
        self.caches = caches
        #: counters: bytes copied out / in, seconds spent in the copies of loads
        self.bytes_saved = self.bytes_loaded = 0
        self.load_seconds = 0.0
        self.block_bytes = 2 * len(caches) * k0[0].numel() * k0.element_size()

    def apply(self, transfer: KVTransfer) -> None:
        """Run a step's copies: saves, then loads (see the module docstring)."""
        import torch

        if transfer.saves:
            blocks = torch.tensor([b for b, _ in transfer.saves], device=self.device)
            slots = torch.tensor([s for _, s in transfer.saves])
            for layer, kv in enumerate(self.caches):
                for j, cache in enumerate(kv):
                    self.data[layer, j, slots] = cache[blocks].cpu()  # a blocking copy on CUDA
            self.bytes_saved += len(transfer.saves) * self.block_bytes
        if transfer.loads:
            t0 = time.perf_counter()
            slots = torch.tensor([s for s, _ in transfer.loads])
            blocks = torch.tensor([b for _, b in transfer.loads], device=self.device)
            for layer, kv in enumerate(self.caches):
                for j, cache in enumerate(kv):
                    cache[blocks] = self.data[layer, j, slots].to(self.device)
            self.load_seconds += time.perf_counter() - t0
            self.bytes_loaded += len(transfer.loads) * self.block_bytes

    def write_slots(self, slots: list[int], rows) -> None:
        """Write blocks into ``slots`` (this rank's shares of :class:`KVBlockCopy`, one ``uint8``
        row of :func:`read_blocks`'s layout per slot, a ``[len(slots), block bytes]`` array).

        Raises:
            ValueError: a row of another size than this rank's block (another model, dtype, block
                size or parallel layout).
        """
        import torch

        per_block = self.data[:, :, 0]  # [layers, 2, bs, h, d]
        nbytes = per_block.numel() * per_block.element_size()
        rows = torch.as_tensor(rows)
        if rows.dim() != 2 or rows.shape[1] != nbytes or rows.dtype != torch.uint8:
            raise ValueError(
                f"a KV block copy of {tuple(rows.shape)} {rows.dtype} does not fit this rank's "
                f"blocks of {nbytes} bytes (another model, KV dtype, block size or parallel layout)"
            )
        vals = rows.contiguous().view(self.data.dtype).view(len(slots), *per_block.shape)  # [n, layers, 2, ...]
        self.data[:, :, torch.tensor(slots)] = vals.permute(1, 2, 0, *range(3, vals.dim()))
