"""The OpenAI API's error body and ids: :class:`OpenAIError` (raised anywhere on the gateway side,
rendered as OpenAI's ``{"error": {...}}`` body) and :func:`random_id`."""

from __future__ import annotations

import math
import uuid

from pydantic import BaseModel

from kvserve.deployments.contract.types import GenerationError


# ---- errors --------------------------------------------------------------------------------
class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}`` as the OpenAI API returns it."""

    error: ErrorInfo


class OpenAIError(Exception):
    """An error with an HTTP status and an OpenAI error body (raised by request handlers)."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | int | None = None,
        retry_after_s: float | None = None,
    ):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, err: "GenerationError") -> "OpenAIError":
        """The HTTP error of a :class:`GenerationError` from the model server."""
        type_ = (
            "rate_limit_error" if err.status == 429 else "invalid_request_error" if err.status < 500 else "server_error"
        )
        return cls(err.message, err.status, type_, param=err.param, code=err.code, retry_after_s=err.retry_after_s)

    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` (whole seconds, at least 1) for a 429 or 503."""
        if self.status_code in (429, 503):
            return {"Retry-After": str(max(1, math.ceil(self.retry_after_s or 1)))}
        return None

    def body(self) -> dict:
        return ErrorResponse(
            error=ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        ).model_dump()


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: str | int | None = None
) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


#: Anthropic's error ``type`` by HTTP status (its API's errors page); others: ``api_error``.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str, request_id: str | None = None) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}, "request_id"}``
    (the ``/v1/messages`` endpoints answer in it)."""
    out: dict = {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}
    if request_id:
        out["request_id"] = request_id
    return out


# ---- ids ------------------------------------------------------------------------------------
def random_id(prefix: str) -> str:
    """An OpenAI-style response id: ``<prefix>-<32 hex digits>`` (``chatcmpl-...``, ``cmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"
