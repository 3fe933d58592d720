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
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from deployments import gate
from deployments.args import DEFAULT_MAX_PROMPTS_PER_REQUEST
from deployments.protocol import (
    ChatCompletionChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessageOut,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    OpenAIError,
    TokenLogprob,
    UsageInfo,
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
    headers = {"Retry-After": "1"} if exc.status_code == 429 else None
    return _error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code, headers)


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

    if isinstance(exc, BackPressureError):
        return OpenAIError("the model's queue is full, retry later", 429, "rate_limit_error", code="queue_full")
    if isinstance(exc, (DeploymentUnavailableError, ActorDiedError, ActorUnavailableError)):
        return OpenAIError("the model server is not available, retry later", 503, "server_error",
                           code="model_unavailable")
    return None


def _strip(entry: dict) -> dict:
    return {k: v for k, v in entry.items() if k in ("token", "logprob", "bytes", "top_logprobs")}


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


class _Stream:
    """One request's handle stream, with its first item already fetched (so bad input fails
    as an HTTP error before any byte of a streaming response is sent)."""

    def __init__(self, gen, first: dict):
        self.gen, self.first, self.done = gen, first, first.get("finished", False)

    async def items(self) -> AsyncIterator[dict]:
        yield self.first
        if self.done:
            return
        async for item in self.gen:
            if item.get("finished"):
                self.done = True
            yield item
            if self.done:
                return

    def cancel(self) -> None:
        if not self.done:
            self.done = True
            try:
                self.gen.cancel()
            except Exception:
                pass


def _chat_logprobs(entries: list[dict]) -> dict:
    return {"content": [{"token": e["token"], "logprob": e["logprob"], "bytes": e["bytes"],
                         "top_logprobs": [{"token": t["token"], "logprob": t["logprob"], "bytes": t["bytes"]}
                                          for t in e["top_logprobs"]]} for e in entries]}


def _completion_logprobs(entries: list[dict], offset: int) -> tuple[dict, int]:
    lp = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        lp["tokens"].append(e["token"])
        lp["token_logprobs"].append(e["logprob"])
        lp["top_logprobs"].append({t["token"]: t["logprob"] for t in e["top_logprobs"]})
        lp["text_offset"].append(offset)
        offset += len(e["token"])
    return lp, offset


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
                 health_timeout_s: float = 5.0):
        from cluster import reset_niceness

        reset_niceness()  # Ray starts workers at niceness 15: latency-critical here
        if not models:
            raise ValueError("OpenAIIngress needs at least one model")
        if max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be positive, got {max_prompts_per_request}")
        gate.configure(api_keys, max_request_body_bytes)  # checked before any body is read
        self.models = dict(models)
        self.default_model = next(iter(self.models))
        self.max_prompts_per_request = max_prompts_per_request
        self.health_timeout_s = health_timeout_s
        self._max_model_len: dict[str, int] = {}
        self._streaming = {name: h.options(stream=True) for name, h in self.models.items()}

    # ---- helpers ---------------------------------------------------------------------------
    def _route(self, model: str | None) -> tuple[str, DeploymentHandle]:
        name = model or self.default_model
        if name not in self._streaming:
            raise OpenAIError(f"the model '{name}' does not exist; available: {', '.join(self.models)}", 404,
                              "invalid_request_error", param="model", code="model_not_found")
        return name, self._streaming[name]

    async def _open(self, rid: str, handle: DeploymentHandle, *args, **kwargs) -> _Stream:
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
            raise err from None
        if "error" in first:  # the server's own verdict: a client error, or the engine is gone
            status = int(first.get("status", 400))
            raise OpenAIError(str(first["error"]), status,
                              "invalid_request_error" if status < 500 else "server_error",
                              code=first.get("code", "invalid_value"))
        return _Stream(gen, first)

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

    @app.get("/v1/models")
    async def list_models(self):
        cards = []
        for name in self.models:
            if name not in self._max_model_len:
                self._max_model_len[name] = (await self.models[name].model_info.remote())["max_model_len"]
            cards.append(ModelCard(id=name, root=name, max_model_len=self._max_model_len[name]))
        return ModelList(data=cards)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        name, handle = self._route(body.model)
        hid = request_id_of(request)
        rid = random_id("chatcmpl")
        created = int(time.time())
        sp = body.sampling_dict(body.effective_max_tokens, body.num_logprobs)
        stream = await self._open(hid, handle, None, sp, messages=[m.to_template() for m in body.messages],
                                  request_id=rid, priority=body.priority)
        want_lp = body.logprobs
        if body.stream:
            return StreamingResponse(self._chat_stream(stream, hid, rid, created, name, want_lp,
                                                       body.include_usage),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            text, lps, last, n_prompt = await self._collect(stream, want_lp)
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            raise self._failed(hid, e) from None
        n_out = last.get("num_output_tokens", 0)
        return ChatCompletionResponse(
            id=rid, created=created, model=name,
            choices=[ChatCompletionChoice(
                index=0, message=ChatMessageOut(content=text),
                logprobs=ChoiceLogprobs(content=[TokenLogprob(**_strip(e)) for e in _chat_logprobs(lps)["content"]])
                if want_lp else None,
                finish_reason=finish_reason(last.get("finish_reason")))],
            usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out, total_tokens=n_prompt + n_out))

    async def _chat_stream(self, stream: _Stream, hid: str, rid: str, created: int, model: str, want_lp: bool,
                           include_usage: bool) -> AsyncIterator[bytes]:
        head = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        if include_usage:
            head["usage"] = None
        n_prompt = n_out = 0
        role_sent = False
        try:
            async for item in stream.items():
                n_prompt = item.get("num_prompt_tokens", n_prompt)
                n_out = item.get("num_output_tokens", n_out)
                text = item["text"]
                fr = finish_reason(item.get("finish_reason")) if item.get("finished") else None
                lp = item.get("logprobs") if want_lp else None
                if not text and fr is None and not lp and role_sent:
                    continue  # nothing new for the client in this step (e.g. a held-back stop string prefix)
                delta = {"content": text}
                if not role_sent:
                    delta = {"role": "assistant", "content": text}
                    role_sent = True
                choice = {"index": 0, "delta": delta, "logprobs": _chat_logprobs(lp) if lp else None,
                          "finish_reason": fr}
                yield _sse({**head, "choices": [choice]})
            if include_usage:
                yield _sse({**head, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                             "total_tokens": n_prompt + n_out}})
        except asyncio.CancelledError:
            stream.cancel()
            raise
        except Exception as e:
            stream.cancel()
            yield self._stream_error(hid, e)
        finally:
            stream.cancel()
        yield _DONE

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        name, handle = self._route(body.model)
        hid = request_id_of(request)
        prompts = body.prompts()
        if len(prompts) > self.max_prompts_per_request:
            raise OpenAIError(f"{len(prompts)} prompts in one request; the limit is {self.max_prompts_per_request}",
                              400, param="prompt", code="too_many_prompts")
        if body.echo and any(not isinstance(p, str) for p in prompts):
            raise OpenAIError("echo is only supported for text prompts", 400, param="echo")
        rid = random_id("cmpl")
        created = int(time.time())
        sp = body.sampling_dict(body.max_tokens, body.logprobs)
        streams: list[_Stream] = []
        try:
            results = await asyncio.gather(
                *(self._open(hid, handle, p, sp, request_id=f"{rid}-{i}", priority=body.priority)
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
            raise
        want_lp = body.logprobs is not None
        echo = [p if body.echo else "" for p in prompts]
        if body.stream:
            return StreamingResponse(self._completion_stream(streams, hid, rid, created, name, want_lp, echo,
                                                             body.include_usage),
                                     media_type="text/event-stream", headers=_SSE_HEADERS)
        try:
            finals = await asyncio.gather(*(self._collect(s, want_lp) for s in streams))
        except BaseException as e:
            for s in streams:
                s.cancel()
            if isinstance(e, Exception):
                raise self._failed(hid, e) from None
            raise
        choices, n_prompt, n_out = [], 0, 0
        for i, (text, lps, last, np_) in enumerate(finals):
            lp = None
            if want_lp:
                lp, _ = _completion_logprobs(lps, len(echo[i]))
                lp = CompletionLogprobs(**lp)
            choices.append(CompletionChoice(index=i, text=echo[i] + text, logprobs=lp,
                                            finish_reason=finish_reason(last.get("finish_reason"))))
            n_prompt += np_
            n_out += last.get("num_output_tokens", 0)
        return CompletionResponse(id=rid, created=created, model=name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=n_prompt, completion_tokens=n_out,
                                                  total_tokens=n_prompt + n_out))

    @staticmethod
    async def _collect(stream: _Stream, want_lp: bool):
        text, lps, last, n_prompt = [], [], {}, 0
        async for item in stream.items():
            text.append(item["text"])
            if want_lp:
                lps.extend(item.get("logprobs") or [])
            n_prompt = item.get("num_prompt_tokens", n_prompt)
            last = item
        return "".join(text), lps, last, n_prompt

    async def _completion_stream(self, streams: list[_Stream], hid: str, rid: str, created: int, model: str, want_lp: bool,
                                 echo: list[str], include_usage: bool) -> AsyncIterator[bytes]:
        head = {"id": rid, "object": "text_completion", "created": created, "model": model}
        if include_usage:
            head["usage"] = None
        counts = [[0, 0] for _ in streams]  # prompt, output tokens per choice
        offsets = [len(e) for e in echo]

        def chunk(i: int, item: dict) -> bytes | None:
            counts[i][0] = item.get("num_prompt_tokens", counts[i][0])
            counts[i][1] = item.get("num_output_tokens", counts[i][1])
            text = item["text"]
            if echo[i] and "num_prompt_tokens" in item:
                text = echo[i] + text
            fr = finish_reason(item.get("finish_reason")) if item.get("finished") else None
            lps = item.get("logprobs") if want_lp else None
            if not text and fr is None and not lps:
                return None
            lp = None
            if lps:
                lp, offsets[i] = _completion_logprobs(lps, offsets[i])
            return _sse({**head, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": fr}]})

        try:
            if len(streams) == 1:
                async for item in streams[0].items():
                    b = chunk(0, item)
                    if b is not None:
                        yield b
            else:
                queue: asyncio.Queue = asyncio.Queue()

                async def pump(i: int, s: _Stream):
                    try:
                        async for item in s.items():
                            await queue.put((i, item, None))
                    except Exception as e:  # forwarded to the response
                        await queue.put((i, None, e))
                    finally:
                        await queue.put((i, None, None))

                tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
                try:
                    open_ = len(streams)
                    while open_:
                        i, item, err = await queue.get()
                        if err is not None:
                            raise err
                        if item is None:
                            open_ -= 1
                            continue
                        b = chunk(i, item)
                        if b is not None:
                            yield b
                finally:
                    for t in tasks:
                        t.cancel()
            if include_usage:
                n_prompt = sum(c[0] for c in counts)
                n_out = sum(c[1] for c in counts)
                yield _sse({**head, "choices": [], "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                                                             "total_tokens": n_prompt + n_out}})
        except asyncio.CancelledError:
            for s in streams:
                s.cancel()
            raise
        except Exception as e:
            yield self._stream_error(hid, e)
        finally:
            for s in streams:
                s.cancel()
        yield _DONE

