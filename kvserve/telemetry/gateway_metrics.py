"""The gateway's metrics: requests refused, usage per API key, model routing, HTTP and the response cache.

Each function returns the process's one :class:`~kvserve.telemetry.registry.Metric` of its name
(created on first use); labels are named in each docstring.
"""

from __future__ import annotations

from kvserve.telemetry.registry import Metric, metric

#: Reasons of ``kvserve:requests_rejected_total`` (what the client got).
REJECT_REASONS = (
    "unauthorized",
    "auth_throttled",
    "rate_limited",
    "queue_full",
    "model_unavailable",
    "timeout",
    "draining",
)


def rejected() -> Metric:
    """``kvserve:requests_rejected_total{model_name, reason, variant}``: requests refused before or
    instead of generation (401, 429, 503, 504; see :data:`REJECT_REASONS`); ``variant`` the A/B
    test variant the request was assigned ("" outside an experiment, and for refusals before
    the model is known)."""
    return metric(
        "counter",
        "requests_rejected",
        "Requests refused by the gateway or a replica, by reason.",
        ("model_name", "reason", "variant"),
    )


def api_key_tokens() -> Metric:
    """``kvserve:api_key_tokens_total{api_key, model_name, kind}``: tokens by API key name
    (never the key), ``kind`` ``prompt`` or ``generation``; ``model_name`` is the name the client
    sent (a LoRA adapter's, for its requests)."""
    return metric(
        "counter",
        "api_key_tokens",
        "Tokens served per API key (its name), prompt or generation.",
        ("api_key", "model_name", "kind", "variant"),
    )


def api_key_requests() -> Metric:
    """``kvserve:api_key_requests_total{api_key, model_name}``: requests admitted per API key name."""
    return metric(
        "counter", "api_key_requests", "Requests admitted per API key (its name).", ("api_key", "model_name", "variant")
    )


def model_routes() -> Metric:
    """``kvserve:model_routes_total{model_name, route}``: requests sent as ``model: "auto"``, by
    the model chosen and the rule that chose it (``default`` when none matched;
    ``kvserve/deployments/routing/model_routing.py``)."""
    return metric(
        "counter", "model_routes", "Requests of model auto, by chosen model and rule.", ("model_name", "route")
    )


def upstream_fallbacks() -> Metric:
    """``kvserve:upstream_fallbacks_total{model_name, reason}``: requests sent to the upstream
    because the local model refused them (``reason``: the local error code, e.g. ``queue_full``)."""
    return metric(
        "counter",
        "upstream_fallbacks",
        "Requests sent to the upstream instead of a local replica.",
        ("model_name", "reason", "variant"),
    )


#: Buckets of ``kvserve:http_request_duration_seconds``: 5 ms (a tokenize call) to 5 min (a long stream).
HTTP_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def http_requests() -> Metric:
    """``kvserve:http_requests_total{handler, method, status}``: the gateway's HTTP requests by
    route template (``/v1/embeddings``, ``/v1/responses/{response_id}``; ``none`` for a path no
    route matched), method and status (the names of prometheus-fastapi-instrumentator, which
    vLLM's API server uses)."""
    return metric(
        "counter",
        "http_requests",
        "HTTP requests of the gateway by handler, method and status.",
        ("handler", "method", "status"),
    )


def http_request_seconds() -> Metric:
    """``kvserve:http_request_duration_seconds{handler, method}``: from the request's arrival
    to its response's last byte (a stream's whole length), seconds."""
    return metric(
        "histogram",
        "http_request_duration_seconds",
        "HTTP request latency of the gateway in seconds.",
        ("handler", "method"),
        HTTP_LATENCY_BUCKETS,
    )


#: Buckets of ``kvserve:response_cache_lookup_seconds``: 0.1 ms (an in-process hit) to 1 s.
CACHE_LOOKUP_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
CACHE_LABELS = ("level", "model_name", "variant")


def cache_hits() -> Metric:
    """``kvserve:response_cache_hits_total{level, model_name}``: requests answered by the
    ingress's response cache, ``level`` ``exact`` or ``semantic`` (``kvserve/deployments/cache/``)."""
    return metric(
        "counter", "response_cache_hits", "Requests answered from the response cache, by level.", CACHE_LABELS
    )


def cache_misses() -> Metric:
    """``kvserve:response_cache_misses_total{level, model_name}``: lookups of a level that
    found nothing (a semantic hit follows an exact miss)."""
    return metric(
        "counter", "response_cache_misses", "Response cache lookups that found nothing, by level.", CACHE_LABELS
    )


def cache_warmed_entries() -> Metric:
    """``kvserve:response_cache_warmed_entries_total{level, model_name}``: answers cache warming
    (``kvserve warm``) stored, by level."""
    return metric(
        "counter",
        "response_cache_warmed_entries",
        "Answers stored in the response cache by cache warming, by level.",
        ("level", "model_name"),
    )


def cache_warmed_hits() -> Metric:
    """``kvserve:response_cache_warmed_hits_total{level, model_name, variant}``: live requests
    answered by an entry cache warming stored."""
    return metric(
        "counter",
        "response_cache_warmed_hits",
        "Live requests answered by an entry cache warming stored, by level.",
        CACHE_LABELS,
    )


def cache_lookup_seconds() -> Metric:
    """``kvserve:response_cache_lookup_seconds{level, model_name}``: time of one level's
    lookup (semantic: embedding, vector search and fetching the answer)."""
    return metric(
        "histogram",
        "response_cache_lookup_seconds",
        "Response cache lookup latency in seconds, by level.",
        CACHE_LABELS,
        CACHE_LOOKUP_BUCKETS,
    )
