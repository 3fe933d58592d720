"""Optional export of kvserve autoscaling decisions as metrics.

Best effort and lazy: nothing is imported until the first decision is recorded.

* ``kvserve_autoscaling_desired_replicas{deployment, application, reason}``: the
  replicas the policy asked for. The series of the current reason carries the value;
  series of reasons seen earlier for the same deployment are set to 0, so
  ``max by (deployment) (...)`` (or ``sum``) is the desired count and the non-zero
  series names the reason.
* ``kvserve_autoscaling_raw_desired_replicas{deployment, application}``: the
  unsmoothed demand (replicas, float) behind the decision.
* ``kvserve_autoscaling_scale_decisions_total{deployment, application, direction, reason}``:
  counts evaluations whose decision differs from the current target (up / down).

Backend: inside a Ray worker (the Serve controller runs the policy) the metrics go
through ``kvserve.telemetry.metrics``: ``ray.util.metrics``, which Ray's metrics agent exports to
Prometheus (with Ray's ``ray_`` prefix), and the node's prometheus-client multiprocess files
behind the ingress's ``/metrics`` (as ``kvserve:autoscaling_*``). Elsewhere (tests, the simulator, a process that serves its own
``/metrics``) they go to ``prometheus_client``'s default registry. If neither is
available the calls are no-ops.
"""

from __future__ import annotations

import threading
from typing import Any, Dict, Optional, Tuple

DESIRED_REPLICAS = "kvserve_autoscaling_desired_replicas"
RAW_DESIRED_REPLICAS = "kvserve_autoscaling_raw_desired_replicas"
SCALE_DECISIONS = "kvserve_autoscaling_scale_decisions_total"

_lock = threading.Lock()
_backend: Optional["_Backend"] = None
# (deployment, application) -> (reason, desired, action) last exported
_last: Dict[Tuple[str, str], Tuple[str, int, str]] = {}


class _Backend:
    def set_desired(self, labels: Dict[str, str], value: float) -> None: ...

    def set_raw(self, labels: Dict[str, str], value: float) -> None: ...

    def inc_decision(self, labels: Dict[str, str]) -> None: ...


class _NoopBackend(_Backend):
    pass


class _RayBackend(_Backend):
    """Inside a Ray worker (the Serve controller): through ``kvserve.telemetry.metrics``, i.e. both
    Ray's metrics export (``ray_kvserve_autoscaling_*``) and the node's prometheus-client
    multiprocess files that the ingress's ``/metrics`` renders (``kvserve:autoscaling_*``)."""

    def __init__(self):
        from kvserve.telemetry.metrics import metric

        self._desired = metric(
            "gauge",
            DESIRED_REPLICAS.removeprefix("kvserve_"),
            "Replicas the kvserve autoscaling policy asked for, by reason.",
            ("deployment", "application", "reason"),
        )
        self._raw = metric(
            "gauge",
            RAW_DESIRED_REPLICAS.removeprefix("kvserve_"),
            "Unsmoothed replica demand computed by the kvserve policy.",
            ("deployment", "application"),
        )
        self._decisions = metric(
            "counter",
            SCALE_DECISIONS.removeprefix("kvserve_").removesuffix("_total"),
            "kvserve autoscaling evaluations asking for a different target.",
            ("deployment", "application", "direction", "reason"),
        )

    def set_desired(self, labels, value):
        self._desired.set(labels, value)

    def set_raw(self, labels, value):
        self._raw.set(labels, value)

    def inc_decision(self, labels):
        self._decisions.inc(labels)


class _PromBackend(_Backend):
    def __init__(self):
        import prometheus_client as pc

        self._desired = pc.Gauge(
            DESIRED_REPLICAS,
            "Replicas the kvserve autoscaling policy asked for, by reason.",
            ("deployment", "application", "reason"),
        )
        self._raw = pc.Gauge(
            RAW_DESIRED_REPLICAS,
            "Unsmoothed replica demand computed by the kvserve policy.",
            ("deployment", "application"),
        )
        self._decisions = pc.Counter(
            SCALE_DECISIONS.removesuffix("_total"),
            "kvserve autoscaling evaluations asking for a different target.",
            ("deployment", "application", "direction", "reason"),
        )

    def set_desired(self, labels, value):
        self._desired.labels(**labels).set(value)

    def set_raw(self, labels, value):
        self._raw.labels(**labels).set(value)

    def inc_decision(self, labels):
        self._decisions.labels(**labels).inc()


def _in_ray_worker() -> bool:
    import sys

    if "ray" not in sys.modules:  # never import Ray just to find out
        return False
    try:
        import ray

        return ray.is_initialized()
    except Exception:
        return False


def get_backend() -> _Backend:
    global _backend
    if _backend is not None:
        return _backend
    with _lock:
        if _backend is None:
            backend: _Backend = _NoopBackend()
            candidates = (_RayBackend, _PromBackend) if _in_ray_worker() else (_PromBackend,)
            for cls in candidates:
                try:
                    backend = cls()
                    break
                except Exception:
                    continue
            _backend = backend
    return _backend


def set_backend(backend: Optional[_Backend]) -> None:
    """Override the backend (tests); ``None`` re-detects on next use."""
    global _backend
    with _lock:
        _backend = backend
        _last.clear()


def record_decision(decision: Any) -> None:
    """Export one :class:`kvserve.autoscaling.policy.Decision`."""
    backend = get_backend()
    if isinstance(backend, _NoopBackend):
        return
    inputs = getattr(decision, "inputs", {}) or {}
    dep = str(inputs.get("deployment") or "")
    app = str(inputs.get("application") or "")
    reason = str(decision.reason)
    key = (dep, app)
    desired = int(decision.desired)
    action = str(decision.action)
    with _lock:
        prev = _last.get(key)
        _last[key] = (reason, desired, action)
    if prev is not None and prev[0] != reason:
        backend.set_desired({"deployment": dep, "application": app, "reason": prev[0]}, 0.0)
    backend.set_desired({"deployment": dep, "application": app, "reason": reason}, float(desired))
    raw = inputs.get("raw_desired")
    if isinstance(raw, (int, float)):
        backend.set_raw({"deployment": dep, "application": app}, float(raw))
    # Count a scale decision once, not on every tick Serve's delay makes us repeat it.
    if action in ("up", "down") and (prev is None or prev[1:] != (desired, action)):
        backend.inc_decision({"deployment": dep, "application": app, "direction": action, "reason": reason})
