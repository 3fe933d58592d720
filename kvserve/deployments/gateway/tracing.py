"""The gateway's spans of a request (``kvserve/telemetry/tracing.py`` exports them): the request's own
(``{method} {route}``, kind server, the client's W3C ``traceparent`` its parent) with a child per
pipeline step, ``cache_lookup``, ``key_admission``, ``routing`` (opening the replica streams up
to their first chunk: the deployment, the A/B test variant, the replica that answered) and
``fallback`` (the upstream). The ``routing`` span's context goes to the replica inside the
request, so the replica's ``llm_request`` span is its child. All no-ops when tracing is off
(``tracing`` None)."""

from __future__ import annotations

import contextlib
import time

from kvserve.telemetry.tracing import SpanAttributes as A
from kvserve.telemetry.tracing import Tracing


class GatewayTracing:
    """The gateway's side of tracing (see the module docstring); ``t`` None: off."""

    def __init__(self, t: Tracing | None):
        self.t = t

    def begin(self, call, endpoint: str) -> None:
        """Start ``call``'s request span (from when the gateway got the request)."""
        if self.t is None:
            return
        scope = call.request.scope
        route = getattr(scope.get("route"), "path", None) or scope.get("path", "")
        start = time.time() - (time.monotonic() - call.started)
        a = call.assignment
        call.span = self.t.start_span(
            f"{scope.get('method', 'POST')} {route}",
            self.t.extract(call.request.headers),
            kind="server",
            start_time_s=start,
            attributes={
                "http.request.method": scope.get("method"),
                "http.route": route,
                "kvserve.endpoint": endpoint,
                "kvserve.request_id": call.http_id,
                A.GEN_AI_REQUEST_ID: call.response_id,
                A.GEN_AI_RESPONSE_MODEL: call.served,
                "kvserve.experiment": a.experiment if a else None,
                "kvserve.variant": a.variant if a else None,
                A.GEN_AI_LORA_NAME: call.adapter,
            },
        )

    @contextlib.contextmanager
    def step(self, call, name: str, **attributes):
        """A child span of ``call``'s request span around a pipeline step (yields it, or None);
        an exception leaving the step marks it failed."""
        if self.t is None or call.span is None:
            yield None
            return
        span = self.t.start_span(name, call.span, attributes=attributes)
        try:
            yield span
        except BaseException as e:
            _failed(span, e)
            raise
        finally:
            span.end()

    def context(self, span) -> dict | None:
        """``span``'s W3C context for the replica (None: off)."""
        return None if self.t is None or span is None else self.t.inject(span)

    def end(self, call, usage=None, error: BaseException | None = None, status: str | None = None) -> None:
        """End ``call``'s request span (once) with its usage, TTFT and outcome."""
        span = getattr(call, "span", None)
        if span is None:
            return
        call.span = None
        if usage is not None:
            span.set_attribute(A.GEN_AI_USAGE_PROMPT_TOKENS, usage.prompt_tokens)
            span.set_attribute(A.GEN_AI_USAGE_COMPLETION_TOKENS, usage.completion_tokens)
        if call.first_at is not None:
            span.set_attribute(A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN, call.first_at - call.started)
        if call.look is not None and call.look.status:
            span.set_attribute("kvserve.cache", call.look.status)
        if status:
            span.set_attribute("kvserve.outcome", status)
        if error is not None:
            _failed(span, error)
        span.end()


def _failed(span, e: BaseException) -> None:
    from opentelemetry.trace import Status, StatusCode

    code = getattr(e, "code", None) or type(e).__name__
    span.set_status(Status(StatusCode.ERROR, str(code)))
    span.set_attribute("error.type", str(code))
