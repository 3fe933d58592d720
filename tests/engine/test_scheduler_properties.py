"""Scheduler + KVCacheManager under random add / step / abort programs, driven without a model.

The property test runs the programs against a fake model runner that "writes" into a simulated KV
cache: every slot remembers which token prefix produced it, so a request that reads a wrong block
(bad prefix hit, stale cache entry, a block shared while being written) is caught, as are leaked
or double-freed blocks, wrong ref counts, budget overruns, mixed-step caps exceeded and stalls.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from _kv_cache_helpers import EOS, make_req
from kvserve.engine.kv_cache_manager import KVCacheManager, chain_hashes as _chain, root_hash
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.scheduler import Scheduler


SEED = "scheduler-properties"


def chain_hashes(tokens, bs):
    return _chain(tokens, bs, len(tokens) // bs, root_hash(SEED))


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort programs against Scheduler + KVCacheManager."""

    @initialize(
        bs=st.sampled_from([1, 2, 4]),
        num_blocks=st.integers(2, 12),
        max_seqs=st.integers(1, 4),
        budget=st.integers(1, 24),
        policy=st.sampled_from(["fcfs", "priority"]),
        caching=st.booleans(),
        seed=st.integers(0, 2**16),
        mixed=st.sampled_from([None, 0, 1, 3, 8]),
    )
    def init(self, bs, num_blocks, max_seqs, budget, policy, caching, seed, mixed):
        self.bs, self.max_seqs, self.budget, self.mixed = bs, max_seqs, budget, mixed
        self.kv = KVCacheManager(num_blocks, bs, caching, hash_seed=SEED)
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
        prompt = (self.prefixes[fam][:shared] if fam >= 0 else []) + [tail_rng.randint(1, 3) for _ in range(n - shared)]
        req = make_req(
            f"r{len(self.ids)}",
            prompt,
            max_tokens=data.draw(st.integers(1, self.cap)),
            priority=data.draw(st.integers(0, 2)),
            arrival=self.clock,
            max_model_len=self.cap,
            ignore_eos=data.draw(st.booleans()),
        )
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
        decodes = sum(
            sr.request_id in running_before
            and len(sr.token_ids) == 1
            and self.sched.requests[sr.request_id].num_tokens - sr.start == 1
            for sr in out.requests
        )
        if decodes and self.mixed:  # a step with decodes: short prefills whole, one long one chunked at the cap
            chunks = [
                sr
                for sr in out.requests
                if not (
                    sr.request_id in running_before
                    and len(sr.token_ids) == 1
                    and self.sched.requests[sr.request_id].num_tokens - sr.start == 1
                )
            ]
            assert all(len(sr.token_ids) <= self.mixed for sr in chunks), "mixed-step chunk over the cap"
            long_ones = [sr for sr in chunks if self.sched.requests[sr.request_id].num_tokens > self.mixed]
            assert len(long_ones) <= 1, "two long prefills in one mixed step"
        assert len(out.requests) <= self.max_seqs
        assert len(self.sched.running) <= self.max_seqs
        ids = [sr.request_id for sr in out.requests]
        assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
        if had_work:
            assert out.requests, "stall: unfinished requests but nothing scheduled"
        preempted = {
            rid
            for rid in running_before
            if rid in self.sched.requests and self.sched.requests[rid].status is RequestStatus.PREEMPTED
        }
        assert out.num_preempted == len(preempted)
        self.preempted_seen += len(preempted)
        admitted = [
            self.sched.requests[sr.request_id] for sr in out.requests if sr.new and sr.request_id in waiting_before
        ]
        if preempted and admitted:  # only a preemption for priority lets waiting requests in
            assert self.sched.policy == "priority", "waiting requests admitted in a step that had to preempt"
            worst = min(self.reqs[rid].priority for rid in preempted)
            assert all(r.priority < worst for r in admitted), (
                "a preemption for priority let in a request no better than the one it preempted"
            )
        if self.sched.policy == "priority" and waiting_before and len(running_before) == self.max_seqs:
            best = min(self.reqs[rid].priority for rid in waiting_before)
            worst = max(self.reqs[rid].priority for rid in running_before)
            if best < worst:  # a strictly better request waited behind a full batch: someone made room
                assert preempted, "a strictly better waiting request stuck behind a full batch"

        for sr in out.requests:
            req = self.sched.requests[sr.request_id]
            n = len(sr.token_ids)
            assert req.status is RequestStatus.RUNNING and n >= 1
            assert sr.start == req.num_computed_tokens
            assert sr.token_ids == req.all_token_ids[sr.start : sr.start + n]
            assert sr.sample == (sr.start + n == req.num_tokens)
            assert sr.block_table == req.block_table
            assert len(sr.block_table) == -(-(sr.start + n) // bs), "block table not sized to the tokens"
            assert (sr.new is not None) == (sr.request_id not in running_before)
            if sr.new is not None:
                assert sr.new.prompt_token_ids == req.prompt_token_ids
                assert sr.new.computed_token_ids == req.all_token_ids[: sr.start]
                assert sr.start % bs == 0  # only whole cached blocks are skipped
            for p in range(sr.start, sr.start + n):  # blocks written this step are private and uncached
                b = sr.block_table[p // bs]
                assert self.pool.ref_cnt[b] == 1, f"writing into shared block {b}"
                assert self.pool.block_hash[b] is None, f"writing into cached block {b}"

        # the fake model writes K/V, then every request reads its whole context
        for sr in out.requests:
            req = self.sched.requests[sr.request_id]
            for p in range(sr.start, sr.start + len(sr.token_ids)):
                self.slots[sr.block_table[p // bs] * bs + p % bs] = tuple(req.all_token_ids[: p + 1])
        for sr in out.requests:
            req = self.sched.requests[sr.request_id]
            for p in range(sr.start + len(sr.token_ids)):
                slot = sr.block_table[p // bs] * bs + p % bs
                assert self.slots.get(slot) == tuple(req.all_token_ids[: p + 1]), (
                    f"{sr.request_id} reads wrong K/V at position {p}"
                )

        sampled = {
            sr.request_id: (EOS if self.rng.random() < 0.1 else self.rng.randint(1, 3))
            for sr in out.requests
            if sr.sample
        }
        if abort_mid and out.requests:
            self.sched.abort(self.rng.choice(ids))
        before = {
            sr.request_id: self.sched.requests[sr.request_id].num_tokens
            for sr in out.requests
            if sr.request_id in self.sched.requests
        }
        updated = self.sched.update_from_output(out, sampled)
        assert {r.request_id for r in updated} == {
            sr.request_id for sr in out.requests if sr.sample and sr.request_id in before
        }
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
            assert all(
                self.slots.get(b * self.bs + i) == prefix[: len(prefix) - self.bs + i + 1] for i in range(self.bs)
            )
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
TestScheduler.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
