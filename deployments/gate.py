"""The ingress's front door: API-key check and body-size limit before any body byte is read.

FastAPI reads and parses a request body before a route's code (or its dependencies) runs,
so checks inside the endpoints come too late: a 10 MB body from a client without a key was
parsed before the 401. :class:`RequestGate` is a pure ASGI middleware (streaming responses
pass through untouched) that, for the API paths (``/v1/...``):

1. answers 401 when API keys are configured and ``Authorization: Bearer <key>`` does not
   carry one of them (keys compared as bytes in constant time, so any header value, non-ASCII
   included, is a 401 and never a 500);
2. answers 413 when ``Content-Length`` exceeds the limit, and stops reading a body without a
   length (chunked) as soon as it passes the limit.

``/health``, ``/ready`` and ``/metrics`` stay open; ``/docs``, ``/redoc`` and ``/openapi.json``
follow the API's key setting. Each ingress replica runs in its own process
and configures the gate once with :func:`configure` (the FastAPI app, middleware included,
is frozen when the module is imported, before the replica knows its arguments).
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments.protocol import error_body

#: Default largest request body, bytes (4 MiB: a 128k-token prompt as text or as token ids
#: is well under 1 MiB).
DEFAULT_MAX_BODY_BYTES = 4 << 20


#: FastAPI's API documentation: behind the API key when the API has one.
_DOC_PATHS = frozenset({"/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


@dataclass
class GateSettings:
    """What the gate enforces. ``api_keys`` empty: no key needed."""

    api_keys: list[bytes] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES


_settings = GateSettings()


def configure(api_keys: list[str] | None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> None:
    """Set this process's gate (called by ``OpenAIIngress.__init__``).

    Raises:
        ValueError: ``max_body_bytes`` < 1.
    """
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    _settings.api_keys = [k.encode() for k in (api_keys or []) if k]
    _settings.max_body_bytes = max_body_bytes


def key_matches(header: bytes, keys: list[bytes]) -> bool:
    """Whether an ``Authorization`` header value (raw bytes) is ``Bearer <one of keys>``.
    Compares every key in constant time (``hmac.compare_digest`` on bytes)."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return False
    token = token.strip()
    ok = False
    for k in keys:
        ok |= hmac.compare_digest(token, k)
    return ok


def mask_key(key: str) -> str:
    """A key as it may appear in logs and banners: its first 4 characters, then ``...``."""
    return (key[:4] + "...") if len(key) > 8 else "***"


async def _send_error(send: Send, status: int, message: str, code: str, headers: dict | None = None) -> None:
    body = json.dumps(error_body(message, "invalid_request_error", None, code)).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):]
        if not (path.startswith("/v1/") or path in _DOC_PATHS):  # /health, /ready, /metrics stay open
            return await self.app(scope, receive, send)
        s = _settings
        headers = dict(scope.get("headers") or [])
        if s.api_keys and not key_matches(headers.get(b"authorization", b""), s.api_keys):
            return await _send_error(send, 401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                                     "invalid_api_key", {"WWW-Authenticate": "Bearer"})
        limit = s.max_body_bytes
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _send_error(send, 400, "invalid Content-Length header", "invalid_request")
            if n > limit:
                return await _send_error(send, 413, f"request body is {n} bytes; the limit is {limit} bytes",
                                         "request_too_large")
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:  # a chunked body: stop reading it here
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return msg

        await self.app(scope, limited_receive, send)
