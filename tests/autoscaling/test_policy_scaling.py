"""The autoscaling policy scaling up and down on hand-built fleets (no Ray cluster; the driver of
policy_driver.py plays Serve): queue, prefill backlog, throughput and backlog growth; the drain cap,
cool-downs, the queue guard, noise without flapping, and the replica bounds."""

import math
import random

from policy_driver import drive, fleet, make_ctx, replica_metrics

from kvserve.autoscaling import decision as dec
from kvserve.autoscaling.decision import (
    REASON_DOWNSCALE_COOLDOWN,
    REASON_HYSTERESIS,
    REASON_MAX_REPLICAS,
    REASON_QUEUE_GUARD,
    decide,
)
from kvserve.autoscaling.demand import (
    REASON_PREFILL_BACKLOG,
    REASON_QUEUE,
    REASON_THROUGHPUT,
    compute_demand,
)
from kvserve.autoscaling.settings import KVServeAutoscalingConfig


def test_queue_builds_up_scales_up_proportionally():
    # Queue targets alone (drain cap out of the way): desired = waiting / target_queue_per_replica.
    cfg = KVServeAutoscalingConfig(max_replicas=32, target_queue_per_replica=4.0, queue_drain_s=0)
    results = {}
    for waiting in (16, 32, 64):

        def metrics_at(t, target, waiting=waiting):
            per = waiting / 2
            return fleet(2, util=0.7, waiting=per, waiting_tok=per * 50)

        run = drive(cfg, metrics_at, t_end=12.0, target0=2)
        first = run.changes[0]
        # a rise must persist for upscale_smoothing_s before it is acted on, then at once
        assert cfg.upscale_smoothing_s <= first[0] <= cfg.upscale_smoothing_s + 1.0
        assert first[3] == REASON_QUEUE
        results[waiting] = run.target
    assert results == {16: 4, 32: 8, 64: 16}


def test_prefill_backlog_scales_up_before_request_count_moves():
    # Same number of waiting requests, 3x longer prompts: the token backlog decides.
    cfg = KVServeAutoscalingConfig(max_replicas=32, target_prefill_backlog_s=1.0, queue_drain_s=0)

    def short(t, target):
        return fleet(4, util=0.5, waiting=1, waiting_tok=1 * 1000)

    def long(t, target):
        return fleet(4, util=0.5, waiting=1, waiting_tok=1 * 3000 * 4)

    assert drive(cfg, short, 20.0, target0=4).target == 4
    run = drive(cfg, long, 20.0, target0=4)
    # 4 replicas x 12000 tokens / 4000 tok/s = 12 s of backlog at 1 s per replica
    assert run.target == 12 and run.changes[0][3] == REASON_PREFILL_BACKLOG


def test_throughput_at_target_with_empty_queue_holds():
    cfg = KVServeAutoscalingConfig(max_replicas=16)
    for util in (0.60, 0.70, 0.74):
        run = drive(cfg, lambda t, n, u=util: fleet(n, util=u), t_end=900.0, target0=4)
        assert run.changes == [], (util, run.changes)


def test_throughput_over_target_scales_by_load_ratio():
    cfg = KVServeAutoscalingConfig(max_replicas=16, target_utilization=0.75)

    # Offered load of 6 replica-equivalents spread over the current fleet (capped at 100%).
    def metrics_at(t, n):
        return fleet(n, util=min(1.0, 6.0 / n))

    run = drive(cfg, metrics_at, t_end=120.0, target0=4)
    assert run.target == 8  # 6 / 0.75
    assert all(c[3] == REASON_THROUGHPUT for c in run.changes)


def test_backlog_growth_counts_as_demand_before_a_queue_forms():
    # Overload first shows as running requests piling up (batches filling), not as waiting
    # requests: the growth of the work backlog is added to the served load.
    cfg = KVServeAutoscalingConfig(max_replicas=32)

    def metrics_at(t, n):
        running = 80 + 15 * t  # the fleet's running requests grow by 15/s
        return fleet(4, util=0.95, running=running / 4, waiting=1.0, waiting_tok=500.0)

    run = drive(cfg, metrics_at, t_end=20.0, target0=4)
    d = run.decisions[-1][1]
    assert d.inputs["backlog_growth_replicas"] > 1.0
    assert run.target > math.ceil(4 * 0.95 / 0.75)  # more than the served load alone asks for


def test_demand_is_computed_once_per_tick(monkeypatch):
    # decide() measures the fleet and turns it into demand once per tick, from the memory the
    # tick started with; the request mix and the backlog growth are advanced after that.
    calls = {"measure": 0, "demand": 0}
    real_measure, real_demand = dec.measure_fleet, dec.replica_demand

    def measure(*a, **k):
        calls["measure"] += 1
        return real_measure(*a, **k)

    def demand(*a, **k):
        calls["demand"] += 1
        return real_demand(*a, **k)

    monkeypatch.setattr(dec, "measure_fleet", measure)
    monkeypatch.setattr(dec, "replica_demand", demand)
    cfg = KVServeAutoscalingConfig(max_replicas=32)
    state, target, grew = {}, 4, 0
    for i in range(40):
        t = i * 0.5
        # running requests pile up (backlog growth); prompts grow (the mix average moves)
        per = fleet(4, util=0.95, running=(80 + 15 * t) / 4, waiting=1.0, waiting_tok=500.0 + 50 * t)
        before = dict(state)
        d, state = decide(make_ctx(per, target, 1_000_000.0 + t, state, total_queued_requests=3.0), cfg)
        growth = max(0.0, state.get("kvserve.growth", 0.0))
        want = compute_demand(per, cfg, before, 3.0, growth)
        for key in ("raw", "waiting_prefill_tokens", "work_backlog_s", "backlog_growth_replicas", "signals"):
            assert d.inputs[key] == (round(want[key], 3) if isinstance(want[key], float) else want[key]), key
        grew += d.inputs["backlog_growth_replicas"] > 0
        target = d.desired
    assert calls == {"measure": 40, "demand": 40}
    assert grew >= 10  # the backlog-growth path was taken


def test_queue_signal_capped_by_drain_time():
    cfg = KVServeAutoscalingConfig(max_replicas=64, target_queue_per_replica=1.0, queue_drain_s=30.0)
    run = drive(cfg, lambda t, n: fleet(2, util=0.9, waiting=50, waiting_tok=50 * 100), 20.0, target0=2)
    d = run.decisions[-1][1]
    # 100 waiting requests / 1 per replica would ask for 100 replicas; the cap is the
    # throughput need plus the queued work drained in 30 s.
    cap = d.inputs["signals"][REASON_THROUGHPUT] + d.inputs["queued_work_s"] / 30.0
    assert run.target == math.ceil(cap - cfg.upscale_tolerance) < 100


def test_refused_demand_is_priced_at_the_served_prompt():
    # A saturated 2-seat replica with a bounded queue: demand shows as refusals (429s), not as a
    # queue. Counted as waiting requests of no prompt tokens they once left the queue signal's
    # drain cap at one replica's throughput (docs/known-limits.md history); priced at the
    # served requests' mean prompt they ask for the replicas the offered load needs.
    cfg = KVServeAutoscalingConfig(max_replicas=16, target_queue_per_replica=4.0, queue_drain_s=30.0)

    def saturated(t, n, refused=120.0):
        per = refused / n  # the same offered load spread over the fleet
        return fleet(n, util=1.0, running=2.0, waiting=0.0, waiting_tok=0.0, refused=per, served_prompt=400.0)

    run = drive(cfg, saturated, 30.0, target0=1)
    d = run.decisions[-1][1]
    assert d.inputs["refused_requests"] > 0 and d.inputs["avg_prompt_tokens"] == 400.0
    assert d.inputs["reason"] == REASON_QUEUE
    assert run.target >= 4
    # the same refusals with nothing served to price them by still count as requests
    run = drive(cfg, lambda t, n: fleet(n, util=1.0, running=2.0, refused=120.0 / n), 30.0, target0=1)
    assert run.target >= 2
    # and a fleet that refuses nothing and is not loaded stays put
    run = drive(cfg, lambda t, n: fleet(n, util=0.5, running=2.0, refused=0.0, served_prompt=400.0), 30.0, target0=1)
    assert run.target == 1


def test_idle_scales_down_only_after_cooldown():
    cfg = KVServeAutoscalingConfig(min_replicas=1, max_replicas=8, downscale_cooldown_s=60.0)
    idle = lambda t, n: fleet(n, util=0.0, running=0.0, kv=0.0)  # noqa: E731
    run = drive(cfg, idle, t_end=600.0, target0=6)
    assert run.changes, "never scaled down"
    first_t = run.changes[0][0]
    assert cfg.downscale_cooldown_s <= first_t <= cfg.downscale_cooldown_s + 1.0
    assert all(new < old for _, old, new, _ in run.changes)
    # one cool-down between consecutive scale-downs
    times = [c[0] for c in run.changes]
    assert all(b - a >= cfg.downscale_cooldown_s for a, b in zip(times, times[1:]))
    assert run.target == cfg.min_replicas


def test_cooldown_measured_from_serves_last_scale_event():
    cfg = KVServeAutoscalingConfig(downscale_cooldown_s=60.0)
    t0 = 1_000_000.0
    state = {}
    # Idle for 200 s, but Serve keeps reporting a scale-up 10 s ago: no scale-down.
    for i in range(400):
        now = t0 + i * 0.5
        ctx = make_ctx(fleet(6, util=0.0, running=0.0, kv=0.0), 6, now, state, last_scale_up_time=now - 10.0)
        d, state = decide(ctx, cfg)
        assert d.desired == 6
    assert d.reason == REASON_DOWNSCALE_COOLDOWN
    ctx = make_ctx(fleet(6, util=0.0, running=0.0, kv=0.0), 6, t0 + 200.5, state, last_scale_up_time=t0 + 200.5 - 61.0)
    d, state = decide(ctx, cfg)
    assert d.desired < 6


def test_no_scale_down_while_requests_wait():
    cfg = KVServeAutoscalingConfig(target_queue_per_replica=4.0)
    # Tiny load but a queue longer than the smaller fleet may hold: hold.
    run = drive(
        cfg,
        lambda t, n: fleet(n, util=0.05, waiting=5.0, waiting_tok=50.0),
        400.0,
        target0=4,
    )
    assert run.target == 4
    assert run.decisions[-1][1].reason in (REASON_QUEUE_GUARD, REASON_HYSTERESIS)


def test_noisy_inputs_do_not_flap():
    cfg = KVServeAutoscalingConfig(max_replicas=32)
    rng = random.Random(0)

    def noisy(t, n):
        # steady 0.66 utilisation per replica, +-30% per-replica noise on every sample,
        # noisy small queues and KV usage, plus a 3x one-sample blip about every 30 s
        blip = 3.0 if rng.random() < 2.0 / 30.0 else 1.0
        out = {}
        for i in range(8):
            u = 0.66 * rng.uniform(0.7, 1.3) * blip
            w = rng.choice([0, 0, 0, 1, 2])
            out[f"r{i}"] = replica_metrics(
                util=min(u, 1.0),
                waiting=w,
                waiting_tok=w * rng.uniform(50, 800),
                running=rng.uniform(10, 40),
                kv=rng.uniform(0.2, 0.6),
            )
        return out

    run = drive(cfg, noisy, t_end=1800.0, target0=8)
    assert run.changes == []


def test_noisy_load_change_is_followed_without_reversals():
    cfg = KVServeAutoscalingConfig(max_replicas=32)
    rng = random.Random(1)

    def metrics_at(t, n):
        load = 3.0 if t < 300 else 9.0  # replica-equivalents offered
        return {f"r{i}": replica_metrics(util=min(1.0, load / n * rng.uniform(0.85, 1.15))) for i in range(n)}

    run = drive(cfg, metrics_at, t_end=900.0, target0=4)
    dirs = [1 if new > old else -1 for _, old, new, _ in run.changes]
    reversals = sum(1 for a, b in zip(dirs, dirs[1:]) if a != b)
    assert reversals <= 1  # (a single initial scale-down to the low load is fine)
    assert 12 <= run.target <= 14  # 9 / 0.75 = 12 (+ hysteresis headroom)


def test_bounds_respected():
    cfg = KVServeAutoscalingConfig(min_replicas=2, max_replicas=5, queue_drain_s=0)
    run = drive(cfg, lambda t, n: fleet(n, util=1.0, waiting=100, waiting_tok=10_000), 30.0, target0=2)
    assert run.target == 5 and run.changes[-1][3] == REASON_MAX_REPLICAS
    run = drive(cfg, lambda t, n: fleet(n, util=0.0, running=0.0, kv=0.0), 900.0, target0=5)
    assert run.target == 2
    assert min(d.desired for _, d in run.decisions) == 2
    # Serve's capacity-adjusted bounds (target_capacity) are honoured too.
    run = drive(
        cfg,
        lambda t, n: fleet(n, util=1.0, waiting=100, waiting_tok=10_000),
        30.0,
        target0=2,
        capacity_adjusted_max_replicas=3,
    )
    assert run.target == 3
