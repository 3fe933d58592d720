"""``OpenAIIngress``: the OpenAI-compatible HTTP front (FastAPI through ``@serve.ingress``).

Endpoints: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``,
``GET /health``. Bodies are validated with the pydantic models of
:mod:`deployments.protocol`; every error, FastAPI's own validation errors included, leaves as
an OpenAI error body (``{"error": {"message", "type", "param", "code"}}``): 400 for invalid
fields and prompts longer than the context, 401 for a missing or wrong API key (when keys
are configured), 404 for an unknown model, 429 when the model's queue is full, 500 only for
failures of the server itself.

Streaming answers are Server-Sent Events in OpenAI's chunk format, one event per engine
step that gives the request text, ending with ``data: [DONE]``; nothing is buffered or
delayed on the way. A client that disconnects cancels the handle stream, which aborts the
request in the engine (its KV blocks go back to the pool).
"""
# No ``from __future__ import annotations``: Serve rebuilds the endpoint signatures of the
# class-based view and FastAPI must see real annotations (``Request``) there.
import asyncio
import contextvars
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs as ChatChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkChoiceLogprobs
from openai.types.chat.chat_completion_token_logprob import TopLogprob as OpenAITopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.completion_usage import PromptTokensDetails
from pydantic import BaseModel
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import gate
from deployments.cache import NO_CACHE, CacheSettings, Lookup, ResponseCache, request_options
from deployments.limits import NeverFits, RateLimited, RateLimiter, find_policy, policies_from_keys
from telemetry.metrics import api_key_requests, api_key_tokens, model_routes, rejected, upstream_fallbacks
from deployments.model_routing import AUTO_MODEL, ModelRouting, Upstream, UpstreamArgs, UpstreamError, user_text
from deployments.args import DEFAULT_MAX_PROMPTS_PER_REQUEST
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    NamedToolChoice,
    OpenAIError,
    error_body,
    random_id,
    unknown_fields,
)
from deployments.server_types import GenerationChunk, TokenLogprob, finish_reason
from deployments.tools import StreamingToolText, ToolParser, get_tool_parser, parse_forced, tool_grammar

logger = logging.getLogger("ray.serve")

app = FastAPI(title="kvserve", description="OpenAI-compatible LLM serving on Ray Serve", version="0.1.0")
app.add_middleware(gate.RequestGate)  # API key and body size, before any body byte is read
app.add_middleware(gate.CORS)  # outermost: preflights answered, and every answer (401s too) carries CORS headers

_REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def request_id_of(request: Request | None) -> str:
    """The id Serve's proxy gave this HTTP request (the ``X-Request-ID`` response header):
    error messages carry it and the server log records it next to the details. A client-sent
    id that is not a short plain token is replaced (it would go into our logs)."""
    rid = request.headers.get("x-request-id", "") if request is not None else ""
    return rid if _REQUEST_ID_RE.fullmatch(rid) else uuid.uuid4().hex


def _internal(request_id: str, what: str = "internal server error") -> OpenAIError:
    """A 500 whose body tells the client nothing but the request id (details go to the log)."""
    return OpenAIError(f"{what} (request id {request_id})", 500, "server_error")


# ---- errors: always OpenAI's body -------------------------------------------------------------
def _error_response(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                    code: str | int | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, type, param, code), status_code=status, headers=headers)


@app.exception_handler(OpenAIError)
async def _openai_error(_: Request, exc: OpenAIError):
    return _error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code, exc.headers())


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError):
    errs = exc.errors()
    first = errs[0] if errs else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        msg = f"request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg', ''))}"
        return _error_response(400, msg, param=None, code="invalid_json")
    parts = []
    for e in errs[:5]:
        where = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        parts.append(f"{where}: {msg}")
    return _error_response(400, "; ".join(parts), param=".".join(loc) or None, code="invalid_value")


@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException):
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    code = "request_too_large" if exc.status_code == 413 else None
    return _error_response(exc.status_code, str(exc.detail), type_, code=code, headers=getattr(exc, "headers", None))


@app.exception_handler(Exception)
async def _internal_error(request: Request, exc: Exception):
    rid = request_id_of(request)
    logger.error("request %s: unhandled error in the OpenAI ingress", rid, exc_info=exc)
    return _error_response(500, _internal(rid).message, "server_error")


def _as_client_error(exc: BaseException) -> OpenAIError | None:
    """Map an exception from the LLM server (possibly wrapped by Ray) to a client error, or
    None for a failure of the server (the caller logs it and answers a bare 500). Messages
    never carry Ray's text (actor ids, addresses, tracebacks)."""
    from ray.exceptions import ActorDiedError, ActorUnavailableError
    from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, BackPressureError):  # every replica is full and so is this caller's handle queue
        return OpenAIError("the model's queue is full, retry later", 429, "rate_limit_error", code="queue_full",
                           retry_after_s=1.0)
    if isinstance(exc, (DeploymentUnavailableError, ActorDiedError, ActorUnavailableError)):
        return OpenAIError("the model server is not available, retry later", 503, "server_error",
                           code="model_unavailable")
    return None


def _deployment_of(handle: DeploymentHandle) -> str:
    """The deployment name behind a handle."""
    return getattr(handle, "deployment_name", None) or getattr(handle.deployment_id, "name", "")


def _sse(obj: BaseModel | dict) -> bytes:
    """One Server-Sent Event; an OpenAI model is written with the fields we set (no nulls
    for fields kvserve never fills, such as tool calls)."""
    body = obj.model_dump_json(exclude_unset=True) if isinstance(obj, BaseModel) else json.dumps(
        obj, separators=(",", ":"), ensure_ascii=False)
    return b"data: " + body.encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Stream:
    """One request's handle stream of :class:`GenerationChunk` (``n`` choices interleaved,
    each ending with its own finished chunk), with its first chunk already fetched (so bad
    input fails as an HTTP error before any byte of a streaming response is sent)."""

    def __init__(self, gen, first: GenerationChunk, n: int = 1):
        self.gen, self.first, self.left = gen, first, n - first.finished
        self.done = self.left == 0
        self.record: list[GenerationChunk] | None = None  # every chunk, for the response cache

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The chunks; a chunk with ``error`` (e.g. the request ran past the server's
        ``request_timeout_s``) raises it as an :class:`OpenAIError`."""
        if self.record is not None:
            self.record.append(self.first)
        yield self.first
        if self.done:
            return
        async for chunk in self.gen:
            if chunk.error is not None:
                self.done = True
                raise OpenAIError.of(chunk.error)
            self.left -= chunk.finished
            self.done = self.left == 0
            if self.record is not None:
                self.record.append(chunk)
            yield chunk
            if self.done:
                return

    @classmethod
    def replay(cls, chunks: list[GenerationChunk], n: int) -> "_Stream":
        """A stream of a cached answer's chunks (the response cache's hit)."""
        async def rest():
            for c in chunks[1:]:
                yield c

        return cls(rest(), chunks[0], n)

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            try:
                self.gen.cancel()
            except Exception:
                pass


def _usage(n_prompt: int, n_out: int, n_cached: int) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out,
                           prompt_tokens_details=PromptTokensDetails(cached_tokens=n_cached))


def _chat_logprobs(entries: list[TokenLogprob]) -> list[ChatCompletionTokenLogprob]:
    return [ChatCompletionTokenLogprob(token=e.token, logprob=e.logprob, bytes=e.bytes, top_logprobs=[
        OpenAITopLogprob(token=t.token, logprob=t.logprob, bytes=t.bytes) for t in e.top_logprobs]) for e in entries]


def _completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[Logprobs, int]:
    """Legacy completions logprobs (parallel lists per token) from ``offset`` characters on;
    returns them and the offset after the last token. An entry without a log-probability
    (the first prompt token under ``echo``) gets null ones, as OpenAI writes it."""
    lp = Logprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        lp.tokens.append(e.token)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append(None if e.logprob is None else {t.token: t.logprob for t in e.top_logprobs})
        lp.text_offset.append(offset)
        offset += len(e.token)
    return lp, offset


def _join_logprobs(a: Logprobs, b: Logprobs) -> Logprobs:
    """``a``'s tokens followed by ``b``'s."""
    return Logprobs.model_construct(tokens=a.tokens + b.tokens, token_logprobs=a.token_logprobs + b.token_logprobs,
                    top_logprobs=a.top_logprobs + b.top_logprobs, text_offset=a.text_offset + b.text_offset)


def estimate_prompt_tokens(prompt) -> int:
    """A prompt's token count before the model server tokenizes it, for reserving a key's
    token budget (settled with the real count afterwards): exact for token ids, about 4
    UTF-8 bytes per token for text (BPE tokenizers on English), plus a few tokens of chat
    template per message."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):  # chat messages
        return sum(4 + estimate_prompt_tokens(json.dumps(m.get("content"), ensure_ascii=False)
                                              if not isinstance(m.get("content"), str) else m["content"])
                   for m in prompt)
    return len(str(prompt).encode()) // 4 + 1


class _KeyUse:
    """One request's use of its API key: the rate limiter's grant and the key's metrics."""

    def __init__(self, ingress: "OpenAIIngress", key: str, model: str, grant, priority: int):
        self.ingress, self.key, self.model, self.grant, self.priority = ingress, key, model, grant, priority
        self.done = False

    async def settle(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Count the tokens the request used (once) and give the unused reservation back."""
        if self.done:
            return
        self.done = True
        labels = {"api_key": self.key, "model_name": self.model}
        self.ingress._key_tokens.inc({**labels, "kind": "prompt"}, prompt_tokens)
        self.ingress._key_tokens.inc({**labels, "kind": "generation"}, generation_tokens)
        if self.grant is not None:
            await self.ingress.limiter.settle(self.grant, prompt_tokens + generation_tokens)

    def settle_soon(self, lasts: dict[tuple[int, int], GenerationChunk] | list[GenerationChunk]) -> None:
        """:meth:`settle` with the last chunks of a request's choices (keyed ``(prompt index,
        choice index)`` as in :func:`_usage_of`; a list is one choice per prompt), in a task of
        its own (a cancelled response's cleanup must not await the rate limiter's Redis)."""
        if self.done:
            return
        if isinstance(lasts, list):
            lasts = {(k, 0): c for k, c in enumerate(lasts)}
        usage = _usage_of(lasts)
        task = asyncio.ensure_future(self.settle(usage.prompt_tokens, usage.completion_tokens))
        _SETTLING.add(task)
        task.add_done_callback(_SETTLING.discard)


_SETTLING: set[asyncio.Task] = set()  # settle tasks in flight (referenced until done)
#: Seconds between re-reads of a model's weights revision (the response cache's key): a
#: replica restarted on new weights stops old cached answers within this time.
REVISION_REFRESH_S = 10.0
_WARNED_FIELDS: set[str] = set()  # unknown request fields already logged (once per name)


def _warn_unknown(body: BaseModel) -> None:
    """Log the request's unknown (ignored) fields, once per field name for this replica."""
    new = [f for f in unknown_fields(body) if f not in _WARNED_FIELDS]
    if new:
        _WARNED_FIELDS.update(new)
        logger.warning("ignoring unknown request field(s) %s (accepted, no effect; logged once per field)",
                       ", ".join(repr(f[:64]) for f in new[:20]))


def _usage_of(lasts: dict[tuple[int, int], GenerationChunk]) -> CompletionUsage:
    """Usage of a request's choices, keyed ``(prompt index, choice index)``: each prompt's
    tokens counted once (its ``n`` choices share it), every choice's output tokens, the
    prefix-cache hits of each prompt's first choice."""
    prompts: dict[int, tuple[int, int]] = {}
    out = 0
    for (p, i), c in sorted(lasts.items()):
        if p not in prompts:
            prompts[p] = (c.num_prompt_tokens, c.num_cached_tokens)
        out += c.num_output_tokens
    return _usage(sum(n for n, _ in prompts.values()), out, sum(k for _, k in prompts.values()))


class _ChatChoice:
    """How one chat choice's text becomes OpenAI's message: plain content, or tool calls
    (``mode``: ``text``, ``auto`` (parsed by the model family's parser), ``required`` (a
    grammar-forced JSON array of calls) or ``named`` (the output is the arguments of
    ``tool_choice``'s function)); streaming and whole."""

    def __init__(self, mode: str, parser: ToolParser | None, tool_choice):
        self.mode, self.parser, self.tool_choice = mode, parser, tool_choice
        self.role_sent = False
        self.tool_text = StreamingToolText(parser) if mode == "auto" else None
        self.held = ""  # required: the whole output is parsed at the end
        self.call_id: str | None = None  # named: the call streamed so far
        self.called = False

    @staticmethod
    def mode_of(body: ChatCompletionRequest) -> str:
        choice = body.effective_tool_choice
        if choice == "none":
            return "text"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def _finish(self, engine_reason: str | None) -> str | None:
        fr = finish_reason(engine_reason)
        return "tool_calls" if self.called and fr == "stop" else fr

    def message(self, whole: GenerationChunk) -> tuple[ChatCompletionMessage, str | None]:
        """The whole choice: the assistant message and its finish reason."""
        text, calls = whole.text, None
        if self.mode in ("required", "named"):
            calls = parse_forced(text, self.tool_choice.model_dump() if self.mode == "named" else "required")
            if calls:
                text = None
        elif self.mode == "auto":
            content, calls = self.parser.extract(text)
            if calls:
                text = content
        self.called = bool(calls)
        msg = ChatCompletionMessage(role="assistant", content=text, tool_calls=[
            ChatCompletionMessageFunctionToolCall(id=c.id, type="function", function=Function(
                name=c.name, arguments=c.arguments)) for c in calls] if calls else None)
        return msg, self._finish(whole.finish_reason)

    def deltas(self, chunk: GenerationChunk) -> tuple[list[ChoiceDelta], str | None]:
        """The stream deltas for one chunk of this choice, and its finish reason (on the last)."""
        text, calls, content = chunk.text, [], ""
        if self.mode == "text":
            content = text
        elif self.mode == "auto":
            content = self.tool_text.feed(text)
            if chunk.finished:
                rest, calls = self.tool_text.finish()
                content += rest
        elif self.mode == "required":
            self.held += text
            if chunk.finished:
                calls = parse_forced(self.held, "required") or []
                content = "" if calls else self.held
        else:  # named: the arguments stream as they are generated
            name = self.tool_choice.function.name
            out = []
            if self.call_id is None and (text or chunk.finished):
                self.call_id, self.called = f"call_{uuid.uuid4().hex[:24]}", True
                out.append(ChoiceDeltaToolCall(index=0, id=self.call_id, type="function",
                                               function=ChoiceDeltaToolCallFunction(name=name, arguments=text)))
            elif text:
                out.append(ChoiceDeltaToolCall(index=0, function=ChoiceDeltaToolCallFunction(arguments=text)))
            deltas = [ChoiceDelta(tool_calls=out)] if out else []
            return self._role(deltas), self._finish(chunk.finish_reason) if chunk.finished else None
        deltas = [ChoiceDelta(content=content)] if content else []
        if calls:
            self.called = True
            deltas.append(ChoiceDelta(tool_calls=[ChoiceDeltaToolCall(
                index=k, id=c.id, type="function", function=ChoiceDeltaToolCallFunction(name=c.name, arguments=c.arguments))
                for k, c in enumerate(calls)]))
        return self._role(deltas), self._finish(chunk.finish_reason) if chunk.finished else None

    def _role(self, deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
        """The first delta of a choice carries ``role`` (an empty one is sent if need be)."""
        if not self.role_sent:
            self.role_sent = True
            if deltas:
                deltas[0].role = "assistant"
            else:
                deltas = [ChoiceDelta(role="assistant", content="")]
        return deltas


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, graceful_shutdown_timeout_s=5)
@serve.ingress(app)
class OpenAIIngress:
    """Routes OpenAI requests to the ``LLMServer`` deployment of the requested model.

    Args:
        models: served model name -> ``LLMServer`` handle; the first is the default for
            requests without ``model``.
        api_keys: if set, ``Authorization: Bearer <key>`` must carry one of them (all
            endpoints but ``/health``).
        cache: the response caches' :class:`~deployments.cache.CacheSettings` as a dict
            (None: the defaults, exact cache on); ``redis_url`` is this ingress's unless given.
        admin_api_keys: keys that may clear the response cache (``DELETE /v1/cache``); with
            ``api_keys`` set they are accepted by the gate too.
        model_routing: rules of ``model: "auto"`` (:class:`~deployments.model_routing.ModelRouting`
            or its dict); None: no ``auto`` model.
        upstream: the fallback (:class:`~deployments.model_routing.UpstreamArgs` or its dict) for
            requests every local replica refuses (capacity, failure); None: those fail here.
    """

    def __init__(self, models: dict[str, DeploymentHandle], api_keys: list[str] | None = None, *,
                 max_request_body_bytes: int = gate.DEFAULT_MAX_BODY_BYTES,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 health_timeout_s: float = 5.0, rate_limit_rpm: float | None = None,
                 rate_limit_tpm: float | None = None, redis_url: str | None = None,
                 auth_failures_per_minute: int = gate.DEFAULT_AUTH_FAILURES_PER_MINUTE,
                 num_ingress_replicas: int = 1, allowed_origins: list[str] | None = None,
                 cache: dict | None = None, admin_api_keys: list[str] | None = None,
                 model_routing: dict | ModelRouting | None = None, upstream: dict | UpstreamArgs | None = None):
        from cluster import reset_niceness

        reset_niceness()  # Ray starts workers at niceness 15: latency-critical here
        if not models:
            raise ValueError("OpenAIIngress needs at least one model")
        if max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be positive, got {max_prompts_per_request}")
        self._admin_keys = policies_from_keys(admin_api_keys or [])
        if api_keys:  # an admin key must get past the gate to reach DELETE /v1/cache
            known = {k.split()[0] for k in api_keys if k.split()}
            api_keys = list(api_keys) + [p.key for p in self._admin_keys if p.key not in known]
        gate.configure(api_keys, max_request_body_bytes, auth_failures_per_minute,  # before any body is read
                       ["*"] if allowed_origins is None else allowed_origins)
        settings = CacheSettings(**{"redis_url": redis_url, **(cache or {})})
        self.cache = ResponseCache(settings) if settings.enabled else None
        self._revision_checked: dict[str, float] = {}  # model -> when its revision was last fetched
        # per-key limits: shared through Redis when given, else each ingress replica enforces its share
        self.limiter = RateLimiter(rate_limit_rpm, rate_limit_tpm, redis_url=redis_url,
                                   divide_by=max(1, num_ingress_replicas))
        self._rejected, self._key_tokens, self._key_requests = rejected(), api_key_tokens(), api_key_requests()
        self.models = dict(models)
        self.default_model = next(iter(self.models))
        self.max_prompts_per_request = max_prompts_per_request
        self.health_timeout_s = health_timeout_s
        self._info: dict[str, dict] = {}  # model_info() of each model's server
        self._info_lock = asyncio.Lock()
        self.draining = False
        self._status_cache: tuple[float, object] | None = None
        self._created = int(time.time())
        self._streaming = {name: h.options(stream=True) for name, h in self.models.items()}
        self.routing = None if model_routing is None else ModelRouting.model_validate(model_routing)
        if self.routing is not None:
            self.routing.check(list(self.models))
        self.upstream = None if upstream is None else Upstream(UpstreamArgs.model_validate(upstream))
        self._routes, self._fallbacks = model_routes(), upstream_fallbacks()

    # ---- helpers ---------------------------------------------------------------------------
    def _route(self, model: str | None) -> tuple[str, DeploymentHandle]:
        name = model or self.default_model
        if name not in self._streaming:
            raise OpenAIError(f"the model '{name}' does not exist; available: {', '.join(self.models)}", 404,
                              "invalid_request_error", param="model", code="model_not_found")
        return name, self._streaming[name]

    def _pick(self, model: str | None, max_tokens: int | None, *, messages: list[dict] | None = None,
              prompts: list | None = None) -> tuple[str, DeploymentHandle, dict[str, str]]:
        """:meth:`_route`, with ``model: "auto"`` resolved by the routing rules; also the
        response headers saying so (``x-kvserve-route: auto:<rule>``)."""
        if model != AUTO_MODEL or self.routing is None:
            return (*self._route(model), {})
        if messages is not None:
            tokens = estimate_prompt_tokens(messages)
        else:
            tokens = max((estimate_prompt_tokens(p) for p in prompts or [""]), default=0)
        name, rule = self.routing.choose(tokens, max_tokens, user_text(messages, prompts), self.default_model)
        self._routes.inc({"model_name": name, "route": rule})
        return (*self._route(name), {"x-kvserve-route": f"auto:{rule}"})

    async def _fallback(self, request: Request, path: str, model: str, hid: str, err: OpenAIError):
        """The upstream's answer to this request (``path`` under its base URL), which every
        local replica of ``model`` refused with ``err``; ``err`` itself when the upstream cannot
        be reached (the client then sees the local verdict and its Retry-After)."""
        self._fallbacks.inc({"model_name": model, "reason": err.code or str(err.status_code)})
        logger.info("request %s: %s refused it (%s); sending it upstream", hid, model, err.code or err.status_code)
        try:
            return await self.upstream.forward(path, await request.json(), model, hid)
        except UpstreamError as e:
            logger.warning("request %s: fallback failed: %s", hid, e)
            raise err from None

    def _falls_back(self, exc: BaseException) -> bool:
        return (self.upstream is not None and isinstance(exc, OpenAIError)
                and Upstream.applies(exc.status_code, exc.code))

    async def _open(self, rid: str, model: str, handle: DeploymentHandle, *args, n: int = 1, **kwargs) -> _Stream:
        """Start ``handle.generate`` (``n`` choices) and wait for its first chunk.

        Raises:
            OpenAIError: the server refused the request (its error), or Serve did
                (``queue_full`` 429, ``model_unavailable`` 503).
        """
        gen = handle.generate.remote(*args, return_errors=True, **kwargs)
        try:
            first = await gen.__anext__()
        except asyncio.CancelledError:  # the client went away before the first token
            gen.cancel()
            raise
        except StopAsyncIteration:
            logger.error("request %s: the model server returned no output", rid)
            raise _internal(rid) from None
        except Exception as e:
            err = _as_client_error(e)
            if err is None:
                logger.error("request %s: the model server failed", rid, exc_info=e)
                err = _internal(rid)
            elif err.code in ("queue_full", "model_unavailable"):  # refused by Serve before any replica saw it
                self._rejected.inc({"model_name": model, "reason": err.code})
            raise err from None
        if first.error is not None:  # the server's own verdict: a client error, a full queue, a dead engine
            raise OpenAIError.of(first.error)
        return _Stream(gen, first, n)

    async def _admit_key(self, request: Request, model: str, prompt_tokens: int, max_tokens: int | None,
                         priority: int) -> "_KeyUse":
        """Per-API-key admission: the key's token buckets (``prompt_tokens`` estimated +
        ``max_tokens`` reserved; :meth:`_KeyUse.settle` returns what was not used) and its
        scheduler priority (a request may lower its own precedence, never raise it above its
        key's: the larger number wins, lower runs first).

        Raises:
            OpenAIError: 429 ``rate_limit_exceeded`` (with ``Retry-After``), 400 ``too_large``
                (more tokens than the key may use per minute), 403 (the key may send nothing).
        """
        policy = gate.request_policy(request.scope)
        key = policy.name if policy is not None else "anonymous"
        grant = None
        if policy is not None and self.limiter.enabled_for(policy):
            if max_tokens is None:
                max_tokens = (await self._model_info(model))["max_model_len"] - prompt_tokens
            try:
                grant = await self.limiter.acquire(policy, prompt_tokens + max(0, max_tokens))
            except RateLimited as e:
                self._rejected.inc({"model_name": model, "reason": "rate_limited"})
                raise OpenAIError(str(e), 429, "rate_limit_error", code="rate_limit_exceeded",
                                  retry_after_s=e.retry_after_s) from None
            except NeverFits as e:
                if e.limit == "requests":
                    raise OpenAIError("this API key may not send requests", 403, "permission_error",
                                      code="permission_denied") from None
                raise OpenAIError(str(e), 400, param="max_tokens", code="too_large") from None
        self._key_requests.inc({"api_key": key, "model_name": model})
        return _KeyUse(self, key, model, grant, max(priority, policy.priority if policy is not None else priority))

    # ---- response cache (deployments/cache.py) ---------------------------------------------
    async def _cache_lookup(self, request: Request, model: str, endpoint: str,
                            body: ChatCompletionRequest | CompletionRequest) -> Lookup:
        """The response cache's verdict on this request (before any replica sees it):
        a hit with the cached answer, a miss to store, or a bypass; ``NO_CACHE`` when off."""
        if self.cache is None:
            return NO_CACHE
        return await self.cache.lookup(model, await self._revision(model), endpoint, body,
                                       request_options(body, request.headers))

    async def _revision(self, model: str) -> str:
        """The weights revision of ``model`` (``LLMServer.model_info()["revision"]``), re-read
        in the background every :data:`REVISION_REFRESH_S` seconds."""
        info = await self._model_info(model)
        now = time.monotonic()
        if now - self._revision_checked.setdefault(model, now) > REVISION_REFRESH_S:
            self._revision_checked[model] = now
            # in a context of its own: a handle call made in this request's context shares the
            # request's Serve id with its generate call, and Serve's router matches replicas to
            # requests by that id (a concurrent model_info left the generate call pending forever)
            task = asyncio.get_running_loop().create_task(self._refresh_model_info(model),
                                                          context=contextvars.Context())
            _SETTLING.add(task)
            task.add_done_callback(_SETTLING.discard)
        return str(info.get("revision", ""))

    async def _refresh_model_info(self, model: str) -> None:
        try:
            info = await self.models[model].model_info.remote()
        except Exception as e:  # the old info stays; the next request tries again later
            logger.info("model %s: re-reading model_info failed (%s)", model, type(e).__name__)
            return
        if info.get("revision") != self._info.get(model, {}).get("revision"):
            logger.info("model %s: weights revision is now %s (older cached answers are not served)", model,
                        info.get("revision"))
        self._info[model] = info

    def _cache_store(self, look: Lookup, streams: list[_Stream], n: int) -> None:
        """Store a fresh answer that completed (each stream's recorded chunks, ``n`` choices)."""
        if self.cache is not None and look.store:
            self.cache.store_soon(look, [s.record or [] for s in streams], n)

    def _admin_denied(self, request: Request) -> JSONResponse | None:
        """None when the request carries an admin key; else its 401 (no or a wrong key), 403
        (an API key that is not an admin key, or no admin key configured) or 429 (too many
        wrong keys from this address, the gate's throttle)."""
        if not self._admin_keys:
            return _error_response(403, "cache administration is off: no admin key is configured (admin_api_keys "
                                        "or $KVSERVE_ADMIN_API_KEYS)", "permission_error", code="admin_disabled")
        client = request.client.host if request.client else "unknown"
        throttle = gate._settings.throttle
        wait = throttle.retry_after(client)
        if wait is not None:
            return _error_response(429, "too many failed authentication attempts from this address, retry later",
                                   "rate_limit_error", code="auth_throttled",
                                   headers={"Retry-After": str(max(1, int(wait + 0.999)))})
        token = gate.bearer_token(dict(request.scope.get("headers") or []).get(b"authorization", b""))
        if token and find_policy(token, self._admin_keys) is not None:
            return None
        if gate.request_policy(request.scope) is not None:  # a valid API key, not an admin one
            return _error_response(403, "this API key may not administer the response cache", "permission_error",
                                   code="permission_denied")
        throttle.record_failure(client)
        return _error_response(401, "an admin key is needed (send 'Authorization: Bearer <admin key>')",
                               code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    @staticmethod
    def _failed(rid: str, e: BaseException) -> OpenAIError:
        """The client's error for a generation that failed midway (the details are logged)."""
        err = _as_client_error(e)
        if err is None:
            logger.error("request %s: generation failed", rid, exc_info=e)
            err = _internal(rid, "generation failed")
        return err

    @classmethod
    def _stream_error(cls, rid: str, e: BaseException) -> bytes:
        """The SSE event of a stream that failed after its response started."""
        return _sse(cls._failed(rid, e).body())

    # ---- Python API (``serve.get_app_handle("kvserve")``) ---------------------------------
    async def drain(self) -> str:
        """Mark this ingress replica as draining (``/ready`` answers 503 ``draining`` so load
        balancers stop sending; requests are still served until Serve stops the replica).
        Returns the replica's id (``kvserve serve`` calls it until every replica has answered)."""
        self.draining = True
        return serve.get_replica_context().replica_id.unique_id

    async def generate(self, prompt: str | list[int] | None = None, sampling_params: dict | None = None, *,
                       model: str | None = None, messages: list[dict] | None = None,
                       tools: list[dict] | None = None, request_id: str | None = None, priority: int = 0):
        """Stream ``LLMServer.generate`` items of ``model`` (default: the first model); for
        ``serve.get_app_handle(...).options(stream=True).generate.remote(...)``
        (``sampling_params`` may hold ``n``, ``structured_outputs``, ``logit_bias``, ...)."""
        try:
            _, handle = self._route(model)
        except OpenAIError as e:
            raise ValueError(e.message) from None
        gen = handle.generate.remote(prompt, sampling_params, messages=messages, tools=tools, request_id=request_id,
                                     priority=priority)
        try:
            async for item in gen:
                yield item
        finally:
            gen.cancel()

    async def cache_stats(self) -> dict:
        """This ingress replica's response cache counters and sizes (``{}`` when it is off)."""
        return await self.cache.stats() if self.cache is not None else {}

    # ---- endpoints -------------------------------------------------------------------------
    @app.delete("/v1/cache")
    async def clear_cache(self, request: Request, model: str | None = None):
        """Delete cached answers, all or one served model's (``?model=``), with an admin key:
        ``{"object": "cache.cleared", "model", "exact": n, "semantic": m}`` (entries deleted;
        ``memory`` backend: this ingress replica's, ``redis``: everyone's)."""
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        counts = {"exact": 0, "semantic": 0}
        if self.cache is not None:
            try:
                counts = await self.cache.clear(model)
            except Exception as e:
                rid = request_id_of(request)
                logger.error("request %s: clearing the response cache failed", rid, exc_info=e)
                raise OpenAIError(f"the response cache's backend failed (request id {rid})", 503, "server_error",
                                  code="cache_unavailable") from None
        return {"object": "cache.cleared", "model": model, "enabled": self.cache is not None, **counts}

    @app.get("/v1/cache")
    async def get_cache_stats(self, request: Request):
        """The response cache's counters and sizes on this ingress replica (admin key)."""
        denied = self._admin_denied(request)
        if denied is not None:
            return denied
        return {"object": "cache.stats", "enabled": self.cache is not None, **(await self.cache_stats())}

    @app.get("/health")
    async def health(self):
        """200 when every model's server answers its health probe now (no caching: a dead
        engine, a dead tensor-parallel worker or a replica still loading is a 503 at once)."""
        async def probe(name: str) -> str | None:
            try:
                await asyncio.wait_for(self.models[name].health.remote(), self.health_timeout_s)
                return None
            except asyncio.TimeoutError:
                return "not responding"
            except Exception as e:  # the details (Ray's actor ids, addresses) go to the log only
                logger.warning("health probe of model %s failed", name, exc_info=e)
                dead = type(getattr(e, "cause", e)).__name__ == "EngineDeadError"
                return "engine stopped, being replaced" if dead else "not available"

        problems = dict(zip(self.models, await asyncio.gather(*(probe(n) for n in self.models))))
        bad = {n: p for n, p in problems.items() if p is not None}
        if bad:
            msg = "; ".join(f"{n}: {p}" for n, p in bad.items())
            return _error_response(503, f"not ready: {msg}", "server_error", code="unhealthy")
        return {"status": "ok", "models": list(self.models)}

    async def _app_status(self):
        """This application's status from Serve's controller (cached for 1 s): its
        ``status`` (``DELETING`` while it drains) and its deployments' replica states."""
        now = time.monotonic()
        if self._status_cache is None or now - self._status_cache[0] > 1.0:
            app = serve.get_replica_context().app_name
            st = await asyncio.to_thread(serve.status)
            self._status_cache = (now, st.applications.get(app))
        return self._status_cache[1]

    @app.get("/ready")
    async def ready(self):
        """Readiness (for load balancers, Kubernetes' readinessProbe): 200 when every model
        has a replica that stepped recently or answers a 1-token probe; 503 with the reason
        (``loading``, ``draining``, ``not responding``) otherwise. A full queue is ready."""
        if self.draining:
            return _error_response(503, "not ready: draining (the server is shutting down)", "server_error",
                                   code="draining", headers={"Retry-After": "5"})

        async def probe(name: str) -> str | None:
            try:
                await asyncio.wait_for(self.models[name].ready.remote(), self.health_timeout_s)
                return None
            except asyncio.TimeoutError:
                reason = "not responding"
            except Exception as e:  # one line, no traceback: a failing probe is expected while replicas restart
                dead = type(getattr(e, "cause", e)).__name__ == "EngineDeadError"
                reason = "engine stopped, being replaced" if dead else "not available"
                logger.warning("readiness probe of model %s failed: %s", name, type(getattr(e, "cause", e)).__name__)
            try:  # the status as of now, not as of before the probe waited
                self._status_cache = None
                status = await self._app_status()
            except Exception:
                status = None
            dep = status.deployments.get(_deployment_of(self.models[name])) if status is not None else None
            states = {str(getattr(k, "value", k)): v for k, v in (dep.replica_states or {}).items()} if dep else {}
            if states.get("STARTING", 0) + states.get("RECOVERING", 0):
                return "loading (a replica is starting)"
            return reason

        problems = dict(zip(self.models, await asyncio.gather(*(probe(n) for n in self.models))))
        bad = {n: p for n, p in problems.items() if p is not None}
        if bad:
            msg = "; ".join(f"{n}: {p}" for n, p in bad.items())
            return _error_response(503, f"not ready: {msg}", "server_error", code="not_ready",
                                   headers={"Retry-After": "5"})
        return {"status": "ready", "models": list(self.models)}

    @app.get("/metrics")
    async def metrics(self):
        """Prometheus exposition of every kvserve process on this node (the engines' vLLM-named
        metrics, the gateway's, the autoscaler's); see :mod:`telemetry.metrics`."""
        from telemetry.metrics import render

        body, ctype = await asyncio.to_thread(render)
        return Response(body, media_type=ctype)

    async def _model_info(self, name: str) -> dict:
        """The model server's :meth:`LLMServer.model_info`, fetched once per ingress replica.

        The call goes through the model's bounded handle queue like any request, so under a
        burst it can be refused (``BackPressureError``): one fetch runs at a time and is
        retried for up to 30 s while generation requests drain.

        Raises:
            OpenAIError: 429 ``queue_full`` if the queue stayed full, 503 if no replica is up.
        """
        from ray.serve.exceptions import BackPressureError

        if name in self._info:
            return self._info[name]
        async with self._info_lock:
            deadline = time.monotonic() + 30.0
            while name not in self._info:
                try:
                    self._info[name] = await self.models[name].model_info.remote()
                except BackPressureError as e:
                    if time.monotonic() > deadline:
                        raise _as_client_error(e) from None
                    await asyncio.sleep(0.2)
                except (OpenAIError, asyncio.CancelledError):
                    raise
                except Exception as e:
                    err = _as_client_error(e)
                    if err is None:
                        raise
                    raise err from None
        return self._info[name]

    async def _model_card(self, name: str) -> Model:
        """OpenAI's ``Model`` for a served name, plus vLLM's ``max_model_len`` and ``root``
        (the served name: paths of the server stay private), the KV cache's dtype
        (``kv_cache_dtype``: ``auto`` or ``fp8``), the weights' ``quantization`` (None or ``int8``)
        and ``speculative_config`` (None, or its ``method`` and ``num_speculative_tokens``)."""
        info = await self._model_info(name)
        return Model(id=name, object="model", created=self._created, owned_by="kvserve", root=name,
                     max_model_len=info["max_model_len"], kv_cache_dtype=info.get("kv_cache_dtype", "auto"),
                     quantization=info.get("quantization"), speculative_config=info.get("speculative_config"))

    @app.get("/v1/models")
    async def list_models(self):
        data = [(await self._model_card(n)).model_dump() for n in self.models]
        if self.routing is not None:  # "auto": as long a context as the smallest model it may pick
            data.append({**data[0], "id": AUTO_MODEL, "root": AUTO_MODEL,
                         "max_model_len": min(d["max_model_len"] for d in data)})
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str):
        if model_id == AUTO_MODEL and self.routing is not None:
            return next(m for m in (await self.list_models())["data"] if m["id"] == AUTO_MODEL)
        self._route(model_id)  # 404 for a name that is not served
        return (await self._model_card(model_id)).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request, response: Response):
        messages = [m.to_template() for m in body.messages]
        name, handle, route_h = self._pick(body.model, body.effective_max_tokens, messages=messages)
        _warn_unknown(body)
        hid = request_id_of(request)
        rid = random_id("chatcmpl")
        created = int(time.time())
        sp = body.sampling_dict(body.effective_max_tokens, body.num_logprobs)
        mode = _ChatChoice.mode_of(body)
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and mode != "text" else None
        choice = body.tool_choice.model_dump() if mode == "named" else mode
        grammar = tool_grammar(tools, choice, body.parallel_tool_calls) if tools else None
        if grammar is not None:
            sp["structured_outputs"] = grammar
        parser = get_tool_parser((await self._model_info(name)).get("tool_call_parser", "hermes")) \
            if mode == "auto" else None
        look = await self._cache_lookup(request, name, "chat", body)
        # a cached answer counts as a request of the key, with no tokens: nothing is generated
        use = await self._admit_key(request, name, 0 if look.hit else estimate_prompt_tokens(messages),
                                    0 if look.hit else None if body.effective_max_tokens is None
                                    else body.effective_max_tokens * body.n, body.priority)
        try:
            stream = _Stream.replay(look.streams[0], body.n) if look.hit else await self._open(
                hid, name, handle, None, sp, messages=messages, tools=tools, request_id=rid, priority=use.priority,
                n=body.n)
        except BaseException as e:
            use.settle_soon([])
            if self._falls_back(e):
                return await self._fallback(request, "/chat/completions", name, hid, e)
            raise
        if look.hit:
            use.settle_soon([])  # settled at 0 now (the first settle wins; the replay's later one is a no-op)
        elif look.store:
            stream.record = []
        states = [_ChatChoice(mode, parser, body.tool_choice) for _ in range(body.n)]
        if body.stream:
            return StreamingResponse(self._chat_stream(stream, hid, rid, created, name, body, states, use, look),
                                     media_type="text/event-stream",
                                     headers={**_SSE_HEADERS, **look.headers, **route_h})
        wholes = [GenerationChunk(index=i) for i in range(body.n)]
        try:
            async for chunk in stream.chunks():
                wholes[chunk.index].extend(chunk)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            raise self._failed(hid, e) from None
        finally:
            use.settle_soon({(0, w.index): w for w in wholes})
        self._cache_store(look, [stream], body.n)
        response.headers.update({**look.headers, **route_h})
        choices = []
        for i, (whole, state) in enumerate(zip(wholes, states)):
            msg, fr = state.message(whole)
            choices.append(ChatChoice(
                index=i, message=msg, finish_reason=fr,
                logprobs=ChatChoiceLogprobs(content=_chat_logprobs(whole.logprobs or [])) if body.logprobs else None))
        return ChatCompletion(id=rid, object="chat.completion", created=created, model=name, choices=choices,
                              usage=_usage_of({(0, w.index): w for w in wholes}))

    async def _chat_stream(self, stream: _Stream, hid: str, rid: str, created: int, model: str,
                           body: ChatCompletionRequest, states: list[_ChatChoice],
                           use: _KeyUse, look: Lookup = NO_CACHE) -> AsyncIterator[bytes]:
        head = dict(id=rid, object="chat.completion.chunk", created=created, model=model)
        lasts = {(0, 0): stream.first}
        include_usage, continuous = body.include_usage, body.continuous_usage
        try:
            async for chunk in stream.chunks():
                lasts[(0, chunk.index)] = chunk
                state = states[chunk.index]
                deltas, fr = state.deltas(chunk)
                lp = chunk.logprobs if body.logprobs else None
                if not deltas and fr is None and not lp:
                    continue  # nothing new for the client in this step (e.g. a held-back stop string prefix)
                deltas = deltas or [ChoiceDelta()]
                for k, delta in enumerate(deltas):
                    last = k == len(deltas) - 1
                    choice = ChunkChoice(index=chunk.index, delta=delta, finish_reason=fr if last else None,
                                         logprobs=ChunkChoiceLogprobs(content=_chat_logprobs(lp)) if lp and not k else None)
                    out = ChatCompletionChunk(**head, choices=[choice])
                    if include_usage:  # OpenAI sends "usage": null on every chunk but the last
                        out.usage = _usage_of(lasts) if continuous else None
                    yield _sse(out)
            if include_usage:
                yield _sse(ChatCompletionChunk(**head, choices=[], usage=_usage_of(lasts)))
            self._cache_store(look, [stream], body.n)
        except asyncio.CancelledError:
            stream.cancel()
            logger.info("request %s: client disconnected mid-stream; generation aborted", hid)
            raise
        except Exception as e:
            stream.cancel()
            yield self._stream_error(hid, e)
        finally:
            stream.cancel()
            use.settle_soon(lasts)
        yield _DONE

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request, response: Response):
        prompts = body.prompts()
        name, handle, route_h = self._pick(body.model, body.max_tokens, prompts=prompts)
        _warn_unknown(body)
        hid = request_id_of(request)
        if len(prompts) > self.max_prompts_per_request:
            raise OpenAIError(f"{len(prompts)} prompts in one request; the limit is {self.max_prompts_per_request}",
                              400, param="prompt", code="too_many_prompts")
        n_gen = body.best_of or body.n  # sequences generated per prompt; the best n are returned
        bound = (await self._model_info(name)).get("max_in_flight_requests")
        if len(prompts) * n_gen > 1 and bound and len(prompts) * n_gen > bound:  # a retry could never help
            raise OpenAIError(f"{len(prompts)} prompts x {n_gen} choices in one request; a replica of this model "
                              f"takes at most {bound} requests at once (max_num_seqs + max_queued_requests), so this "
                              "request can never be admitted: send fewer prompts or choices per request", 400,
                              param="prompt", code="too_large")
        rid = random_id("cmpl")
        created = int(time.time())
        ranking = n_gen > body.n
        sp = body.sampling_dict(body.max_tokens, body.logprobs if body.logprobs is not None or not ranking else 0)
        sp["n"] = n_gen
        if body.echo and body.logprobs is not None:
            sp["prompt_logprobs"] = body.logprobs
        look = await self._cache_lookup(request, name, "completion", body)
        # a cached answer counts as a request of the key, with no tokens: nothing is generated
        use = await self._admit_key(request, name, 0 if look.hit else sum(estimate_prompt_tokens(p) for p in prompts),
                                    0 if look.hit else None if body.max_tokens is None
                                    else body.max_tokens * len(prompts) * n_gen, body.priority)
        streams: list[_Stream] = []
        try:
            results = [_Stream.replay(c, n_gen) for c in look.streams] if look.hit else await asyncio.gather(
                *(self._open(hid, name, handle, p, sp, request_id=f"{rid}-{i}", priority=use.priority, n=n_gen,
                             echo=body.echo) for i, p in enumerate(prompts)), return_exceptions=True)
            for r in results:
                if isinstance(r, _Stream):
                    streams.append(r)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        except BaseException as e:
            for s in streams:
                s.cancel()
            use.settle_soon([])
            if self._falls_back(e):
                return await self._fallback(request, "/completions", name, hid, e)
            raise
        if look.hit:
            use.settle_soon([])  # settled at 0 now (the first settle wins; the replay's later one is a no-op)
        elif look.store:
            for s in streams:
                s.record = []
        if body.stream:
            return StreamingResponse(self._completion_stream(streams, hid, rid, created, name, body, use, look),
                                     media_type="text/event-stream",
                                     headers={**_SSE_HEADERS, **look.headers, **route_h})
        wholes: dict[tuple[int, int], GenerationChunk] = {}

        async def collect(p: int, s: _Stream):
            async for chunk in s.chunks():
                wholes.setdefault((p, chunk.index), GenerationChunk(index=chunk.index)).extend(chunk)

        try:
            await asyncio.gather(*(collect(p, s) for p, s in enumerate(streams)))
        except BaseException as e:
            for s in streams:
                s.cancel()
            use.settle_soon(wholes)
            if isinstance(e, Exception):
                raise self._failed(hid, e) from None
            raise
        use.settle_soon(wholes)
        self._cache_store(look, streams, n_gen)
        response.headers.update({**look.headers, **route_h})
        choices = []
        for p in range(len(prompts)):
            group = [wholes[(p, i)] for i in range(n_gen)]
            prompt_lp = group[0].prompt_logprobs
            if ranking:  # best_of: the n sequences of highest cumulative log-probability
                group = sorted(group, key=lambda w: -sum(e.logprob for e in w.logprobs or []))[:body.n]
            for w in group:
                echo = (w.prompt_text or "") if body.echo else ""
                lp = None
                if body.logprobs is not None:
                    lp, offset = _completion_logprobs(prompt_lp or [], 0) if body.echo else (None, 0)
                    gen, _ = _completion_logprobs(w.logprobs or [], offset if body.echo else len(echo))
                    lp = gen if lp is None else _join_logprobs(lp, gen)
                choices.append(CompletionChoice(index=len(choices), text=echo + w.text, logprobs=lp,
                                                finish_reason=finish_reason(w.finish_reason)))
        return Completion(id=rid, object="text_completion", created=created, model=name, choices=choices,
                          usage=_usage_of(wholes))

    async def _completion_stream(self, streams: list[_Stream], hid: str, rid: str, created: int, model: str,
                                 body: CompletionRequest, use: _KeyUse,
                                 look: Lookup = NO_CACHE) -> AsyncIterator[bytes]:
        head = dict(id=rid, object="text_completion", created=created, model=model)
        n = body.n
        want_lp = body.logprobs is not None
        include_usage, continuous = body.include_usage, body.continuous_usage
        lasts: dict[tuple[int, int], GenerationChunk] = {(p, 0): s.first for p, s in enumerate(streams)}
        offsets: dict[tuple[int, int], int] = {}
        prompt_lps: dict[int, list] = {}

        def event(p: int, chunk: GenerationChunk) -> bytes | None:
            key = (p, chunk.index)
            lasts[key] = chunk
            if chunk.prompt_logprobs is not None:
                prompt_lps[p] = chunk.prompt_logprobs
            text, lp = chunk.text, None
            if key not in offsets:  # the choice's first chunk: the echoed prompt goes first
                offsets[key] = 0
                if body.echo:
                    text = (chunk.prompt_text or "") + text
                    if want_lp:
                        lp, offsets[key] = _completion_logprobs(prompt_lps.get(p) or [], 0)
                    else:
                        offsets[key] = len(chunk.prompt_text or "")
            if want_lp and chunk.logprobs:
                gen, offsets[key] = _completion_logprobs(chunk.logprobs, offsets[key])
                lp = gen if lp is None else _join_logprobs(lp, gen)
            fr = finish_reason(chunk.finish_reason) if chunk.finished else None
            if not text and fr is None and lp is None:
                return None
            # OpenAI streams finish_reason null until the last chunk, which the SDK's type does
            # not admit (the SDK builds stream chunks unvalidated, as here)
            choice = CompletionChoice.model_construct(index=p * n + chunk.index, text=text, logprobs=lp,
                                                      finish_reason=fr)
            out = Completion(**head, choices=[choice])
            if include_usage:
                out.usage = _usage_of(lasts) if continuous else None
            return _sse(out)

        async def merged() -> AsyncIterator[tuple[int, GenerationChunk]]:
            """(prompt index, chunk) of every stream, as they arrive."""
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(p: int, s: _Stream):
                try:
                    async for chunk in s.chunks():
                        await queue.put((p, chunk, None))
                except Exception as e:  # forwarded to the response
                    await queue.put((p, None, e))
                finally:
                    await queue.put((p, None, None))

            tasks = [asyncio.create_task(pump(p, s)) for p, s in enumerate(streams)]
            try:
                open_ = len(streams)
                while open_:
                    p, chunk, err = await queue.get()
                    if err is not None:
                        raise err
                    if chunk is None:
                        open_ -= 1
                        continue
                    yield p, chunk
            finally:
                for t in tasks:
                    t.cancel()

        try:
            async for p, chunk in merged():
                b = event(p, chunk)
                if b is not None:
                    yield b
            if include_usage:
                yield _sse(Completion(**head, choices=[], usage=_usage_of(lasts)))
            self._cache_store(look, streams, body.best_of or body.n)
        except asyncio.CancelledError:
            for s in streams:
                s.cancel()
            logger.info("request %s: client disconnected mid-stream; generation aborted", hid)
            raise
        except Exception as e:
            yield self._stream_error(hid, e)
        finally:
            for s in streams:
                s.cancel()
            use.settle_soon(lasts)
        yield _DONE
