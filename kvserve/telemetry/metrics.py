"""kvserve's Prometheus metrics: vLLM V1's names and semantics under a ``kvserve:`` prefix.

Every metric is recorded twice, through prometheus-client in multiprocess mode (``kvserve:<name>``,
rendered by the ingress's ``GET /metrics``) and through Ray's metrics export
(``ray_kvserve_<name>``, scraped per node on a cluster); see :mod:`kvserve.telemetry.registry`.

Labels: ``model_name`` (vLLM's label: the served model name) and ``replica`` (the Serve
replica id) on engine metrics; ``model_name`` and what the metric needs on the gateway's.
Histograms use vLLM V1's buckets.

Modules: :mod:`kvserve.telemetry.registry` (:class:`Metric`, :func:`metric`, :func:`render`: the
mechanism), :mod:`kvserve.telemetry.engine_metrics` (:class:`PrometheusStatLogger`, a replica's engine
metrics), :mod:`kvserve.telemetry.gateway_metrics` (the gateway's). This module re-exports their names.
"""

from __future__ import annotations

from kvserve.telemetry.engine_metrics import (
    ENGINE_LABELS,
    ITL_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_BUCKETS,
    TTFT_BUCKETS,
    ClusterTierMetrics,
    PrometheusStatLogger,
)
from kvserve.telemetry.gateway_metrics import (
    CACHE_LABELS,
    CACHE_LOOKUP_BUCKETS,
    HTTP_LATENCY_BUCKETS,
    REJECT_REASONS,
    api_key_requests,
    api_key_tokens,
    cache_hits,
    cache_lookup_seconds,
    cache_misses,
    cache_warmed_entries,
    cache_warmed_hits,
    http_request_seconds,
    http_requests,
    model_routes,
    rejected,
    upstream_fallbacks,
)
from kvserve.telemetry.registry import PREFIX, RAY_PREFIX, Metric, _metrics, cached_render, metric, metrics_dir, render

__all__ = [
    "CACHE_LABELS",
    "CACHE_LOOKUP_BUCKETS",
    "ENGINE_LABELS",
    "HTTP_LATENCY_BUCKETS",
    "ITL_BUCKETS",
    "PREFIX",
    "RAY_PREFIX",
    "REJECT_REASONS",
    "REQUEST_LATENCY_BUCKETS",
    "TOKEN_BUCKETS",
    "TTFT_BUCKETS",
    "ClusterTierMetrics",
    "Metric",
    "cached_render",
    "PrometheusStatLogger",
    "_metrics",
    "api_key_requests",
    "api_key_tokens",
    "cache_hits",
    "cache_lookup_seconds",
    "cache_misses",
    "cache_warmed_entries",
    "cache_warmed_hits",
    "http_request_seconds",
    "http_requests",
    "metric",
    "metrics_dir",
    "model_routes",
    "rejected",
    "render",
    "upstream_fallbacks",
]
