"""kvserve's custom Ray Serve autoscaling policy: queue depth + token throughput.

Pure code: this module imports only the standard library at import time. Ray is
imported inside :func:`build_autoscaling_config` only, so the policy can be unit
tested (and simulated, see ``autoscaling/simulate.py``) without a Ray cluster.

How it plugs into Ray Serve 2.60
--------------------------------
``AutoscalingConfig(policy=AutoscalingPolicy(policy_function=KVServeAutoscalingPolicy,
policy_kwargs=<knobs>))``. Serve's controller sees that ``policy_function`` is a
class, instantiates it once with ``policy_kwargs`` (which must be JSON
serialisable) and then calls ``instance(ctx)`` on every control-loop tick
(``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``, 0.1 s by default). The call returns
``(desired_replicas, policy_state)``; Serve stores ``policy_state`` and hands a copy
back as ``ctx.policy_state`` on the next tick (it is reset to ``{}`` when the
deployment is redeployed or its config changes). All of this policy's memory
(EWMA, timestamps, last capacities) lives in that dict under ``kvserve.*`` keys.

Serve still wraps the returned number (``ray.serve.autoscaling_policy.
_apply_autoscaling_config``): upscaling/downscaling factors, then
``upscale_delay_s``/``downscale_delay_s`` (the new target must be asked for
continuously that long), then ``min_replicas``/``max_replicas``.
:func:`build_autoscaling_config` sets the factors to 1 and the delays near 0 so the
policy's own smoothing, hysteresis and cool-downs are what decides, within seconds.

Inputs: per-replica metrics that ``LLMServer.record_autoscaling_stats()`` returns
(names below), which Serve exposes as ``ctx.aggregated_metrics[name][replica_id]``
(mean over ``look_back_period_s``) and ``ctx.raw_metrics[name][replica_id]`` (the
time series; this policy reads its newest sample by default and smooths itself).

Decision (all quantities in replicas; details in ``compute_demand`` and ``decide``):

* ``load      = sum_r gen_tps_r / decode_cap_r + prefill_tps_r / prefill_cap_r``
  (busy replica-equivalents, each replica against the capacity it measured itself),
  plus the growth rate of the work backlog once the fleet nears saturation (a replica
  cannot report more throughput than it has, so overload first shows as work piling
  up: batches filling, then a queue);
* ``n_util    = load / target_utilization``;
* ``n_queue   = waiting_requests / target_queue_per_replica`` and
  ``n_prefill = waiting_prefill_tokens / (prefill_cap * target_prefill_backlog_s)``,
  both capped at ``n_util + queued work / queue_drain_s``;
* ``n_kv      = sum_r kv_cache_usage_r / kv_cache_target`` (secondary);
* ``raw = max(...)``; ``(running + waiting) / fallback_ongoing_per_replica`` replaces
  the token signals while no replica has reported a capacity.

A rise of ``raw`` must persist for ``upscale_smoothing_s`` (the lowest value over that
window is used); a fall goes through an EWMA with time constant
``downscale_smoothing_s``. The result must leave a hysteresis band around the current
target, and cool-downs (from Serve's last scale events) gate repeated changes; a
scale-down never undercuts the sustained peaks of the last cool-down. Finally the
time-of-day floor ("time-based"/"hybrid" modes) and the min/max bounds are applied.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence, Tuple, Union

#: A child of Serve's "ray.serve" logger, so inside the Serve controller the decision lines go
#: to the controller's log (logs/serve/controller_*.log) at INFO; elsewhere, to whatever the
#: application configures.
logger = logging.getLogger("ray.serve.kvserve_autoscaling")

# --------------------------------------------------------------------------------------
# Metric names reported by LLMServer.record_autoscaling_stats() (one float each).
# --------------------------------------------------------------------------------------
#: Requests queued in the engine whose prefill has not started (not yet scheduled).
NUM_WAITING_REQUESTS = "num_waiting_requests"
#: Prompt tokens not computed yet: waiting requests plus running ones still in (chunked) prefill.
NUM_WAITING_PREFILL_TOKENS = "num_waiting_prefill_tokens"
#: Requests scheduled in the engine (prefill started or decoding).
NUM_RUNNING_REQUESTS = "num_running_requests"
#: Output tokens generated per second over the replica's recent steps.
GENERATION_TOKENS_PER_S = "generation_tokens_per_s"
#: Prompt tokens prefilled per second over the replica's recent steps.
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
#: Decode tokens/s this replica can sustain at a full batch, measured from its own steps.
DECODE_CAPACITY_TOKENS_PER_S = "decode_capacity_tokens_per_s"
#: Prefill tokens/s this replica can sustain, measured from its own steps.
PREFILL_CAPACITY_TOKENS_PER_S = "prefill_capacity_tokens_per_s"
#: Fraction of KV cache blocks in use, 0..1.
KV_CACHE_USAGE = "kv_cache_usage"

METRIC_NAMES: Tuple[str, ...] = (
    NUM_WAITING_REQUESTS,
    NUM_WAITING_PREFILL_TOKENS,
    NUM_RUNNING_REQUESTS,
    GENERATION_TOKENS_PER_S,
    PREFILL_TOKENS_PER_S,
    DECODE_CAPACITY_TOKENS_PER_S,
    PREFILL_CAPACITY_TOKENS_PER_S,
    KV_CACHE_USAGE,
)

#: Import path Serve uses to load the policy class (``module:attr``).
POLICY_IMPORT_PATH = "autoscaling.policy:KVServeAutoscalingPolicy"

POLICY_MODES = ("metrics", "time-based", "hybrid")
SIGNAL_SOURCES = ("latest", "aggregated")

# Reasons (a closed set: they become a metric label).
REASON_THROUGHPUT = "throughput"  # token throughput vs measured capacity
REASON_QUEUE = "queue"  # waiting requests above target per replica
REASON_PREFILL_BACKLOG = "prefill_backlog"  # waiting prefill tokens above target seconds
REASON_KV_CACHE = "kv_cache"  # KV cache usage above target
REASON_REQUESTS_FALLBACK = "requests_fallback"  # no capacity reported yet: request count
REASON_IDLE = "idle"  # no load at all
REASON_SCHEDULE = "schedule_floor"  # time-of-day floor raised the decision
REASON_MIN_REPLICAS = "min_replicas"
REASON_MAX_REPLICAS = "max_replicas"
REASON_HYSTERESIS = "hold_hysteresis"  # smoothed demand inside the band around target
REASON_UPSCALE_COOLDOWN = "hold_upscale_cooldown"
REASON_DOWNSCALE_COOLDOWN = "hold_downscale_cooldown"
REASON_QUEUE_GUARD = "hold_queue_not_empty"  # would scale down but requests are waiting
REASON_NO_METRICS = "hold_no_metrics"
REASONS: Tuple[str, ...] = (
    REASON_THROUGHPUT,
    REASON_QUEUE,
    REASON_PREFILL_BACKLOG,
    REASON_KV_CACHE,
    REASON_REQUESTS_FALLBACK,
    REASON_IDLE,
    REASON_SCHEDULE,
    REASON_MIN_REPLICAS,
    REASON_MAX_REPLICAS,
    REASON_HYSTERESIS,
    REASON_UPSCALE_COOLDOWN,
    REASON_DOWNSCALE_COOLDOWN,
    REASON_QUEUE_GUARD,
    REASON_NO_METRICS,
)

_STATE_PREFIX = "kvserve."


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScheduleEntry:
    """Minimum replicas between two local hours; ``end_hour < start_hour`` wraps midnight.

    Hours are floats in [0, 24] (9.5 = 09:30); the window is ``[start_hour, end_hour)``.
    """

    start_hour: float
    end_hour: float
    min_replicas: int

    def __post_init__(self):
        for name in ("start_hour", "end_hour"):
            v = getattr(self, name)
            if not (0.0 <= float(v) <= 24.0):
                raise ValueError(f"schedule {name}={v} must be within [0, 24]")
        if int(self.min_replicas) < 0:
            raise ValueError("schedule min_replicas must be >= 0")

    def contains(self, hour: float) -> bool:
        s, e = float(self.start_hour), float(self.end_hour)
        if s == e:
            return True  # whole day
        if s < e:
            return s <= hour < e
        return hour >= s or hour < e

    def to_dict(self) -> Dict[str, Any]:
        return {
            "start_hour": float(self.start_hour),
            "end_hour": float(self.end_hour),
            "min_replicas": int(self.min_replicas),
        }


def parse_schedule(spec: Union[None, str, Iterable[Any]]) -> Tuple[ScheduleEntry, ...]:
    """Parse a schedule from ``"8-20:4,20-23:2"`` (hours, ``H`` or ``H:MM``... as
    ``9.5``), a list of dicts ``{"start_hour", "end_hour", "min_replicas"}``, a list of
    ``(start, end, n)`` tuples, or ``ScheduleEntry`` objects."""
    if spec is None or spec == "" or spec == ():
        return ()
    if isinstance(spec, str):
        entries = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                window, n = part.rsplit(":", 1)
                start, end = window.split("-", 1)
                entries.append(ScheduleEntry(float(start), float(end), int(n)))
            except ValueError as e:
                raise ValueError(
                    f"bad schedule entry {part!r}: expected START-END:MIN_REPLICAS "
                    f"(hours, e.g. '8-20:4' or '22-6:1')"
                ) from e
        return tuple(entries)
    out = []
    for item in spec:
        if isinstance(item, ScheduleEntry):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(
                ScheduleEntry(
                    float(item["start_hour"]), float(item["end_hour"]), int(item["min_replicas"])
                )
            )
        else:
            s, e, n = item
            out.append(ScheduleEntry(float(s), float(e), int(n)))
    return tuple(out)


@dataclass(frozen=True)
class KVServeAutoscalingConfig:
    """All knobs of the kvserve autoscaling policy (JSON-serialisable via ``to_dict``).

    Replica bounds and mode
      * ``policy_mode``: ``"metrics"`` (queue + throughput), ``"time-based"`` (replicas
        follow ``schedule`` only) or ``"hybrid"`` (metrics, with ``schedule`` as a floor).
      * ``min_replicas`` (1: a warm pool; 0 needs ``allow_scale_to_zero``),
        ``max_replicas``, ``initial_replicas``.
    Targets
      * ``target_queue_per_replica``: waiting requests a replica may hold.
      * ``target_prefill_backlog_s``: waiting prefill tokens a replica may hold, in
        seconds of its own prefill capacity (bounds the queueing part of TTFT).
      * ``target_utilization``: fraction of measured token capacity to run at.
      * ``kv_cache_target``: KV cache usage per replica to stay under (secondary).
      * ``fallback_ongoing_per_replica``: running+waiting requests per replica, used
        only until some replica has reported its capacity.
      * ``queue_drain_s``: the queue targets never ask for more replicas than serve the
        offered load plus drain the queued work within this many seconds (they would
        otherwise keep growing while new replicas start); 0 disables the cap.
    Smoothing, hysteresis, cool-downs
      * ``upscale_smoothing_s``: a rise in demand must persist this long; the policy
        then scales to the lowest demand seen over that window (a one-sample blip is
        ignored, a real step passes whole). Keep it above ``serve_metrics_interval_s``.
      * ``downscale_smoothing_s``: time constant of the EWMA that lets the demand decay
        (it follows sustained rises immediately).
      * ``backlog_growth_smoothing_s``: EWMA time constant of the growth rate of the
        work backlog (waiting prefill + decode work of ongoing requests), which is
        added to the served load as demand not served yet (0 disables).
      * ``upscale_tolerance``: the sustained demand must exceed the current target by
        this much (replicas) before replicas are added; ``downscale_headroom``: after
        removing replicas the fleet must still have this many replicas to spare.
      * ``upscale_cooldown_s``: minimum time between two scale-ups;
        ``downscale_cooldown_s``: minimum time since the last scale event (up or down,
        or the policy's start) before a scale-down.
    Time-of-day floor
      * ``schedule``: entries (``start_hour``, ``end_hour``, ``min_replicas``);
        ``schedule_timezone`` (IANA name); ``schedule_prewarm_s``: look this far ahead so
        replicas are warm when a window opens.
    Serve wrapping (see ``build_autoscaling_config``)
      * ``serve_upscale_delay_s`` (0), ``serve_downscale_delay_s`` (5),
        ``serve_downscale_to_zero_delay_s`` (300), ``serve_look_back_period_s`` (10),
        ``serve_metrics_interval_s`` (2: replicas record and push metrics this often).
    Observability
      * ``log_interval_s``: a decision line is logged whenever the decision or reason
        changes, and at least this often otherwise.
      * ``export_metrics``: set the ``kvserve_autoscaling_*`` gauges.
    """

    policy_mode: str = "metrics"
    min_replicas: int = 1
    max_replicas: int = 8
    initial_replicas: Optional[int] = None
    allow_scale_to_zero: bool = False

    target_queue_per_replica: float = 4.0
    target_prefill_backlog_s: float = 1.0
    target_utilization: float = 0.75
    kv_cache_target: float = 0.90
    fallback_ongoing_per_replica: float = 32.0
    queue_drain_s: float = 30.0

    upscale_smoothing_s: float = 4.0
    downscale_smoothing_s: float = 60.0
    backlog_growth_smoothing_s: float = 4.0
    upscale_tolerance: float = 0.2
    downscale_headroom: float = 0.5
    upscale_cooldown_s: float = 3.0
    downscale_cooldown_s: float = 60.0

    schedule: Tuple[ScheduleEntry, ...] = ()
    schedule_timezone: str = "UTC"
    schedule_prewarm_s: float = 0.0

    signal_source: str = "latest"

    serve_upscale_delay_s: float = 0.0
    serve_downscale_delay_s: float = 5.0
    serve_downscale_to_zero_delay_s: float = 300.0
    serve_look_back_period_s: float = 10.0
    serve_metrics_interval_s: float = 2.0

    log_interval_s: float = 30.0
    export_metrics: bool = True

    def __post_init__(self):
        object.__setattr__(self, "schedule", parse_schedule(self.schedule))
        if self.policy_mode not in POLICY_MODES:
            raise ValueError(f"policy_mode must be one of {POLICY_MODES}, got {self.policy_mode!r}")
        if self.signal_source not in SIGNAL_SOURCES:
            raise ValueError(f"signal_source must be one of {SIGNAL_SOURCES}")
        if self.min_replicas < 0:
            raise ValueError("min_replicas must be >= 0")
        if self.min_replicas == 0 and not self.allow_scale_to_zero:
            raise ValueError(
                "min_replicas=0 scales LLM replicas to zero (minutes of cold start); "
                "set allow_scale_to_zero=True to opt in"
            )
        if self.max_replicas < max(1, self.min_replicas):
            raise ValueError("max_replicas must be >= max(1, min_replicas)")
        if self.initial_replicas is not None and not (
            self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must be within [min_replicas, max_replicas]")
        for name in (
            "target_queue_per_replica",
            "target_prefill_backlog_s",
            "fallback_ongoing_per_replica",
            "serve_look_back_period_s",
            "serve_metrics_interval_s",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not (0.0 < self.target_utilization <= 1.0):
            raise ValueError("target_utilization must be in (0, 1]")
        if not (0.0 < self.kv_cache_target <= 1.0):
            raise ValueError("kv_cache_target must be in (0, 1]")
        for name in (
            "upscale_smoothing_s",
            "downscale_smoothing_s",
            "backlog_growth_smoothing_s",
            "upscale_tolerance",
            "downscale_headroom",
            "upscale_cooldown_s",
            "downscale_cooldown_s",
            "queue_drain_s",
            "schedule_prewarm_s",
            "serve_upscale_delay_s",
            "serve_downscale_delay_s",
            "serve_downscale_to_zero_delay_s",
            "log_interval_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.upscale_tolerance >= 1.0:
            raise ValueError("upscale_tolerance must be < 1 replica")
        if self.serve_look_back_period_s <= self.serve_metrics_interval_s:
            raise ValueError("serve_look_back_period_s must be > serve_metrics_interval_s")
        for e in self.schedule:
            if e.min_replicas > self.max_replicas:
                raise ValueError(f"schedule entry {e} exceeds max_replicas={self.max_replicas}")
        if self.policy_mode in ("time-based", "hybrid") and not self.schedule:
            raise ValueError(f"policy_mode={self.policy_mode!r} needs a schedule")

    # -- conversions ------------------------------------------------------------------
    def to_dict(self) -> Dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        d["schedule"] = [e.to_dict() for e in self.schedule]
        return d

    @classmethod
    def from_dict(cls, d: Optional[Mapping[str, Any]] = None, **overrides) -> "KVServeAutoscalingConfig":
        data = dict(d or {})
        data.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown autoscaling knobs: {unknown}")
        return cls(**data)

    @classmethod
    def coerce(cls, knobs: Union[None, "KVServeAutoscalingConfig", Mapping[str, Any]]) -> "KVServeAutoscalingConfig":
        if knobs is None:
            return cls()
        if isinstance(knobs, cls):
            return knobs
        return cls.from_dict(knobs)

    def replace(self, **changes) -> "KVServeAutoscalingConfig":
        return dataclasses.replace(self, **changes)


# --------------------------------------------------------------------------------------
# Helpers over the (duck-typed) Serve AutoscalingContext
# --------------------------------------------------------------------------------------
def _ctx_attr(ctx: Any, name: str, default: Any = None) -> Any:
    """Read a context attribute; Serve evaluates some lazily, so tolerate failures."""
    try:
        v = getattr(ctx, name)
    except Exception:  # lazy metric callables can raise inside the controller
        return default
    return default if v is None else v


def _finite(v: Any) -> Optional[float]:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _latest_sample(series: Any) -> Optional[float]:
    """Newest value of a Serve TimeSeries: a time-ordered list of TimeStampedValue
    (``(timestamp, value)`` pairs and bare numbers are accepted too)."""
    if isinstance(series, (list, tuple)):
        if not series:
            return None
        pt = series[-1]  # Serve appends samples in time order
        v = getattr(pt, "value", None)
        if v is None and isinstance(pt, (list, tuple)) and len(pt) == 2:
            v = pt[1]
        elif v is None:
            v = pt
        return _finite(v)
    return _finite(series)


def read_replica_metrics(ctx: Any, source: str = "latest") -> Dict[Any, Dict[str, float]]:
    """Return ``{replica_id: {metric: value}}`` for the replicas Serve considers running.

    ``source="latest"`` prefers the newest raw sample (``ctx.raw_metrics``) and falls
    back to the window mean (``ctx.aggregated_metrics``) per metric and replica.
    Metrics of replicas not in ``ctx.running_replicas`` are ignored (stopping
    replicas); running replicas without any report yet map to ``{}``.
    """
    table: Dict[Any, Dict[str, float]] = {}

    def _fill(source_map: Any, reader) -> None:
        if not isinstance(source_map, Mapping):
            return
        for name, per_replica in source_map.items():
            if name not in METRIC_NAMES or not isinstance(per_replica, Mapping):
                continue
            for rid, v in per_replica.items():
                row = table.setdefault(rid, {})
                if name in row:
                    continue
                f = reader(v)
                if f is not None:
                    row[name] = f

    if source == "latest":
        _fill(_ctx_attr(ctx, "raw_metrics", {}), _latest_sample)
    complete = bool(table) and all(len(row) == len(METRIC_NAMES) for row in table.values())
    if not complete:  # window means (Serve's aggregated_metrics) for whatever is missing
        _fill(_ctx_attr(ctx, "aggregated_metrics", {}), _finite)
    running = list(_ctx_attr(ctx, "running_replicas", []) or [])
    if running:
        return {rid: table.get(rid, {}) for rid in running}
    return table


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def _local_hour(now: float, tz_name: str) -> float:
    import datetime

    tz: Any = datetime.timezone.utc
    if tz_name and tz_name.upper() != "UTC":
        try:
            from zoneinfo import ZoneInfo

            tz = ZoneInfo(tz_name)
        except Exception:  # no tzdata: fall back to UTC rather than failing the controller
            tz = datetime.timezone.utc
    dt = datetime.datetime.fromtimestamp(now, tz)
    return dt.hour + dt.minute / 60.0 + dt.second / 3600.0


def schedule_floor(config: KVServeAutoscalingConfig, now: float) -> int:
    """Minimum replicas the schedule asks for at ``now + schedule_prewarm_s`` (0 if none)."""
    if not config.schedule or config.policy_mode == "metrics":
        return 0
    hour = _local_hour(now + config.schedule_prewarm_s, config.schedule_timezone)
    floor = 0
    for e in config.schedule:
        if e.contains(hour):
            floor = max(floor, int(e.min_replicas))
    return floor


# --------------------------------------------------------------------------------------
# The decision
# --------------------------------------------------------------------------------------
@dataclass
class Decision:
    """One policy evaluation: the number returned to Serve, why, and the inputs."""

    desired: int
    reason: str
    action: str  # "up" | "down" | "hold"
    inputs: Dict[str, Any] = field(default_factory=dict)

    def log_record(self) -> Dict[str, Any]:
        rec = {"event": "kvserve_autoscaling_decision", "desired": self.desired,
               "action": self.action, "reason": self.reason}
        rec.update(self.inputs)
        return rec


def _k(name: str) -> str:
    return _STATE_PREFIX + name


def compute_demand(
    replicas: Mapping[Any, Mapping[str, float]],
    config: KVServeAutoscalingConfig,
    state: Mapping[str, Any],
    handle_queued: float = 0.0,
    backlog_growth_replicas: float = 0.0,
) -> Dict[str, Any]:
    """Raw demand in replicas from per-replica metrics (no smoothing, no bounds).

    Returns a dict with ``raw``, ``reason`` (the dominating signal) and every input.
    ``state`` supplies the last known fleet capacities and mean prompt length when
    the current reports lack them.

    ``backlog_growth_replicas`` is the smoothed growth rate of ``work_backlog_s`` (the
    work in the system not served yet, in replica-seconds: waiting prefill tokens over
    prefill capacity plus ongoing requests times the decode work of one request).
    Served load plus that growth is the offered load: a replica cannot report more
    throughput than its capacity, so overload shows up only as work piling up, first
    as batches filling up (running requests) and then as a queue.
    """
    reporting = {rid: m for rid, m in replicas.items() if m}
    cap_d_list = [m[DECODE_CAPACITY_TOKENS_PER_S] for m in reporting.values()
                  if m.get(DECODE_CAPACITY_TOKENS_PER_S, 0.0) > 0]
    cap_p_list = [m[PREFILL_CAPACITY_TOKENS_PER_S] for m in reporting.values()
                  if m.get(PREFILL_CAPACITY_TOKENS_PER_S, 0.0) > 0]
    cap_d = _median(cap_d_list) if cap_d_list else _finite(state.get(_k("cap_decode")))
    cap_p = _median(cap_p_list) if cap_p_list else _finite(state.get(_k("cap_prefill")))

    waiting = sum(max(0.0, m.get(NUM_WAITING_REQUESTS, 0.0)) for m in reporting.values())
    waiting_tok = sum(max(0.0, m.get(NUM_WAITING_PREFILL_TOKENS, 0.0)) for m in reporting.values())
    running = sum(max(0.0, m.get(NUM_RUNNING_REQUESTS, 0.0)) for m in reporting.values())
    gen_tps = sum(max(0.0, m.get(GENERATION_TOKENS_PER_S, 0.0)) for m in reporting.values())
    pre_tps = sum(max(0.0, m.get(PREFILL_TOKENS_PER_S, 0.0)) for m in reporting.values())
    kv_vals = [min(1.0, max(0.0, m[KV_CACHE_USAGE])) for m in reporting.values() if KV_CACHE_USAGE in m]

    # Requests queued at Serve handles (not yet given to any replica) are waiting too;
    # their prompt size is unknown, so use the mean waiting prompt seen at the replicas.
    handle_queued = max(0.0, _finite(handle_queued) or 0.0)
    ew_wtok, ew_wreq = _finite(state.get(_k("mix_wtok"))), _finite(state.get(_k("mix_wreq")))
    if ew_wtok and ew_wreq:
        avg_prompt: Optional[float] = ew_wtok / ew_wreq  # ratio of long averages: robust
    else:
        avg_prompt = (waiting_tok / waiting) if waiting >= 1.0 else None
    waiting_total = waiting + handle_queued
    waiting_tok_total = waiting_tok + handle_queued * (avg_prompt or 0.0)

    have_capacity = bool(cap_d) and bool(cap_p)
    signals: Dict[str, float] = {}
    load = None
    prefill_load = None
    growth_load = 0.0
    if have_capacity:
        load = 0.0
        prefill_load = 0.0
        for m in reporting.values():
            cd = m.get(DECODE_CAPACITY_TOKENS_PER_S, 0.0)
            cp = m.get(PREFILL_CAPACITY_TOKENS_PER_S, 0.0)
            cd = cd if cd > 0 else cap_d
            cp = cp if cp > 0 else cap_p
            pl = max(0.0, m.get(PREFILL_TOKENS_PER_S, 0.0)) / cp
            load += max(0.0, m.get(GENERATION_TOKENS_PER_S, 0.0)) / cd + pl
            prefill_load += pl
        growth_load = max(0.0, _finite(backlog_growth_replicas) or 0.0)
        # A replica with throughput to spare serves new work at once (it shows up in
        # its measured throughput within seconds), so backlog growth counts only as the
        # fleet saturates: not at all up to target_utilization, fully at 100% or when
        # requests wait beyond the queue target. This keeps the noise of a derivative
        # out of the steady state.
        if reporting:
            u = load / len(reporting)
            gate = (u - config.target_utilization) / max(1e-6, 1.0 - config.target_utilization)
            if waiting_total > config.target_queue_per_replica * len(reporting):
                gate = 1.0
            growth_load *= min(1.0, max(0.0, gate))
        signals[REASON_THROUGHPUT] = (load + growth_load) / config.target_utilization
        signals[REASON_PREFILL_BACKLOG] = (waiting_tok_total / cap_p) / config.target_prefill_backlog_s
    else:
        signals[REASON_REQUESTS_FALLBACK] = (running + waiting_total) / config.fallback_ongoing_per_replica
    signals[REASON_QUEUE] = waiting_total / config.target_queue_per_replica

    # Decode work per request (replica-seconds): decode load over the request rate,
    # the request rate being prefill throughput over the mean prompt length (long
    # averages kept in the state, see _update_mix).
    decode_work = None
    ew_dload, ew_ptps = _finite(state.get(_k("mix_dload"))), _finite(state.get(_k("mix_ptps")))
    if avg_prompt and ew_dload is not None and ew_ptps and ew_ptps > 0:
        decode_work = ew_dload * avg_prompt / ew_ptps
    elif have_capacity and avg_prompt and pre_tps > 0:
        decode_work = (load - prefill_load) * avg_prompt / pre_tps
    dw = decode_work
    work_backlog = None
    queued_work = None
    if have_capacity:
        queued_work = waiting_tok_total / cap_p + waiting_total * (dw or 0.0)
        work_backlog = queued_work + running * (dw or 0.0)
        # Queue targets are per replica, so they keep asking for more while new
        # replicas start (the queue still grows then). Cap them at what serves the
        # offered load and drains the queued work within ``queue_drain_s``.
        if config.queue_drain_s > 0:
            cap = signals[REASON_THROUGHPUT] + queued_work / config.queue_drain_s
            for key in (REASON_QUEUE, REASON_PREFILL_BACKLOG):
                signals[key] = min(signals[key], cap)
    if kv_vals:
        signals[REASON_KV_CACHE] = sum(kv_vals) / config.kv_cache_target

    idle = waiting_total <= 0 and running <= 0 and gen_tps <= 0 and pre_tps <= 0
    reason, raw = max(signals.items(), key=lambda kv: kv[1])
    if idle:
        reason, raw = REASON_IDLE, 0.0
    return {
        "raw": raw,
        "reason": reason,
        "signals": {k: round(v, 3) for k, v in signals.items()},
        "num_replicas_reporting": len(reporting),
        "waiting_requests": waiting,
        "handle_queued_requests": handle_queued,
        "waiting_prefill_tokens": waiting_tok_total,
        "running_requests": running,
        "generation_tokens_per_s": gen_tps,
        "prefill_tokens_per_s": pre_tps,
        "decode_capacity_tokens_per_s": cap_d,
        "prefill_capacity_tokens_per_s": cap_p,
        "kv_cache_usage_mean": (sum(kv_vals) / len(kv_vals)) if kv_vals else None,
        "load_replicas": load,
        "prefill_load_replicas": prefill_load,
        "decode_work_per_request_s": decode_work,
        "work_backlog_s": work_backlog,
        "queued_work_s": queued_work,
        "backlog_growth_replicas": growth_load,
        "avg_prompt_tokens": avg_prompt,
        "idle": idle,
    }


def decide(ctx: Any, config: Optional[KVServeAutoscalingConfig] = None) -> Tuple[Decision, Dict[str, Any]]:
    """Evaluate the policy on a Serve ``AutoscalingContext`` (or any object with its
    attributes). Returns the :class:`Decision` and the new policy state (a new dict;
    ``ctx.policy_state`` is not modified). Pure apart from reading ``time.time()``
    when ``ctx.current_time`` is missing."""
    cfg = config or KVServeAutoscalingConfig()
    prev: Mapping[str, Any] = _ctx_attr(ctx, "policy_state", {}) or {}
    state: Dict[str, Any] = dict(prev)
    now = _finite(_ctx_attr(ctx, "current_time")) or time.time()
    target = int(_ctx_attr(ctx, "target_num_replicas", 0) or 0)
    current = int(_ctx_attr(ctx, "current_num_replicas", 0) or 0)

    # Bounds: our knobs, Serve's capacity-adjusted bounds, the time-of-day floor.
    floor = schedule_floor(cfg, now)
    lo = cfg.min_replicas
    hi = cfg.max_replicas
    cap_lo = _ctx_attr(ctx, "capacity_adjusted_min_replicas")
    cap_hi = _ctx_attr(ctx, "capacity_adjusted_max_replicas")
    if isinstance(cap_hi, (int, float)) and cap_hi >= 0:
        hi = min(hi, int(cap_hi))
    if isinstance(cap_lo, (int, float)):
        lo = max(lo, int(cap_lo))
    lo = min(max(lo, floor), hi)

    t0 = _finite(state.get(_k("t0")))
    if t0 is None:
        t0 = now
        state[_k("t0")] = now
    last_t = _finite(state.get(_k("t")))
    dt = 0.0 if last_t is None else min(max(0.0, now - last_t), 600.0)
    state[_k("t")] = now

    # Last scale events: Serve's record, or the target changes we observed ourselves
    # (Serve only records events for targets within its bounds).
    last_target = state.get(_k("last_target"))
    if isinstance(last_target, (int, float)):
        if target > last_target:
            state[_k("last_up")] = now
        elif target < last_target:
            state[_k("last_down")] = now
    state[_k("last_target")] = target
    serve_up = _finite(_ctx_attr(ctx, "last_scale_up_time"))
    serve_down = _finite(_ctx_attr(ctx, "last_scale_down_time"))
    last_up = max(x for x in (serve_up, _finite(state.get(_k("last_up"))), -math.inf) if x is not None)
    last_down = max(x for x in (serve_down, _finite(state.get(_k("last_down"))), -math.inf) if x is not None)
    last_event = max(last_up, last_down, t0)

    inputs: Dict[str, Any] = {
        "deployment": _ctx_attr(ctx, "deployment_name"),
        "application": _ctx_attr(ctx, "app_name"),
        "time": round(now, 3),
        "mode": cfg.policy_mode,
        "current_replicas": current,
        "target_replicas": target,
        "min_bound": lo,
        "max_bound": hi,
        "schedule_floor": floor,
    }

    if cfg.policy_mode == "time-based":
        desired = min(max(floor, lo), hi)
        reason = REASON_SCHEDULE if floor > cfg.min_replicas and desired == floor else REASON_MIN_REPLICAS
        return _finish(desired, reason, target, inputs, state, prev, now, cfg)

    replicas = read_replica_metrics(ctx, cfg.signal_source)
    handle_queued = _ctx_attr(ctx, "total_queued_requests", 0.0)
    demand = compute_demand(replicas, cfg, state, handle_queued)
    _update_mix(state, demand, dt)
    growth = _update_backlog_growth(state, demand["work_backlog_s"], now, cfg)
    if growth > 0.0 and demand["num_replicas_reporting"] > 0:
        demand = compute_demand(replicas, cfg, state, handle_queued, growth)
    for key, name in (("decode_capacity_tokens_per_s", "cap_decode"),
                      ("prefill_capacity_tokens_per_s", "cap_prefill")):
        if demand[key]:
            state[_k(name)] = demand[key]
    inputs.update({k: (round(v, 3) if isinstance(v, float) else v) for k, v in demand.items()})

    if demand["num_replicas_reporting"] == 0:
        # No replica has reported yet (just deployed, or all restarting): hold.
        state.pop(_k("ewma"), None)
        desired, reason = target, REASON_NO_METRICS
        if desired > hi:
            desired, reason = hi, REASON_MAX_REPLICAS
        if desired < lo:
            desired, reason = lo, _floor_reason(floor, lo, cfg)
        return _finish(desired, reason, target, inputs, state, prev, now, cfg)

    raw = float(demand["raw"])
    # Upscale smoothing: demand must persist; scale to the lowest level seen over the
    # last ``upscale_smoothing_s`` (a one-sample blip is ignored, a step passes whole).
    window = [w for w in state.get(_k("up_window"), []) if isinstance(w, (list, tuple)) and len(w) == 2]
    if not window or window[-1][1] != raw:
        window.append([now, raw])
    keep_from = now - cfg.upscale_smoothing_s
    older = [w for w in window if w[0] < keep_from]
    window = ([older[-1]] if older else []) + [w for w in window if w[0] >= keep_from]
    state[_k("up_window")] = window
    if cfg.upscale_smoothing_s <= 0:
        sustained = raw
    elif older:
        sustained = min(w[1] for w in window)
    else:  # the policy (re)started less than one window ago: no upscale on a partial window
        sustained = min(raw, float(target))
    # Downscale smoothing: an EWMA that follows sustained rises at once and decays
    # toward lower demand with time constant ``downscale_smoothing_s``.
    ewma = _finite(state.get(_k("ewma")))
    if ewma is None:
        # Start from where the fleet is (or higher): no instant scale-down after a deploy.
        ewma = max(raw, float(target))
    elif raw < ewma:
        tau = cfg.downscale_smoothing_s
        alpha = 1.0 if tau <= 0 else 1.0 - math.exp(-dt / tau)
        ewma += alpha * (raw - ewma)
    ewma = max(ewma, sustained)
    state[_k("ewma")] = ewma
    inputs["raw_desired"] = round(raw, 3)
    inputs["sustained_desired"] = round(sustained, 3)
    inputs["smoothed_desired"] = round(ewma, 3)

    # Sustained-demand peaks of the last ``downscale_cooldown_s`` (2 s buckets): a
    # scale-down never goes below what those would have scaled up to, so it is not
    # undone by the next upward wiggle of a noisy signal.
    peaks = [p for p in state.get(_k("peaks"), []) if isinstance(p, (list, tuple)) and len(p) == 2
             and p[0] >= now - cfg.downscale_cooldown_s]
    bucket = math.floor(now / 2.0) * 2.0
    if peaks and peaks[-1][0] == bucket:
        peaks[-1] = [bucket, max(peaks[-1][1], sustained)]
    else:
        peaks.append([bucket, sustained])
    state[_k("peaks")] = peaks
    recent_peak = max(p[1] for p in peaks)
    inputs["recent_sustained_peak"] = round(recent_peak, 3)

    signal_reason = demand["reason"]
    up_candidate = math.ceil(sustained - cfg.upscale_tolerance)
    down_candidate = max(math.ceil(ewma + cfg.downscale_headroom),
                         math.ceil(recent_peak - cfg.upscale_tolerance))
    if cfg.allow_scale_to_zero and demand["idle"] and ewma < 0.05:
        down_candidate = 0
    down_candidate = max(down_candidate, lo)

    desired, reason = target, REASON_HYSTERESIS
    if up_candidate > target:
        if now - last_up >= cfg.upscale_cooldown_s:
            desired, reason = up_candidate, signal_reason
        else:
            reason = REASON_UPSCALE_COOLDOWN
    elif down_candidate < target:
        waiting_total = demand["waiting_requests"] + demand["handle_queued_requests"]
        if waiting_total > cfg.target_queue_per_replica * max(down_candidate, 1):
            reason = REASON_QUEUE_GUARD
        elif now - last_event >= cfg.downscale_cooldown_s:
            desired, reason = down_candidate, signal_reason
        else:
            reason = REASON_DOWNSCALE_COOLDOWN

    # Bounds (the schedule floor and min/max) always win, cool-downs notwithstanding.
    if desired > hi:
        desired, reason = hi, REASON_MAX_REPLICAS
    if desired < lo:
        desired, reason = lo, _floor_reason(floor, lo, cfg)
    return _finish(desired, reason, target, inputs, state, prev, now, cfg)


_MIX_TAU_S = 60.0


def _ewma_into(state: Dict[str, Any], key: str, value: float, dt: float, tau: float) -> None:
    prev = _finite(state.get(_k(key)))
    if prev is None:
        state[_k(key)] = value
    else:
        state[_k(key)] = prev + (1.0 - math.exp(-dt / tau)) * (value - prev)


def _update_mix(state: Dict[str, Any], demand: Mapping[str, Any], dt: float) -> None:
    """Long (60 s) averages of the request mix: waiting prompt tokens per waiting
    request, decode load and prefill throughput (for the decode work per request)."""
    if demand["waiting_requests"] >= 1.0:
        replica_tok = demand["waiting_prefill_tokens"] - demand["handle_queued_requests"] * (
            demand["avg_prompt_tokens"] or 0.0)
        _ewma_into(state, "mix_wtok", max(0.0, replica_tok), dt, _MIX_TAU_S)
        _ewma_into(state, "mix_wreq", demand["waiting_requests"], dt, _MIX_TAU_S)
    load, pl = demand["load_replicas"], demand["prefill_load_replicas"]
    if load is not None and pl is not None and demand["prefill_tokens_per_s"] > 0:
        _ewma_into(state, "mix_dload", max(0.0, load - pl), dt, _MIX_TAU_S)
        _ewma_into(state, "mix_ptps", demand["prefill_tokens_per_s"], dt, _MIX_TAU_S)


def _update_backlog_growth(state: Dict[str, Any], backlog: Optional[float], now: float,
                           cfg: KVServeAutoscalingConfig) -> float:
    """Smoothed d(work backlog)/dt in replicas, sampled at most once per second."""
    tau = cfg.backlog_growth_smoothing_s
    if tau <= 0 or backlog is None:
        return 0.0
    slope = _finite(state.get(_k("growth"))) or 0.0
    last_v = _finite(state.get(_k("growth_v")))
    last_t = _finite(state.get(_k("growth_t")))
    if last_v is None or last_t is None or now < last_t:
        state[_k("growth_v")], state[_k("growth_t")] = backlog, now
        return max(0.0, slope)
    span = now - last_t
    if span >= 1.0:
        inst = (backlog - last_v) / span
        slope += (1.0 - math.exp(-span / tau)) * (inst - slope)
        state[_k("growth")] = slope
        state[_k("growth_v")], state[_k("growth_t")] = backlog, now
    return max(0.0, slope)


def _floor_reason(floor: int, lo: int, cfg: KVServeAutoscalingConfig) -> str:
    return REASON_SCHEDULE if floor >= lo and floor > cfg.min_replicas else REASON_MIN_REPLICAS


def _finish(desired: int, reason: str, target: int, inputs: Dict[str, Any], state: Dict[str, Any],
            prev: Mapping[str, Any], now: float, cfg: KVServeAutoscalingConfig) -> Tuple[Decision, Dict[str, Any]]:
    action = "up" if desired > target else ("down" if desired < target else "hold")
    decision = Decision(desired=int(desired), reason=reason, action=action, inputs=inputs)
    _observe(decision, state, prev, now, cfg)
    return decision, state


def _observe(decision: Decision, state: Dict[str, Any], prev: Mapping[str, Any], now: float,
             cfg: KVServeAutoscalingConfig) -> None:
    """One structured log line per decision change (and every ``log_interval_s``), plus gauges."""
    last_log = _finite(prev.get(_k("last_log")))
    changed = (
        prev.get(_k("last_desired")) != decision.desired
        or prev.get(_k("last_reason")) != decision.reason
    )
    if changed or last_log is None or now - last_log >= cfg.log_interval_s:
        if logger.isEnabledFor(logging.INFO):
            logger.info("%s", json.dumps(decision.log_record(), default=str, sort_keys=False))
        state[_k("last_log")] = now
    state[_k("last_desired")] = decision.desired
    state[_k("last_reason")] = decision.reason
    if cfg.export_metrics:
        try:
            from autoscaling import metrics as _metrics

            _metrics.record_decision(decision)
        except Exception:  # metrics are best effort: never break the controller
            pass


def kvserve_policy(ctx: Any, config: Optional[KVServeAutoscalingConfig] = None) -> Tuple[int, Dict[str, Any]]:
    """Serve policy-function signature: ``(ctx) -> (desired_replicas, policy_state)``."""
    decision, state = decide(ctx, config)
    return decision.desired, state


def kvserve_autoscaling_policy(ctx: Any) -> Tuple[int, Dict[str, Any]]:
    """Plain-function form with default knobs (``policy_function=`` this function)."""
    return kvserve_policy(ctx, None)


class KVServeAutoscalingPolicy:
    """Class-callable policy: Serve 2.60 instantiates it once with ``policy_kwargs``
    (the knobs, see :class:`KVServeAutoscalingConfig`) and calls it every tick."""

    def __init__(self, **knobs: Any):
        self.config = KVServeAutoscalingConfig.from_dict(knobs)

    def __call__(self, ctx: Any) -> Tuple[int, Dict[str, Any]]:
        return kvserve_policy(ctx, self.config)

    def decide(self, ctx: Any) -> Tuple[Decision, Dict[str, Any]]:
        return decide(ctx, self.config)


# --------------------------------------------------------------------------------------
# Serve config + CLI helpers
# --------------------------------------------------------------------------------------
def serve_autoscaling_dict(knobs: Union[None, KVServeAutoscalingConfig, Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The ``autoscaling_config`` dict for ``@serve.deployment`` / a Serve YAML file."""
    cfg = KVServeAutoscalingConfig.coerce(knobs)
    initial = cfg.initial_replicas
    floor_now = schedule_floor(cfg, time.time())
    if initial is None and floor_now > cfg.min_replicas:
        initial = min(floor_now, cfg.max_replicas)
    d: Dict[str, Any] = {
        "min_replicas": cfg.min_replicas,
        "max_replicas": cfg.max_replicas,
        "upscale_delay_s": cfg.serve_upscale_delay_s,
        "downscale_delay_s": cfg.serve_downscale_delay_s,
        "look_back_period_s": cfg.serve_look_back_period_s,
        # Deprecated in Serve 2.60 but still the period at which replicas and handles
        # push metrics to the controller (and the record period's upper bound).
        "metrics_interval_s": cfg.serve_metrics_interval_s,
        "aggregation_function": "mean",
        "upscaling_factor": 1.0,
        "downscaling_factor": 1.0,
        "policy": {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": cfg.to_dict()},
    }
    if initial is not None:
        d["initial_replicas"] = initial
    if cfg.allow_scale_to_zero:
        d["downscale_to_zero_delay_s"] = cfg.serve_downscale_to_zero_delay_s
    return d


def build_autoscaling_config(
    knobs: Union[None, KVServeAutoscalingConfig, Mapping[str, Any]] = None, *, as_dict: bool = False
):
    """Build Ray Serve's ``AutoscalingConfig`` for the kvserve policy.

    ``knobs``: a :class:`KVServeAutoscalingConfig`, a dict of its fields, or None for
    defaults. ``as_dict=True`` returns the plain dict (for YAML / ``serve.deployment``)
    and does not import Ray.
    """
    d = serve_autoscaling_dict(knobs)
    if as_dict:
        return d
    import warnings

    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    d = dict(d)
    policy = d.pop("policy")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*metrics_interval_s.*", category=DeprecationWarning)
        return AutoscalingConfig(policy=AutoscalingPolicy(**policy), **d)


_CLI_FLAGS: Tuple[Tuple[str, str, Any], ...] = (
    # (field, flag, type)
    ("policy_mode", "--autoscaling-policy", str),
    ("min_replicas", "--min-replicas", int),
    ("max_replicas", "--max-replicas", int),
    ("initial_replicas", "--initial-replicas", int),
    ("target_queue_per_replica", "--target-queue-per-replica", float),
    ("target_prefill_backlog_s", "--target-prefill-backlog-s", float),
    ("target_utilization", "--target-utilization", float),
    ("kv_cache_target", "--kv-cache-target", float),
    ("upscale_smoothing_s", "--upscale-smoothing-s", float),
    ("downscale_smoothing_s", "--downscale-smoothing-s", float),
    ("upscale_cooldown_s", "--upscale-cooldown-s", float),
    ("downscale_cooldown_s", "--downscale-cooldown-s", float),
    ("schedule", "--autoscaling-schedule", str),
    ("schedule_timezone", "--autoscaling-timezone", str),
    ("schedule_prewarm_s", "--autoscaling-prewarm-s", float),
)


def add_autoscaling_args(parser: Any) -> Any:
    """Add the autoscaling knobs as ``kvserve serve`` flags to an argparse parser.

    Unset flags stay ``None`` so :func:`config_from_args` can layer them over a
    deployment config's values."""
    group = parser.add_argument_group("autoscaling")
    defaults = KVServeAutoscalingConfig()
    for name, flag, typ in _CLI_FLAGS:
        default = getattr(defaults, name)
        if name == "schedule":
            help_ = "min replicas by local hour, e.g. '8-20:4,20-23:2' (time-based/hybrid modes)"
        else:
            help_ = f"default: {default}"
        kwargs: Dict[str, Any] = {"type": typ, "default": None, "dest": f"autoscaling_{name}", "help": help_}
        if name == "policy_mode":
            kwargs["choices"] = POLICY_MODES
        group.add_argument(flag, **kwargs)
    group.add_argument("--allow-scale-to-zero", action="store_true", default=None,
                       dest="autoscaling_allow_scale_to_zero", help="permit min_replicas=0")
    return parser


def config_from_args(args: Any, base: Union[None, KVServeAutoscalingConfig, Mapping[str, Any]] = None) -> KVServeAutoscalingConfig:
    """Knobs from parsed ``add_autoscaling_args`` flags layered over ``base``."""
    data = KVServeAutoscalingConfig.coerce(base).to_dict()
    for name, _flag, _typ in _CLI_FLAGS + (("allow_scale_to_zero", "", bool),):
        v = getattr(args, f"autoscaling_{name}", None)
        if v is not None:
            data[name] = v
    return KVServeAutoscalingConfig.from_dict(data)


__all__ = [
    "METRIC_NAMES", "NUM_WAITING_REQUESTS", "NUM_WAITING_PREFILL_TOKENS", "NUM_RUNNING_REQUESTS",
    "GENERATION_TOKENS_PER_S", "PREFILL_TOKENS_PER_S", "DECODE_CAPACITY_TOKENS_PER_S",
    "PREFILL_CAPACITY_TOKENS_PER_S", "KV_CACHE_USAGE", "POLICY_IMPORT_PATH", "POLICY_MODES", "REASONS",
    "ScheduleEntry", "parse_schedule", "KVServeAutoscalingConfig", "Decision", "compute_demand",
    "decide", "kvserve_policy", "kvserve_autoscaling_policy", "KVServeAutoscalingPolicy",
    "read_replica_metrics", "schedule_floor", "serve_autoscaling_dict", "build_autoscaling_config",
    "add_autoscaling_args", "config_from_args",
]
