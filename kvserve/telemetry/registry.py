"""The process's metrics in both exports: one :class:`Metric` per name, and ``GET /metrics``'s render.

Every metric is recorded twice, once per way a Prometheus reaches it:

1. **prometheus-client, multiprocess mode** (names ``kvserve:<name>``, exactly vLLM's
   ``vllm:<name>`` series with the prefix swapped, so vLLM dashboards map over). Every kvserve
   process of a node (the ingress, each ``LLMServer`` replica, the Serve controller running
   the autoscaling policy) writes its samples to one directory of the node's Ray session
   (``<session dir>/kvserve_metrics``; ``$KVSERVE_METRICS_DIR`` overrides it), and the
   ingress's ``GET /metrics`` renders them all (:func:`render`). One scrape target for a
   single box; on a cluster it sees only the processes of the ingress's own node.
2. **Ray's metrics export** (``ray.util.metrics``; Ray names them ``ray_kvserve_<name>``,
   since Ray no longer allows ``:`` in names): each node's Ray metrics agent serves the
   samples of every process of its node, which is how Ray clusters are scraped (KubeRay's
   PodMonitor / ServiceMonitor, ``ray metrics launch-prometheus``). The cluster path.
"""

from __future__ import annotations

import glob
import logging
import os
import re
import threading

logger = logging.getLogger("ray.serve")

PREFIX = "kvserve:"
RAY_PREFIX = "kvserve_"  # Ray's export adds "ray_": ray_kvserve_<name>

_lock = threading.Lock()
_metrics: dict[str, "Metric"] = {}
_dir: str | None = None


def metrics_dir() -> str | None:
    """This node's directory of prometheus-client multiprocess files: ``$KVSERVE_METRICS_DIR``,
    else ``kvserve_metrics`` in the Ray session's directory (per node, per Ray session, so a
    new Ray starts from zero). None outside Ray without the variable (no sharing then)."""
    d = os.environ.get("KVSERVE_METRICS_DIR")
    if d:
        return d
    try:
        import ray

        if not ray.is_initialized():
            return None
        from ray._private.worker import global_worker  # the session dir has no public accessor

        return os.path.join(global_worker.node.get_session_dir_path(), "kvserve_metrics")
    except Exception:
        return None


def _setup() -> None:
    """Switch this process's prometheus-client to multiprocess mode on :func:`metrics_dir`
    (once, before any kvserve metric exists)."""
    global _dir
    if _dir is not None:
        return
    d = metrics_dir()
    if d:
        os.makedirs(d, mode=0o700, exist_ok=True)
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = d
        from prometheus_client import values

        values.ValueClass = values.get_value_class()  # prometheus-client picks it at import time
    _dir = d or ""


def _in_ray_worker() -> bool:
    import sys

    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized()


#: Labels a caller may leave out (recorded as ""): ``variant``, the A/B test variant of the
#: request or replica (``kvserve/deployments/contract/experiments.py``), empty outside an experiment (and
#: PromQL treats an empty label as an absent one, so queries without it see every series).
OPTIONAL_LABELS = ("variant",)


class Metric:
    """One metric in both exports. ``kind``: ``counter``, ``gauge`` or ``histogram``; ``name``
    without prefix (counters without ``_total``); ``labels``: label names (those of
    :data:`OPTIONAL_LABELS` may be left out of a sample's labels)."""

    def __init__(
        self, kind: str, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None
    ):
        import prometheus_client as pc

        self.kind, self.name, self.labels = kind, name, labels
        self._optional = tuple(k for k in labels if k in OPTIONAL_LABELS)
        full = PREFIX + name
        if kind == "counter":
            self.prom = pc.Counter(full, doc, labels, registry=None)
        elif kind == "gauge":
            # one process per label set (replica), so summing the live processes is the value;
            # a dead replica's gauges leave with it (render() marks dead processes)
            self.prom = pc.Gauge(full, doc, labels, registry=None, multiprocess_mode="livesum")
        elif kind == "histogram":
            self.prom = pc.Histogram(full, doc, labels, registry=None, buckets=buckets)
        else:
            raise ValueError(f"unknown metric kind {kind!r}")
        self.ray = None
        if _in_ray_worker():
            try:
                from ray.util import metrics as rm

                rname = RAY_PREFIX + name
                if kind == "counter":
                    self.ray = rm.Counter(rname, doc, tag_keys=labels)
                elif kind == "gauge":
                    self.ray = rm.Gauge(rname, doc, tag_keys=labels)
                else:
                    self.ray = rm.Histogram(rname, doc, boundaries=list(buckets), tag_keys=labels)
            except Exception as e:  # Ray's export is best effort; /metrics still has it
                logger.warning("metric %s not exported through Ray: %s", name, e)

    def _full(self, labels: dict[str, str]) -> dict[str, str]:
        for k in self._optional:
            if k not in labels:
                return {**labels, **{o: "" for o in self._optional if o not in labels}}
        return labels

    def inc(self, labels: dict[str, str], value: float = 1.0) -> None:
        if value <= 0:
            return
        labels = self._full(labels)
        self.prom.labels(**labels).inc(value)
        if self.ray is not None:
            self.ray.inc(value, tags=labels)

    def set(self, labels: dict[str, str], value: float) -> None:
        labels = self._full(labels)
        self.prom.labels(**labels).set(value)
        if self.ray is not None:
            self.ray.set(value, tags=labels)

    def observe(self, labels: dict[str, str], value: float) -> None:
        labels = self._full(labels)
        self.prom.labels(**labels).observe(value)
        if self.ray is not None:
            self.ray.observe(value, tags=labels)


def metric(kind: str, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None) -> Metric:
    """The process's one :class:`Metric` of this name (created on first use)."""
    with _lock:
        m = _metrics.get(name)
        if m is None:
            _setup()
            m = _metrics[name] = Metric(kind, name, doc, labels, buckets)
        return m


_PID_RE = re.compile(r"_(\d+)\.db$")


class CoalescedRender:
    """``GET /metrics``'s renders, coalesced: at most one :func:`render` runs at a time, and every
    caller gets one that started after it called (never an older answer), shared with all who
    called while the previous one ran. Reading every process's files is the scrape's cost; a
    flood of calls on the open path costs one render after another on one thread, never one
    per call at once (and a scrape every 15 s renders once, as before).

    Args:
        fn: what renders (default :func:`render`), called without arguments.
    """

    def __init__(self, fn=None):
        self._fn = fn
        self._cond = threading.Condition()
        self._started = 0  # renders begun
        self._done = 0  # renders finished (their answers in _answer, or _error)
        self._running = False
        self._answer = None
        self._error: BaseException | None = None
        self.renders = 0  # renders made (for tests and logs)

    def __call__(self) -> tuple[bytes, str]:
        """The body and content type (blocking: call it in a worker thread).

        Raises:
            RuntimeError: as :func:`render`.
        """
        with self._cond:
            need = self._started + 1  # the next render to begin: it begins after this call
            while self._done < need:
                if not self._running:
                    self._running = True
                    self._started += 1
                    self._cond.release()
                    try:
                        answer, error = (self._fn or render)(), None
                    except BaseException as e:  # handed to every waiter of this render
                        answer, error = None, e
                    finally:
                        self._cond.acquire()
                    self.renders += 1
                    self._answer, self._error = answer, error
                    self._done += 1
                    self._running = False
                    self._cond.notify_all()
                else:
                    self._cond.wait()
            if self._error is not None:
                raise self._error
            return self._answer


#: The process's coalesced renders of ``GET /metrics`` (:class:`CoalescedRender`).
cached_render = CoalescedRender()


def render() -> tuple[bytes, str]:
    """``(body, content type)`` of ``GET /metrics``: every kvserve process of this node (the
    multiprocess directory), gauges of processes that are gone left out.

    Raises:
        RuntimeError: multiprocess mode is off (no Ray session and no ``$KVSERVE_METRICS_DIR``).
    """
    from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest, multiprocess

    with _lock:
        _setup()
    if not _dir:
        raise RuntimeError("kvserve metrics need a Ray session or $KVSERVE_METRICS_DIR")
    for path in glob.glob(os.path.join(_dir, "gauge_live*_*.db")):
        m = _PID_RE.search(path)
        if m and not _alive(int(m.group(1))):
            multiprocess.mark_process_dead(int(m.group(1)), _dir)
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=_dir)
    return generate_latest(registry), CONTENT_TYPE_LATEST


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
