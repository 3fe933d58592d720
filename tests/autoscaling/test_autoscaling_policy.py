"""Unit tests of the kvserve autoscaling policy with hand-built contexts (no Ray cluster).

The driver below plays Serve's role: it calls the policy every control tick with the
metrics of the current fleet, passes the returned policy state back, and applies the
decision at once (as Serve does with ``upscale_delay_s=0``).
"""

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import json
import logging
import math
import random
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest

from autoscaling import decision as dec
from autoscaling import policy as P
from autoscaling import schedule as sch
from autoscaling import serve_config as sc
from autoscaling import signals as sig
from autoscaling.decision import (
    REASON_DOWNSCALE_COOLDOWN,
    REASON_HYSTERESIS,
    REASON_MAX_REPLICAS,
    REASON_NO_METRICS,
    REASON_QUEUE_GUARD,
    REASON_SCHEDULE,
    decide,
)
from autoscaling.demand import (
    REASON_PREFILL_BACKLOG,
    REASON_QUEUE,
    REASON_REQUESTS_FALLBACK,
    REASON_THROUGHPUT,
    compute_demand,
)
from autoscaling.settings import KVServeAutoscalingConfig

CAP_D = 1000.0  # decode tokens/s per replica (replica-measured capacity)
CAP_P = 4000.0  # prefill tokens/s per replica


# --------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------
def replica_metrics(util=0.6, prefill_share=0.25, waiting=0.0, waiting_tok=0.0, running=20.0, kv=0.3,
                    cap_d=CAP_D, cap_p=CAP_P):
    """One replica's record_autoscaling_stats() dict with token load ``util`` (of capacity)."""
    return {
        sig.NUM_WAITING_REQUESTS: waiting,
        sig.NUM_WAITING_PREFILL_TOKENS: waiting_tok,
        sig.NUM_RUNNING_REQUESTS: running,
        sig.GENERATION_TOKENS_PER_S: util * (1 - prefill_share) * cap_d,
        sig.PREFILL_TOKENS_PER_S: util * prefill_share * cap_p,
        sig.DECODE_CAPACITY_TOKENS_PER_S: cap_d,
        sig.PREFILL_CAPACITY_TOKENS_PER_S: cap_p,
        sig.KV_CACHE_USAGE: kv,
    }


def make_ctx(per_replica, target, now, state=None, current=None, raw=False, **extra):
    """A duck-typed Serve AutoscalingContext. ``per_replica``: {replica_id: metrics}."""
    names = sig.METRIC_NAMES
    table = {n: {rid: m[n] for rid, m in per_replica.items() if n in m} for n in names}
    ctx = SimpleNamespace(
        deployment_name="LLMServer",
        app_name="test",
        current_num_replicas=len(per_replica) if current is None else current,
        target_num_replicas=target,
        running_replicas=list(per_replica),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=None if raw else table,
        raw_metrics={n: {rid: [(now - 1.0, v)] for rid, v in t.items()} for n, t in table.items()} if raw else None,
        capacity_adjusted_min_replicas=None,
        capacity_adjusted_max_replicas=None,
        policy_state=dict(state or {}),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=None,
    )
    for k, v in extra.items():
        setattr(ctx, k, v)
    return ctx


def fleet(n, **kw):
    return {f"r{i}": replica_metrics(**kw) for i in range(n)}


@dataclass
class Run:
    target: int
    changes: list  # (t, old, new, reason)
    decisions: list


def drive(cfg, metrics_at, t_end, target0, dt=0.5, t0=1_000_000.0, sample_every=2.0, **ctx_extra):
    """Call the policy every ``dt`` s; metrics are sampled every ``sample_every`` s (held in
    between, like Serve's metric pushes); decisions are applied at once."""
    state, target = {}, target0
    changes, decisions = [], []
    held, next_sample = None, -1.0
    steps = int(round(t_end / dt))
    for i in range(steps):
        t = i * dt
        if t >= next_sample:
            held = metrics_at(t, target)
            next_sample = t + sample_every
        ctx = make_ctx(held, target, t0 + t, state, **ctx_extra)
        d, state = decide(ctx, cfg)
        json.dumps(state)  # the state must stay plain data
        decisions.append((t, d))
        if d.desired != target:
            changes.append((t, target, d.desired, d.reason))
            target = d.desired
    return Run(target, changes, decisions)


# --------------------------------------------------------------------------------------
# API surface
# --------------------------------------------------------------------------------------
def test_metric_names_and_defaults():
    assert sig.METRIC_NAMES == (
        "num_waiting_requests", "num_waiting_prefill_tokens", "num_running_requests",
        "generation_tokens_per_s", "prefill_tokens_per_s", "decode_capacity_tokens_per_s",
        "prefill_capacity_tokens_per_s", "kv_cache_usage",
    )
    cfg = KVServeAutoscalingConfig()
    assert cfg.min_replicas >= 1 and not cfg.allow_scale_to_zero  # warm pool by default
    assert cfg.policy_mode == "metrics"
    assert cfg.serve_upscale_delay_s == 0.0 and cfg.serve_downscale_delay_s <= 10.0
    d = cfg.to_dict()
    assert KVServeAutoscalingConfig.from_dict(json.loads(json.dumps(d))) == cfg


def test_policy_module_imports_without_ray():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from autoscaling import decision, demand, metrics, schedule, settings, signals\n"
        "from autoscaling import policy as P, serve_config as sc\n"
        "from types import SimpleNamespace as NS\n"
        "ctx = NS(target_num_replicas=2, current_num_replicas=2, running_replicas=[], aggregated_metrics={},"
        " current_time=1.0, policy_state={})\n"
        "print(P.kvserve_autoscaling_policy(ctx)[0]); print(sc.build_autoscaling_config(as_dict=True)['min_replicas'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"]


def test_policy_module_keeps_its_public_names():
    # deployments/ and the docs import from autoscaling.policy; the split by concern kept
    # every name of its public API there, and Serve's import path still resolves.
    for name in P.__all__:
        assert hasattr(P, name), name
    assert P.build_autoscaling_config is sc.build_autoscaling_config and P.decide is decide
    assert sc.POLICY_IMPORT_PATH == "autoscaling.policy:KVServeAutoscalingPolicy"
    module, attr = sc.POLICY_IMPORT_PATH.split(":")
    assert getattr(importlib.import_module(module), attr) is P.KVServeAutoscalingPolicy


@pytest.mark.parametrize("bad", [
    dict(min_replicas=0),
    dict(min_replicas=4, max_replicas=2),
    dict(target_utilization=0.0),
    dict(target_utilization=1.5),
    dict(policy_mode="hybrid"),  # needs a schedule
    dict(policy_mode="nope"),
    dict(schedule="8-20:99", max_replicas=8),
    dict(serve_look_back_period_s=2.0, serve_metrics_interval_s=2.0),
    dict(unknown_knob=1),
])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        KVServeAutoscalingConfig.from_dict(bad)


def test_scale_to_zero_is_opt_in():
    cfg = KVServeAutoscalingConfig(min_replicas=0, allow_scale_to_zero=True)
    d = sc.build_autoscaling_config(cfg, as_dict=True)
    assert d["min_replicas"] == 0 and d["downscale_to_zero_delay_s"] == cfg.serve_downscale_to_zero_delay_s


# --------------------------------------------------------------------------------------
# behaviour
# --------------------------------------------------------------------------------------
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
        ctx = make_ctx(fleet(6, util=0.0, running=0.0, kv=0.0), 6, now, state,
                       last_scale_up_time=now - 10.0)
        d, state = decide(ctx, cfg)
        assert d.desired == 6
    assert d.reason == REASON_DOWNSCALE_COOLDOWN
    ctx = make_ctx(fleet(6, util=0.0, running=0.0, kv=0.0), 6, t0 + 200.5, state,
                   last_scale_up_time=t0 + 200.5 - 61.0)
    d, state = decide(ctx, cfg)
    assert d.desired < 6


def test_no_scale_down_while_requests_wait():
    cfg = KVServeAutoscalingConfig(target_queue_per_replica=4.0)
    # Tiny load but a queue longer than the smaller fleet may hold: hold.
    run = drive(cfg, lambda t, n: fleet(n, util=0.05, waiting=5.0, waiting_tok=50.0), 400.0, target0=4,)
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
            out[f"r{i}"] = replica_metrics(util=min(u, 1.0), waiting=w, waiting_tok=w * rng.uniform(50, 800),
                                           running=rng.uniform(10, 40), kv=rng.uniform(0.2, 0.6))
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
    run = drive(cfg, lambda t, n: fleet(n, util=1.0, waiting=100, waiting_tok=10_000), 30.0, target0=2,
                capacity_adjusted_max_replicas=3)
    assert run.target == 3


def test_missing_metrics_and_no_replicas():
    cfg = KVServeAutoscalingConfig()
    # No replica has reported yet: hold the current target.
    d, state = decide(make_ctx({}, 3, 100.0), cfg)
    assert d.desired == 3 and d.reason == REASON_NO_METRICS
    # Running replicas that have not reported, lazily evaluated metrics that raise.
    ctx = make_ctx({}, 2, 100.0)
    ctx.running_replicas = ["a", "b"]

    class Boom:
        def __get__(self, obj, objtype=None):
            raise RuntimeError("controller hiccup")

    class Ctx(SimpleNamespace):
        aggregated_metrics = Boom()

    c2 = Ctx(**{k: v for k, v in vars(ctx).items() if k != "aggregated_metrics"})
    d, _ = decide(c2, cfg)
    assert d.desired == 2
    # Below min with nothing reported: brought up to min.
    d, _ = decide(make_ctx({}, 0, 100.0), cfg)
    assert d.desired == cfg.min_replicas
    # No capacity reported (and none remembered): fall back to request counts.
    per = {f"r{i}": {sig.NUM_RUNNING_REQUESTS: 60.0, sig.NUM_WAITING_REQUESTS: 4.0,
                     sig.GENERATION_TOKENS_PER_S: float("nan")} for i in range(2)}
    run = drive(cfg, lambda t, n: per, 10.0, target0=2)
    assert run.changes and run.changes[0][3] == REASON_REQUESTS_FALLBACK
    assert run.target == math.ceil(128 / cfg.fallback_ongoing_per_replica - cfg.upscale_tolerance)


def test_latest_raw_sample_is_used():
    cfg = KVServeAutoscalingConfig(max_replicas=16)
    # aggregated (window mean) says idle; the newest raw sample says overloaded
    per_now = fleet(2, util=1.0, waiting=20, waiting_tok=2000)
    idle = fleet(2, util=0.0, running=0.0)
    names = sig.METRIC_NAMES

    class TSV:  # ray.serve._private.common.TimeStampedValue look-alike
        def __init__(self, timestamp, value):
            self.timestamp, self.value = timestamp, value

    def ctx_at(now, state, target):
        c = make_ctx(idle, target, now, state)
        c.raw_metrics = {n: {rid: [TSV(now - 5, idle[rid][n]), TSV(now - 1, per_now[rid][n])]
                             for rid in per_now} for n in names}
        return c

    state, target = {}, 2
    for i in range(20):
        d, state = decide(ctx_at(1000.0 + i * 0.5, state, target), cfg)
        target = d.desired
    assert target > 2
    d2, _ = decide(ctx_at(2000.0, {}, 2), KVServeAutoscalingConfig(signal_source="aggregated"))
    assert d2.inputs["load_replicas"] == 0.0


def test_state_is_kept_in_policy_state_only():
    cfg = KVServeAutoscalingConfig()
    serve_keys = {"__decision_counter": 3, "__decision_timestamp": 12.0}
    ctx = make_ctx(fleet(2), 2, 100.0, dict(serve_keys))
    before = dict(ctx.policy_state)
    n, state = P.kvserve_policy(ctx, cfg)
    assert ctx.policy_state == before  # input not mutated
    assert all(state[k] == v for k, v in serve_keys.items())  # foreign keys preserved
    assert any(k.startswith("kvserve.") for k in state)
    json.dumps(state)
    # a class instance keeps only the config: two calls with the same state agree
    pol = P.KVServeAutoscalingPolicy(max_replicas=4)
    assert pol(make_ctx(fleet(2), 2, 100.0, state))[0] == pol(make_ctx(fleet(2), 2, 100.0, state))[0]


def test_time_based_floor():
    day = 1_700_006_400.0  # 2023-11-15 00:00:00 UTC
    hour = lambda h: day + h * 3600.0  # noqa: E731
    tb = KVServeAutoscalingConfig(policy_mode="time-based", schedule="8-20:4,22-6:2", max_replicas=8)
    for h, want in ((10, 4), (7.9, 1), (21, 1), (23, 2), (3, 2), (20, 1)):
        d, _ = decide(make_ctx(fleet(1), 1, hour(h)), tb)
        assert d.desired == want, (h, d)
    # pre-warm: the window counts from schedule_prewarm_s earlier
    pw = tb.replace(schedule_prewarm_s=300.0)
    assert decide(make_ctx(fleet(1), 1, hour(7.95)), pw)[0].desired == 4

    hy = KVServeAutoscalingConfig(policy_mode="hybrid", schedule=[{"start_hour": 8, "end_hour": 20,
                                                                   "min_replicas": 4}], max_replicas=16)
    idle = lambda t, n: fleet(n, util=0.0, running=0.0, kv=0.0)  # noqa: E731
    # idle inside the window: the floor wins at once, cool-downs notwithstanding
    run = drive(hy, idle, 300.0, target0=1, t0=hour(9))
    assert run.changes[0][0] == 0.0 and run.changes[0][3] == REASON_SCHEDULE and run.target == 4
    # idle outside the window: down to min_replicas
    assert drive(hy, idle, 900.0, target0=4, t0=hour(21)).target == 1
    # busy inside the window: metrics above the floor
    assert drive(hy, lambda t, n: fleet(n, util=min(1.0, 7.5 / n)), 120.0, target0=4, t0=hour(9)).target == 10
    # metrics mode ignores the schedule
    assert sch.schedule_floor(KVServeAutoscalingConfig(schedule="0-24:4"), hour(9)) == 0


def test_schedule_timezone():
    pytest.importorskip("zoneinfo")
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo("Asia/Tokyo")
    except Exception:
        pytest.skip("no tzdata")
    cfg = KVServeAutoscalingConfig(policy_mode="time-based", schedule="9-18:3", schedule_timezone="Asia/Tokyo")
    day = 1_700_006_400.0  # 00:00 UTC = 09:00 in Tokyo
    assert decide(make_ctx(fleet(1), 1, day + 60), cfg)[0].desired == 3
    assert decide(make_ctx(fleet(1), 1, day + 10 * 3600), cfg)[0].desired == 1  # 19:00 Tokyo


def test_parse_schedule_forms():
    a = sch.parse_schedule("8-20:4, 22-6:2")
    b = sch.parse_schedule([{"start_hour": 8, "end_hour": 20, "min_replicas": 4}, (22, 6, 2)])
    assert a == b and len(a) == 2
    with pytest.raises(ValueError):
        sch.parse_schedule("8to20=4")


def test_decision_logged_as_one_structured_line(caplog):
    cfg = KVServeAutoscalingConfig(max_replicas=16, log_interval_s=30.0, queue_drain_s=0)
    with caplog.at_level(logging.INFO, logger=dec.logger.name):
        run = drive(cfg, lambda t, n: fleet(2, util=0.7, waiting=16, waiting_tok=800), 20.0, target0=2)
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == dec.logger.name]
    # 40 evaluations, but only changes of decision/reason (and one line per 30 s) are logged
    assert 1 <= len(recs) <= 6
    up = [r for r in recs if r["action"] == "up"]
    assert up and up[0]["desired"] == run.changes[0][2] and up[0]["reason"] == REASON_QUEUE
    for key in ("waiting_requests", "waiting_prefill_tokens", "load_replicas", "raw_desired",
                "smoothed_desired", "signals", "target_replicas", "decode_capacity_tokens_per_s"):
        assert key in up[0]


def test_metrics_export_with_reason_label():
    from autoscaling import metrics as M

    class Fake(M._Backend):
        def __init__(self):
            self.desired, self.raw, self.count = {}, {}, {}

        def set_desired(self, labels, value):
            self.desired[labels["reason"]] = value

        def set_raw(self, labels, value):
            self.raw[labels["deployment"]] = value

        def inc_decision(self, labels):
            key = (labels["direction"], labels["reason"])
            self.count[key] = self.count.get(key, 0) + 1

    fake = Fake()
    M.set_backend(fake)
    try:
        cfg = KVServeAutoscalingConfig(max_replicas=16, queue_drain_s=0)
        drive(cfg, lambda t, n: fleet(2, util=0.7, waiting=16, waiting_tok=800), 20.0, target0=2)
        assert fake.desired[REASON_QUEUE] == 0.0 or fake.desired.get(REASON_HYSTERESIS) == 0.0
        current = [r for r, v in fake.desired.items() if v > 0]
        assert len(current) == 1  # one live reason series, the others zeroed
        assert fake.count == {("up", REASON_QUEUE): 1}
        assert fake.raw["LLMServer"] > 0
    finally:
        M.set_backend(None)


def test_cli_flags_round_trip():
    import argparse

    ap = sc.add_autoscaling_args(argparse.ArgumentParser())
    args = ap.parse_args(["--max-replicas", "12", "--target-utilization", "0.6", "--autoscaling-policy", "hybrid",
                          "--autoscaling-schedule", "8-20:3"])
    cfg = sc.config_from_args(args, base={"min_replicas": 2})
    assert (cfg.max_replicas, cfg.target_utilization, cfg.policy_mode, cfg.min_replicas) == (12, 0.6, "hybrid", 2)
    assert cfg.schedule == (sch.ScheduleEntry(8, 20, 3),)
    assert sc.config_from_args(ap.parse_args([])) == KVServeAutoscalingConfig()


# --------------------------------------------------------------------------------------
# Ray Serve 2.60 wiring (imports Ray's config classes; no cluster)
# --------------------------------------------------------------------------------------
def test_build_autoscaling_config_for_serve():
    pytest.importorskip("ray.serve")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    knobs = KVServeAutoscalingConfig(min_replicas=2, max_replicas=12, target_utilization=0.7, queue_drain_s=0)
    cfg = sc.build_autoscaling_config(knobs)
    assert isinstance(cfg, AutoscalingConfig)
    assert (cfg.min_replicas, cfg.max_replicas) == (2, 12)
    assert cfg.upscale_delay_s == 0.0 and cfg.downscale_delay_s == knobs.serve_downscale_delay_s
    assert cfg.metrics_interval_s == 2.0 and cfg.look_back_period_s == 10.0
    assert cfg.get_upscaling_factor() == 1.0 and cfg.get_downscaling_factor() == 1.0
    assert cfg.policy.policy_function == sc.POLICY_IMPORT_PATH
    # the plain-dict form validates to the same config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # metrics_interval_s, see the report
        assert AutoscalingConfig(**sc.build_autoscaling_config(knobs, as_dict=True)) == cfg

    # What the controller does: resolve (instantiate the class with policy_kwargs), wrap, call.
    inst = _resolve_policy_callable(cfg.policy)
    assert isinstance(inst, P.KVServeAutoscalingPolicy) and inst.config == knobs
    policy = _apply_autoscaling_config(inst)
    dep = DeploymentID(name="LLMServer", app_name="default")
    rids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(2)]
    state = {}
    target = 2
    t0 = 1_000_000.0
    for i in range(20):
        now = t0 + i * 0.5
        per = replica_metrics(util=1.0, waiting=40, waiting_tok=4000)
        raw = {n: {rid: [TimeStampedValue(now - 1.0, per[n])] for rid in rids} for n in sig.METRIC_NAMES}
        agg = {n: {rid: per[n] for rid in rids} for n in sig.METRIC_NAMES}
        ctx = AutoscalingContext(
            deployment_id=dep, deployment_name="LLMServer", app_name="default",
            current_num_replicas=2, target_num_replicas=target, running_replicas=rids,
            total_num_requests=lambda: 200.0, total_queued_requests=lambda: 0.0,
            aggregated_metrics=lambda agg=agg: agg, raw_metrics=lambda raw=raw: raw,
            capacity_adjusted_min_replicas=2, capacity_adjusted_max_replicas=12,
            policy_state=state, last_scale_up_time=None, last_scale_down_time=None,
            current_time=now, config=cfg,
        )
        n, state = policy(ctx)
        assert isinstance(n, int)
        target = n
    assert target == 12
    assert any(k.startswith("kvserve.") for k in state)


SIMULATOR = Path(__file__).resolve().parents[2] / "benchmarks" / "autoscaling_sim.py"


def simulator():
    """The simulator module, ``benchmarks/autoscaling_sim.py`` (a benchmark script: benchmarks/
    is not a package on sys.path, so it is loaded from its file, once per session)."""
    mod = sys.modules.get("autoscaling_sim")
    if mod is None:
        spec = importlib.util.spec_from_file_location("autoscaling_sim", SIMULATOR)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["autoscaling_sim"] = mod  # dataclasses look their module up while the file runs
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules["autoscaling_sim"]
            raise
    return mod


#: sha256 of ``inspect.getsource()`` of the Ray Serve 2.60.0 functions benchmarks/autoscaling_sim.py calls.
RAY_SERVE_WRAPPER_SHA256 = {
    "_apply_scaling_factors": "a4259fcb2aa69aba5c7b1bc31707ce758e759e6e62f6699376854b0e8b40457c",
    "_apply_delay_logic": "beb02da8cc3b4014b070db6e9fe741544e78cd2d5c39dc9d58fda8de953eaf28",
}


def test_ray_serve_wrapper_is_pinned():
    # The simulator applies Serve's own (private) scaling-factor and delay functions to every
    # decision; the committed simulator results rest on them, so a Ray upgrade that changes
    # them must be looked at before the hashes are updated.
    rap = pytest.importorskip("ray.serve.autoscaling_policy")
    import ray

    got = {name: hashlib.sha256(inspect.getsource(getattr(rap, name)).encode()).hexdigest()
           for name in RAY_SERVE_WRAPPER_SHA256}
    assert got == RAY_SERVE_WRAPPER_SHA256, (
        f"Ray {ray.__version__} changed Serve's scaling-factor/delay logic: check serve_wrap in "
        "benchmarks/autoscaling_sim.py and test_simulator_serve_wrap_on_simulated_time, then update the hashes")


def test_simulator_serve_wrap_on_simulated_time():
    S = simulator()

    t = S.ServeTiming(upscale_delay_s=2.0, downscale_delay_s=10.0, look_back_period_s=30.0,
                      metrics_interval_s=10.0, min_replicas=1, max_replicas=8)
    # an upscale must be asked for continuously for upscale_delay_s of simulated time
    state = {}
    assert [S.serve_wrap(5, 3, 3, t, state, now) for now in (100.0, 101.0, 102.0)] == [3, 3, 5]
    # a downscale waits downscale_delay_s; asking for the current target resets the wait
    state = {}
    asks = ((2, 200.0, 5), (5, 205.0, 5), (2, 206.0, 5), (2, 215.0, 5), (2, 216.0, 2))
    for desired, now, want in asks:
        assert S.serve_wrap(desired, 5, 5, t, state, now) == want, (desired, now)
    # from zero replicas there is no delay; max_replicas bounds the result
    assert S.serve_wrap(20, 0, 0, t, {}, 0.0) == 8
    # scaling factors act on the difference to the current replicas: 3 + 0.5 * (7 - 3)
    half = dataclasses.replace(t, upscale_delay_s=0.0, upscaling_factor=0.5)
    assert S.serve_wrap(7, 3, 3, half, {}, 0.0) == 5


# --------------------------------------------------------------------------------------
# simulator smoke test (small trace)
# --------------------------------------------------------------------------------------
def test_simulator_smoke(tmp_path):
    S = simulator()

    spec = S.TraceSpec(duration_s=400.0, base_load_replicas=2.0, spike_start_s=100.0, spike_duration_s=60.0,
                       long_start_s=250.0, long_duration_s=100.0)
    rep = S.run_all(S.CPU_PROFILE, spec, dt=0.5, max_replicas=12, knobs={}, seeds=[0],
                    equal_cost_utilization=None)
    names = [r["policy"] for r in rep["results"]]
    assert names == ["fixed_peak", "request_default", "request_fast", "kvserve"]
    for r in rep["results"]:
        assert r["overall"]["requests"] == rep["requests"] > 0
        assert 0.0 <= r["overall"]["slo_attainment"] <= 1.0
        assert r["replica_seconds"] > 0
    table = S.markdown_table(rep)
    assert table.count("\n| ") == 1 + len(names)  # header + one row per policy
    S.plot(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_simulator_reads_measured_replica_numbers(tmp_path):
    S = simulator()

    path = tmp_path / "throughput.json"
    path.write_text(json.dumps({"systems": [{"system": "hf_generate_static_bs16", "output_tok_per_s": 90.0},
                                            {"system": "kvserve", "output_tok_per_s": 310.0,
                                             "max_running_batch": 48}]}))
    prof = S.load_profile(str(path), S.CPU_PROFILE)
    assert (prof.decode_tokens_per_s, prof.max_num_seqs, prof.max_ongoing_requests) == (310.0, 48, 96)
    assert prof.prefill_tokens_per_s == S.CPU_PROFILE.prefill_tokens_per_s
    path.write_text(json.dumps({"replica_profile": {"prefill_tokens_per_s": 1500, "startup_s": 12}}))
    prof = S.load_profile(str(path), S.CPU_PROFILE)
    assert (prof.prefill_tokens_per_s, prof.startup_s) == (1500.0, 12.0)
    assert S.load_profile(str(tmp_path / "missing.json"), S.CPU_PROFILE) is S.CPU_PROFILE
