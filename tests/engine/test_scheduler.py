"""The scheduler's policies, driven without a model: preemption picks the lowest priority then the
latest request, chunked prefill with decodes first, the mixed-step prefill cap and the long-prefill
threshold, ``max_num_seqs``, priority admission and stop conditions. Random programs:
``test_scheduler_properties.py``."""

from __future__ import annotations

import pytest

from _kv_cache_helpers import EOS, make_req
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import RequestStatus
from kvserve.engine.scheduler import Scheduler


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
    reqs = {
        "A": make_req("A", [1, 2, 3, 4], max_tokens=3, priority=1, arrival=1.0),
        "B": make_req("B", [5, 6, 7, 8], max_tokens=3, priority=1, arrival=2.0),
        "C": make_req("C", [9, 10, 11, 12], max_tokens=3, priority=0, arrival=3.0),
    }
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
    assert got == [
        [("a", 3, 1, True), ("b", 0, 7, False)],
        [("a", 4, 1, True), ("b", 7, 7, False)],
        [("a", 5, 1, True), ("b", 14, 6, True)],
    ]


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


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_better_priority_preempts_a_full_batch_of_worse_ones(policy):
    """Under the priority policy a request of strictly better priority does not wait behind
    ``max_num_seqs`` running requests of worse priority: the worst (lowest priority, latest
    arrival) is preempted by recompute at the start of the next step, keeping its output tokens,
    and the better one is scheduled in that step; the preempted request resumes once a slot is
    free and finishes all its tokens. An equal-priority arrival preempts nobody, nor does any
    arrival under fcfs (it waits for a slot)."""
    s = _sched(num_blocks=64, bs=4, max_seqs=2, policy=policy)
    low = {
        rid: make_req(rid, [1, 2, 3, 4, 5], max_tokens=12, ignore_eos=True, priority=5, arrival=t)
        for rid, t in (("low0", 1.0), ("low1", 2.0))
    }
    for r in low.values():
        s.add_request(r)
    for _ in range(4):
        _step(s)
    assert [r.request_id for r in s.running] == ["low0", "low1"] and low["low1"].num_output_tokens == 4
    same = make_req("same", [7, 8], max_tokens=2, priority=5, arrival=3.0)  # equal priority: waits
    s.add_request(same)
    out = _step(s)
    assert out.num_preempted == 0 and "same" not in {sr.request_id for sr in out.requests}
    s.abort("same")
    high = make_req("high", [9, 9, 9], max_tokens=3, ignore_eos=True, priority=0, arrival=4.0)
    s.add_request(high)
    out = _step(s)
    ids = {sr.request_id for sr in out.requests}
    if policy == "fcfs":
        assert out.num_preempted == 0 and ids == {"low0", "low1"} and high.status is RequestStatus.WAITING
    else:
        assert out.num_preempted == 1 and s.num_preemptions == 1 and ids == {"low0", "high"}
        victim = low["low1"]  # the lower priority's latest arrival
        assert victim.status is RequestStatus.PREEMPTED and victim.block_table == []
        assert victim.num_output_tokens == 5 and victim.metrics.num_preemptions == 1  # its tokens are kept
        assert [r.request_id for r in s.waiting] == ["low1"]
        assert high.status is RequestStatus.RUNNING and high.num_output_tokens == 1
    while s.has_unfinished():
        _step(s)
    assert all(r.status is RequestStatus.FINISHED_LENGTH for r in (*low.values(), high))
    assert [r.num_output_tokens for r in (*low.values(), high)] == [12, 12, 3]
    assert s.kv.pool.num_free_blocks == 64
