"""KV block pool and KV cache manager, driven without a model.

A property test runs random programs against ``BlockPool`` and a plain-list reference model (LRU
free order, ref counts, the hash map); targeted tests check ``KVCacheManager``'s prefix caching
(shared blocks, the hit cap, LRU eviction, chained hashes) and that a failed allocation changes
nothing. The scheduler on top of them: ``test_scheduler.py``, ``test_scheduler_properties.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from _kv_cache_helpers import make_req
from kvserve.engine.kv_cache_manager import BlockPool, KVCacheManager
from kvserve.engine.request import Request


# --------------------------------------------------------------------------- BlockPool vs a reference model


class BlockPoolMachine(RuleBasedStateMachine):
    """BlockPool against a plain-list reference: LRU free order, ref counts, hash map."""

    @initialize(n=st.integers(1, 8))
    def init(self, n):
        self.n = n
        self.pool = BlockPool(n)
        self.free_order = list(range(n))  # head (next to evict) first
        self.holders: list[list[int]] = []  # each a live "block table"
        self.hash_of: dict[int, int] = {}  # block -> hash, for cached blocks

    def refs(self):
        return Counter(b for h in self.holders for b in h)

    @rule(data=st.data())
    def allocate(self, data):
        k = data.draw(st.integers(0, len(self.free_order)))
        got = self.pool.allocate(k)
        assert got == self.free_order[:k], "allocate must take blocks from the LRU head"
        del self.free_order[:k]
        for b in got:
            self.hash_of.pop(b, None)  # evicted
        self.holders.append(got)

    @rule()
    def allocate_too_many(self):
        with pytest.raises(RuntimeError):
            self.pool.allocate(len(self.free_order) + 1)

    @precondition(lambda self: self.holders)
    @rule(data=st.data())
    def free(self, data):
        blocks = self.holders.pop(data.draw(st.integers(0, len(self.holders) - 1)))
        order = list(reversed(blocks))
        self.pool.free(order)
        refs = self.refs()
        for b in order:
            if refs[b] == 0:
                self.free_order.append(b)

    @rule(data=st.data())
    def double_free(self, data):
        zero = [b for b in range(self.n) if self.refs()[b] == 0]
        if zero:
            with pytest.raises(RuntimeError):
                self.pool.free([data.draw(st.sampled_from(zero))])

    @precondition(lambda self: any(self.holders))
    @rule(data=st.data(), h=st.integers(1, 6))
    def cache(self, data, h):
        b = data.draw(st.sampled_from([b for hold in self.holders for b in hold]))
        self.pool.cache_block(b, h)
        if b not in self.hash_of and h not in self.hash_of.values():  # first writer wins
            self.hash_of[b] = h

    @precondition(lambda self: self.hash_of)
    @rule(data=st.data())
    def hit(self, data):
        b, h = data.draw(st.sampled_from(sorted(self.hash_of.items())))
        assert self.pool.lookup(h) == b
        self.pool.touch([b])
        if b in self.free_order:
            self.free_order.remove(b)  # revived from the free queue
        self.holders.append([b])

    @rule(h=st.integers(1, 6))
    def lookup_unknown(self, h):
        if h not in self.hash_of.values():
            assert self.pool.lookup(h) is None

    @rule()
    def reset(self):
        self.pool.reset_prefix_cache()
        self.hash_of.clear()

    @invariant()
    def matches_reference(self):
        if not hasattr(self, "pool"):
            return
        self.pool.check()
        refs = self.refs()
        assert self.pool.ref_cnt == [refs[b] for b in range(self.n)]
        assert list(self.pool.free_queue) == self.free_order
        assert self.pool.num_free_blocks == len(self.free_order)
        assert dict(self.pool.cached) == {h: b for b, h in self.hash_of.items()}
        assert self.pool.usage() == pytest.approx(1 - len(self.free_order) / self.n)


TestBlockPool = BlockPoolMachine.TestCase
TestBlockPool.settings = settings(max_examples=150, stateful_step_count=30, deadline=None)


# --------------------------------------------------------------------------- KVCacheManager: prefix caching


def _compute_all(kv: KVCacheManager, req: Request, hits=()):
    """Allocate and 'compute' every token of req (as one prefill), then cache its blocks."""
    assert kv.allocate_slots(req, req.num_tokens - len(hits) * kv.block_size, list(hits))
    req.num_computed_tokens = req.num_tokens
    kv.cache_blocks(req)


def test_prefix_hit_shares_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=16)
    prefix = list(range(100, 148))  # 48 tokens = 3 full blocks
    a = make_req("a", prefix + [1, 2, 3, 4, 5])
    _compute_all(kv, a)
    assert len(a.block_table) == 4
    b = make_req("b", prefix + [7, 8, 9])
    hits = kv.get_computed_blocks(b)
    assert hits == a.block_table[:3]
    assert kv.allocate_slots(b, b.num_tokens - 48, hits)
    assert b.num_computed_tokens == 48 and b.metrics.num_cached_tokens == 48
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert [kv.pool.ref_cnt[x] for x in b.block_table] == [2, 2, 2, 1]
    assert kv.pool.ref_cnt[a.block_table[3]] == 1
    assert kv.pool.num_free_blocks == 16 - 5
    assert kv.hit_rate() == pytest.approx(48 / (a.num_tokens + b.num_tokens))
    # a different token inside the prefix breaks the chain from that block on
    c = make_req("c", prefix[:20] + [999] + prefix[21:] + [1])
    assert kv.get_computed_blocks(c) == a.block_table[:1]
    kv.free(a)
    assert [kv.pool.ref_cnt[x] for x in b.block_table] == [1, 1, 1, 1]
    kv.free(b)
    kv.pool.check()
    assert kv.pool.num_free_blocks == 16 and b.block_table == []
    with pytest.raises(RuntimeError, match="double free"):
        kv.pool.free(hits[:1])


def test_prefix_caching_disabled_shares_nothing():
    kv = KVCacheManager(num_blocks=16, block_size=16, enable_prefix_caching=False)
    prefix = list(range(100, 148))
    a = make_req("a", prefix + [1])
    _compute_all(kv, a)
    b = make_req("b", prefix + [2])
    assert kv.get_computed_blocks(b) == []
    assert kv.pool.cached == {}


def test_hit_cap_leaves_one_token_to_compute():
    kv = KVCacheManager(num_blocks=8, block_size=16)
    toks = list(range(200, 232))  # exactly 2 blocks
    a = make_req("a", toks + [5])
    _compute_all(kv, a)
    assert kv.get_computed_blocks(make_req("b", toks)) == a.block_table[:1]  # (32-1)//16 = 1
    assert kv.get_computed_blocks(make_req("c", toks + [9])) == a.block_table[:2]  # (33-1)//16 = 2
    assert kv.get_computed_blocks(make_req("d", toks[:16])) == []  # (16-1)//16 = 0


def test_lru_eviction_order():
    bs = 4
    kv = KVCacheManager(num_blocks=5, block_size=bs)
    toks = list(range(10, 22))  # 3 full blocks
    a = make_req("a", toks)
    _compute_all(kv, a)
    assert a.block_table == [0, 1, 2]
    kv.free(a)
    # never-used block first, then a's blocks tail first (the prefix head survives longest)
    assert list(kv.pool.free_queue) == [3, 4, 2, 1, 0]
    assert kv.get_computed_blocks(make_req("a2", toks + [1])) == [0, 1, 2]
    other = make_req("x", [1] * 12)  # needs 3 blocks: 3, 4 and then a's tail block 2
    assert kv.allocate_slots(other, 12)
    assert other.block_table == [3, 4, 2]
    assert kv.get_computed_blocks(make_req("a3", toks + [1])) == [0, 1]  # block 2 evicted
    # reviving a block and freeing it again makes it the most recently used
    a4 = make_req("a4", toks[:4] + [7])
    hits = kv.get_computed_blocks(a4)
    assert hits == [0]
    assert kv.allocate_slots(a4, 1, hits)
    assert a4.block_table == [0, 1]  # block 1 taken from the head of the queue: its hash is gone
    assert kv.get_computed_blocks(make_req("a5", toks + [1])) == [0]
    kv.free(a4)
    assert list(kv.pool.free_queue) == [1, 0]
    kv.free(other)
    kv.pool.check()


def test_hits_stop_at_first_evicted_block():
    """Chained hashes: once a block of the prefix is gone, later cached blocks cannot be used
    (their K/V would sit at the wrong positions)."""
    bs = 4
    kv = KVCacheManager(num_blocks=4, block_size=bs)
    toks = list(range(10, 22))
    a = make_req("a", toks)
    _compute_all(kv, a)
    assert a.block_table == [0, 1, 2]
    kv.free(a)
    kv.pool.touch([2])
    kv.pool.free([2])  # block 2 becomes the most recently used: block 1 is evicted before it
    assert list(kv.pool.free_queue) == [3, 1, 0, 2]
    x = make_req("x", [7] * 8)
    assert kv.allocate_slots(x, 8) and x.block_table == [3, 1]
    assert kv.pool.lookup(a.block_hashes[2]) == 2  # still cached...
    assert kv.get_computed_blocks(make_req("a2", toks + [1])) == [0]  # ...but not reachable


def test_allocate_slots_fails_without_side_effects():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = make_req("a", list(range(1, 9)))
    assert kv.allocate_slots(a, 8)
    b = make_req("b", list(range(20, 29)))  # 9 tokens: 3 blocks, only 1 free
    before = (list(kv.pool.free_queue), list(kv.pool.ref_cnt), kv.prefix_queries)
    assert not kv.allocate_slots(b, 9)
    assert (list(kv.pool.free_queue), list(kv.pool.ref_cnt), kv.prefix_queries) == before
    assert b.block_table == [] and b.num_computed_tokens == 0
