"""kvserve's custom Ray Serve autoscaling policy: queue depth + token throughput.

This module is what Serve loads (``POLICY_IMPORT_PATH = "kvserve.autoscaling.policy:KVServeAutoscalingPolicy"``)
and the package's public face; the policy itself is split by concern:

==========================  ==================================================================
``settings.py``             every knob (units, defaults, validation): ``KVServeAutoscalingConfig``
``schedule.py``             time-of-day floor: ``ScheduleEntry``, ``parse_schedule``, ``schedule_floor``
``signals.py``              metric names and reading them from Serve's ``AutoscalingContext``
``demand.py``               per-signal replica demand (throughput, queue, prefill backlog, KV cache)
``decision.py``             smoothing, hysteresis, cool-downs, bounds: ``decide``, ``Decision``
``serve_config.py``         ``build_autoscaling_config`` (Serve's ``AutoscalingConfig``), CLI flags
``metrics.py``              export of decisions as Prometheus metrics (best effort)
==========================  ==================================================================

The trace-driven simulator against Serve's request-based policy is a benchmark tool:
``benchmarks/autoscaling_sim.py``.

How it plugs into Ray Serve 2.60
--------------------------------
``AutoscalingConfig(policy=AutoscalingPolicy(policy_function=KVServeAutoscalingPolicy,
policy_kwargs=<knobs>))``. Serve's controller sees that ``policy_function`` is a class,
instantiates it once with ``policy_kwargs`` (JSON serialisable) and then calls
``instance(ctx)`` on every control-loop tick (``RAY_SERVE_CONTROL_LOOP_INTERVAL_S``, 0.1 s by
default). The call returns ``(desired_replicas, policy_state)``; Serve stores
``policy_state`` and hands a copy back as ``ctx.policy_state`` on the next tick (it is reset
to ``{}`` when the deployment is redeployed or its config changes). All of this policy's
memory lives in that dict under ``kvserve.*`` keys. Serve still wraps the returned number
(factors, delays, min/max; see ``serve_config.py``).

Pure code: the standard library only at import time (Ray only inside
``build_autoscaling_config``), so the policy is unit tested and simulated without Ray.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from kvserve.autoscaling.decision import REASONS, Decision, decide, logger
from kvserve.autoscaling.demand import compute_demand
from kvserve.autoscaling.schedule import ScheduleEntry, parse_schedule, schedule_floor
from kvserve.autoscaling.serve_config import (
    POLICY_IMPORT_PATH,
    add_autoscaling_args,
    build_autoscaling_config,
    config_from_args,
    serve_autoscaling_dict,
)
from kvserve.autoscaling.settings import POLICY_MODES, KVServeAutoscalingConfig
from kvserve.autoscaling.signals import (
    DECODE_CAPACITY_TOKENS_PER_S,
    GENERATION_TOKENS_PER_S,
    KV_CACHE_USAGE,
    METRIC_NAMES,
    NUM_REFUSED_REQUESTS,
    NUM_RUNNING_REQUESTS,
    NUM_WAITING_PREFILL_TOKENS,
    NUM_WAITING_REQUESTS,
    PREFILL_CAPACITY_TOKENS_PER_S,
    PREFILL_TOKENS_PER_S,
    SERVED_PROMPT_TOKENS,
    read_replica_metrics,
)


def kvserve_policy(ctx: Any, config: Optional[KVServeAutoscalingConfig] = None) -> Tuple[int, Dict[str, Any]]:
    """Serve policy-function signature: ``(ctx) -> (desired_replicas, policy_state)``."""
    decision, state = decide(ctx, config)
    return decision.desired, state


def kvserve_autoscaling_policy(ctx: Any) -> Tuple[int, Dict[str, Any]]:
    """Plain-function form with default knobs (``policy_function=`` this function)."""
    return kvserve_policy(ctx, None)


class KVServeAutoscalingPolicy:
    """Class-callable policy: Serve 2.60 instantiates it once with ``policy_kwargs``
    (the knobs, see :class:`KVServeAutoscalingConfig`; ValueError on a bad one) and
    calls it every tick."""

    def __init__(self, **knobs: Any):
        self.config = KVServeAutoscalingConfig.from_dict(knobs)

    def __call__(self, ctx: Any) -> Tuple[int, Dict[str, Any]]:
        return kvserve_policy(ctx, self.config)

    def decide(self, ctx: Any) -> Tuple[Decision, Dict[str, Any]]:
        return decide(ctx, self.config)


__all__ = [
    "METRIC_NAMES",
    "NUM_WAITING_REQUESTS",
    "NUM_WAITING_PREFILL_TOKENS",
    "NUM_RUNNING_REQUESTS",
    "GENERATION_TOKENS_PER_S",
    "PREFILL_TOKENS_PER_S",
    "DECODE_CAPACITY_TOKENS_PER_S",
    "PREFILL_CAPACITY_TOKENS_PER_S",
    "KV_CACHE_USAGE",
    "NUM_REFUSED_REQUESTS",
    "SERVED_PROMPT_TOKENS",
    "POLICY_IMPORT_PATH",
    "POLICY_MODES",
    "REASONS",
    "ScheduleEntry",
    "parse_schedule",
    "KVServeAutoscalingConfig",
    "Decision",
    "compute_demand",
    "decide",
    "kvserve_policy",
    "kvserve_autoscaling_policy",
    "KVServeAutoscalingPolicy",
    "read_replica_metrics",
    "schedule_floor",
    "serve_autoscaling_dict",
    "build_autoscaling_config",
    "add_autoscaling_args",
    "config_from_args",
    "logger",
]
