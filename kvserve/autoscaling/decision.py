"""The decision: from one tick's demand (replicas, float) to the replica count Serve gets.

Per tick (:func:`decide`):

1. bounds: ``min/max_replicas``, Serve's capacity-adjusted bounds and the time-of-day floor
   ("time-based" mode stops here: the floor is the answer);
2. demand, once (``kvserve/autoscaling/demand.py``), from the memory the tick started with;
3. smoothing: a rise of ``raw`` must persist for ``upscale_smoothing_s`` (the lowest value
   over that window is used); a fall goes through an EWMA with time constant
   ``downscale_smoothing_s``;
4. hysteresis and cool-downs: the smoothed demand must leave a band around the current
   target (``upscale_tolerance`` / ``downscale_headroom``), cool-downs (from Serve's last
   scale events) gate repeated changes, a scale-down never undercuts the sustained peaks
   of the last cool-down nor leaves more requests waiting than the smaller fleet may hold;
5. the bounds win, cool-downs notwithstanding.

Every decision is logged as one JSON line (when it changes, and every ``log_interval_s``)
and exported as metrics (``kvserve/autoscaling/metrics.py``). Pure apart from that and reading
``time.time()`` when the context has no ``current_time``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional, Tuple

from kvserve.autoscaling.demand import SIGNAL_REASONS, measure_fleet, replica_demand, update_fleet_memory
from kvserve.autoscaling.schedule import schedule_floor
from kvserve.autoscaling.settings import KVServeAutoscalingConfig
from kvserve.autoscaling.signals import ctx_attr, finite, read_replica_metrics, state_key

#: A child of Serve's "ray.serve" logger, so inside the Serve controller the decision lines go
#: to the controller's log (logs/serve/controller_*.log) at INFO; elsewhere, to whatever the
#: application configures.
logger = logging.getLogger("ray.serve.kvserve_autoscaling")

REASON_SCHEDULE = "schedule_floor"  # time-of-day floor raised the decision
REASON_MIN_REPLICAS = "min_replicas"
REASON_MAX_REPLICAS = "max_replicas"
REASON_HYSTERESIS = "hold_hysteresis"  # smoothed demand inside the band around target
REASON_UPSCALE_COOLDOWN = "hold_upscale_cooldown"
REASON_DOWNSCALE_COOLDOWN = "hold_downscale_cooldown"
REASON_QUEUE_GUARD = "hold_queue_not_empty"  # would scale down but requests are waiting
REASON_NO_METRICS = "hold_no_metrics"
#: Every reason a decision can carry (a closed set: it is a metric label).
REASONS: Tuple[str, ...] = SIGNAL_REASONS + (
    REASON_SCHEDULE,
    REASON_MIN_REPLICAS,
    REASON_MAX_REPLICAS,
    REASON_HYSTERESIS,
    REASON_UPSCALE_COOLDOWN,
    REASON_DOWNSCALE_COOLDOWN,
    REASON_QUEUE_GUARD,
    REASON_NO_METRICS,
)

#: Width (s) of the buckets in which sustained-demand peaks are remembered.
PEAK_BUCKET_S = 2.0


@dataclass
class Decision:
    """One policy evaluation: the number returned to Serve, why, and the inputs."""

    desired: int
    reason: str
    action: str  # "up" | "down" | "hold"
    inputs: Dict[str, Any] = field(default_factory=dict)

    def log_record(self) -> Dict[str, Any]:
        rec = {
            "event": "kvserve_autoscaling_decision",
            "desired": self.desired,
            "action": self.action,
            "reason": self.reason,
        }
        rec.update(self.inputs)
        return rec


@dataclass(frozen=True)
class Tick:
    """Where one evaluation stands: times in seconds, counts in replicas."""

    now: float
    dt: float  # since the previous evaluation (0 on the first, at most 600)
    target: int  # Serve's current target
    lo: int  # lower bound: min_replicas, Serve's capacity-adjusted min, schedule floor
    hi: int  # upper bound: max_replicas, Serve's capacity-adjusted max
    floor: int  # schedule floor (0 outside "time-based"/"hybrid")
    last_up: float  # last scale-up (Serve's record or seen by us), -inf if none
    last_event: float  # last scale event of either kind, or the policy's start


def decide(ctx: Any, config: Optional[KVServeAutoscalingConfig] = None) -> Tuple[Decision, Dict[str, Any]]:
    """Evaluate the policy on a Serve ``AutoscalingContext`` (or any object with its
    attributes). Returns the :class:`Decision` and the new policy state (a new dict;
    ``ctx.policy_state`` is not modified)."""
    cfg = config or KVServeAutoscalingConfig()
    prev: Mapping[str, Any] = ctx_attr(ctx, "policy_state", {}) or {}
    state: Dict[str, Any] = dict(prev)
    tick = _start_tick(ctx, state, cfg)
    inputs: Dict[str, Any] = {
        "deployment": ctx_attr(ctx, "deployment_name"),
        "application": ctx_attr(ctx, "app_name"),
        "time": round(tick.now, 3),
        "mode": cfg.policy_mode,
        "current_replicas": int(ctx_attr(ctx, "current_num_replicas", 0) or 0),
        "target_replicas": tick.target,
        "min_bound": tick.lo,
        "max_bound": tick.hi,
        "schedule_floor": tick.floor,
    }
    if cfg.policy_mode == "time-based":
        desired = min(max(tick.floor, tick.lo), tick.hi)
        reason = REASON_SCHEDULE if tick.floor > cfg.min_replicas and desired == tick.floor else REASON_MIN_REPLICAS
        return _finish(desired, reason, tick, inputs, state, prev, cfg)

    # Demand, once: measured with the memory the tick started with, which then advances.
    fleet = measure_fleet(
        read_replica_metrics(ctx, cfg.signal_source), state, ctx_attr(ctx, "total_queued_requests", 0.0)
    )
    growth = update_fleet_memory(state, fleet, tick.now, tick.dt, cfg)
    demand = replica_demand(fleet, cfg, growth)
    inputs.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in demand.items()})
    if demand["num_replicas_reporting"] == 0:
        # No replica has reported yet (just deployed, or all restarting): hold.
        state.pop(state_key("ewma"), None)
        desired, reason = tick.target, REASON_NO_METRICS
    else:
        raw = float(demand["raw"])
        sustained = _sustained(state, raw, tick, cfg)
        smoothed = _decayed(state, raw, sustained, tick, cfg)
        peak = _recent_peak(state, sustained, tick, cfg)
        inputs.update(
            raw_desired=round(raw, 3),
            sustained_desired=round(sustained, 3),
            smoothed_desired=round(smoothed, 3),
            recent_sustained_peak=round(peak, 3),
        )
        desired, reason = _hysteresis(sustained, smoothed, peak, demand, tick, cfg)
    return _finish(desired, reason, tick, inputs, state, prev, cfg)


def _start_tick(ctx: Any, state: Dict[str, Any], cfg: KVServeAutoscalingConfig) -> Tick:
    """Clock, bounds and last scale events; records the tick's time and target in ``state``."""
    now = finite(ctx_attr(ctx, "current_time")) or time.time()
    target = int(ctx_attr(ctx, "target_num_replicas", 0) or 0)
    floor = schedule_floor(cfg, now)
    lo, hi = cfg.min_replicas, cfg.max_replicas
    cap_lo = ctx_attr(ctx, "capacity_adjusted_min_replicas")
    cap_hi = ctx_attr(ctx, "capacity_adjusted_max_replicas")
    if isinstance(cap_hi, (int, float)) and cap_hi >= 0:
        hi = min(hi, int(cap_hi))
    if isinstance(cap_lo, (int, float)):
        lo = max(lo, int(cap_lo))
    lo = min(max(lo, floor), hi)

    t0 = finite(state.get(state_key("t0")))
    if t0 is None:
        t0 = now
        state[state_key("t0")] = now
    last_t = finite(state.get(state_key("t")))
    dt = 0.0 if last_t is None else min(max(0.0, now - last_t), 600.0)
    state[state_key("t")] = now

    # Last scale events: Serve's record, or the target changes we observed ourselves
    # (Serve only records events for targets within its bounds).
    last_target = state.get(state_key("last_target"))
    if isinstance(last_target, (int, float)):
        if target > last_target:
            state[state_key("last_up")] = now
        elif target < last_target:
            state[state_key("last_down")] = now
    state[state_key("last_target")] = target
    ups = (finite(ctx_attr(ctx, "last_scale_up_time")), finite(state.get(state_key("last_up"))))
    downs = (finite(ctx_attr(ctx, "last_scale_down_time")), finite(state.get(state_key("last_down"))))
    last_up = max([x for x in ups if x is not None], default=-math.inf)
    last_down = max([x for x in downs if x is not None], default=-math.inf)
    return Tick(
        now=now,
        dt=dt,
        target=target,
        lo=lo,
        hi=hi,
        floor=floor,
        last_up=last_up,
        last_event=max(last_up, last_down, t0),
    )


def _sustained(state: Dict[str, Any], raw: float, tick: Tick, cfg: KVServeAutoscalingConfig) -> float:
    """Upscale smoothing: demand must persist; the lowest level seen over the last
    ``upscale_smoothing_s`` (a one-sample blip is ignored, a step passes whole)."""
    now = tick.now
    window = [w for w in state.get(state_key("up_window"), []) if isinstance(w, (list, tuple)) and len(w) == 2]
    if not window or window[-1][1] != raw:
        window.append([now, raw])
    keep_from = now - cfg.upscale_smoothing_s
    older = [w for w in window if w[0] < keep_from]
    window = ([older[-1]] if older else []) + [w for w in window if w[0] >= keep_from]
    state[state_key("up_window")] = window
    if cfg.upscale_smoothing_s <= 0:
        return raw
    if older:
        return min(w[1] for w in window)
    return min(raw, float(tick.target))  # (re)started less than one window ago: no upscale yet


def _decayed(state: Dict[str, Any], raw: float, sustained: float, tick: Tick, cfg: KVServeAutoscalingConfig) -> float:
    """Downscale smoothing: an EWMA that follows sustained rises at once and decays toward
    lower demand with time constant ``downscale_smoothing_s``."""
    ewma = finite(state.get(state_key("ewma")))
    if ewma is None:
        # Start from where the fleet is (or higher): no instant scale-down after a deploy.
        ewma = max(raw, float(tick.target))
    elif raw < ewma:
        tau = cfg.downscale_smoothing_s
        alpha = 1.0 if tau <= 0 else 1.0 - math.exp(-tick.dt / tau)
        ewma += alpha * (raw - ewma)
    ewma = max(ewma, sustained)
    state[state_key("ewma")] = ewma
    return ewma


def _recent_peak(state: Dict[str, Any], sustained: float, tick: Tick, cfg: KVServeAutoscalingConfig) -> float:
    """Highest sustained demand of the last ``downscale_cooldown_s`` (``PEAK_BUCKET_S``
    buckets): a scale-down never goes below what it would have scaled up to, so it is not
    undone by the next upward wiggle of a noisy signal."""
    now = tick.now
    peaks = [
        p
        for p in state.get(state_key("peaks"), [])
        if isinstance(p, (list, tuple)) and len(p) == 2 and p[0] >= now - cfg.downscale_cooldown_s
    ]
    bucket = math.floor(now / PEAK_BUCKET_S) * PEAK_BUCKET_S
    if peaks and peaks[-1][0] == bucket:
        peaks[-1] = [bucket, max(peaks[-1][1], sustained)]
    else:
        peaks.append([bucket, sustained])
    state[state_key("peaks")] = peaks
    return max(p[1] for p in peaks)


def _hysteresis(
    sustained: float, smoothed: float, peak: float, demand: Mapping[str, Any], tick: Tick, cfg: KVServeAutoscalingConfig
) -> Tuple[int, str]:
    """Scale up when the sustained demand leaves the band above the target (after the
    upscale cool-down), down when the smoothed demand plus headroom and the recent peaks
    fit a smaller fleet (after the downscale cool-down, and only if the queue fits it)."""
    up = math.ceil(sustained - cfg.upscale_tolerance)
    down = max(math.ceil(smoothed + cfg.downscale_headroom), math.ceil(peak - cfg.upscale_tolerance))
    if cfg.allow_scale_to_zero and demand["idle"] and smoothed < 0.05:
        down = 0
    down = max(down, tick.lo)
    if up > tick.target:
        if tick.now - tick.last_up >= cfg.upscale_cooldown_s:
            return up, demand["reason"]
        return tick.target, REASON_UPSCALE_COOLDOWN
    if down < tick.target:
        if demand["waiting_total"] > cfg.target_queue_per_replica * max(down, 1):
            return tick.target, REASON_QUEUE_GUARD
        if tick.now - tick.last_event >= cfg.downscale_cooldown_s:
            return down, demand["reason"]
        return tick.target, REASON_DOWNSCALE_COOLDOWN
    return tick.target, REASON_HYSTERESIS


def _finish(
    desired: int,
    reason: str,
    tick: Tick,
    inputs: Dict[str, Any],
    state: Dict[str, Any],
    prev: Mapping[str, Any],
    cfg: KVServeAutoscalingConfig,
) -> Tuple[Decision, Dict[str, Any]]:
    """Apply the bounds (the schedule floor and min/max win over everything), then log/export."""
    if desired > tick.hi:
        desired, reason = tick.hi, REASON_MAX_REPLICAS
    if desired < tick.lo:
        schedule_raised = tick.floor >= tick.lo and tick.floor > cfg.min_replicas
        desired, reason = tick.lo, (REASON_SCHEDULE if schedule_raised else REASON_MIN_REPLICAS)
    action = "up" if desired > tick.target else ("down" if desired < tick.target else "hold")
    decision = Decision(desired=int(desired), reason=reason, action=action, inputs=inputs)
    _observe(decision, state, prev, tick.now, cfg)
    return decision, state


def _observe(
    decision: Decision, state: Dict[str, Any], prev: Mapping[str, Any], now: float, cfg: KVServeAutoscalingConfig
) -> None:
    """One structured log line per decision change (and every ``log_interval_s``), plus gauges."""
    last_log = finite(prev.get(state_key("last_log")))
    changed = (
        prev.get(state_key("last_desired")) != decision.desired or prev.get(state_key("last_reason")) != decision.reason
    )
    if changed or last_log is None or now - last_log >= cfg.log_interval_s:
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", json.dumps(decision.log_record(), default=str, sort_keys=False))
        state[state_key("last_log")] = now
    state[state_key("last_desired")] = decision.desired
    state[state_key("last_reason")] = decision.reason
    if cfg.export_metrics:
        try:
            from kvserve.autoscaling import metrics as _metrics

            _metrics.record_decision(decision)
        except Exception:  # metrics are best effort: never break the controller
            pass
