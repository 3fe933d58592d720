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
from openai.types.chat.chat_completion_chunk import ChoiceDelta
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
from deployments.limits import NeverFits, RateLimited, RateLimiter
from deployments.metrics import api_key_requests, api_key_tokens, rejected
from deployments.args import DEFAULT_MAX_PROMPTS_PER_REQUEST
from deployments.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    GenerationChunk,
    OpenAIError,
    TokenLogprob,
    error_body,
    finish_reason,
    random_id,
)

logger = logging.getLogger("ray.serve")

app = FastAPI(title="kvserve", description="OpenAI-compatible LLM serving on Ray Serve", version="0.1.0")
app.add_middleware(gate.RequestGate)  # API key and body size, before any body byte is read

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
    """One request's handle stream of :class:`GenerationChunk`, with its first chunk already
    fetched (so bad input fails as an HTTP error before any byte of a streaming response is
    sent)."""

    def __init__(self, gen, first: GenerationChunk):
        self.gen, self.first, self.done = gen, first, first.finished

    async def chunks(self) -> AsyncIterator[GenerationChunk]:
        """The chunks; a chunk with ``error`` (e.g. the request ran past the server's
        ``request_timeout_s``) raises it as an :class:`OpenAIError`."""
        yield self.first
        if self.done:
            return
        async for chunk in self.gen:
            self.done = chunk.finished
            if chunk.error is not None:
                raise OpenAIError.of(chunk.error)
            yield chunk
            if self.done:
                return

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
    returns them and the offset after the last token."""
    lp = Logprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        lp.tokens.append(e.token)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append({t.token: t.logprob for t in e.top_logprobs})
        lp.text_offset.append(offset)
        offset += len(e.token)
    return lp, offset


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

    def settle_soon(self, chunks: list[GenerationChunk]) -> None:
        """:meth:`settle` with the last chunks of a request's streams, in a task of its own (a
        cancelled response's cleanup must not await the rate limiter's Redis)."""
        if self.done:
            return
        task = asyncio.ensure_future(self.settle(sum(c.num_prompt_tokens for c in chunks),
                                                 sum(c.num_output_tokens for c in chunks)))
        _SETTLING.add(task)
        task.add_done_callback(_SETTLING.discard)


_SETTLING: set[asyncio.Task] = set()  # settle tasks in flight (referenced until done)


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, graceful_shutdown_timeout_s=5)
@serve.ingress(app)
class OpenAIIngress:
    """Routes OpenAI requests to the ``LLMServer`` deployment of the requested model.

    Args:
        models: served model name -> ``LLMServer`` handle; the first is the default for
            requests without ``model``.
        api_keys: if set, ``Authorization: Bearer <key>`` must carry one of them (all
            endpoints but ``/health``).
    """

    def __init__(self, models: dict[str, DeploymentHandle], api_keys: list[str] | None = None, *,
                 max_request_body_bytes: int = gate.DEFAULT_MAX_BODY_BYTES,
                 max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
                 health_timeout_s: float = 5.0, rate_limit_rpm: float | None = None,
                 rate_limit_tpm: float | None = None, redis_url: str | None = None,
                 auth_failures_per_minute: int = gate.DEFAULT_AUTH_FAILURES_PER_MINUTE,
                 num_ingress_replicas: int = 1):
        from cluster import reset_niceness

        reset_niceness()  # Ray starts workers at niceness 15: latency-critical here
        if not models:
            raise ValueError("OpenAIIngress needs at least one model")
        if max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be positive, got {max_prompts_per_request}")
        gate.configure(api_keys, max_request_body_bytes, auth_failures_per_minute)  # before any body is read
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

    # ---- helpers ---------------------------------------------------------------------------
    def _route(self, model: str | None) -> tuple[str, DeploymentHandle]:
        name = model or self.default_model
        if name not in self._streaming:
            raise OpenAIError(f"the model '{name}' does not exist; available: {', '.join(self.models)}", 404,
                              "invalid_request_error", param="model", code="model_not_found")
        return name, self._streaming[name]

    async def _open(self, rid: str, model: str, handle: DeploymentHandle, *args, **kwargs) -> _Stream:
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
        return _Stream(gen, first)

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
                       request_id: str | None = None, priority: int = 0):
        """Stream ``LLMServer.generate`` items of ``model`` (default: the first model); for
        ``serve.get_app_handle(...).options(stream=True).generate.remote(...)``."""
        try:
            _, handle = self._route(model)
        except OpenAIError as e:
            raise ValueError(e.message) from None
        gen = handle.generate.remote(prompt, sampling_params, messages=messages, request_id=request_id,
                                     priority=priority)
        try:
            async for item in gen:
                yield item
        finally:
            gen.cancel()

    # ---- endpoints -------------------------------------------------------------------------
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
        metrics, the gateway's, the autoscaler's); see :mod:`deployments.metrics`."""
        from deployments.metrics import render

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
        (the served name: paths of the server stay private)."""
        info = await self._model_info(name)
        return Model(id=name, object="model", created=self._created, owned_by="kvserve", root=name,
                     max_model_len=info["max_model_len"])

    @app.get("/v1/models")
    async def list_models(self):
        return {"object": "list", "data": [(await self._model_card(n)).model_dump() for n in self.models]}

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(self, model_id: str):
        self._route(model_id)  # 404 for a name that is not served
        return (await self._model_card(model_id)).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        name, handle = self._route(body.model)
        hid = request_id_of(request)
        rid = random_id("chatcmpl")
        created = int(time.time())
        sp = body.sampling_dict(body.effective_max_tokens, body.num_logprobs)
        messages = [m.to_template() for m in body.messages]
        use = await self._admit_key(request, name, estimate_prompt_tokens(messages), body.effective_max_tokens,
                                    body.priority)
        try:
            stream = await self._open(hid, name, handle, None, sp, messages=messages, request_id=rid,
                                      priority=use.priority)
        except BaseException:
            use.settle_soon([])
            raise
        if body.stream:
            return StreamingResponse(self._chat_stream(stream, hid, rid, created, name, body.logprobs,
                                                       body.include_usage, use),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        whole = GenerationChunk()
        try:
            whole = await self._collect(stream)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            raise self._failed(hid, e) from None
        finally:
            use.settle_soon([whole])
        return ChatCompletion(
            id=rid, object="chat.completion", created=created, model=name,
            choices=[ChatChoice(
                index=0, message=ChatCompletionMessage(role="assistant", content=whole.text),
                logprobs=ChatChoiceLogprobs(content=_chat_logprobs(whole.logprobs or [])) if body.logprobs else None,
                finish_reason=finish_reason(whole.finish_reason))],
            usage=_usage(whole.num_prompt_tokens, whole.num_output_tokens, whole.num_cached_tokens))

    async def _chat_stream(self, stream: _Stream, hid: str, rid: str, created: int, model: str, want_lp: bool,
                           include_usage: bool, use: _KeyUse) -> AsyncIterator[bytes]:
        head = dict(id=rid, object="chat.completion.chunk", created=created, model=model)
        last = stream.first
        role_sent = False
        try:
            async for chunk in stream.chunks():
                last = chunk
                fr = finish_reason(chunk.finish_reason) if chunk.finished else None
                lp = chunk.logprobs if want_lp else None
                if not chunk.text and fr is None and not lp and role_sent:
                    continue  # nothing new for the client in this step (e.g. a held-back stop string prefix)
                delta = ChoiceDelta(content=chunk.text) if role_sent else ChoiceDelta(role="assistant",
                                                                                       content=chunk.text)
                role_sent = True
                choice = ChunkChoice(index=0, delta=delta, finish_reason=fr,
                                     logprobs=ChunkChoiceLogprobs(content=_chat_logprobs(lp)) if lp else None)
                out = ChatCompletionChunk(**head, choices=[choice])
                if include_usage:
                    out.usage = None  # OpenAI sends "usage": null on every chunk but the last
                yield _sse(out)
            if include_usage:
                yield _sse(ChatCompletionChunk(**head, choices=[], usage=_usage(
                    last.num_prompt_tokens, last.num_output_tokens, last.num_cached_tokens)))
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            yield self._stream_error(hid, e)
        finally:
            stream.cancel()
            use.settle_soon([last])
        yield _DONE

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        name, handle = self._route(body.model)
        hid = request_id_of(request)
        prompts = body.prompts()
        if len(prompts) > self.max_prompts_per_request:
            raise OpenAIError(f"{len(prompts)} prompts in one request; the limit is {self.max_prompts_per_request}",
                              400, param="prompt", code="too_many_prompts")
        bound = (await self._model_info(name)).get("max_in_flight_requests")
        if len(prompts) > 1 and bound and len(prompts) > bound:  # a retry could never help
            raise OpenAIError(f"{len(prompts)} prompts in one request; a replica of this model takes at most "
                              f"{bound} requests at once (max_num_seqs + max_queued_requests), so this request can "
                              "never be admitted: send fewer prompts per request", 400, param="prompt",
                              code="too_large")
        if body.echo and any(not isinstance(p, str) for p in prompts):
            raise OpenAIError("echo is only supported for text prompts", 400, param="echo")
        rid = random_id("cmpl")
        created = int(time.time())
        sp = body.sampling_dict(body.max_tokens, body.logprobs)
        use = await self._admit_key(request, name, sum(estimate_prompt_tokens(p) for p in prompts),
                                    None if body.max_tokens is None else body.max_tokens * len(prompts), body.priority)
        streams: list[_Stream] = []
        try:
            results = await asyncio.gather(
                *(self._open(hid, name, handle, p, sp, request_id=f"{rid}-{i}", priority=use.priority)
                  for i, p in enumerate(prompts)), return_exceptions=True)
            for r in results:
                if isinstance(r, _Stream):
                    streams.append(r)
            for r in results:
                if isinstance(r, BaseException):
                    raise r
        except BaseException:
            for s in streams:
                s.cancel()
            use.settle_soon([])
            raise
        want_lp = body.logprobs is not None
        echo = [p if body.echo else "" for p in prompts]
        if body.stream:
            return StreamingResponse(self._completion_stream(streams, hid, rid, created, name, want_lp, echo,
                                                             body.include_usage, use),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            wholes = await asyncio.gather(*(self._collect(s) for s in streams))
        except BaseException as e:
            for s in streams:
                s.cancel()
            use.settle_soon([s.first for s in streams])
            if isinstance(e, Exception):
                raise self._failed(hid, e) from None
            raise
        use.settle_soon(wholes)
        choices = [CompletionChoice(index=i, text=echo[i] + w.text, finish_reason=finish_reason(w.finish_reason),
                                    logprobs=_completion_logprobs(w.logprobs or [], len(echo[i]))[0] if want_lp else None)
                   for i, w in enumerate(wholes)]
        return Completion(id=rid, object="text_completion", created=created, model=name, choices=choices,
                          usage=_usage(sum(w.num_prompt_tokens for w in wholes), sum(w.num_output_tokens for w in wholes),
                                       sum(w.num_cached_tokens for w in wholes)))

    @staticmethod
    async def _collect(stream: _Stream) -> GenerationChunk:
        """The whole generation of a stream as one finished chunk (text and logprobs joined)."""
        whole = GenerationChunk()
        async for chunk in stream.chunks():
            whole.extend(chunk)
        return whole

    async def _completion_stream(self, streams: list[_Stream], hid: str, rid: str, created: int, model: str,
                                 want_lp: bool, echo: list[str], include_usage: bool,
                                 use: _KeyUse) -> AsyncIterator[bytes]:
        head = dict(id=rid, object="text_completion", created=created, model=model)
        lasts = [s.first for s in streams]
        offsets = [len(e) for e in echo]

        def event(i: int, chunk: GenerationChunk, first: bool) -> bytes | None:
            lasts[i] = chunk
            text = (echo[i] + chunk.text) if first and echo[i] else chunk.text
            fr = finish_reason(chunk.finish_reason) if chunk.finished else None
            lps = chunk.logprobs if want_lp else None
            if not text and fr is None and not lps:
                return None
            lp = None
            if lps:
                lp, offsets[i] = _completion_logprobs(lps, offsets[i])
            # OpenAI streams finish_reason null until the last chunk, which the SDK's type does
            # not admit (the SDK builds stream chunks unvalidated, as here)
            choice = CompletionChoice.model_construct(index=i, text=text, logprobs=lp, finish_reason=fr)
            out = Completion(**head, choices=[choice])
            if include_usage:
                out.usage = None
            return _sse(out)

        async def merged() -> AsyncIterator[tuple[int, GenerationChunk, bool]]:
            """(choice index, chunk, is first) of every stream, as they arrive."""
            queue: asyncio.Queue = asyncio.Queue()

            async def pump(i: int, s: _Stream):
                try:
                    first = True
                    async for chunk in s.chunks():
                        await queue.put((i, chunk, first, None))
                        first = False
                except Exception as e:  # forwarded to the response
                    await queue.put((i, None, False, e))
                finally:
                    await queue.put((i, None, False, None))

            tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
            try:
                open_ = len(streams)
                while open_:
                    i, chunk, first, err = await queue.get()
                    if err is not None:
                        raise err
                    if chunk is None:
                        open_ -= 1
                        continue
                    yield i, chunk, first
            finally:
                for t in tasks:
                    t.cancel()

        try:
            async for i, chunk, first in merged():
                b = event(i, chunk, first)
                if b is not None:
                    yield b
            if include_usage:
                yield _sse(Completion(**head, choices=[], usage=_usage(
                    sum(c.num_prompt_tokens for c in lasts), sum(c.num_output_tokens for c in lasts),
                    sum(c.num_cached_tokens for c in lasts))))
        except asyncio.CancelledError:
            for s in streams:
                s.cancel()
            raise
        except Exception as e:
            yield self._stream_error(hid, e)
        finally:
            for s in streams:
                s.cancel()
            use.settle_soon(lasts)
        yield _DONE
