"""A replica's spans of one finished engine request, under the gateway's span that sent it (its
W3C context crossed the Ray hop in ``GenerateRequest.trace_context``): ``llm_request`` (vLLM's
span, with vLLM's ``gen_ai.*`` attributes) from the request's arrival in the engine to its end,
and its phases as children, ``queue`` (waiting for its first schedule), ``prefill`` (to its first
token) and ``decode`` (to its end), from the engine's own timestamps."""

from __future__ import annotations

import logging

from kvserve.telemetry.tracing import SpanAttributes as A
from kvserve.telemetry.tracing import Tracing

logger = logging.getLogger("ray.serve")


def record_request(
    t: Tracing | None,
    context: dict | None,
    out,
    model: str,
    params,
    lora: str | None = None,
    variant: str | None = None,
) -> None:
    """Emit the spans of finished engine request ``out`` (an ``engine.RequestOutput``) under
    ``context`` (a W3C carrier; None: the request came untraced, nothing is emitted). Never
    raises: a tracing failure is logged only."""
    if t is None or not context:
        return
    try:
        m = out.metrics
        end = m.finished_time or m.last_token_time or m.arrival_time
        parent = t.extract(context)
        queue = None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time
        prefill = (
            None
            if m.first_scheduled_time is None or m.first_token_time is None
            else m.first_token_time - m.first_scheduled_time
        )
        decode = None if m.first_token_time is None else end - m.first_token_time
        attrs = {
            A.GEN_AI_REQUEST_ID: out.request_id,
            A.GEN_AI_RESPONSE_MODEL: model,
            A.GEN_AI_REQUEST_MAX_TOKENS: params.max_tokens,
            A.GEN_AI_REQUEST_TEMPERATURE: params.temperature,
            A.GEN_AI_REQUEST_TOP_P: params.top_p,
            A.GEN_AI_REQUEST_N: 1,
            A.GEN_AI_USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
            A.GEN_AI_USAGE_COMPLETION_TOKENS: sum(len(o.token_ids) for o in out.outputs),
            A.GEN_AI_USAGE_NUM_SEQUENCES: len(out.outputs),
            A.GEN_AI_LATENCY_TIME_IN_QUEUE: queue,
            A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: m.ttft,
            A.GEN_AI_LATENCY_E2E: end - m.arrival_time,
            A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: prefill,
            A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: decode,
            A.GEN_AI_LORA_NAME: lora,
            "kvserve.variant": variant or None,
            "kvserve.cached_prompt_tokens": m.num_cached_tokens,
            "kvserve.finish_reason": out.outputs[0].finish_reason if out.outputs else None,
        }
        span = t.start_span("llm_request", parent, kind="server", start_time_s=m.arrival_time, attributes=attrs)
        for name, start, stop in (
            ("queue", m.arrival_time, m.first_scheduled_time),
            ("prefill", m.first_scheduled_time, m.first_token_time),
            ("decode", m.first_token_time, end),
        ):
            if start is not None and stop is not None:
                t.start_span(name, span, start_time_s=start).end(end_time=int(stop * 1e9))
        span.end(end_time=int(end * 1e9))
    except Exception as e:  # noqa: BLE001 -- tracing never fails a request
        logger.warning("tracing: the spans of request %s were not recorded (%s)", getattr(out, "request_id", "?"), e)
