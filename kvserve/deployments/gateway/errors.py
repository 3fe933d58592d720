"""Every error the gateway answers is OpenAI's body (``{"error": {"message", "type",
"param", "code"}}``) and carries no traceback, path or process id: 400 for invalid fields and
prompts longer than the context, 401/403 for keys, 404 for an unknown model, 413 for a body
over the limit, 429 when a queue or a key's budget is full (with ``Retry-After``), 503 when a
model's replicas are down, 500 only for failures of the server itself (its message gives the
request id; the details go to the log)."""

from __future__ import annotations

import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from kvserve.deployments.contract.openai_errors import OpenAIError, anthropic_error_body, error_body
from kvserve.deployments.gateway.gate import anthropic_path
from kvserve.deployments.gateway.streams import sse

logger = logging.getLogger("ray.serve")

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(request: Request | None) -> str:
    """The request's id for logs and error messages: the client's ``X-Request-ID`` when it
    is a short plain token (anything else would go into our logs), else a random one."""
    rid = request.headers.get("x-request-id", "") if request is not None else ""
    return rid if _REQUEST_ID_RE.fullmatch(rid) else uuid.uuid4().hex


def internal(request_id: str, what: str = "internal server error") -> OpenAIError:
    """A 500 whose body tells the client nothing but the request id (details go to the log)."""
    return OpenAIError(f"{what} (request id {request_id})", 500, "server_error")


def error_response(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    param: str | None = None,
    code: str | int | None = None,
    headers: dict | None = None,
    request: Request | None = None,
) -> JSONResponse:
    """An OpenAI error body as a response; Anthropic's body for a request of the Messages API
    (``request`` given, its path under ``/v1/messages``)."""
    if request is not None and anthropic_path(request.scope):
        return JSONResponse(
            anthropic_error_body(status, message, request_id_of(request)), status_code=status, headers=headers
        )
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


def as_client_error(exc: BaseException) -> OpenAIError | None:
    """Map an exception from a model's handle (possibly wrapped by Ray) to a client error, or
    None for a failure of the server (the caller logs it and answers a bare 500). Messages
    never carry Ray's text (actor ids, addresses, tracebacks)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, BackPressureError):  # every replica is full and so is this caller's handle queue
        return OpenAIError(
            "the model's queue is full, retry later", 429, "rate_limit_error", code="queue_full", retry_after_s=1.0
        )
    if isinstance(exc, (DeploymentUnavailableError, ActorDiedError, ActorUnavailableError)):
        return OpenAIError(
            "the model server is not available, retry later", 503, "server_error", code="model_unavailable"
        )
    return None


def failed(request_id: str, exc: BaseException) -> OpenAIError:
    """The client's error for a generation that failed midway (the details are logged)."""
    err = as_client_error(exc)
    if err is None:
        logger.error("request %s: generation failed", request_id, exc_info=exc)
        err = internal(request_id, "generation failed")
    return err


def stream_error(request_id: str, exc: BaseException) -> bytes:
    """The SSE event of a stream that failed after its response started."""
    return sse(failed(request_id, exc).body())


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` (FastAPI's validation errors, Starlette's HTTP errors,
    anything unhandled) with OpenAI's body."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code, exc.headers(), request)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        if first.get("type") == "json_invalid":
            msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
            return error_response(400, msg, param=None, code="invalid_json", request=request)
        parts = []
        for e in errs[:5]:
            where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
            msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
            parts.append(f"{where}: {msg}")
        return error_response(400, "; ".join(parts), param=".".join(loc) or None, code="invalid_value", request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = "request_too_large" if exc.status_code == 413 else None
        return error_response(
            exc.status_code, str(exc.detail), type_, code=code, headers=getattr(exc, "headers", None), request=request
        )

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        rid = request_id_of(request)
        logger.error("request %s: unhandled error in the gateway", rid, exc_info=exc)
        return error_response(500, internal(rid).message, "server_error", request=request)
