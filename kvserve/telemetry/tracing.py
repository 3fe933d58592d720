"""OpenTelemetry traces of requests (vLLM's ``--otlp-traces-endpoint``), exported over OTLP.

Off by default and free when off: nothing of OpenTelemetry is imported until an endpoint is
configured, and every helper here takes a :class:`Tracing` that is None when tracing is off.

- :func:`tracing` sets up this process's exporter once (a ``TracerProvider`` with a batching
  span processor: spans leave in the background, never on a request's path) and gives its
  :class:`Tracing`. The protocol: the ``protocol`` argument, else ``$OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``
  / ``$OTEL_EXPORTER_OTLP_PROTOCOL``, else ``grpc`` (vLLM's default); ``http/protobuf`` posts
  to the endpoint as given (e.g. ``http://collector:4318/v1/traces``). The standard ``OTEL_*``
  variables keep their meaning: ``OTEL_SERVICE_NAME`` (default ``kvserve``),
  ``OTEL_TRACES_SAMPLER`` / ``OTEL_TRACES_SAMPLER_ARG`` (when no ``sample_ratio`` is given),
  ``OTEL_EXPORTER_OTLP_TRACES_HEADERS``, ``..._TIMEOUT``, ``..._COMPRESSION``, ``..._INSECURE``,
  ``..._CERTIFICATE``, and ``OTEL_BSP_*`` for the batching.
- W3C trace context (``traceparent`` / ``tracestate``): :meth:`Tracing.extract` reads it from a
  client's headers; :meth:`Tracing.inject` writes a span's into a dict that crosses the Ray hop
  inside the request (``GenerateRequest.trace_context``), where the replica extracts it again,
  so a replica's spans are children of the gateway's in one trace.

Span names and attributes follow vLLM's (``llm_request`` with ``gen_ai.*`` attributes, vLLM's
``vllm/tracing.py`` names) on the replica; the gateway's spans are kvserve's (see
``kvserve/deployments/gateway/tracing.py``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

logger = logging.getLogger("ray.serve")

#: Protocols of the OTLP exporter.
PROTOCOLS = ("grpc", "http/protobuf")

_lock = threading.Lock()
_by_config: dict[tuple, "Tracing"] = {}


class SpanAttributes:
    """The ``gen_ai.*`` attribute names vLLM's tracing uses (``vllm/tracing.py``)."""

    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_SCHEDULER = "gen_ai.latency.time_in_scheduler"
    GEN_AI_LORA_NAME = "gen_ai.request.lora_name"


def resolve_protocol(protocol: str | None) -> str:
    """The exporter's protocol (see the module docstring).

    Raises:
        ValueError: not one of :data:`PROTOCOLS`.
    """
    p = (
        (
            protocol
            or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
            or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
            or "grpc"
        )
        .strip()
        .lower()
    )
    if p not in PROTOCOLS:
        raise ValueError(f"OTLP traces protocol must be one of {PROTOCOLS}, got {p!r}")
    return p


class Tracing:
    """This process's tracer for one endpoint (made by :func:`tracing`).

    Attributes:
        tracer: the OpenTelemetry ``Tracer``.
        provider: its ``TracerProvider`` (:meth:`flush` forces its spans out).
    """

    def __init__(self, endpoint: str, protocol: str, sample_ratio: float | None, service_name: str):
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        kwargs: dict[str, Any] = {}
        if sample_ratio is not None:  # else the SDK reads OTEL_TRACES_SAMPLER (default: parent-based, always on)
            kwargs["sampler"] = ParentBased(TraceIdRatioBased(sample_ratio))
        resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME") or service_name})
        self.provider = TracerProvider(resource=resource, **kwargs)
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("kvserve")
        self.propagator = TraceContextTextMapPropagator()
        self.endpoint, self.protocol = endpoint, protocol

    def extract(self, carrier: Any):
        """The OpenTelemetry ``Context`` of a W3C ``traceparent`` in ``carrier`` (a mapping of
        headers, any case; None or empty: a new root)."""
        if not carrier:
            return None
        getter = _Getter()
        return self.propagator.extract(carrier, getter=getter)

    def inject(self, span) -> dict[str, str]:
        """``span``'s W3C trace context as a dict (``traceparent``, maybe ``tracestate``)."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier

    def start_span(
        self,
        name: str,
        parent=None,
        *,
        kind: str = "internal",
        start_time_s: float | None = None,
        attributes: dict[str, Any] | None = None,
    ):
        """A started span (end it with ``span.end()``) under ``parent`` (a ``Context``, a span,
        or None: a new root). ``kind``: ``server``, ``client`` or ``internal``;
        ``start_time_s``: Unix seconds (default now)."""
        from opentelemetry import trace

        if parent is not None and not hasattr(parent, "get"):  # a span: its context
            parent = trace.set_span_in_context(parent)
        kinds = {"server": trace.SpanKind.SERVER, "client": trace.SpanKind.CLIENT, "internal": trace.SpanKind.INTERNAL}
        return self.tracer.start_span(
            name,
            context=parent,
            kind=kinds[kind],
            attributes={k: v for k, v in (attributes or {}).items() if v is not None},
            start_time=None if start_time_s is None else int(start_time_s * 1e9),
        )

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Send the spans still batched now; False when the exporter did not finish in time."""
        return self.provider.force_flush(int(timeout_s * 1000))


class _Getter:
    """A case-insensitive getter of W3C headers from a mapping (Starlette headers, a dict)."""

    def get(self, carrier, key: str):
        v = carrier.get(key)
        if v is None and hasattr(carrier, "items"):
            v = next((val for k, val in carrier.items() if str(k).lower() == key), None)
        return None if v is None else [v] if isinstance(v, str) else list(v)

    def keys(self, carrier):
        return list(carrier.keys())


def tracing(
    endpoint: str | None, protocol: str | None = None, sample_ratio: float | None = None, service_name: str = "kvserve"
) -> Tracing | None:
    """This process's :class:`Tracing` for ``endpoint`` (one per endpoint, protocol and ratio;
    None when ``endpoint`` is empty: tracing off).

    Raises:
        ValueError: an unknown protocol, a ratio outside [0, 1].
        ImportError: the OpenTelemetry SDK or the protocol's exporter is not installed.
    """
    if not endpoint:
        return None
    protocol = resolve_protocol(protocol)
    if sample_ratio is not None and not 0.0 <= sample_ratio <= 1.0:
        raise ValueError(f"the trace sample ratio must be in [0, 1], got {sample_ratio}")
    key = (endpoint, protocol, sample_ratio, service_name)
    with _lock:
        t = _by_config.get(key)
        if t is None:
            t = _by_config[key] = Tracing(endpoint, protocol, sample_ratio, service_name)
            logger.info("tracing: OTLP %s spans to %s", protocol, endpoint)
        return t
