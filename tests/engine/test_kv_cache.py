"""KV block pool, KV cache manager and scheduler, driven without a model.

The property tests run random programs (add / step / abort) against a fake model runner that
"writes" into a simulated KV cache: every slot remembers which token prefix produced it, so
a request that reads a wrong block (bad prefix hit, stale cache entry, a block shared while
being written) is caught, as are leaked or double-freed blocks, wrong ref counts, budget
overruns and stalls.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv_cache_manager import NONE_HASH, BlockPool, KVCacheManager, hash_block
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

EOS = 0


def make_req(rid, prompt, max_tokens=4, priority=0, arrival=None, max_model_len=1 << 30, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), eos_token_ids={EOS},
                   priority=priority, arrival_time=arrival, max_model_len=max_model_len)


def chain_hashes(tokens, bs):
    out, parent = [], NONE_HASH
    for i in range(len(tokens) // bs):
        parent = hash_block(parent, tuple(tokens[i * bs:(i + 1) * bs]))
        out.append(parent)
    return out


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


# --------------------------------------------------------------------------- scheduler with a fake runner


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort programs against Scheduler + KVCacheManager."""

    @initialize(bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(2, 12), max_seqs=st.integers(1, 4),
                budget=st.integers(1, 24), policy=st.sampled_from(["fcfs", "priority"]),
                caching=st.booleans(), seed=st.integers(0, 2**16), mixed=st.sampled_from([None, 0, 1, 3, 8]))
    def init(self, bs, num_blocks, max_seqs, budget, policy, caching, seed, mixed):
        self.bs, self.max_seqs, self.budget, self.mixed = bs, max_seqs, budget, mixed
        self.kv = KVCacheManager(num_blocks, bs, caching)
        self.pool = self.kv.pool
        self.sched = Scheduler(self.kv, max_seqs, budget, policy, mixed_prefill_tokens=mixed)
        self.cap = num_blocks * bs  # max_model_len, as LLMEngine caps it
        self.rng = random.Random(seed)
        # a few shared prefixes so that prefix caching has something to hit
        self.prefixes = [[self.rng.randint(1, 3) for _ in range(self.cap)] for _ in range(2)]
        self.clock = 1.0
        self.ids: list[str] = []
        self.reqs: dict[str, Request] = {}
        self.slots: dict[int, tuple[int, ...]] = {}  # fake KV: slot -> token prefix that wrote it
        self.preempted_seen = 0

    # ---- rules ------------------------------------------------------------------
    @rule(data=st.data())
    def add(self, data):
        n = data.draw(st.integers(1, self.cap - 1), label="prompt_len")
        fam = data.draw(st.integers(-1, len(self.prefixes) - 1), label="prefix")
        shared = data.draw(st.integers(0, n), label="shared") if fam >= 0 else 0
        tail_rng = random.Random(data.draw(st.integers(0, 2**16), label="tail_seed"))
        prompt = (self.prefixes[fam][:shared] if fam >= 0 else []) + [
            tail_rng.randint(1, 3) for _ in range(n - shared)]
        req = make_req(f"r{len(self.ids)}", prompt, max_tokens=data.draw(st.integers(1, self.cap)),
                       priority=data.draw(st.integers(0, 2)), arrival=self.clock, max_model_len=self.cap,
                       ignore_eos=data.draw(st.booleans()))
        self.clock += 1.0
        self.sched.add_request(req)
        self.ids.append(req.request_id)
        self.reqs[req.request_id] = req
        with pytest.raises(ValueError):
            self.sched.add_request(req)  # duplicate id

    @rule(k=st.integers(1, 4))
    def step(self, k):
        for _ in range(k):
            self._step(abort_mid=False)

    @rule()
    def step_abort_midway(self):
        self._step(abort_mid=True)

    @precondition(lambda self: self.ids)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(self.ids + ["unknown"]))
        live = rid in self.sched.requests
        req = self.sched.abort(rid)
        assert (req is not None) == live
        if live:
            assert req.status is RequestStatus.FINISHED_ABORTED and req.block_table == []
            assert rid not in self.sched.requests

    # ---- the fake step ------------------------------------------------------------
    def _step(self, abort_mid: bool):
        running_before = {r.request_id for r in self.sched.running}
        waiting_before = {r.request_id for r in self.sched.waiting}
        had_work = self.sched.has_unfinished()
        out = self.sched.schedule()
        bs = self.bs

        assert out.num_batched_tokens <= self.budget
        decodes = sum(sr.request_id in running_before and len(sr.token_ids) == 1
                      and self.sched.requests[sr.request_id].num_tokens - sr.start == 1 for sr in out.requests)
        if decodes and self.mixed:  # a step with decodes: short prefills whole, one long one chunked at the cap
            chunks = [sr for sr in out.requests if not (sr.request_id in running_before and len(sr.token_ids) == 1
                      and self.sched.requests[sr.request_id].num_tokens - sr.start == 1)]
            assert all(len(sr.token_ids) <= self.mixed for sr in chunks), "mixed-step chunk over the cap"
            long_ones = [sr for sr in chunks if self.sched.requests[sr.request_id].num_tokens > self.mixed]
            assert len(long_ones) <= 1, "two long prefills in one mixed step"
        assert len(out.requests) <= self.max_seqs
        assert len(self.sched.running) <= self.max_seqs
        ids = [sr.request_id for sr in out.requests]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        if had_work:
            assert out.requests, "stall: unfinished requests but nothing scheduled"
        preempted = {rid for rid in running_before
                     if rid in self.sched.requests and self.sched.requests[rid].status is RequestStatus.PREEMPTED}
        assert out.num_preempted == len(preempted)
        self.preempted_seen += len(preempted)
        if preempted:
            assert not any(sr.new and sr.request_id in waiting_before for sr in out.requests), \
                "waiting requests admitted in a step that had to preempt"

        for sr in out.requests:
            req = self.sched.requests[sr.request_id]
            n = len(sr.token_ids)
            assert req.status is RequestStatus.RUNNING and n >= 1
            assert sr.start == req.num_computed_tokens
            assert sr.token_ids == req.all_token_ids[sr.start:sr.start + n]
            assert sr.sample == (sr.start + n == req.num_tokens)
            assert sr.block_table == req.block_table
            assert len(sr.block_table) == -(-(sr.start + n) // bs), "block table not sized to the tokens"
            assert (sr.new is not None) == (sr.request_id not in running_before)
            if sr.new is not None:
                assert sr.new.prompt_token_ids == req.prompt_token_ids
                assert sr.new.computed_token_ids == req.all_token_ids[:sr.start]
                assert sr.start % bs == 0  # only whole cached blocks are skipped
            for p in range(sr.start, sr.start + n):  # blocks written this step are private and uncached
                b = sr.block_table[p // bs]
                assert self.pool.ref_cnt[b] == 1, f"writing into shared block {b}"
                assert self.pool.block_hash[b] is None, f"writing into cached block {b}"

        # the fake model writes K/V, then every request reads its whole context
        for sr in out.requests:
            req = self.sched.requests[sr.request_id]
            for p in range(sr.start, sr.start + len(sr.token_ids)):
                self.slots[sr.block_table[p // bs] * bs + p % bs] = tuple(req.all_token_ids[:p + 1])
        for sr in out.requests:
            req = self.sched.requests[sr.request_id]
            for p in range(sr.start + len(sr.token_ids)):
                slot = sr.block_table[p // bs] * bs + p % bs
                assert self.slots.get(slot) == tuple(req.all_token_ids[:p + 1]), \
                    f"{sr.request_id} reads wrong K/V at position {p}"

        sampled = {sr.request_id: (EOS if self.rng.random() < 0.1 else self.rng.randint(1, 3))
                   for sr in out.requests if sr.sample}
        if abort_mid and out.requests:
            self.sched.abort(self.rng.choice(ids))
        before = {sr.request_id: self.sched.requests[sr.request_id].num_tokens
                  for sr in out.requests if sr.request_id in self.sched.requests}
        updated = self.sched.update_from_output(out, sampled)
        assert {r.request_id for r in updated} == {sr.request_id for sr in out.requests
                                                   if sr.sample and sr.request_id in before}
        for r in updated:
            assert r.num_tokens == before[r.request_id] + 1 and r.all_token_ids[-1] == sampled[r.request_id]

    # ---- invariants ---------------------------------------------------------------
    @invariant()
    def blocks_consistent(self):
        if not hasattr(self, "sched"):
            return
        self.pool.check()
        refs = Counter()
        for r in self.sched.running:
            assert len(r.block_table) == len(set(r.block_table)), f"block twice in {r}"
            refs.update(r.block_table)
            assert r.num_computed_tokens < r.num_tokens <= self.cap
            assert len(r.block_table) * self.bs >= r.num_computed_tokens
        for r in self.sched.waiting:
            assert r.block_table == [] and r.num_computed_tokens == 0, f"waiting {r} holds blocks"
        assert self.pool.ref_cnt == [refs[b] for b in range(self.pool.num_blocks)], "ref count != live tables"
        assert self.pool.num_free_blocks == self.pool.num_blocks - len(refs)
        assert set(self.sched.requests) == {r.request_id for r in self.sched.running + self.sched.waiting}
        assert len(self.sched.running) == len({id(r) for r in self.sched.running})
        # every cached block holds exactly the tokens its hash names
        for h, b in self.pool.cached.items():
            prefix = self.slots.get(b * self.bs + self.bs - 1)
            assert prefix is not None and len(prefix) % self.bs == 0
            assert all(self.slots.get(b * self.bs + i) == prefix[:len(prefix) - self.bs + i + 1]
                       for i in range(self.bs))
            assert chain_hashes(list(prefix), self.bs)[-1] == h, f"cached block {b} holds other tokens"
        assert 0.0 <= self.kv.hit_rate() <= 1.0

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        remaining = sum(r.max_output_tokens + r.num_tokens for r in self.sched.requests.values())
        for _ in range(50 * remaining + 10):
            if not self.sched.has_unfinished():
                break
            self._step(abort_mid=False)
            self.blocks_consistent()
        assert not self.sched.has_unfinished(), "requests never finished"
        assert self.pool.num_free_blocks == self.pool.num_blocks
        assert all(c == 0 for c in self.pool.ref_cnt)
        for r in self.reqs.values():
            assert r.finished and r.block_table == []
            assert r.num_output_tokens <= r.max_output_tokens
            if r.status is RequestStatus.FINISHED_LENGTH:
                assert r.num_output_tokens == r.max_output_tokens
            elif r.status is RequestStatus.FINISHED_STOPPED:
                assert r.all_token_ids[-1] == EOS and not r.params.ignore_eos
        event(f"preemptions>0: {self.preempted_seen > 0}")


TestScheduler = SchedulerMachine.TestCase
TestScheduler.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])


# --------------------------------------------------------------------------- targeted unit tests


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


def _sched(num_blocks, bs, max_seqs=8, budget=64, policy="fcfs", caching=True, mixed=None):
    return Scheduler(KVCacheManager(num_blocks, bs, caching), max_seqs, budget, policy, mixed_prefill_tokens=mixed)


def _step(s: Scheduler, token=5):
    out = s.schedule()
    s.update_from_output(out, {sr.request_id: token for sr in out.requests if sr.sample})
    return out


@pytest.mark.parametrize("policy, victim", [("priority", "B"), ("fcfs", "C")])
def test_preemption_picks_lowest_priority_then_latest(policy, victim):
    # three 4-token prompts fill 3 of 4 blocks; next step each decode needs a second block
    s = _sched(num_blocks=4, bs=4, policy=policy)
    reqs = {"A": make_req("A", [1, 2, 3, 4], max_tokens=3, priority=1, arrival=1.0),
            "B": make_req("B", [5, 6, 7, 8], max_tokens=3, priority=1, arrival=2.0),
            "C": make_req("C", [9, 10, 11, 12], max_tokens=3, priority=0, arrival=3.0)}
    for r in reqs.values():
        s.add_request(r)
    out = _step(s)
    assert len(out.requests) == 3 and s.kv.pool.num_free_blocks == 1
    out = _step(s)
    assert out.num_preempted == 1 and s.num_preemptions == 1
    assert reqs[victim].status is RequestStatus.PREEMPTED and reqs[victim].block_table == []
    assert reqs[victim].metrics.num_preemptions == 1 and reqs[victim].num_computed_tokens == 0
    assert [r.request_id for r in s.waiting] == [victim]
    assert sorted(sr.request_id for sr in out.requests) == sorted(set(reqs) - {victim})
    # the victim resumes later, recomputing prompt + its output
    for _ in range(200):
        out = _step(s)
        new = [sr for sr in out.requests if sr.request_id == victim and sr.new]
        if new:  # its freed block went straight to the request that needed it: full recompute
            assert new[0].start == 0 and new[0].token_ids == reqs[victim].all_token_ids[:5]
            assert new[0].sample and new[0].new.computed_token_ids == []
            assert reqs[victim].num_output_tokens == 2  # prompt + 1 output recomputed, then sampled
            break
    else:
        pytest.fail("victim never rescheduled")
    while s.has_unfinished():
        _step(s)
    assert all(r.status is RequestStatus.FINISHED_LENGTH and r.num_output_tokens == 3 for r in reqs.values())
    assert s.kv.pool.num_free_blocks == 4


def test_chunked_prefill_and_decode_first():
    s = _sched(num_blocks=32, bs=4, budget=8)
    a = make_req("a", [1, 2, 3], max_tokens=5, arrival=1.0)
    s.add_request(a)
    out = _step(s)
    assert [(sr.request_id, sr.start, len(sr.token_ids), sr.sample) for sr in out.requests] == [("a", 0, 3, True)]
    b = make_req("b", list(range(10, 30)), max_tokens=2, arrival=2.0)  # 20 tokens, budget 8
    s.add_request(b)
    got = []
    while b.num_output_tokens == 0:
        out = _step(s)
        assert out.num_batched_tokens <= 8
        got.append([(sr.request_id, sr.start, len(sr.token_ids), sr.sample) for sr in out.requests])
    # the decode of a goes first each step; b's prompt is chunked into the rest of the budget
    assert got == [[("a", 3, 1, True), ("b", 0, 7, False)],
                   [("a", 4, 1, True), ("b", 7, 7, False)],
                   [("a", 5, 1, True), ("b", 14, 6, True)]]


@pytest.mark.parametrize("cap", [None, 0, 5])
def test_mixed_step_prefill_cap(cap):
    """With decodes in the step, a long prefill is chunked at the cap and a short prompt that
    arrives meanwhile is admitted whole at once (vLLM's long_prefill_token_threshold); a step
    without decodes gets the whole budget; None / 0 = no cap."""
    s = _sched(num_blocks=64, bs=4, budget=16, mixed=cap)
    for rid in ("a", "b"):
        s.add_request(make_req(rid, [1, 2, 3], max_tokens=30, ignore_eos=True, arrival=1.0 if rid == "a" else 2.0))
    _step(s)  # both prompts: a prefill-only step
    long = make_req("long", list(range(10, 50)), max_tokens=2, arrival=3.0)  # 40 tokens
    short = make_req("short", [7, 8, 9], max_tokens=2, arrival=4.0)
    s.add_request(long)
    s.add_request(short)
    chunks = []
    while long.num_output_tokens == 0:
        out = _step(s)
        chunks.append([(sr.request_id, len(sr.token_ids)) for sr in out.requests])
    room = 14 if not cap else cap  # two decodes take 2 of the 16 tokens
    assert all(c[:2] == [("a", 1), ("b", 1)] for c in chunks)  # decodes every step
    got = [n for c in chunks for rid, n in c if rid == "long"]
    assert sum(got) == 40 and max(got) == room
    if cap:  # the long prompt goes in chunks of the cap; the short one is not held back behind it
        assert got == [5] * 8 and len(chunks) == 8
        assert chunks[0][2:] == [("long", 5), ("short", 3)]
        assert all([x for x in c[2:] if x != ("short", 1)] == [("long", 5)] for c in chunks[1:])
    # prefill-only steps keep the full budget
    t = _sched(num_blocks=64, bs=4, budget=16, mixed=5)
    t.add_request(make_req("p", list(range(10, 50)), max_tokens=1))
    assert _step(t).num_batched_tokens == 16


def test_max_num_seqs_limits_admission():
    s = _sched(num_blocks=64, bs=4, max_seqs=2)
    for i in range(4):
        s.add_request(make_req(f"r{i}", [1, 2, 3], max_tokens=3, arrival=float(i + 1)))
    out = _step(s)
    assert [sr.request_id for sr in out.requests] == ["r0", "r1"]
    assert [r.request_id for r in s.waiting] == ["r2", "r3"]
    while s.has_unfinished():
        assert len(_step(s).requests) <= 2
    assert s.kv.pool.num_free_blocks == 64


def test_priority_policy_orders_admission():
    s = _sched(num_blocks=64, bs=4, max_seqs=1, policy="priority")
    for rid, prio, t in [("low", 2, 1.0), ("high", 0, 2.0), ("mid", 1, 3.0), ("high2", 0, 4.0)]:
        s.add_request(make_req(rid, [1, 2], max_tokens=1, priority=prio, arrival=t))
    order = []
    while s.has_unfinished():
        order += [sr.request_id for sr in _step(s).requests]
    assert order == ["high", "high2", "mid", "low"]
    with pytest.raises(ValueError, match="scheduling_policy"):
        _sched(4, 4, policy="lifo")


def test_stop_conditions_in_scheduler():
    s = _sched(num_blocks=64, bs=4)
    eos = make_req("eos", [1, 2], max_tokens=10)
    mint = make_req("mint", [1, 2], max_tokens=10, min_tokens=3)
    stop = make_req("stop", [1, 2], max_tokens=10, stop_token_ids=[7], ignore_eos=True)
    for r in (eos, mint, stop):
        s.add_request(r)
    _step(s, token=EOS)
    assert eos.status is RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert not mint.finished  # EOS before min_tokens does not stop
    assert not stop.finished
    _step(s, token=7)
    assert stop.status is RequestStatus.FINISHED_STOPPED and stop.stop_reason == 7
    _step(s, token=EOS)
    assert mint.status is RequestStatus.FINISHED_STOPPED and mint.num_output_tokens == 3
    assert not s.has_unfinished() and s.kv.pool.num_free_blocks == 64


def test_long_prefill_threshold_admits_ordinary_prompts_whole():
    """Only prompts longer than the threshold (and the cap) are chunked beside decodes: a burst
    of ordinary prompts is admitted in one step even when the cap is small."""
    s = Scheduler(KVCacheManager(128, 4, True), 16, 256, mixed_prefill_tokens=5, long_prefill_threshold=20)
    s.add_request(make_req("d", [1, 2, 3], max_tokens=30, ignore_eos=True, arrival=1.0))
    _step(s)  # d's prefill; it decodes from now on
    for i in range(6):
        s.add_request(make_req(f"p{i}", list(range(100 + 20 * i, 118 + 20 * i)), max_tokens=2, arrival=2.0 + i))
    s.add_request(make_req("long", list(range(300, 340)), max_tokens=2, arrival=9.0))
    out = _step(s)
    got = {sr.request_id: len(sr.token_ids) for sr in out.requests}
    assert got == {"d": 1, **{f"p{i}": 18 for i in range(6)}, "long": 5}
