"""Settings of the kvserve autoscaling policy: every knob, its unit and default, and validation.

:class:`KVServeAutoscalingConfig` is frozen and JSON-serialisable (``to_dict`` /
``from_dict``): Serve passes it to the policy class as ``policy_kwargs``. Where the values
come from (a Serve config's ``autoscaling:`` section, ``kvserve serve`` flags) is
``kvserve/autoscaling/serve_config.py``'s business.

Pure: standard library only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from kvserve.autoscaling.schedule import ScheduleEntry, parse_schedule
from kvserve.autoscaling.signals import SIGNAL_SOURCES

#: ``metrics``: queue + token throughput; ``time-based``: the schedule only;
#: ``hybrid``: metrics, with the schedule as a floor.
POLICY_MODES = ("metrics", "time-based", "hybrid")


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
    Inputs
      * ``signal_source``: ``"latest"`` (newest raw sample per replica; the policy smooths
        itself) or ``"aggregated"`` (Serve's mean over ``serve_look_back_period_s``).
    Observability
      * ``log_interval_s``: a decision line is logged whenever the decision or reason
        changes, and at least this often otherwise.
      * ``export_metrics``: set the ``kvserve_autoscaling_*`` gauges.

    Times are in seconds, targets per replica. Construction raises ValueError on a value
    out of range or an inconsistent combination (see ``__post_init__``).
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
        if self.initial_replicas is not None and not (self.min_replicas <= self.initial_replicas <= self.max_replicas):
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
        """Knobs from a dict (plus ``overrides``); raises ValueError on an unknown knob."""
        data = dict(d or {})
        data.update(overrides)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown autoscaling knobs: {unknown}")
        return cls(**data)

    @classmethod
    def coerce(cls, knobs: Union[None, "KVServeAutoscalingConfig", Mapping[str, Any]]) -> "KVServeAutoscalingConfig":
        """None -> defaults, a config as is, a dict through :meth:`from_dict`."""
        if knobs is None:
            return cls()
        if isinstance(knobs, cls):
            return knobs
        return cls.from_dict(knobs)

    def replace(self, **changes) -> "KVServeAutoscalingConfig":
        return dataclasses.replace(self, **changes)
