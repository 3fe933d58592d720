"""kvserve's Prometheus metrics: vLLM V1's names and semantics under a ``kvserve:`` prefix.

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

Labels: ``model_name`` (vLLM's label: the served model name) and ``replica`` (the Serve
replica id) on engine metrics; ``model_name`` and what the metric needs on the gateway's.
Histograms use vLLM V1's buckets.
"""
from __future__ import annotations

import glob
import logging
import os
import re
import threading
import time

logger = logging.getLogger("ray.serve")

PREFIX = "kvserve:"
RAY_PREFIX = "kvserve_"  # Ray's export adds "ray_": ray_kvserve_<name>

# vLLM V1's histogram buckets (vllm/v1/metrics/loggers.py), seconds or tokens.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
               40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

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


class Metric:
    """One metric in both exports. ``kind``: ``counter``, ``gauge`` or ``histogram``; ``name``
    without prefix (counters without ``_total``); ``labels``: label names."""

    def __init__(self, kind: str, name: str, doc: str, labels: tuple[str, ...],
                 buckets: tuple[float, ...] | None = None):
        import prometheus_client as pc

        self.kind, self.name, self.labels = kind, name, labels
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

    def inc(self, labels: dict[str, str], value: float = 1.0) -> None:
        if value <= 0:
            return
        self.prom.labels(**labels).inc(value)
        if self.ray is not None:
            self.ray.inc(value, tags=labels)

    def set(self, labels: dict[str, str], value: float) -> None:
        self.prom.labels(**labels).set(value)
        if self.ray is not None:
            self.ray.set(value, tags=labels)

    def observe(self, labels: dict[str, str], value: float) -> None:
        self.prom.labels(**labels).observe(value)
        if self.ray is not None:
            self.ray.observe(value, tags=labels)


def metric(kind: str, name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...] | None = None
           ) -> Metric:
    """The process's one :class:`Metric` of this name (created on first use)."""
    with _lock:
        m = _metrics.get(name)
        if m is None:
            _setup()
            m = _metrics[name] = Metric(kind, name, doc, labels, buckets)
        return m


ENGINE_LABELS = ("model_name", "replica")


def _node_of_this_process() -> tuple[str, str]:
    """``(Ray node id, node IP)`` of this process; ``("", "")`` outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # metrics never fail a replica
        pass
    return "", ""


class EngineMetrics:
    """The vLLM-named engine metrics of one ``LLMServer`` replica; :meth:`record_step` and
    :meth:`record_finished` are the engine's stat loggers (``AsyncLLMEngine.add_stat_logger``),
    called in its step thread (and, for aborts, its event loop)."""

    def __init__(self, model_name: str, replica: str, speculative: bool = False, lora: int | None = None):
        self.labels = {"model_name": model_name, "replica": replica}
        L, E = ENGINE_LABELS, ENGINE_LABELS
        self.running = metric("gauge", "num_requests_running", "Number of requests in model execution batches.", L)
        self.waiting = metric("gauge", "num_requests_waiting", "Number of requests waiting to be processed.", L)
        self.kv_usage = metric("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", L)
        self.pc_queries = metric("counter", "prefix_cache_queries",
                                 "Prefix cache queries, in terms of number of queried tokens.", L)
        self.pc_hits = metric("counter", "prefix_cache_hits",
                              "Prefix cache hits, in terms of number of cached tokens.", L)
        self.preemptions = metric("counter", "num_preemptions", "Cumulative number of preemption from the engine.", L)
        self.prompt_tokens = metric("counter", "prompt_tokens", "Number of prefill tokens processed.", L)
        self.generation_tokens = metric("counter", "generation_tokens", "Number of generation tokens processed.", L)
        self.success = metric("counter", "request_success", "Count of finished requests, by finish reason.",
                              E + ("finished_reason",))
        self.ttft = metric("histogram", "time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                           L, TTFT_BUCKETS)
        self.itl = metric("histogram", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                          L, ITL_BUCKETS)
        self.e2e = metric("histogram", "e2e_request_latency_seconds",
                          "Histogram of e2e request latency in seconds.", L, REQUEST_LATENCY_BUCKETS)
        self.queue = metric("histogram", "request_queue_time_seconds",
                            "Histogram of time spent in WAITING phase for request.", L, REQUEST_LATENCY_BUCKETS)
        self.prefill = metric("histogram", "request_prefill_time_seconds",
                              "Histogram of time spent in PREFILL phase for request.", L, REQUEST_LATENCY_BUCKETS)
        self.decode = metric("histogram", "request_decode_time_seconds",
                             "Histogram of time spent in DECODE phase for request.", L, REQUEST_LATENCY_BUCKETS)
        self.req_prompt = metric("histogram", "request_prompt_tokens", "Number of prefill tokens processed.", L,
                                 TOKEN_BUCKETS)
        self.req_generation = metric("histogram", "request_generation_tokens",
                                     "Number of generation tokens processed.", L, TOKEN_BUCKETS)
        for g in (self.running, self.waiting, self.kv_usage):
            g.set(self.labels, 0.0)
        # which node serves this replica (value 1): on a multi-node cluster, where each model runs
        node_id, node_ip = _node_of_this_process()
        metric("gauge", "replica_info", "The node of each model replica (value 1).",
               L + ("node_id", "node_ip")).set({**self.labels, "node_id": node_id, "node_ip": node_ip}, 1.0)
        self.lora_info = None
        if lora is not None:  # vLLM's lora_requests_info: the adapters in use, as labels; the value is when
            self.lora_info = metric("gauge", "lora_requests_info", "Running stats on lora requests.",
                                    L + ("max_lora", "running_lora_adapters", "waiting_lora_adapters"))
            self._lora_labels: dict | None = None
            self._lora_at, self.max_lora = 0.0, str(lora)
        self.spec = None
        if speculative:  # vLLM's spec_decode_* series (only where speculation is configured, as vLLM)
            self.spec = (
                metric("counter", "spec_decode_num_drafts", "Number of spec decoding drafts.", L),
                metric("counter", "spec_decode_num_draft_tokens", "Number of draft tokens.", L),
                metric("counter", "spec_decode_num_accepted_tokens", "Number of accepted tokens.", L),
                metric("counter", "spec_decode_num_accepted_tokens_per_pos",
                       "Accepted tokens per draft position.", L + ("position",)))

    def record_step(self, m) -> None:
        """One engine step (an ``engine.stats.StepMetrics``)."""
        lb = self.labels
        self.running.set(lb, m.num_running)
        self.waiting.set(lb, m.num_waiting)
        self.kv_usage.set(lb, m.kv_cache_usage)
        self.pc_queries.inc(lb, m.prefix_cache_queries)
        self.pc_hits.inc(lb, m.prefix_cache_hits)
        self.preemptions.inc(lb, m.num_preemptions)
        self.prompt_tokens.inc(lb, m.num_prompt_tokens)
        self.generation_tokens.inc(lb, m.num_sampled)
        for t in m.time_to_first_tokens:
            self.ttft.observe(lb, t)
        for t in m.inter_token_latencies:
            self.itl.observe(lb, t)
        if self.lora_info is not None and m.running_lora_adapters is not None:
            self._record_lora(m.running_lora_adapters, m.waiting_lora_adapters)
        if self.spec is not None and m.num_drafts:
            drafts, draft_tokens, accepted, per_pos = self.spec
            drafts.inc(lb, m.num_drafts)
            draft_tokens.inc(lb, m.num_draft_tokens)
            accepted.inc(lb, m.num_accepted_tokens)
            for pos, n in enumerate(m.accepted_per_position):
                if n:
                    per_pos.inc({**lb, "position": str(pos)}, n)

    def _record_lora(self, running: list[str], waiting: list[str]) -> None:
        """``lora_requests_info``, as vLLM: one series per set of adapters in use (comma-separated
        names), its value the Unix time it was last seen (read the newest); written when the set
        changes or a second after the last write."""
        labels = {**self.labels, "max_lora": self.max_lora, "running_lora_adapters": ",".join(running),
                  "waiting_lora_adapters": ",".join(waiting)}
        now = time.time()
        if labels != self._lora_labels or now - self._lora_at >= 1.0:
            self.lora_info.set(labels, now)
            self._lora_labels, self._lora_at = labels, now

    def record_queue(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Gauges between steps (an idle engine runs no step that would reset them)."""
        self.running.set(self.labels, num_running)
        self.waiting.set(self.labels, num_waiting)
        self.kv_usage.set(self.labels, kv_cache_usage)

    def record_finished(self, r) -> None:
        """One request that left the engine (an ``engine.stats.FinishedRequestStats``)."""
        lb = self.labels
        self.success.inc({**lb, "finished_reason": r.finish_reason})
        self.e2e.observe(lb, r.e2e_latency)
        for h, v in ((self.queue, r.queue_time), (self.prefill, r.prefill_time), (self.decode, r.decode_time)):
            if v is not None:
                h.observe(lb, v)
        self.req_prompt.observe(lb, r.num_prompt_tokens)
        self.req_generation.observe(lb, r.num_generation_tokens)


#: Reasons of ``kvserve:requests_rejected_total`` (what the client got).
REJECT_REASONS = ("unauthorized", "auth_throttled", "rate_limited", "queue_full", "model_unavailable",
                  "timeout", "draining")


def rejected() -> Metric:
    """``kvserve:requests_rejected_total{model_name, reason}``: requests refused before or
    instead of generation (401, 429, 503, 504; see :data:`REJECT_REASONS`)."""
    return metric("counter", "requests_rejected", "Requests refused by the gateway or a replica, by reason.",
                  ("model_name", "reason"))


def api_key_tokens() -> Metric:
    """``kvserve:api_key_tokens_total{api_key, model_name, kind}``: tokens by API key name
    (never the key), ``kind`` ``prompt`` or ``generation``; ``model_name`` is the name the client
    sent (a LoRA adapter's, for its requests)."""
    return metric("counter", "api_key_tokens", "Tokens served per API key (its name), prompt or generation.",
                  ("api_key", "model_name", "kind"))


def api_key_requests() -> Metric:
    """``kvserve:api_key_requests_total{api_key, model_name}``: requests admitted per API key name."""
    return metric("counter", "api_key_requests", "Requests admitted per API key (its name).",
                  ("api_key", "model_name"))


def model_routes() -> Metric:
    """``kvserve:model_routes_total{model_name, route}``: requests sent as ``model: "auto"``, by
    the model chosen and the rule that chose it (``default`` when none matched;
    ``deployments/model_routing.py``)."""
    return metric("counter", "model_routes", "Requests of model auto, by chosen model and rule.",
                  ("model_name", "route"))


def upstream_fallbacks() -> Metric:
    """``kvserve:upstream_fallbacks_total{model_name, reason}``: requests sent to the upstream
    because the local model refused them (``reason``: the local error code, e.g. ``queue_full``)."""
    return metric("counter", "upstream_fallbacks", "Requests sent to the upstream instead of a local replica.",
                  ("model_name", "reason"))


#: Buckets of ``kvserve:http_request_duration_seconds``: 5 ms (a tokenize call) to 5 min (a long stream).
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def http_requests() -> Metric:
    """``kvserve:http_requests_total{handler, method, status}``: the gateway's HTTP requests by
    route template (``/v1/embeddings``, ``/v1/responses/{response_id}``; ``none`` for a path no
    route matched), method and status (the names of prometheus-fastapi-instrumentator, which
    vLLM's API server uses)."""
    return metric("counter", "http_requests", "HTTP requests of the gateway by handler, method and status.",
                  ("handler", "method", "status"))


def http_request_seconds() -> Metric:
    """``kvserve:http_request_duration_seconds{handler, method}``: from the request's arrival
    to its response's last byte (a stream's whole length), seconds."""
    return metric("histogram", "http_request_duration_seconds", "HTTP request latency of the gateway in seconds.",
                  ("handler", "method"), HTTP_LATENCY_BUCKETS)


#: Buckets of ``kvserve:response_cache_lookup_seconds``: 0.1 ms (an in-process hit) to 1 s.
CACHE_LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CACHE_LABELS = ("level", "model_name")


def cache_hits() -> Metric:
    """``kvserve:response_cache_hits_total{level, model_name}``: requests answered by the
    ingress's response cache, ``level`` ``exact`` or ``semantic`` (``deployments/cache/``)."""
    return metric("counter", "response_cache_hits", "Requests answered from the response cache, by level.",
                  CACHE_LABELS)


def cache_misses() -> Metric:
    """``kvserve:response_cache_misses_total{level, model_name}``: lookups of a level that
    found nothing (a semantic hit follows an exact miss)."""
    return metric("counter", "response_cache_misses", "Response cache lookups that found nothing, by level.",
                  CACHE_LABELS)


def cache_lookup_seconds() -> Metric:
    """``kvserve:response_cache_lookup_seconds{level, model_name}``: time of one level's
    lookup (semantic: embedding, vector search and fetching the answer)."""
    return metric("histogram", "response_cache_lookup_seconds", "Response cache lookup latency in seconds, by level.",
                  CACHE_LABELS, CACHE_LOOKUP_BUCKETS)


_PID_RE = re.compile(r"_(\d+)\.db$")


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
