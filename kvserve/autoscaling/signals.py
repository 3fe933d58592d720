"""What the policy reads: replica metrics and its own memory, from Serve's ``AutoscalingContext``.

The contract with the replicas: ``LLMServer.record_autoscaling_stats()`` returns one float per
name below. Serve 2.60 hands them to the policy as

* ``ctx.raw_metrics[name][replica_id]``: the pushed samples, a time-ordered list of
  ``TimeStampedValue(timestamp, value)`` (the policy reads the newest one by default), and
* ``ctx.aggregated_metrics[name][replica_id]``: their mean over ``look_back_period_s``.

Serve evaluates some context attributes lazily, inside its controller, and they can raise;
:func:`ctx_attr` turns that into a default so a hiccup never breaks the control loop. The
policy's own memory (EWMAs, timestamps, last capacities) lives in ``ctx.policy_state`` under
``kvserve.*`` keys (:func:`state_key`); Serve keeps its own keys in the same dict.

Pure: standard library only.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

#: Requests queued in the engine whose prefill has not started (not yet scheduled).
NUM_WAITING_REQUESTS = "num_waiting_requests"
#: Prompt tokens not computed yet: waiting requests plus running ones still in (chunked) prefill.
NUM_WAITING_PREFILL_TOKENS = "num_waiting_prefill_tokens"
#: Requests scheduled in the engine (prefill started or decoding).
NUM_RUNNING_REQUESTS = "num_running_requests"
#: Output tokens generated per second (tokens/s) over the replica's recent steps.
GENERATION_TOKENS_PER_S = "generation_tokens_per_s"
#: Prompt tokens prefilled per second (tokens/s) over the replica's recent steps.
PREFILL_TOKENS_PER_S = "prefill_tokens_per_s"
#: Decode tokens/s this replica can sustain at a full batch, measured from its own steps.
DECODE_CAPACITY_TOKENS_PER_S = "decode_capacity_tokens_per_s"
#: Prefill tokens/s this replica can sustain, measured from its own steps.
PREFILL_CAPACITY_TOKENS_PER_S = "prefill_capacity_tokens_per_s"
#: Fraction of KV cache blocks in use, 0..1.
KV_CACHE_USAGE = "kv_cache_usage"
#: Requests turned away as full (the bounded queue's 429s, the gateway's shedding) over the
#: replica's rate window: demand the queue never held, so with no prompt tokens counted.
NUM_REFUSED_REQUESTS = "num_refused_requests"
#: Mean prompt (tokens) of the requests that got their first token over the replica's recent
#: steps (0: none yet): what a request whose prompt is unknown is priced at.
SERVED_PROMPT_TOKENS = "served_prompt_tokens"

METRIC_NAMES: Tuple[str, ...] = (
    NUM_WAITING_REQUESTS,
    NUM_WAITING_PREFILL_TOKENS,
    NUM_RUNNING_REQUESTS,
    GENERATION_TOKENS_PER_S,
    PREFILL_TOKENS_PER_S,
    DECODE_CAPACITY_TOKENS_PER_S,
    PREFILL_CAPACITY_TOKENS_PER_S,
    KV_CACHE_USAGE,
    NUM_REFUSED_REQUESTS,
    SERVED_PROMPT_TOKENS,
)

#: ``"latest"``: newest raw sample per metric and replica (window mean where missing);
#: ``"aggregated"``: Serve's window mean only.
SIGNAL_SOURCES = ("latest", "aggregated")

STATE_PREFIX = "kvserve."


def state_key(name: str) -> str:
    """The ``policy_state`` key of one piece of the policy's memory."""
    return STATE_PREFIX + name


def ctx_attr(ctx: Any, name: str, default: Any = None) -> Any:
    """``ctx.<name>``, or ``default`` when it is missing, None, or raises (lazy Serve callables)."""
    try:
        v = getattr(ctx, name)
    except Exception:  # lazy metric callables can raise inside the controller
        return default
    return default if v is None else v


def finite(v: Any) -> Optional[float]:
    """``float(v)`` if that is a finite number, else None."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def latest_sample(series: Any) -> Optional[float]:
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
        return finite(v)
    return finite(series)


def read_replica_metrics(ctx: Any, source: str = "latest") -> Dict[Any, Dict[str, float]]:
    """Return ``{replica_id: {metric: value}}`` for the replicas Serve considers running.

    ``source="latest"`` prefers the newest raw sample (``ctx.raw_metrics``) and falls
    back to the window mean (``ctx.aggregated_metrics``) per metric and replica.
    Metrics of replicas not in ``ctx.running_replicas`` are ignored (stopping
    replicas); running replicas without any report yet map to ``{}``. Non-finite
    values are dropped.
    """
    table: Dict[Any, Dict[str, float]] = {}

    def fill(source_map: Any, reader: Callable[[Any], Optional[float]]) -> None:
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
        fill(ctx_attr(ctx, "raw_metrics", {}), latest_sample)
    complete = bool(table) and all(len(row) == len(METRIC_NAMES) for row in table.values())
    if not complete:  # window means (Serve's aggregated_metrics) for whatever is missing
        fill(ctx_attr(ctx, "aggregated_metrics", {}), finite)
    running = list(ctx_attr(ctx, "running_replicas", []) or [])
    if running:
        return {rid: table.get(rid, {}) for rid in running}
    return table
