"""OpenAI API request bodies (pydantic), the OpenAI error body, and the typed stream
from the LLM server to the ingress (:class:`GenerationChunk`). Response bodies are the
``openai`` package's own types (built in the ingress).

Requests follow https://platform.openai.com/docs/api-reference (chat completions and legacy
completions), plus the vLLM-style extra sampling fields ``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens`` and ``include_stop_str_in_output``. Unknown fields are accepted and
ignored (clients send many optional ones), except fields that would silently change the
meaning of a request that kvserve cannot honour (``tools``, ``response_format`` other than
text, ``logit_bias``, ``n > 1``, ``best_of > 1``, ``suffix``): those get a 400.

This module imports neither Ray nor the engine: it is shared by the ingress, the LLM server
and clients.
"""
from __future__ import annotations

import math

import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


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

    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | int | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, err: "GenerationError") -> "OpenAIError":
        """The HTTP error of a :class:`GenerationError` from the model server."""
        type_ = ("rate_limit_error" if err.status == 429 else
                 "invalid_request_error" if err.status < 500 else "server_error")
        return cls(err.message, err.status, type_, code=err.code, retry_after_s=err.retry_after_s)

    def headers(self) -> dict[str, str] | None:
        """``Retry-After`` (whole seconds, at least 1) for a 429 or 503."""
        if self.status_code in (429, 503):
            return {"Retry-After": str(max(1, math.ceil(self.retry_after_s or 1)))}
        return None

    def body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | int | None = None) -> dict:
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


# ---- shared request fields --------------------------------------------------------------------
class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class _SamplingFields(BaseModel):
    """Sampling fields common to both endpoints (OpenAI names, then vLLM extras)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM-style extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0

    @field_validator("n")
    @classmethod
    def _n_is_one(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        if v is None:
            return v
        items = [v] if isinstance(v, str) else v
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported")
        return v

    @model_validator(mode="after")
    def _check_unsupported(self):
        extra = self.model_extra or {}
        if extra.get("tools"):
            raise ValueError("tools / function calling is not supported")
        rf = extra.get("response_format")
        if isinstance(rf, dict) and rf.get("type", "text") != "text":
            raise ValueError("response_format other than text is not supported")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    def sampling_dict(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """Keyword arguments for ``engine.SamplingParams``."""
        d: dict[str, Any] = {
            "max_tokens": max_tokens,
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "stop": self.stop,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "stop_token_ids": self.stop_token_ids,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
        }
        if self.top_k is not None:
            d["top_k"] = self.top_k
        if self.min_p is not None:
            d["min_p"] = self.min_p
        if self.repetition_penalty is not None:
            d["repetition_penalty"] = self.repetition_penalty
        return d

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# ---- chat completions ---------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for p in v:
                if p.type != "text" or p.text is None:
                    raise ValueError(f"only text content parts are supported, got type {p.type!r}")
        return v

    def to_template(self) -> dict[str, Any]:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        return d


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.top_logprobs is not None and self.top_logprobs > 0 and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


# ---- completions ----------------------------------------------------------------------
class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _non_empty(cls, v):
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be empty")
            if isinstance(v[0], list) and any(not p for p in v):
                raise ValueError("token id prompts must not be empty")
        return v

    @model_validator(mode="after")
    def _check_unsupported_completion(self):
        if self.best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt(s) as a list: a string, a token id list, or a batch of either."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [list(p)]
        return list(p)


# ---- the server -> ingress stream ---------------------------------------------------------
def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


#: Error codes of :class:`GenerationError` and the HTTP status each maps to.
ERROR_STATUS = {
    "context_length_exceeded": 400,  # the prompt (plus one output token) does not fit max_model_len
    "invalid_value": 400,            # a value the engine cannot honour (the message names the field)
    "queue_full": 429,               # the replica is at capacity: retry after retry_after_s
    "too_large": 400,                # can never be admitted (more than a replica's whole queue bound)
    "timeout": 504,                  # ran past the server's request_timeout_s (aborted, blocks freed)
    "engine_dead": 503,              # the replica's engine stopped; Serve replaces the replica
    "internal": 500,                 # a failure of the server itself (details in its log)
}


@dataclass
class GenerationError:
    """Why a request could not run: ``code`` is a key of :data:`ERROR_STATUS`."""

    code: str
    message: str
    retry_after_s: float | None = None  # for "queue_full": when a retry may succeed, seconds

    @property
    def status(self) -> int:
        """The HTTP status of this error."""
        return ERROR_STATUS[self.code]


@dataclass
class TopLogprob:
    """One candidate token at a position: id, text, UTF-8 bytes, log-probability (natural log)."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float


@dataclass
class TokenLogprob(TopLogprob):
    """The sampled token at a position, with the ``logprobs`` most likely candidates."""

    top_logprobs: list[TopLogprob] = field(default_factory=list)


@dataclass
class GenerationChunk:
    """What ``LLMServer.generate`` yields: one record per engine step that gives the request
    tokens (the contract between the LLM server and the ingress or any Python-handle caller;
    a plain dataclass, so it pickles cleanly over Ray and needs neither torch nor the engine).

    Attributes:
        text: the text new in this step (held back while it may be the start of a stop string).
        token_ids: the token ids new in this step.
        finished: the last record of the request.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``"error"`` on the last record.
        stop_reason: the stop string or stop token id that ended it, if any.
        num_prompt_tokens, num_output_tokens, num_cached_tokens: tokens so far (cached: prompt
            tokens served from the prefix cache).
        logprobs: per new token (only when asked for).
        error: set (and ``finished``) when the request could not run.

    ``chunk["text"]`` works as ``chunk.text`` (the records were plain dicts before).
    """

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: GenerationError | None = None

    def extend(self, chunk: "GenerationChunk") -> None:
        """Fold the request's next chunk into this one (the whole generation so far): text,
        token ids and logprobs are appended; status, counts and error are the newest."""
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(chunk.logprobs)
        self.finished, self.finish_reason, self.stop_reason = chunk.finished, chunk.finish_reason, chunk.stop_reason
        self.num_prompt_tokens, self.num_output_tokens = chunk.num_prompt_tokens, chunk.num_output_tokens
        self.num_cached_tokens, self.error = chunk.num_cached_tokens, chunk.error

    def __getitem__(self, key: str) -> Any:
        return getattr(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)


def finish_reason(engine_reason: str | None) -> str | None:
    """Engine finish reasons -> OpenAI's (``stop``, ``length``; aborts count as ``stop``)."""
    if engine_reason is None:
        return None
    return "length" if engine_reason == "length" else "stop"
