"""Per-endpoint request counts and latencies of the gateway (``kvserve:http_requests_total``,
``kvserve:http_request_duration_seconds``; :func:`kvserve.telemetry.metrics.http_requests`), as a
pure ASGI middleware so that a streamed response is timed to its last byte."""

from __future__ import annotations

import time

from kvserve.telemetry.metrics import http_request_seconds, http_requests


class EndpointMetrics:
    """Wrap an ASGI app: count every HTTP request by its route's path template (the router
    writes the matched route into the scope) and record its latency.

    Args:
        app: the ASGI app (FastAPI's).
    """

    def __init__(self, app):
        self.app = app
        self.requests, self.seconds = http_requests(), http_request_seconds()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0, status = time.perf_counter(), 500

        async def send_(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_)
        finally:
            route = scope.get("route")
            handler = getattr(route, "path", None) or "none"
            method = scope.get("method", "")
            self.requests.inc({"handler": handler, "method": method, "status": str(status)})
            self.seconds.observe({"handler": handler, "method": method}, time.perf_counter() - t0)
