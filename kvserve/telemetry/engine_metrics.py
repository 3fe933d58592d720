"""The engine's metrics of one ``LLMServer`` replica, by vLLM V1's names: its Prometheus stat logger.

Labels: ``model_name`` (vLLM's label: the served model name), ``replica`` (the Serve replica
id) and ``variant`` (the A/B test variant the replica serves, "" outside an experiment); histograms use vLLM V1's buckets. The logger reads the engine's records
(``kvserve.engine.stats.IterationStats`` per step, ``SchedulerStats`` between steps,
``FinishedRequestStats`` per request) by attribute: telemetry imports no engine module.
"""

from __future__ import annotations

import time

from kvserve.telemetry.cost_metrics import ReplicaCost
from kvserve.telemetry.registry import metric

# vLLM V1's histogram buckets (vllm/v1/metrics/loggers.py), seconds or tokens.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)

ENGINE_LABELS = ("model_name", "replica", "variant")


def _node_of_this_process() -> tuple[str, str]:
    """``(Ray node id, node IP)`` of this process; ``("", "")`` outside Ray."""
    try:
        import ray

        if ray.is_initialized():
            return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
    except Exception:  # metrics never fail a replica
        pass
    return "", ""


class PrometheusStatLogger:
    """The vLLM-named engine metrics of one ``LLMServer`` replica (vLLM V1's
    ``PrometheusStatLogger``); :meth:`record_step` and :meth:`record_finished` are the engine's
    stat loggers (``AsyncLLMEngine.add_stat_logger``), called in its step thread (and, for
    aborts, its event loop).

    Args:
        model_name: the served model name (label ``model_name``).
        replica: the Serve replica id (label ``replica``).
        variant: the A/B test variant the replica serves (label ``variant``; "" outside one).
        cost_per_hour: what the replica costs per hour (``cost_per_replica_hour``; None: no
            cost metrics): ``replica_cost_total`` accrues it by the wall clock, and
            ``cost_per_million_output_tokens`` divides it by the tokens generated so far.
        speculative: also the ``spec_decode_*`` series (an engine that speculates).
        lora: ``max_loras`` of an engine that serves LoRA adapters (``lora_requests_info``);
            None: LoRA off.
    """

    def __init__(
        self,
        model_name: str,
        replica: str,
        speculative: bool = False,
        lora: int | None = None,
        *,
        variant: str = "",
        cost_per_hour: float | None = None,
    ):
        self.labels = {"model_name": model_name, "replica": replica, "variant": variant}
        self.cost = None if cost_per_hour is None else ReplicaCost(self.labels, cost_per_hour)
        L, E = ENGINE_LABELS, ENGINE_LABELS
        self.running = metric("gauge", "num_requests_running", "Number of requests in model execution batches.", L)
        self.waiting = metric("gauge", "num_requests_waiting", "Number of requests waiting to be processed.", L)
        self.kv_usage = metric("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", L)
        self.pc_queries = metric(
            "counter", "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.", L
        )
        self.pc_hits = metric(
            "counter", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", L
        )
        self.ext_hits = metric(
            "counter",
            "external_prefix_cache_hits",
            "External prefix cache hits (the host KV tier), in terms of number of cached tokens.",
            L,
        )
        self.offload_bytes = metric(
            "counter",
            "kv_offload_bytes",
            "Bytes copied between the KV pool and the host tier, by direction.",
            L + ("direction",),
        )
        self.offload_load_s = metric(
            "counter", "kv_offload_load_seconds", "Seconds spent loading blocks back from the host KV tier.", L
        )
        self.preemptions = metric("counter", "num_preemptions", "Cumulative number of preemption from the engine.", L)
        self.prompt_tokens = metric("counter", "prompt_tokens", "Number of prefill tokens processed.", L)
        self.generation_tokens = metric("counter", "generation_tokens", "Number of generation tokens processed.", L)
        self.success = metric(
            "counter", "request_success", "Count of finished requests, by finish reason.", E + ("finished_reason",)
        )
        self.ttft = metric(
            "histogram", "time_to_first_token_seconds", "Histogram of time to first token in seconds.", L, TTFT_BUCKETS
        )
        self.itl = metric(
            "histogram", "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", L, ITL_BUCKETS
        )
        self.e2e = metric(
            "histogram",
            "e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.",
            L,
            REQUEST_LATENCY_BUCKETS,
        )
        self.queue = metric(
            "histogram",
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            L,
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill = metric(
            "histogram",
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            L,
            REQUEST_LATENCY_BUCKETS,
        )
        self.decode = metric(
            "histogram",
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            L,
            REQUEST_LATENCY_BUCKETS,
        )
        self.req_prompt = metric(
            "histogram", "request_prompt_tokens", "Number of prefill tokens processed.", L, TOKEN_BUCKETS
        )
        self.req_generation = metric(
            "histogram", "request_generation_tokens", "Number of generation tokens processed.", L, TOKEN_BUCKETS
        )
        self._set_queue(0, 0, 0.0)
        # which node serves this replica (value 1): on a multi-node cluster, where each model runs
        node_id, node_ip = _node_of_this_process()
        metric("gauge", "replica_info", "The node of each model replica (value 1).", L + ("node_id", "node_ip")).set(
            {**self.labels, "node_id": node_id, "node_ip": node_ip}, 1.0
        )
        self.lora_info = None
        if lora is not None:  # vLLM's lora_requests_info: the adapters in use, as labels; the value is when
            self.lora_info = metric(
                "gauge",
                "lora_requests_info",
                "Running stats on lora requests.",
                L + ("max_lora", "running_lora_adapters", "waiting_lora_adapters"),
            )
            self._lora_labels: dict | None = None
            self._lora_at, self.max_lora = 0.0, str(lora)
        self.spec = None
        if speculative:  # vLLM's spec_decode_* series (only where speculation is configured, as vLLM)
            self.spec = (
                metric("counter", "spec_decode_num_drafts", "Number of spec decoding drafts.", L),
                metric("counter", "spec_decode_num_draft_tokens", "Number of draft tokens.", L),
                metric("counter", "spec_decode_num_accepted_tokens", "Number of accepted tokens.", L),
                metric(
                    "counter",
                    "spec_decode_num_accepted_tokens_per_pos",
                    "Accepted tokens per draft position.",
                    L + ("position",),
                ),
            )

    def record_step(self, m) -> None:
        """One engine step (an ``kvserve.engine.stats.IterationStats``): counters, histograms, and the
        queue gauges from its scheduler snapshot."""
        lb = self.labels
        if self.cost is not None:
            self.cost.generated(m.num_sampled)
        self.record_scheduler_stats(m)
        self.pc_queries.inc(lb, m.prefix_cache_queries)
        self.pc_hits.inc(lb, m.prefix_cache_hits)
        if m.kv_offload_saved_bytes or m.kv_offload_loaded_bytes:  # the host KV tier (kvserve/engine/kv_offload.py)
            self.ext_hits.inc(lb, m.external_prefix_cache_hits)
            self.offload_bytes.inc({**lb, "direction": "saved"}, m.kv_offload_saved_bytes)
            self.offload_bytes.inc({**lb, "direction": "loaded"}, m.kv_offload_loaded_bytes)
            self.offload_load_s.inc(lb, m.kv_offload_load_seconds)
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
        labels = {
            **self.labels,
            "max_lora": self.max_lora,
            "running_lora_adapters": ",".join(running),
            "waiting_lora_adapters": ",".join(waiting),
        }
        now = time.time()
        if labels != self._lora_labels or now - self._lora_at >= 1.0:
            self.lora_info.set(labels, now)
            self._lora_labels, self._lora_at = labels, now

    def record_scheduler_stats(self, s) -> None:
        """The queue gauges from a snapshot: an ``kvserve.engine.stats.SchedulerStats`` (between steps:
        an idle engine runs no step that would reset them), or anything with its attributes
        ``num_running``, ``num_waiting`` and ``kv_cache_usage`` (an ``IterationStats``)."""
        if self.cost is not None:
            self.cost.accrue()
        self._set_queue(s.num_running, s.num_waiting, s.kv_cache_usage)

    def _set_queue(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        lb = self.labels
        self.running.set(lb, num_running)
        self.waiting.set(lb, num_waiting)
        self.kv_usage.set(lb, kv_cache_usage)

    def record_finished(self, r) -> None:
        """One request that left the engine (an ``kvserve.engine.stats.FinishedRequestStats``)."""
        lb = self.labels
        self.success.inc({**lb, "finished_reason": r.finish_reason})
        self.e2e.observe(lb, r.e2e_latency)
        for h, v in ((self.queue, r.queue_time), (self.prefill, r.prefill_time), (self.decode, r.decode_time)):
            if v is not None:
                h.observe(lb, v)
        self.req_prompt.observe(lb, r.num_prompt_tokens)
        self.req_generation.observe(lb, r.num_generation_tokens)


class ClusterTierMetrics:
    """The cluster KV tier's metrics of one ``LLMServer`` replica (``kvserve/deployments/replica/kv_cluster.py``):
    ``kv_cluster_hit_tokens`` (prompt tokens whose blocks were fetched from the tier for a request;
    loaded into the pool they also count in ``external_prefix_cache_hits``), ``kv_cluster_bytes``
    by direction (``saved``: put in the object store; ``loaded``: fetched), ``kv_cluster_load_seconds``
    (requests' waits on fetches), ``kv_cluster_load_fallbacks`` by reason (``timeout``: the fetch
    would have taken longer than computing; ``lost``: the object's owner is gone; ``error``).
    Labels as :class:`PrometheusStatLogger`'s."""

    def __init__(self, model_name: str, replica: str, variant: str = ""):
        self.labels = {"model_name": model_name, "replica": replica, "variant": variant}
        L = ENGINE_LABELS
        self.hits = metric(
            "counter", "kv_cluster_hit_tokens", "Prompt tokens whose KV blocks were fetched from the cluster tier.", L
        )
        self.bytes = metric(
            "counter", "kv_cluster_bytes", "Bytes put into / fetched from the cluster KV tier.", L + ("direction",)
        )
        self.load_s = metric(
            "counter", "kv_cluster_load_seconds", "Seconds requests waited on cluster-tier fetches.", L
        )
        self.fallbacks = metric(
            "counter",
            "kv_cluster_load_fallbacks",
            "Cluster-tier loads given up for recomputing, by reason.",
            L + ("reason",),
        )

    def saved(self, nbytes: int) -> None:
        self.bytes.inc({**self.labels, "direction": "saved"}, nbytes)

    def loaded(self, tokens: int, nbytes: int, seconds: float) -> None:
        self.hits.inc(self.labels, tokens)
        self.bytes.inc({**self.labels, "direction": "loaded"}, nbytes)
        self.load_s.inc(self.labels, seconds)

    def fallback(self, reason: str, seconds: float) -> None:
        self.fallbacks.inc({**self.labels, "reason": reason}, 1)
        self.load_s.inc(self.labels, seconds)
