"""The gateway's state and its request pipeline, with no HTTP framework and no Serve in it.

One pipeline serves every generating endpoint (:meth:`Gateway.call` then :meth:`Gateway.start`):
pick the model (``model: "auto"`` by the routing rules) -> response cache lookup -> per-key
admission -> open the replica streams (with the upstream fallback when every replica refuses)
-> settle the key's tokens and store the answer when it completes. The endpoints render what
comes back (:mod:`~deployments.gateway.chat`, :mod:`~deployments.gateway.completions`).

**What the gateway owns and what the replica owns.** The gateway owns what needs no model:
keys, limits, caches, the choice of model and the fallback, request ids, OpenAI rendering
(tool-call parsing, finish reasons, logprob formats, echo text, ``best_of`` ranking). The
replica owns everything that needs the tokenizer or the engine: chat templates, tokenizing,
the one ``max_model_len`` rule (prompt plus ``max_tokens``), fanning ``n`` out into engine
requests, admission to its queue, logprob token strings, the prompt text of ``echo``. What
crosses is typed (:mod:`deployments.contract.types`): the gateway sends a
:class:`~deployments.contract.types.GenerateRequest` (sampling values already validated as the
engine's ``SamplingParams``) and reads :class:`~deployments.contract.types.GenerationChunk`
records, an error being a typed chunk.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request
from ray.serve.handle import DeploymentHandle

from deployments.cache import NO_CACHE, CacheSettings, Lookup, ResponseCache, request_options
from deployments.contract.adapters import AdapterEntry
from deployments.contract.openai_errors import OpenAIError, random_id
from deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest, unknown_fields
from deployments.contract.types import GenerateRequest, GenerationChunk
from deployments.gateway.adapters import AdapterDirectory
from deployments.gateway.errors import as_client_error, internal, request_id_of, stream_error
from deployments.gateway.gate import GateSettings, key_name, request_policy
from deployments.gateway.models import ModelDirectory
from deployments.gateway.responses_input import ResponseStore
from deployments.gateway.settings import GatewaySettings  # noqa: F401 (re-exported)
from deployments.gateway.shedding import LoadShedder
from deployments.gateway.streams import DONE, ChunkStream, background, usage_of
from deployments.limits import RateLimiter, policies_from_keys
from deployments.limits.key_limits import KeyLimits, KeyUse
from deployments.routing.model_routing import AUTO_MODEL, ModelRouting, Upstream, UpstreamArgs, UpstreamError, user_text
from telemetry.metrics import model_routes, rejected, upstream_fallbacks

logger = logging.getLogger("ray.serve")

#: Times a request is sent again when its replica died before its first chunk (nothing generated).
UNAVAILABLE_RETRIES = 2

def estimate_prompt_tokens(prompt) -> int:
    """A prompt's token count before the replica tokenizes it, for reserving a key's token
    budget (settled with the real count afterwards): exact for token ids, about 4 UTF-8 bytes
    per token for text (BPE tokenizers on English), plus a few tokens of template per message."""
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, list):  # chat messages
        return sum(4 + estimate_prompt_tokens(json.dumps(m.get("content"), ensure_ascii=False)
                                              if not isinstance(m.get("content"), str) else m["content"])
                   for m in prompt)
    return len(str(prompt).encode()) // 4 + 1


@dataclass
class Call:
    """One generating HTTP request on its way through the pipeline.

    Attributes:
        request: the HTTP request.
        http_id: ``X-Request-ID`` (or a random id): in the logs and in error messages.
        response_id: the response's id (``chatcmpl-...``, ``cmpl-...``), also the stem of the
            engine's request ids.
        model: the served (base) model's name; ``handle`` its streaming handle.
        headers: response headers of the pipeline's verdicts (route, cache).
        created: the response's ``created`` (Unix seconds).
        use: the API key's admission; ``look`` the response cache's verdict.
        streams: one per prompt, each with the prompt's ``n`` choices.
    """

    request: Request
    http_id: str
    response_id: str
    model: str
    handle: DeploymentHandle
    headers: dict[str, str]
    created: int
    use: KeyUse | None = None
    look: Lookup = field(default_factory=lambda: NO_CACHE)
    streams: list[ChunkStream] = field(default_factory=list)
    adapter: str | None = None  # the LoRA adapter the client named as its model, None: the base model
    adapter_version: str | None = None  # a run-time adapter's load (its cached answers are this load's)

    @property
    def served(self) -> str:
        """The name the client asked for (an adapter's, or the model's): answers carry it."""
        return self.adapter or self.model

    def cancel(self) -> None:
        """Stop every stream of the call."""
        for s in self.streams:
            s.cancel()


class Gateway:
    """The state shared by a gateway replica's endpoints: the models' handles and facts, the
    gate's settings, the response cache, the per-key limiter, the ``auto`` routing rules, the
    upstream fallback and the gateway's metrics.

    Raises:
        ValueError: no model, a bad setting (key entries, routing rules naming unknown models).
    """

    def __init__(self, models: dict[str, DeploymentHandle], settings: GatewaySettings,
                 encoders: dict[str, DeploymentHandle] | None = None):
        if not models:
            raise ValueError("the gateway needs at least one model")
        s = settings
        if s.max_prompts_per_request < 1:
            raise ValueError(f"max_prompts_per_request must be positive, got {s.max_prompts_per_request}")
        self.settings = s
        self.admin_keys = policies_from_keys(s.admin_api_keys or [])
        api_keys = s.api_keys
        if api_keys:  # an admin key must get past the gate to reach the admin endpoints
            known = {k.split()[0] for k in api_keys if k.split()}
            api_keys = list(api_keys) + [p.key for p in self.admin_keys if p.key not in known]
        self.gate = GateSettings.of(api_keys, s.max_request_body_bytes, s.auth_failures_per_minute, s.allowed_origins)
        cache = CacheSettings(**{"redis_url": s.redis_url, **(s.cache or {})})
        self.cache = ResponseCache(cache) if cache.enabled else None
        self.responses = ResponseStore(cache)  # stored Responses API responses, in the cache's backend
        # per-key limits: shared through Redis when given, else each gateway replica enforces its share
        self.keys = KeyLimits(RateLimiter(s.rate_limit_rpm, s.rate_limit_tpm, redis_url=s.redis_url,
                                          divide_by=max(1, s.ingress_num_replicas)))
        self.models = dict(models)
        self.default_model = next(iter(self.models))
        self.adapters = dict(s.adapters or {})  # configured LoRA adapters: {name: base model}
        for a, base in self.adapters.items():
            if base not in self.models or a in self.models:
                raise ValueError(f"adapter {a!r}: its base model {base!r} is not served, or the name is a model's")
        self.lora = AdapterDirectory()  # and those loaded at run time
        self._multiplexed: dict[tuple[str, bool], DeploymentHandle] = {}  # (multiplexed id, streaming) -> handle
        self.streaming = {name: h.options(stream=True) for name, h in self.models.items()}
        self.encoders = dict(encoders or {})  # embedding-only models (deployments.replica.embedding_server)
        if set(self.encoders) & set(self.models):
            raise ValueError(f"embedding model names {sorted(set(self.encoders) & set(self.models))} are also "
                             "generating models' names")
        self.directory = ModelDirectory({**self.models, **self.encoders})
        self.routing = None if s.model_routing is None else ModelRouting.model_validate(s.model_routing)
        if self.routing is not None:
            self.routing.check(list(self.models))
        self.upstream = None if s.upstream is None else Upstream(UpstreamArgs.model_validate(s.upstream))
        self.rejected = rejected()
        self.routes, self.fallbacks = model_routes(), upstream_fallbacks()
        self.shedder = LoadShedder()
        self.draining = False
        self._warned_fields: set[str] = set()

    # ---- model choice -------------------------------------------------------------------
    def model_handle(self, model: str | None) -> tuple[str, DeploymentHandle]:
        """The served name and streaming handle of ``model`` (None: the default model).

        Raises:
            OpenAIError: 404 ``model_not_found``.
        """
        name = model or self.default_model
        if name not in self.streaming:
            known = ", ".join([*self.models, *self.adapters])
            raise OpenAIError(f"the model '{name}' does not exist; available: {known}", 404,
                              "invalid_request_error", param="model", code="model_not_found")
        return name, self.streaming[name]

    async def adapter_base(self, name: str | None) -> tuple[str | None, AdapterEntry | None]:
        """``(base model, registry entry)`` of LoRA adapter ``name``: a configured adapter's
        base and None, a run-time adapter's base and its entry, ``(None, None)`` for a name that
        is no adapter (a model's, or unknown)."""
        if name is None or name in self.streaming:
            return None, None
        if name in self.adapters:
            return self.adapters[name], None
        entry = await self.lora.lookup(name)
        return (entry.base, entry) if entry is not None and entry.base in self.streaming else (None, None)

    async def call(self, request: Request, body: ChatCompletionRequest | CompletionRequest, id_prefix: str, *,
                   max_tokens: int | None, messages: list[dict] | None = None, prompts: list | None = None) -> Call:
        """Start a :class:`Call`: the model (``model: "auto"`` resolved by the routing rules,
        with an ``x-kvserve-route: auto:<rule>`` header; a LoRA adapter's name by its base
        model, with Serve's multiplexed model id for one loaded at run time) and the ids.

        Raises:
            OpenAIError: 404 for an unknown model.
        """
        self.warn_unknown(body)
        headers = {}
        if body.model == AUTO_MODEL and self.routing is not None:
            tokens = (estimate_prompt_tokens(messages) if messages is not None
                      else max((estimate_prompt_tokens(p) for p in prompts or [""]), default=0))
            name, rule = self.routing.choose(tokens, max_tokens, user_text(messages, prompts), self.default_model)
            self.routes.inc({"model_name": name, "route": rule})
            headers["x-kvserve-route"] = f"auto:{rule}"
        else:
            name = body.model
        return await self._call(request, name, id_prefix, headers, stream=True)

    async def unary_call(self, request: Request, model: str | None, id_prefix: str) -> Call:
        """A :class:`Call` for a one-answer replica method (embeddings, tokenize): ``model``
        may name a generating model (None: the default), one of its LoRA adapters, or an
        embedding model; ``call.handle`` is the non-streaming handle.

        Raises:
            OpenAIError: 404 for a name that is not served.
        """
        if model in self.encoders:
            return Call(request, request_id_of(request), random_id(id_prefix), model, self.encoders[model], {},
                        int(time.time()))
        return await self._call(request, model, id_prefix, {}, stream=False)

    async def _call(self, request: Request, name: str | None, id_prefix: str, headers: dict[str, str], *,
                    stream: bool) -> Call:
        """The :class:`Call` of served name ``name``: a LoRA adapter's goes to its base model,
        with Serve's multiplexed model id for one loaded at run time (``stream``: the streaming
        handle, cached per adapter load).

        Raises:
            OpenAIError: 404 for an unknown model.
        """
        base, entry = await self.adapter_base(name)
        adapter = name if base is not None else None
        name, handle = self.model_handle(base or name)
        if not stream:
            handle = self.models[name]
        if entry is not None:  # to a replica that holds the adapter (Serve's model multiplexing)
            key = (entry.multiplexed_id, stream)
            if key not in self._multiplexed:
                if len(self._multiplexed) > 1024:
                    self._multiplexed.clear()
                self._multiplexed[key] = handle.options(multiplexed_model_id=entry.multiplexed_id)
            handle = self._multiplexed[key]
        return Call(request, request_id_of(request), random_id(id_prefix), name, handle, headers, int(time.time()),
                    adapter=adapter, adapter_version=entry.version if entry is not None else None)

    async def ask(self, call: Call, method: str, *args, **kwargs):
        """``call.handle.<method>.remote(*args, **kwargs)``'s answer; a typed ``error`` on it
        (the replica's verdict) or a refusal by Serve becomes an :class:`OpenAIError`, any other failure
        a 500 with the request id (logged); a replica lost under the call: sent again, as :meth:`open`."""
        for attempt in range(UNAVAILABLE_RETRIES + 1):
            try:
                out = await getattr(call.handle, method).remote(*args, **kwargs)
                break
            except Exception as e:  # (a cancellation is no Exception: it goes through)
                err = self._replica_error(call, e)
                if err.code != "model_unavailable" or attempt == UNAVAILABLE_RETRIES:
                    raise err from None
                await asyncio.sleep(0.2 * (attempt + 1))
        if getattr(out, "error", None) is not None:
            raise OpenAIError.of(out.error)
        return out

    def _replica_error(self, call: Call, e: Exception) -> OpenAIError:
        """The client's error for a failed call to a replica: Serve's refusals (counted) and
        client errors as they are, anything else a 500 with the request id (details logged)."""
        err = as_client_error(e)
        if err is None:
            logger.error("request %s: the model server failed", call.http_id, exc_info=e)
            err = internal(call.http_id)
        elif err.code in ("queue_full", "model_unavailable"):  # refused by Serve before any replica saw it
            self.rejected.inc({"model_name": call.model, "reason": err.code})
        return err

    # ---- the pipeline -------------------------------------------------------------------
    async def start(self, call: Call, body: ChatCompletionRequest | CompletionRequest, endpoint: str,
                    requests: list[GenerateRequest], *, prompt_tokens: int, reserve_tokens: int | None,
                    fallback: bool = True):
        """Cache lookup -> key admission -> the replica streams (or the cached answer's replay).

        Args:
            endpoint: ``chat`` or ``completion`` (the cache's key and the upstream's path).
            requests: one per prompt; their ``priority`` is raised to the key's.
            prompt_tokens: the prompts' estimated tokens, ``reserve_tokens`` the output tokens
                to reserve (None: up to the context), both for the key's token budget.
            fallback: a refusal by every replica may go to the upstream (when one is configured).

        Returns:
            None with ``call.streams`` open, or the upstream's response when every replica
            refused and a fallback is configured.

        Raises:
            OpenAIError: the cache, the key's limits, the replica or Serve refused the request.
        """
        call.look = await self.lookup(call, endpoint, body)
        hit = call.look.hit
        # a cached answer counts as a request of the key, with no tokens: nothing is generated
        call.use = await self.admit(call, 0 if hit else prompt_tokens, 0 if hit else reserve_tokens, body.priority)
        try:
            if hit:
                call.streams = [ChunkStream.replay(c, r.n) for c, r in zip(call.look.streams, requests)]
            else:
                shed = self.shedder.check(call.model, len(requests))
                if shed is not None:  # the replicas refused as full just now: no trip to them
                    self.rejected.inc({"model_name": call.model, "reason": "queue_full"})
                    raise shed
                for r in requests:
                    r.priority, r.lora_name = call.use.priority, call.adapter
                results = await asyncio.gather(*(self.open(call, r) for r in requests), return_exceptions=True)
                call.streams = [r for r in results if isinstance(r, ChunkStream)]
                for r in results:
                    if isinstance(r, BaseException):
                        raise r
        except BaseException as e:
            call.cancel()
            self.settle_soon(call.use, [])
            if fallback and self.upstream is not None and isinstance(e, OpenAIError) and Upstream.applies(
                    e.status_code, e.code):
                return await self.fallback(call, f"/{'chat/completions' if endpoint == 'chat' else 'completions'}", e)
            raise
        if hit:
            self.settle_soon(call.use, [])  # settled at 0 now (the first settle wins; later ones are no-ops)
        elif call.look.store:
            for s in call.streams:
                s.record = []
        call.headers.update(call.look.headers)
        return None

    def finish(self, call: Call, lasts: dict[tuple[int, int], GenerationChunk], n: int, *, store: bool) -> None:
        """Settle the key's tokens from the last chunks and, when the answer completed
        (``store``), give it to the response cache (``n`` choices per prompt)."""
        self.settle_soon(call.use, lasts)
        if store and self.cache is not None and call.look.store:
            self.cache.store_soon(call.look, [s.record or [] for s in call.streams], n)

    async def sse(self, call: Call, events: AsyncIterator[bytes], lasts: dict[tuple[int, int], GenerationChunk],
                  n: int, done: bool = True) -> AsyncIterator[bytes]:
        """A streaming response's body: the endpoint's SSE ``events``, then ``data: [DONE]``.
        A failure midway becomes an SSE error event (request id, no internals); a client that
        disconnects cancels the streams, which aborts the generation in the engine. At the end
        the key is settled from ``lasts`` (the endpoint keeps it current) and a complete answer
        (``n`` choices per prompt) goes to the response cache. ``done=False``: no ``[DONE]``
        (the Responses API ends with its own event)."""
        complete = False
        try:
            async for event in events:
                yield event
            complete = True
        except asyncio.CancelledError:
            call.cancel()
            logger.info("request %s: client disconnected mid-stream; generation aborted", call.http_id)
            raise
        except Exception as e:
            call.cancel()
            yield stream_error(call.http_id, e)
        finally:
            call.cancel()
            await events.aclose()
            self.finish(call, lasts, n, store=complete)
        if done:
            yield DONE

    async def open(self, call: Call, request: GenerateRequest) -> ChunkStream:
        """Start the replica's stream of ``request`` and wait for its first chunk; the load
        shedder counts the stream open until it ends, and a ``queue_full`` refusal (the
        replica's or Serve's) marks the model full.

        A replica that died before the request's first chunk (its node lost: ``model_unavailable``)
        has produced nothing, so the request is sent again, up to :data:`UNAVAILABLE_RETRIES`
        times (Serve's router has dropped the dead replica by then).

        Raises:
            OpenAIError: the replica refused the request (its typed error), or Serve did
                (``queue_full`` 429, ``model_unavailable`` 503).
        """
        model = call.model
        request.shed_requests = self.shedder.opened(model)
        try:
            for attempt in range(UNAVAILABLE_RETRIES + 1):
                gen = call.handle.stream.remote(request)
                try:
                    first = await self._first_chunk(call, gen)
                    break
                except OpenAIError as e:
                    if e.code != "model_unavailable" or attempt == UNAVAILABLE_RETRIES:
                        raise
                    logger.info("request %s: the replica was lost before its first token; sent again", call.http_id)
                    await asyncio.sleep(0.2 * (attempt + 1))
        except BaseException as e:  # the request left before its first token
            self.shedder.closed(model)
            if isinstance(e, OpenAIError) and e.code == "queue_full":
                self.shedder.refused(model, e.retry_after_s)
            raise
        return ChunkStream(gen, first, request.n, on_end=lambda: self.shedder.closed(model))

    async def _first_chunk(self, call: Call, gen) -> GenerationChunk:
        """The stream's first chunk; a refusal or failure as an :class:`OpenAIError`."""
        try:
            first = await gen.__anext__()
        except asyncio.CancelledError:  # the client went away before the first token
            gen.cancel()
            raise
        except StopAsyncIteration:
            logger.error("request %s: the model server returned no output", call.http_id)
            raise internal(call.http_id) from None
        except Exception as e:
            raise self._replica_error(call, e) from None
        if first.error is not None:  # the replica's own verdict: a client error, a full queue, a dead engine
            raise OpenAIError.of(first.error)
        return first

    async def lookup(self, call: Call, endpoint: str, body) -> Lookup:
        """The response cache's verdict before any replica sees the request: a hit with the
        cached answer, a miss to store, or a bypass; ``NO_CACHE`` when the cache is off."""
        if self.cache is None:
            return NO_CACHE
        revision = await self.directory.revision(call.model)
        if call.adapter_version is not None:
            revision += "+lora:" + call.adapter_version
        return await self.cache.lookup(call.served, revision, endpoint, body,
                                       request_options(body, call.request.headers))

    async def admit(self, call: Call, prompt_tokens: int, max_tokens: int | None, priority: int) -> KeyUse:
        """Per-API-key admission of ``call`` (:meth:`KeyLimits.admit`): ``prompt_tokens``
        estimated + ``max_tokens`` reserved (None: up to the model's context).

        Raises:
            OpenAIError: as :meth:`KeyLimits.admit`.
        """
        policy = request_policy(call.request.scope)
        if max_tokens is None:
            max_tokens = 0
            if self.keys.reserves(policy):
                max_tokens = (await self.directory.info(call.model)).max_model_len - prompt_tokens
        return await self.keys.admit(policy, key_name(call.request.scope), call.model, call.served, prompt_tokens,
                                     max_tokens, priority)

    @staticmethod
    def settle_soon(use: KeyUse, lasts: dict[tuple[int, int], GenerationChunk] | list[GenerationChunk]) -> None:
        """:meth:`KeyUse.settle` with the last chunks of the request's choices (keyed ``(prompt
        index, choice index)``; a list is one choice per prompt), in a task of its own (a
        cancelled response's cleanup must not await the limiter's Redis)."""
        if use.done:
            return
        if isinstance(lasts, list):
            lasts = {(k, 0): c for k, c in enumerate(lasts)}
        usage = usage_of(lasts)
        background(use.settle(usage.prompt_tokens, usage.completion_tokens))

    async def fallback(self, call: Call, path: str, err: OpenAIError):
        """The upstream's answer to this request (``path`` under its base URL), which every
        local replica refused with ``err``; ``err`` itself when the upstream cannot be reached
        (the client then sees the local verdict and its Retry-After)."""
        self.fallbacks.inc({"model_name": call.model, "reason": err.code or str(err.status_code)})
        logger.info("request %s: %s refused it (%s); sending it upstream", call.http_id, call.model,
                    err.code or err.status_code)
        try:
            return await self.upstream.forward(path, await call.request.json(), call.served, call.http_id)
        except UpstreamError as e:
            logger.warning("request %s: fallback failed: %s", call.http_id, e)
            raise err from None

    def warn_unknown(self, body) -> None:
        """Log the request's unknown (ignored) fields, once per field name for this replica."""
        new = [f for f in unknown_fields(body) if f not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            logger.warning("ignoring unknown request field(s) %s (accepted, no effect; logged once per field)",
                           ", ".join(repr(f[:64]) for f in new[:20]))
