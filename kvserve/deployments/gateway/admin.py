"""The admin key's check (:func:`admin_denied`) and the response cache's administration (``GET`` /
``DELETE /v1/cache``); the LoRA adapter endpoints are in :mod:`kvserve.deployments.gateway.adapters`."""

from __future__ import annotations

import logging

from fastapi import Request
from fastapi.responses import JSONResponse

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.errors import error_response, request_id_of
from kvserve.deployments.gateway.gate import bearer_token, request_policy
from kvserve.deployments.limits import find_policy

logger = logging.getLogger("ray.serve")


def is_admin(gw, request: Request) -> bool:
    """Whether the request carries an admin key (``Authorization: Bearer <admin key>``). No
    admin key configured (loopback dev mode among others): nobody is. Records nothing: a
    caller that is not an admin is no failed authentication here."""
    if not gw.admin_keys:
        return False
    token = bearer_token(dict(request.scope.get("headers") or []).get(b"authorization", b""))
    return bool(token) and find_policy(token, gw.admin_keys) is not None


def admin_denied(gw, request: Request, what: str = "the response cache") -> JSONResponse | None:
    """None when the request carries an admin key; else its 401 (no or a wrong key), 403 (an
    API key that is not an admin key, or no admin key configured) or 429 (too many wrong keys
    from this address, the gate's throttle)."""
    if not gw.admin_keys:
        return error_response(
            403,
            f"administration of {what} is off: no admin key is configured (admin_api_keys or $KVSERVE_ADMIN_API_KEYS)",
            "permission_error",
            code="admin_disabled",
        )
    client = request.client.host if request.client else "unknown"
    throttle = gw.gate.throttle
    wait = throttle.retry_after(client)
    if wait is not None:
        return error_response(
            429,
            "too many failed authentication attempts from this address, retry later",
            "rate_limit_error",
            code="auth_throttled",
            headers={"Retry-After": str(max(1, int(wait + 0.999)))},
        )
    if is_admin(gw, request):
        return None
    if request_policy(request.scope) is not None:  # a valid API key, not an admin one
        return error_response(
            403, f"this API key may not administer {what}", "permission_error", code="permission_denied"
        )
    throttle.record_failure(client)
    return error_response(
        401,
        "an admin key is needed (send 'Authorization: Bearer <admin key>')",
        code="invalid_api_key",
        headers={"WWW-Authenticate": "Bearer"},
    )


async def clear_cache(gw, request: Request, model: str | None = None):
    """Delete cached answers, all or one served model's (``?model=``), with an admin key:
    ``{"object": "cache.cleared", "model", "exact": n, "semantic": m}`` (entries deleted;
    ``memory`` backend: this gateway replica's, ``redis``: everyone's)."""
    denied = admin_denied(gw, request)
    if denied is not None:
        return denied
    counts = {"exact": 0, "semantic": 0}
    if gw.cache is not None:
        try:
            counts = await gw.cache.clear(model)
        except Exception as e:
            rid = request_id_of(request)
            logger.error("request %s: clearing the response cache failed", rid, exc_info=e)
            raise OpenAIError(
                f"the response cache's backend failed (request id {rid})", 503, "server_error", code="cache_unavailable"
            ) from None
    return {"object": "cache.cleared", "model": model, "enabled": gw.cache is not None, **counts}


async def cache_stats(gw, request: Request):
    """The response cache's counters and sizes on this gateway replica (admin key)."""
    denied = admin_denied(gw, request)
    if denied is not None:
        return denied
    stats = await gw.cache.stats() if gw.cache is not None else {}
    return {"object": "cache.stats", "enabled": gw.cache is not None, **stats}
