"""Paged KV cache bookkeeping: a pool of fixed-size blocks with automatic prefix caching.

The algorithm is PagedAttention's (Kwon et al. 2023, sec. 4.2-4.3): a request's K/V live
in ``block_size``-token blocks listed in its block table; blocks are reference counted so
that requests sharing a prefix share blocks. Prefix caching identifies a full block by a
hash chained over (parent block hash, the block's token ids), as in vLLM's automatic
prefix caching. Freed blocks keep their contents and hash and go to the tail of an LRU
free queue; a later request with the same prefix can revive them until they are evicted
(reused from the head of the queue).

This module only does bookkeeping on block ids; the tensors live in the model runner.
"""
from __future__ import annotations

from collections import OrderedDict

from engine.request import Request

NONE_HASH = 0


def hash_block(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """Chained block hash: equal iff the whole prefix up to this block is equal (modulo
    64-bit collisions)."""
    return hash((parent_hash, token_ids))


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

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Register a full, computed block under its hash (first writer wins)."""
        if not self.enable_caching or self.block_hash[block_id] is not None:
            return
        if block_hash not in self.cached:
            self.cached[block_hash] = block_id
            self.block_hash[block_id] = block_hash

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
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_queries = 0  # prompt tokens looked up
        self.prefix_hits = 0  # of which found in the cache

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
            parent = req.block_hashes[-1] if i else (NONE_HASH if req.lora_request is None  # adapters never
                                                     else hash(("lora", req.lora_request.lora_int_id)))  # share KV
            req.block_hashes.append(hash_block(parent, tuple(toks[i * bs:(i + 1) * bs])))

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

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Make room for ``num_new_tokens`` more tokens of ``req`` beyond its computed ones.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only for a request with an empty
        block table) are prepended to the block table and their tokens counted as computed.
        The first allocation of a (re)scheduled request updates the prefix-cache hit/query
        counters (tokens). Returns False, changing nothing, when the pool has too few free blocks.
        """
        bs = self.block_size
        n_hit = len(computed_blocks)
        total = req.num_computed_tokens + n_hit * bs + num_new_tokens
        need = -(-total // bs) - len(req.block_table) - n_hit
        revive = sum(1 for b in computed_blocks if self.pool.ref_cnt[b] == 0)
        if max(need, 0) + revive > self.pool.num_free_blocks:
            return False
        if not req.block_table and req.num_computed_tokens == 0:
            self.prefix_queries += req.num_tokens
            self.prefix_hits += n_hit * bs
        if n_hit:
            assert not req.block_table, "prefix hits only for a request without blocks"
            self.pool.touch(list(computed_blocks))
            req.block_table.extend(computed_blocks)
            req.num_computed_tokens += n_hit * bs
            req.metrics.num_cached_tokens = max(req.metrics.num_cached_tokens, n_hit * bs)
        if need > 0:
            req.block_table.extend(self.pool.allocate(need))
        return True

    def cache_blocks(self, req: Request) -> None:
        """Register ``req``'s blocks that are now full and computed in the prefix cache."""
        if not self.pool.enable_caching:
            return
        self._update_hashes(req)
        n_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        for i in range(n_full):
            self.pool.cache_block(req.block_table[i], req.block_hashes[i])

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

    def hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0
