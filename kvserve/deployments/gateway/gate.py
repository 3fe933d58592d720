"""The gateway's front door: API-key check and body-size limit before any body byte is read.

FastAPI reads and parses a request body before a route's code (or its dependencies) runs,
so checks inside the endpoints come too late: a 10 MB body from a client without a key was
parsed before the 401. :class:`RequestGate` is a pure ASGI middleware (streaming responses
pass through untouched) that, for the API paths (``/v1/...``):

1. answers 401 (with ``WWW-Authenticate: Bearer``) when API keys are configured and
   ``Authorization: Bearer <key>`` does not carry one of them (keys compared as bytes in
   constant time, so any header value, non-ASCII included, is a 401 and never a 500), and 429
   instead of the 401 to a client that sent too many wrong keys in the last minute (the key is
   looked at first: a valid key is never throttled, whoever shares its address, and clears
   the count of its client; the client is the peer, or behind ``forwarded_allow_ips`` the
   rightmost untrusted ``X-Forwarded-For`` hop, :mod:`kvserve.deployments.limits.auth_throttle`); a matched key's
   :class:`kvserve.deployments.limits.KeyPolicy` (limits, priority) goes to the endpoint in
   ``scope["state"]`` (:func:`request_policy`);
2. answers 413 when ``Content-Length`` exceeds the limit, and stops reading a body without a
   length (chunked) as soon as it passes the limit (on every path, the open ones too).

FastAPI's ``/docs``, ``/redoc`` and ``/openapi.json`` are not open: behind the API key like
every route when keys are set. Starlette's ``CORSMiddleware`` with the configured origins sits in front of it
(:func:`install`), so a browser's preflight ``OPTIONS`` is answered
without a key and every answer, a 401 included, carries the ``Access-Control-*`` headers. Both take their :class:`GateSettings`
as middleware options, given by :func:`kvserve.deployments.gateway.api.build_api` when it builds a
replica's app (no module state).
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field

from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvserve.deployments.contract.config import DEFAULT_AUTH_FAILURES_PER_MINUTE, DEFAULT_MAX_BODY_BYTES
from kvserve.deployments.contract.openai_errors import anthropic_error_body, error_body
from kvserve.deployments.limits import (
    AuthFailureThrottle,
    KeyPolicy,
    TrustedProxies,
    client_address,
    find_policy,
    policies_from_keys,
)
from kvserve.telemetry.metrics import rejected


#: The only paths answered without an API key (exact matches, after the root path): the
#: probes and the metrics scrape. Everything else, routes added later included, needs a key
#: when keys are configured.
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
#: The upload path of the Batch API's files: its body limit is ``max_file_bytes``.
FILES_PATH = "/v1/files"
#: What a multipart upload adds to the file's bytes (boundaries, headers, the purpose field).
FILE_ENVELOPE_BYTES = 64 << 10
#: Paths of Anthropic's Messages API: their errors take Anthropic's shape.
ANTHROPIC_PREFIX = "/v1/messages"


@dataclass
class GateSettings:
    """What the gate enforces. ``policies`` empty: no key needed."""

    policies: list[KeyPolicy] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_file_bytes: int = DEFAULT_MAX_BODY_BYTES  # POST /v1/files (plus the multipart envelope)
    throttle: AuthFailureThrottle = field(default_factory=AuthFailureThrottle)
    allowed_origins: list[str] = field(default_factory=list)
    trusted_proxies: TrustedProxies = field(default_factory=TrustedProxies)

    @classmethod
    def of(
        cls,
        api_keys: list[str] | list[KeyPolicy] | None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        auth_failures_per_minute: int = DEFAULT_AUTH_FAILURES_PER_MINUTE,
        allowed_origins: list[str] | None = None,
        max_file_bytes: int | None = None,
        forwarded_allow_ips: list[str] | None = None,
    ) -> "GateSettings":
        """The gate of a replica. ``api_keys``: key entries (``"<key> [name=..] [rpm=..]
        [tpm=..] [priority=..]"``, see :mod:`kvserve.deployments.limits`) or :class:`KeyPolicy`
        objects. ``allowed_origins``: CORS origins (``[]``: no CORS headers; None, the default:
        ``["*"]`` when keys are set, since a page must then know a key, and none without keys,
        so no web page can read an open local server). ``max_file_bytes``: the body limit of
        ``POST /v1/files`` (default ``max_body_bytes``). ``forwarded_allow_ips``: addresses or
        CIDRs of the proxies whose ``X-Forwarded-For`` names the client for the wrong-key
        throttle (none: the connection's peer).

        Raises:
            ValueError: ``max_body_bytes`` or ``auth_failures_per_minute`` < 1, a bad key entry,
                or a ``forwarded_allow_ips`` entry that is no address or network.
        """
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
        if auth_failures_per_minute < 1:
            raise ValueError(f"auth_failures_per_minute must be positive, got {auth_failures_per_minute}")
        keys = list(api_keys or [])
        if allowed_origins is None:
            allowed_origins = ["*"] if keys else []
        return cls(
            policies=keys if all(isinstance(k, KeyPolicy) for k in keys) else policies_from_keys(keys),
            max_body_bytes=max_body_bytes,
            max_file_bytes=max(max_body_bytes, max_file_bytes or 0),
            throttle=AuthFailureThrottle(max_failures=auth_failures_per_minute, window_s=60.0),
            allowed_origins=list(allowed_origins),
            trusted_proxies=TrustedProxies(forwarded_allow_ips or ()),
        )


def install(app, settings: GateSettings) -> None:
    """Add the gate to a FastAPI ``app``: :class:`RequestGate`, and in front of it (outermost)
    Starlette's ``CORSMiddleware`` with the gate's origins (any method and header, no
    credentials: the API key travels in a header, never a cookie), so preflights are answered
    and every answer, 401s too, carries CORS headers. No origins: no CORS middleware."""
    app.add_middleware(RequestGate, settings=settings)
    if settings.allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
            expose_headers=["X-Request-ID", "Retry-After"],
            max_age=600,
        )


def bearer_token(header: bytes) -> bytes | None:
    """The token of an ``Authorization: Bearer <token>`` header value (raw bytes), or None."""
    scheme, _, token = header.strip().partition(b" ")
    return token.strip() if scheme.lower() == b"bearer" else None


def request_policy(scope: Scope) -> KeyPolicy | None:
    """The :class:`KeyPolicy` the gate matched for this request (None: no keys configured)."""
    return (scope.get("state") or {}).get("kvserve_api_key")


def key_name(scope: Scope) -> str:
    """The name of this request's API key (its ``name=``, never the key), ``anonymous`` without keys."""
    policy = request_policy(scope)
    return policy.name if policy is not None else "anonymous"


def owner_id(scope: Scope) -> str:
    """Who owns what this request stores (stored responses): the stable id of its API key
    (:attr:`kvserve.deployments.limits.KeyPolicy.owner_id`, derived from the key itself, so a key
    re-issued under an old name owns nothing of the old key's), ``anonymous`` without keys."""
    policy = request_policy(scope)
    return policy.owner_id if policy is not None else "anonymous"


def credentials(scope: Scope) -> dict[str, str]:
    """The request's own API-key headers (``Authorization``, ``x-api-key``) as it sent them,
    for work it starts that runs later as the same key (a batch job: held in memory only)."""
    headers = dict(scope.get("headers") or [])
    return {
        name: headers[name.encode()].decode("latin-1")
        for name in ("authorization", "x-api-key")
        if name.encode() in headers
    }


def route_path(scope: Scope) -> str:
    """The request's path below the app's root path (Serve's route prefix)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


def mask_key(key: str) -> str:
    """A key as it may appear in logs and banners: its first 4 characters, then ``...``."""
    return (key[:4] + "...") if len(key) > 8 else "***"


def _count_rejected(reason: str) -> None:
    try:
        rejected().inc({"model_name": "", "reason": reason})
    except Exception:  # metrics never fail a request
        pass


def anthropic_path(scope: Scope) -> bool:
    """Whether the request is for Anthropic's Messages API (its errors take Anthropic's shape)."""
    return route_path(scope).startswith(ANTHROPIC_PREFIX)


async def _send_error(
    send: Send, status: int, message: str, code: str, headers: dict | None = None, scope: Scope | None = None
) -> None:
    payload = (
        anthropic_error_body(status, message)
        if scope is not None and anthropic_path(scope)
        else error_body(message, "invalid_request_error", None, code)
    )
    body = json.dumps(payload).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": hdrs})
    await send({"type": "http.response.body", "body": body})


class RequestGate:
    """Pure ASGI middleware: see the module docstring."""

    def __init__(self, app: ASGIApp, settings: GateSettings):
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.settings
        headers = dict(scope.get("headers") or [])
        if s.policies and route_path(scope) not in OPEN_PATHS:  # deny by default
            client = client_address(
                (scope.get("client") or ("unknown", 0))[0],
                [v for k, v in scope.get("headers") or () if k == b"x-forwarded-for"],
                s.trusted_proxies,
            )
            # the key first: a valid one is never throttled by what others sharing its address sent
            # (OpenAI's Authorization: Bearer, or Anthropic's x-api-key)
            token = bearer_token(headers.get(b"authorization", b"")) or headers.get(b"x-api-key", b"").strip() or None
            policy = find_policy(token, s.policies) if token else None
            if policy is not None:
                s.throttle.record_success(client)
            else:
                wait = s.throttle.retry_after(client)
                if wait is not None:  # this client sent too many wrong keys
                    _count_rejected("auth_throttled")
                    return await _send_error(
                        send,
                        429,
                        "too many failed authentication attempts from this address, retry later",
                        "auth_throttled",
                        {"Retry-After": str(max(1, math.ceil(wait)))},
                        scope,
                    )
                s.throttle.record_failure(client)
                _count_rejected("unauthorized")
                return await _send_error(
                    send,
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')",
                    "invalid_api_key",
                    {"WWW-Authenticate": "Bearer"},
                    scope,
                )
            scope.setdefault("state", {})["kvserve_api_key"] = policy
        limit = s.max_body_bytes
        if scope.get("method") == "POST" and route_path(scope) == FILES_PATH:  # + the multipart envelope
            limit = s.max_file_bytes + FILE_ENVELOPE_BYTES
        length = headers.get(b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                return await _send_error(send, 400, "invalid Content-Length header", "invalid_request", scope=scope)
            if n > limit:
                return await _send_error(
                    send,
                    413,
                    f"request body is {n} bytes; the limit is {limit} bytes",
                    "request_too_large",
                    scope=scope,
                )
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:  # a chunked body: stop reading it here
                    raise HTTPException(413, f"request body exceeds the limit of {limit} bytes")
            return msg

        try:
            await self.app(scope, limited_receive, send)
        except Exception as e:  # noqa: BLE001 - re-raised below unless it is a client disconnect
            # Serve's proxy cancels the request when the client goes away; if the handler is
            # reading the body (Starlette's disconnect listener) at that moment, receive() raises
            # Ray's TaskCancelledError. That is a disconnect, not a server error: no traceback.
            if type(e).__name__ != "TaskCancelledError":
                raise
            logging.getLogger("ray.serve").info(
                "client disconnected while the request was being read: %s %s", scope.get("method"), scope.get("path")
            )
