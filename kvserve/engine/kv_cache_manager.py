"""Paged KV cache bookkeeping: a pool of fixed-size blocks with automatic prefix caching.

The algorithm is PagedAttention's (Kwon et al. 2023, sec. 4.2-4.3): a request's K/V live
in ``block_size``-token blocks listed in its block table; blocks are reference counted so
that requests sharing a prefix share blocks. Prefix caching identifies a full block by a
hash chained over (parent block hash, the block's token ids, extra keys), as in vLLM's
automatic prefix caching: SHA-256 (:func:`hash_block`) from a per-engine random root
(:func:`root_hash`, or a seed the replicas of a model share), a LoRA adapter's chain from a
root of its own (name and version, :func:`lora_root_hash`), a request's ``cache_salt`` in its
first block, so prompts cannot be crafted to land on another adapter's or tenant's blocks. Freed blocks keep their contents and hash and go to the tail of an LRU
free queue; a later request with the same prefix can revive them until they are evicted
(reused from the head of the queue).

Below the pool there may be a host tier (:class:`kvserve.engine.kv_offload.HostKVTier`): an evicted
cached block is copied there instead of dropped, and a prefix that continues past the pool's
hits into the tier is loaded back into fresh blocks instead of recomputed. With an event
recorder (:class:`kvserve.engine.kv_events.KVEventRecorder`) the pool and the tier report every block
they gain or lose (vLLM's KV events).

This module only does bookkeeping on block ids; the tensors live in the model runner.
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvserve.engine.kv_events import MEDIUM_HOST, MEDIUM_POOL, BlockStored, KVEventBatch, KVEventRecorder
from kvserve.engine.kv_offload import HostKVTier
from kvserve.engine.request import Request

#: Domain tags of the hashes below: a block, the root of one engine's (cluster's) chains, a LoRA
#: adapter's root, a prompt's ``cache_salt``. Distinct tags keep the inputs of one kind of hash
#: from ever being read as another's.
_BLOCK_TAG = b"kvserve-block\0"
_ROOT_TAG = b"kvserve-root\0"
_LORA_TAG = b"kvserve-lora\0"
_SALT_KEY = b"s"
#: Bytes of a block hash (the leading bytes of its SHA-256): 128 bits, as a Python ``int``.
HASH_BYTES = 16
#: The environment variable that gives an engine its hash seed when its config does not
#: (``EngineConfig.prefix_caching_hash_seed``); unset and unconfigured: a random seed per engine.
HASH_SEED_ENV = "KVSERVE_PREFIX_CACHING_HASH_SEED"
_U32 = struct.Struct(">I")


def _digest(h) -> int:
    return int.from_bytes(h.digest()[:HASH_BYTES], "big")


def _lp(data: bytes) -> bytes:
    """``data`` length-prefixed (4 bytes, big-endian): a field that cannot run into the next."""
    return _U32.pack(len(data)) + data


def root_hash(seed: str | bytes | None = None) -> int:
    """Where every chain of block hashes of one engine (or of the replicas that share blocks)
    starts: 128 bits of ``SHA-256("kvserve-root\\0" + seed)``. ``None``: a random seed
    (``os.urandom``), so no one outside can predict (or precompute collisions against) the
    engine's block names. vLLM's ``NONE_HASH`` (random unless ``PYTHONHASHSEED`` is set)."""
    if seed is None:
        seed = os.urandom(32)
    elif isinstance(seed, str):
        seed = seed.encode()
    return _digest(hashlib.sha256(_ROOT_TAG + seed))


def engine_root_hash(seed: str | None) -> int:
    """The root of an engine whose config gives ``seed`` (``EngineConfig.prefix_caching_hash_seed``):
    that seed, else the :data:`HASH_SEED_ENV` variable's, else a random one."""
    if seed is None:
        seed = os.environ.get(HASH_SEED_ENV) or None
    return root_hash(seed)


def hash_block(parent_hash: int, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """Chained block hash, as vLLM's ``hash_block_tokens`` with ``sha256``: the first 128 bits of
    SHA-256 over an unambiguous serialization of (domain tag, the parent's 16 bytes, the
    token count, each token id as 4 big-endian bytes, ``extra``, already tag-length-value
    encoded by :func:`block_extra`). Equal iff the whole prefix (tokens, adapter, salt) up to
    this block is equal, up to a 2^-64 birthday bound no prompt can be crafted against.

    Raises:
        struct.error: a token id outside ``[0, 2**32)``.
    """
    h = hashlib.sha256(_BLOCK_TAG)
    h.update(parent_hash.to_bytes(HASH_BYTES, "big"))
    h.update(struct.pack(f">I{len(token_ids)}I", len(token_ids), *token_ids))
    if extra:
        h.update(extra)
    return _digest(h)


def block_extra(cache_salt: str | None) -> bytes:
    """The extra keys of a prompt's first block (vLLM puts ``cache_salt`` there): ``b""`` without
    a salt, else the salt's UTF-8 bytes, tagged and length-prefixed."""
    return b"" if not cache_salt else _SALT_KEY + _lp(cache_salt.encode())


def lora_root_hash(root: int, lora_name: str, lora_version: str = "") -> int:
    """Where the hash chain of a LoRA adapter's prompts starts (instead of ``root``): 128 bits of
    SHA-256 over a domain tag, ``root`` and the adapter's name and version, length-prefixed.
    The adapter's KV differs from the base model's and from another adapter's (or another load
    of the same name: a new ``lora_version``), so its blocks never match theirs; no token
    sequence reaches it (block hashes carry another tag)."""
    h = hashlib.sha256(_LORA_TAG)
    h.update(root.to_bytes(HASH_BYTES, "big"))
    h.update(_lp(lora_name.encode()) + _lp(lora_version.encode()))
    return _digest(h)


def request_root(root: int, lora_request) -> int:
    """The root of the chain of a request with adapter ``lora_request`` (a
    :class:`kvserve.engine.lora.LoRARequest`; None: the base model's ``root``)."""
    if lora_request is None:
        return root
    return lora_root_hash(root, lora_request.lora_name, getattr(lora_request, "lora_version", "") or "")


def chain_hashes(
    token_ids: Sequence[int], block_size: int, num_blocks: int, root: int, cache_salt: str | None = None
) -> list[int]:
    """The chained hashes of the first ``num_blocks`` full blocks of ``token_ids`` (fewer if
    the tokens end first), from ``root`` (:func:`request_root`), the first block carrying
    ``cache_salt``: what the engine computes as ``Request.block_hashes``."""
    out, parent = [], root
    extra = block_extra(cache_salt)
    for i in range(min(len(token_ids) // block_size, num_blocks)):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size], extra if i == 0 else b"")
        out.append(parent)
    return out


class BlockPool:
    """``num_blocks`` blocks with reference counts, an LRU free queue and a hash -> block map.

    Invariants (checked by :meth:`check`): a block is in the free queue iff its ref count
    is 0; every cached hash maps to a block that carries that hash.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.ref_cnt = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}
        #: called with ``(block id, hash)`` of each cached block that :meth:`allocate` evicts,
        #: before the block is handed out (its contents are still the cached prefix's)
        self.on_evict: Callable[[int, int], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        """Fraction of blocks referenced by live requests (0..1)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (reviving them from the free queue)."""
        for b in block_ids:
            if self.ref_cnt[b] == 0:
                del self.free_queue[b]
            self.ref_cnt[b] += 1

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` blocks from the head of the free queue, evicting their cached hashes.

        Raises:
            RuntimeError: fewer than ``n`` free blocks (callers check first).
        """
        if n > len(self.free_queue):
            raise RuntimeError(f"asked for {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            b, _ = self.free_queue.popitem(last=False)
            h = self.block_hash[b]
            if h is not None:
                if self.cached.get(h) == b:
                    del self.cached[h]
                    if self.on_evict is not None:
                        self.on_evict(b, h)
                self.block_hash[b] = None
            self.ref_cnt[b] = 1
            out.append(b)
        return out

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the free queue's tail in
        the given order (pass tail blocks first so they are evicted first).

        Raises:
            RuntimeError: a block freed more often than referenced.
        """
        for b in block_ids:
            if self.ref_cnt[b] <= 0:
                raise RuntimeError(f"double free of block {b}")
            self.ref_cnt[b] -= 1
            if self.ref_cnt[b] == 0:
                self.free_queue[b] = None

    def cache_block(self, block_id: int, block_hash: int) -> bool:
        """Register a full, computed block under its hash (first writer wins). Returns whether
        the block was newly cached."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return False
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash
            return True
        return False

    def reset_prefix_cache(self) -> None:
        for h, b in list(self.cached.items()):
            self.block_hash[b] = None
        self.cached.clear()

    def check(self) -> None:
        """Assert the pool's invariants (used by tests)."""
        for b in range(self.num_blocks):
            assert self.ref_cnt[b] >= 0, f"block {b} ref {self.ref_cnt[b]}"
            assert (self.ref_cnt[b] == 0) == (b in self.free_queue), f"block {b} free-queue mismatch"
        for h, b in self.cached.items():
            assert self.block_hash[b] == h, f"hash map points at block {b} without that hash"


class KVCacheManager:
    """Per-request block allocation on top of a :class:`BlockPool`.

    Args:
        num_blocks: blocks in the pool (per layer; all layers share block ids).
        block_size: tokens per block.
        enable_prefix_caching: share full blocks between requests with equal prefixes.
        events: records the pool's and the tier's KV events (None: none are recorded).
        host_tier: the tier below the pool (None: evicted blocks are dropped). Needs prefix
            caching (it keeps cached blocks).
        hash_seed: the seed of the block hashes' root (:func:`engine_root_hash`: None takes
            :data:`HASH_SEED_ENV`, else a random one). Engines that exchange blocks or
            hashes (the replicas of one model, their routers) must share it.

    Raises:
        ValueError: a host tier without prefix caching.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventRecorder | None = None,
        host_tier: HostKVTier | None = None,
        hash_seed: str | None = None,
    ):
        if host_tier is not None and not enable_prefix_caching:
            raise ValueError("the host KV tier keeps prefix-cached blocks: it needs enable_prefix_caching")
        self.block_size = block_size
        #: the root of this engine's block-hash chains (:func:`root_hash`)
        self.root = engine_root_hash(hash_seed)
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.events = events
        self.host_tier = host_tier
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the pool
        self.host_hits = 0  # of which found in the host tier (loaded back)
        #: block id -> (parent hash, token ids, block size, LoRA id) of cached blocks, for the
        #: events and the tier (kept only when one of them is on)
        self._meta: dict[int, tuple] = {}
        if events is not None or host_tier is not None:
            self.pool.on_evict = self._evicted

    def _evicted(self, block_id: int, block_hash: int) -> None:
        meta = self._meta.pop(block_id, None)
        if self.events is not None:
            self.events.removed(block_hash)
        if self.host_tier is not None:
            self.host_tier.save(block_id, block_hash, meta)

    def take_transfer(self):
        """The step's copies between pool and host tier (:class:`kvserve.engine.kv_offload.KVTransfer`),
        None without a tier or copies."""
        return (self.host_tier.take() or None) if self.host_tier is not None else None

    def snapshot(self, ts: float) -> KVEventBatch:
        """What the pool and the tier hold, as one ``BlockStored`` per block (pool blocks first),
        stamped ``ts`` (seconds since the epoch). Empty without events or tier (no block
        metadata is kept then)."""
        out = KVEventBatch(ts)
        for b, h in enumerate(self.pool.block_hash):
            if h is not None and b in self._meta:
                parent, tokens, bs, lora_id = self._meta[b]
                out.events.append(BlockStored([h], parent, list(tokens), bs, lora_id, MEDIUM_POOL))
        if self.host_tier is not None:
            for h in self.host_tier.lru:
                if h in self.host_tier.meta:
                    parent, tokens, bs, lora_id = self.host_tier.meta[h]
                    out.events.append(BlockStored([h], parent, list(tokens), bs, lora_id, MEDIUM_HOST))
        return out

    def cached_blocks(self, hashes: list[int]) -> list[tuple[int, int, tuple]]:
        """``(hash, pool block, metadata)`` of those of ``hashes`` the pool holds cached with their
        metadata (kept with events or a tier on), in the order given."""
        out = []
        for h in hashes:
            b = self.pool.lookup(h)
            if b is not None and b in self._meta:
                out.append((h, b, self._meta[b]))
        return out

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, in the pool and the tier (``AllBlocksCleared``)."""
        self.pool.reset_prefix_cache()
        self._meta.clear()
        if self.host_tier is not None:
            self.host_tier.clear()
        if self.events is not None:
            self.events.cleared()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def _update_hashes(self, req: Request) -> None:
        """Extend ``req.block_hashes`` over every full block of its known tokens."""
        bs = self.block_size
        toks = req.all_token_ids
        while (len(req.block_hashes) + 1) * bs <= len(toks):
            i = len(req.block_hashes)
            if i:
                parent, extra = req.block_hashes[-1], b""
            else:  # adapters (and loads of one) never share KV; the salt only in the first block
                parent, extra = request_root(self.root, req.lora_request), block_extra(req.cache_salt)
            req.block_hashes.append(hash_block(parent, toks[i * bs : (i + 1) * bs], extra))

    def get_computed_blocks(self, req: Request) -> list[int]:
        """Longest run of cached blocks matching the start of ``req``'s tokens.

        At most ``(num_tokens - 1) // block_size`` blocks are returned so that at least one
        token is left to compute (its logits are needed to sample). Takes no
        references and counts nothing (see :meth:`allocate_slots`).
        """
        if not self.pool.enable_caching:
            return []
        self._update_hashes(req)
        limit = (req.num_tokens - 1) // self.block_size
        hits = []
        for h in req.block_hashes[:limit]:
            b = self.pool.lookup(h)
            if b is None:
                break
            hits.append(b)
        return hits

    def get_offloaded_blocks(self, req: Request, num_computed_blocks: int) -> list[int]:
        """The hashes of the blocks that continue ``req``'s pool hits (``num_computed_blocks``
        of them, from :meth:`get_computed_blocks`) in the host tier, as long as they run
        unbroken; at most up to the same limit (one token is always left to compute). ``[]``
        without a tier."""
        if self.host_tier is None or not self.pool.enable_caching:
            return []
        limit = (req.num_tokens - 1) // self.block_size
        out = []
        for h in req.block_hashes[num_computed_blocks:limit]:
            if h not in self.host_tier:
                break
            out.append(h)
        return out

    def allocate_slots(
        self, req: Request, num_new_tokens: int, computed_blocks: list[int] = (), offloaded: list[int] = ()
    ) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` beyond its computed ones.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only for a request with an empty
        block table) are prepended to the block table and their tokens counted as computed.
        ``offloaded`` (hashes from :meth:`get_offloaded_blocks`, following ``computed_blocks``)
        get fresh blocks, loaded from the host tier before the step's forward, also counted as
        computed (and cached in the pool at once: later requests of the step share them).
        The first allocation of a (re)scheduled request updates the prefix-cache hit/query
        counters (tokens). Returns False, changing nothing, when the pool has too few free blocks.
        """
        bs = self.block_size
        n_hit, n_load = len(computed_blocks), len(offloaded)
        total = req.num_computed_tokens + (n_hit + n_load) * bs + num_new_tokens
        need = -(-total // bs) - len(req.block_table) - n_hit
        revive = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if max(need, 0) + revive > self.pool.num_free_blocks:
            return False
        if not req.block_table and req.num_computed_tokens == 0:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += n_hit * bs
            self.host_hits += n_load * bs
        if n_hit or n_load:
            assert not req.block_table, "prefix hits only for a request without blocks"
        if n_load:
            self.host_tier.pin(list(offloaded))  # this step's saves (evictions below) must not overwrite them
        if n_hit:
            self.pool.touch(list(computed_blocks))
            req.block_table.extend(computed_blocks)
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        for i, h in enumerate(offloaded, n_hit):
            self.host_tier.load(h, req.block_table[i])
        if n_hit or n_load:
            req.num_computed_tokens += (n_hit + n_load) * bs
            req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, (n_hit + n_load) * bs)
        if n_load:
            self.cache_blocks(req)  # the loaded blocks are computed once the step's copies ran
        return True

    def cache_blocks(self, req: Request) -> None:
        """Register ``req``'s blocks that are now full and computed in the prefix cache (and,
        with events on, record them as ``BlockStored``)."""
        if not self.pool.enable_caching:
            return
        self._update_hashes(req)
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        keep = self.events is not None or self.host_tier is not None
        first = None
        for i in range(n_full):
            if self.pool.cache_block(req.block_table[i], req.block_hashes[i]) and keep:
                if first is None:
                    first = i
                self._meta[req.block_table[i]] = self._block_meta(req, i)
            elif first is not None:
                self._record_stored(req, first, i)
                first = None
        if first is not None:
            self._record_stored(req, first, n_full)

    def _block_meta(self, req: Request, i: int) -> tuple:
        bs = self.block_size
        lora = req.lora_request
        parent = req.block_hashes[i - 1] if i else (None if lora is None else request_root(self.root, lora))
        return parent, req.all_token_ids[i * bs : (i + 1) * bs], bs, None if lora is None else lora.lora_int_id

    def _record_stored(self, req: Request, start: int, end: int) -> None:
        """One ``BlockStored`` for ``req``'s newly cached blocks ``start .. end - 1``."""
        if self.events is None:
            return
        parent, _, bs, lora_id = self._meta[req.block_table[start]]
        self.events.stored(req.block_hashes[start:end], parent, req.all_token_ids[start * bs : end * bs], bs, lora_id)

    def trim(self, req: Request) -> None:
        """Return the blocks past the ones ``req``'s tokens need (``ceil(num_tokens /
        block_size)``): after speculative decoding, the blocks that held only rejected drafts.
        Those were never cached (only computed full blocks are), so the prefix cache stays
        consistent; slots of rejected drafts inside kept blocks are past ``seq_len`` and get
        overwritten."""
        keep = -(-req.num_tokens // self.block_size)
        if len(req.block_table) > keep:
            self.pool.free(list(reversed(req.block_table[keep:])))
            del req.block_table[keep:]

    def free(self, req: Request) -> None:
        """Return all of ``req``'s blocks to the pool (tail blocks first)."""
        self.pool.free(list(reversed(req.block_table)))
        req.block_table = []

    def check(self, requests) -> None:
        """Assert the pool's invariants (:meth:`BlockPool.check`) and that every block's
        reference count is the number of block tables of ``requests`` (all requests in the
        engine) that hold it: nothing leaks, nothing is freed while in use. Used by tests."""
        refs = [0] * self.num_blocks
        for req in requests:
            for b in req.block_table:
                refs[b] += 1
        bad = [(b, refs[b], self.pool.ref_cnt[b]) for b in range(self.num_blocks) if refs[b] != self.pool.ref_cnt[b]]
        assert not bad, f"(block, held by block tables, ref count) disagree: {bad[:8]}"
        self.pool.check()
        if self.host_tier is not None:
            self.host_tier.check()

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
