"""The gateway's shared state and its one request pipeline, with no HTTP framework and no Serve in it.

An endpoint builds a typed spec (:class:`~kvserve.deployments.gateway.call.GenerateSpec`: prompts or
messages, sampling, options) and renders what comes back; the pipeline does the rest, once:

1. **open** (:meth:`Gateway.run`): pick the model (``model: "auto"`` by the routing rules; a
   LoRA adapter's name by its base model, :class:`~kvserve.deployments.gateway.catalog.ModelCatalog`)
   -> response cache lookup -> per-key admission (:class:`~kvserve.deployments.limits.key_limits.KeyLimits`)
   -> the replica streams (:class:`~kvserve.deployments.gateway.replica_calls.ReplicaCalls`), or the
   upstream's answer when every replica refused and a fallback is configured;
2. **deliver** (``Gateway.answers``, :class:`~kvserve.deployments.gateway.answers.Answers`: its
   ``chunks``, ``whole`` and ``sse``): the chunks as they come, tracked per choice;
3. **settle and store** when the answer ends, however it ends: the key's tokens and, when it
   completed, the response cache's entry (also ``Answers``).

One-answer replica calls (embeddings, tokenize) take the same path in short:
:meth:`Gateway.run_unary` (pick, admit, ask, settle).

**What the gateway owns and what the replica owns.** The gateway owns what needs no model:
keys, limits, caches, the choice of model and the fallback, request ids, OpenAI rendering
(tool-call parsing, finish reasons, logprob formats, echo text, ``best_of`` ranking). The
replica owns everything that needs the tokenizer, the engine or its real capacity: chat
templates, tokenizing, the size checks (prompt plus ``max_tokens`` against ``max_model_len``;
``n`` times the prompts of a batch against what a replica holds in flight), fanning ``n`` out
into engine requests, admission to its queue, logprob token strings, the prompt text of
``echo``. What crosses is typed (:mod:`kvserve.deployments.contract.types`): a
:class:`~kvserve.deployments.contract.types.GenerateRequest` (sampling values already validated as
the engine's ``SamplingParams``) one way, :class:`~kvserve.deployments.contract.types.GenerationChunk`
records back, an error being a typed chunk the gateway renders as it is.
"""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import Request
from pydantic import BaseModel
from ray.serve.handle import DeploymentHandle

from kvserve.deployments.cache import NO_CACHE, CacheSettings, Lookup, ResponseCache, deterministic, request_options
from kvserve.deployments.contract.config import CacheArgs, GatewayArgs, LimitArgs, TracingArgs
from kvserve.deployments.contract.experiments import ExperimentArgs, WeightBoard
from kvserve.deployments.contract.routing_config import AUTO_MODEL, RoutingArgs
from kvserve.deployments.contract.facts import FactsBoard, ModelCard
from kvserve.deployments.contract.openai_errors import OpenAIError, random_id
from kvserve.deployments.contract.openai_requests import unknown_fields
from kvserve.deployments.contract.types import WARM_HEADER, WARM_KEY_HEADER, GenerateRequest
from kvserve.deployments.gateway.admin import is_admin
from kvserve.deployments.gateway.answers import Answers
from kvserve.deployments.gateway.call import Call, GenerateSpec, UnarySpec, estimate_prompt_tokens
from kvserve.deployments.gateway.catalog import ModelCatalog
from kvserve.deployments.gateway.errors import request_id_of
from kvserve.deployments.gateway.experiments import Experiments, Sample
from kvserve.deployments.gateway.request_log import RequestLog
from kvserve.deployments.gateway.gate import GateSettings, key_name, owner_id, request_policy
from kvserve.deployments.gateway.channels import ChannelHub
from kvserve.deployments.gateway.handles import ModelHandles
from kvserve.deployments.gateway.replica_calls import ReplicaCalls
from kvserve.deployments.gateway.batch_lines import is_batch
from kvserve.deployments.gateway.batches import Batches
from kvserve.deployments.gateway.files import FileStore
from kvserve.deployments.gateway.responses_input import ResponseStore
from kvserve.deployments.gateway.shedding import LoadShedder
from kvserve.deployments.gateway.streams import ChunkStream, background, usage_of
from kvserve.deployments.gateway.tracing import GatewayTracing
from kvserve.deployments.limits import RateLimiter, policies_from_keys
from kvserve.deployments.limits.key_limits import KeyLimits, KeyUse
from kvserve.deployments.routing.model_routing import Upstream, UpstreamError, user_text
from kvserve.telemetry.cost_metrics import CacheSavings
from kvserve.telemetry.metrics import cache_warmed_hits, model_routes, rejected, upstream_fallbacks
from kvserve.telemetry.tracing import tracing as otlp_tracing

logger = logging.getLogger("ray.serve")

#: Seconds a probe of a model (``/health``, ``/ready``) may take.
PROBE_TIMEOUT_S = 5.0

#: Engine priority of cache-warming and batch requests (lower runs first: after everything live).
WARM_PRIORITY = 1 << 30


class Gateway:
    """The state shared by a gateway replica's endpoints, and the pipeline they run requests
    through (see the module docstring).

    Args:
        models: served model name -> ``LLMServer`` handle; the first is the default model.
        cards: the models' (and encoders') :class:`~kvserve.deployments.contract.facts.ModelCard`, as
            ``build_app`` makes them from the configuration; a handle without a card gets one
            that knows only its name.
        gateway, limits, cache, routing: the configuration's sections
            (:mod:`kvserve.deployments.contract.config`; None: their defaults).
        encoders: embedding model name -> ``EmbeddingServer`` handle (``/v1/embeddings`` only).
        facts: where replicas publish what they learn at load (default: this Serve
            application's board; None outside Serve).
        variants: model name -> {variant -> ``LLMServer`` handle} of the models A/B tests
            split (``experiments``: the tests, :mod:`kvserve.deployments.gateway.experiments`);
            ``weights``: where their live weights are kept (default: this application's board).
        tracing: the OpenTelemetry section (None or no endpoint: no spans).

    Raises:
        ValueError: no model, a card without a handle, a configured adapter of a model not
            served, a bad setting (key entries, routing rules naming unknown models).
    """

    def __init__(
        self,
        models: dict[str, DeploymentHandle],
        cards: list[ModelCard] | None = None,
        *,
        gateway: GatewayArgs | None = None,
        limits: LimitArgs | None = None,
        cache: CacheArgs | None = None,
        routing: RoutingArgs | None = None,
        encoders: dict[str, DeploymentHandle] | None = None,
        facts: FactsBoard | None = None,
        variants: dict[str, dict[str, DeploymentHandle]] | None = None,
        experiments: list[ExperimentArgs] | None = None,
        weights: WeightBoard | None | str = "app",
        tracing: TracingArgs | None = None,
    ):
        g, lim, r = gateway or GatewayArgs(), limits or LimitArgs(), routing or RoutingArgs()
        self.args = g
        self.handles = ModelHandles(models, encoders, variants)
        self.experiments = Experiments(experiments or [], weights)
        t = tracing or TracingArgs()
        self.tracing = GatewayTracing(
            otlp_tracing(t.otlp_traces_endpoint, t.otlp_traces_protocol, t.otlp_traces_sample_ratio)
        )
        for e in experiments or []:
            missing = {v.name for v in e.variants} - set((variants or {}).get(e.model, {}))
            if missing:
                raise ValueError(f"experiment {e.name!r}: no deployment serves variant(s) {sorted(missing)}")
        self.catalog = _catalog(self.handles, cards or [], facts if facts is not None else FactsBoard.of_this_app())
        self.admin_keys = policies_from_keys(g.admin_api_keys or [])
        api_keys = g.api_keys
        if api_keys:  # an admin key must get past the gate to reach the admin endpoints
            known = {k.split()[0] for k in api_keys if k.split()}
            api_keys = list(api_keys) + [p.key for p in self.admin_keys if p.key not in known]
        self.gate = GateSettings.of(
            api_keys,
            g.max_request_body_bytes,
            g.auth_failures_per_minute,
            g.allowed_origins,
            g.max_file_bytes,
            g.forwarded_allow_ips,
        )
        settings = CacheSettings.of(cache, lim.redis_url)
        self.cache = ResponseCache(settings) if settings.enabled else None
        owners = max(1, len(self.gate.policies))  # each key's stores: an equal share of cache_max_bytes
        self.responses = ResponseStore(settings, owners)  # stored Responses API responses, in the cache's backend
        self.files = FileStore(
            settings, g.max_file_bytes, owners=owners, max_files=g.max_files_per_key
        )  # the Batch API's files, there too
        self.batches = Batches(
            settings,
            self.files,
            g.batch_concurrency,
            owners=owners,
            max_active=g.max_active_batches_per_key,
            keys=self.gate.policies,
        )
        # per-key limits: shared through Redis when given, else each gateway replica enforces its share
        self.keys = KeyLimits(
            RateLimiter(
                lim.rate_limit_rpm,
                lim.rate_limit_tpm,
                redis_url=lim.redis_url,
                divide_by=max(1, g.ingress_num_replicas),
            ),
            g.metrics_per_key,
        )
        self.routing = r.model_routing
        if self.routing is not None:
            self.routing.check(list(self.catalog.models))
        self.upstream = None if r.upstream is None else Upstream(r.upstream)
        self.channels = ChannelHub(self.handles.streaming, enabled=g.replica_channels)
        self.replicas = ReplicaCalls(rejected(), self.channels)
        self.answers = Answers(self.cache, on_finish=self._finished)
        c = cache or CacheArgs()
        self.request_log = (
            RequestLog(c.request_log_dir, c.request_log_prompts, c.request_log_max_bytes, c.request_log_backups)
            if c.request_log_dir
            else None
        )
        self.savings = CacheSavings()
        self.routes, self.fallbacks = model_routes(), upstream_fallbacks()
        self.shedder = LoadShedder()
        self.probe_timeout_s = PROBE_TIMEOUT_S
        self.draining = False
        self._warned_fields: set[str] = set()

    @property
    def models(self) -> dict[str, DeploymentHandle]:
        """Served model name -> ``LLMServer`` handle."""
        return self.handles.models

    @property
    def encoders(self) -> dict[str, DeploymentHandle]:
        """Embedding model name -> ``EmbeddingServer`` handle."""
        return self.handles.encoders

    @property
    def lora(self):
        """The run-time LoRA adapters' view (:class:`~kvserve.deployments.gateway.adapters.AdapterDirectory`)."""
        return self.catalog.lora

    # ---- open: the model, the cache, the key, the replica streams -------------------------
    async def run(self, spec: GenerateSpec):
        """Run a generating request up to its first chunks (see the module docstring).

        Returns:
            The :class:`Call`, its ``streams`` open (one per prompt; a cached answer's replay on
            a hit) and ``headers`` set; or the upstream's response when every replica refused
            and ``spec.fallback`` allows the upstream.

        Raises:
            OpenAIError: 404 for an unknown model; the cache, the key's limits, the replica or
                Serve refused the request.
        """
        self.warn_unknown(spec.body)
        call = await self._pick(spec)
        call.warm = self._is_warm(call)
        call.batch = is_batch(call.request.scope)  # the batch runner's in-process mark, never a client header
        self.tracing.begin(call, spec.endpoint)
        try:
            out = await self._run(call, spec)
        except OpenAIError as e:
            self._refused(call, e)
            self.tracing.end(call, error=e, status="refused")
            raise
        except BaseException as e:
            self.tracing.end(call, error=e, status="error")
            raise
        if out is not call:  # the upstream answered
            self.tracing.end(call, status="fallback")
        elif self.request_log is not None and not (call.warm or call.batch):  # admitted: warming may replay it
            self._log(call, spec)
        return out

    async def _check_prompt_bytes(self, call: Call, spec: GenerateSpec) -> None:
        """A prompt whose text alone has more bytes than any prompt that fits the model's context
        (its replicas' published bound, :meth:`Catalog.max_prompt_bytes`) is refused here,
        before a replica tokenizes it (tokenizing such prompts takes a replica's core from its
        other streams). Nothing is refused before a replica has published the bound.

        Raises:
            OpenAIError: 400 ``context_length_exceeded``.
        """
        limit = await self.catalog.max_prompt_bytes(call.model)
        if limit is None:
            return
        n, param = spec.prompt_bytes()
        if n > limit:
            what = "prompt" if param == "prompt" else "longest user message"
            raise OpenAIError(
                f"the {what} has {n} bytes of text, more than any prompt that fits this model's "
                f"context can hold ({limit} bytes, max_model_len times the most bytes one token "
                f"covers); shorten it",
                400,
                param=param,
                code="context_length_exceeded",
            )

    async def _run(self, call: Call, spec: GenerateSpec):
        await self._check_prompt_bytes(call, spec)
        requests = self._requests(call, spec)
        with self.tracing.step(call, "cache_lookup") as span:
            call.look = await self._lookup(call, spec)
            if span is not None:
                span.set_attribute("kvserve.cache", call.look.status)
        hit = call.look.hit
        # a cached answer counts as a request of the key, with no tokens: nothing is generated
        with self.tracing.step(call, "key_admission", **{"kvserve.api_key": key_name(call.request.scope)}):
            call.use = await self._admit(
                call, 0 if hit else spec.prompt_tokens(), 0 if hit else spec.reserve_tokens(), spec.body.priority
            )
        if call.warm or call.batch:
            call.use.priority = max(call.use.priority, WARM_PRIORITY)
        elif hit and call.look.warmed:
            cache_warmed_hits().inc({"level": call.look.status, "model_name": call.served, "variant": call.variant})
        try:
            if hit:
                call.streams = [ChunkStream.replay(c, call.n) for c in call.look.streams]
            else:
                with self.tracing.step(
                    call, "routing", **{"kvserve.deployment": call.target, "kvserve.variant": call.variant or None}
                ) as span:
                    context = self.tracing.context(span)
                    for r in requests:
                        r.trace_context = context
                    await self._open(call, requests)
                    if span is not None:
                        replicas = sorted({s.first.replica for s in call.streams if s.first.replica})
                        span.set_attribute("kvserve.replicas", ",".join(replicas))
        except BaseException as e:
            call.cancel()
            Answers.settle_soon(call.use, [])
            # batch work waits for local capacity (its runner retries a 429): a replica's batch
            # share being full is routine, not a reason to pay the upstream
            if (
                spec.fallback
                and not call.batch
                and self.upstream is not None
                and isinstance(e, OpenAIError)
                and Upstream.applies(e.status_code, e.code)
            ):
                with self.tracing.step(call, "fallback", **{"kvserve.local_error": e.code or str(e.status_code)}):
                    return await self._fallback(
                        call, "/chat/completions" if spec.endpoint == "chat" else "/completions", e
                    )
            raise
        if hit:
            Answers.settle_soon(call.use, [])  # settled at 0 now (the first settle wins; later ones are no-ops)
        elif call.look.store:
            for s in call.streams:
                s.record = []
        call.first_at = time.monotonic()
        call.headers.update(call.look.headers)
        call.lasts = {(p, 0): s.first for p, s in enumerate(call.streams)}
        return call

    def _is_warm(self, call: Call) -> bool:
        """Whether ``call`` is cache warming's (see :data:`WARM_HEADER`).

        Raises:
            OpenAIError: 403 when the header comes without an admin key.
        """
        if call.request.headers.get(WARM_HEADER, "").strip().lower() not in ("1", "true", "yes"):
            return False
        if not is_admin(self, call.request):
            raise OpenAIError(f"{WARM_HEADER} needs an admin key", 403, "permission_error", code="permission_denied")
        name = call.request.headers.get(WARM_KEY_HEADER, "").strip()
        if name and self.gate.policies:  # replayed under the limits of the key that sent it first
            policy = next((p for p in self.gate.policies if p.name == name), None)
            if policy is None:
                raise OpenAIError(
                    f"{WARM_KEY_HEADER}: no API key is named {name!r}",
                    400,
                    param=WARM_KEY_HEADER,
                    code="unknown_api_key",
                )
            call.request.scope.setdefault("state", {})["kvserve_api_key"] = policy
        return True

    def _log(self, call: Call, spec: GenerateSpec) -> None:
        """The request log's line of ``call`` (never fails the request)."""
        try:
            body = spec.body.model_dump(mode="json", exclude_unset=True)
            body["model"] = call.served
            self.request_log.record(
                call.served, spec.endpoint, body, deterministic(spec.body), key=key_name(call.request.scope)
            )
        except Exception as e:  # noqa: BLE001
            logger.warning("request %s: the request log failed (%s)", call.http_id, e)

    def _refused(self, call: Call, err: OpenAIError) -> None:
        """A request of an experiment that ended before its first chunk: its sample."""
        if call.assignment is None or call.warm:
            return
        status = "refused" if err.status_code in (429, 503) else "error" if err.status_code >= 500 else None
        if status is not None:  # a client's own mistake (400, 404) says nothing of the variant
            self.experiments.record(call.assignment, Sample(time.time(), status, e2e_s=time.monotonic() - call.started))

    def _finished(self, call: Call, lasts: dict, complete: bool) -> None:
        """A request's answer ended (:class:`Answers`' ``on_finish``): what a cache hit saved,
        and an experiment's sample."""
        hit = call.look.hit
        if call.assignment is None and not hit and call.span is None:
            return
        usage = usage_of(lasts)
        self.tracing.end(call, usage, status="ok" if complete else "error")
        if call.warm:  # warming's own: no live traffic was saved or measured
            return
        if hit:
            background(self._count_savings(call, call.look.status, usage.completion_tokens))
        if call.assignment is None:
            return
        now = time.monotonic()
        ttft = None if call.first_at is None else call.first_at - call.started
        out = usage.completion_tokens
        tpot = (now - call.first_at) / (out - 1) if call.first_at is not None and out > 1 else None
        cached = usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0
        replica = next((s.first.replica for s in call.streams if s.first.replica), None)
        self.experiments.record(
            call.assignment,
            Sample(
                time.time(),
                "ok" if complete else "error",
                ttft,
                tpot,
                now - call.started,
                usage.prompt_tokens,
                out,
                cached or 0,
                call.look.status if hit else None,
                None if hit else replica,
            ),
        )

    async def _count_savings(self, call: Call, level: str, output_tokens: int) -> None:
        try:
            cost = await self.catalog.cost_per_million_tokens(call.model)
        except Exception:  # the board away: the tokens still count
            cost = None
        self.savings.hit(call.model, level, call.variant, output_tokens, cost)

    async def run_unary(self, spec: UnarySpec) -> tuple[Call, object]:
        """A one-answer replica call: pick the model (an embedding model's name goes to its
        encoder), admit the key with the inputs' estimated tokens, ask, settle.

        Returns:
            ``(call, the replica's answer)``.

        Raises:
            OpenAIError: 404 for an unknown model, the key's limits, the replica's verdict.
        """
        if spec.body is not None:
            self.warn_unknown(spec.body)
        call = await self._call(
            spec.request, spec.model, spec.id_prefix, {}, stream=False, user=getattr(spec.body, "user", None)
        )
        self.tracing.begin(call, spec.method)
        try:
            call.use = await self._admit(call, spec.prompt_tokens, 0, spec.priority)
        except BaseException as e:
            self.tracing.end(call, error=e, status="refused")
            raise
        used = 0
        error = None
        try:
            kwargs = dict(spec.kwargs)
            if spec.call_context:
                kwargs.update(lora_name=call.adapter, priority=call.use.priority, request_id=call.response_id)
            out = await self.replicas.ask(call, spec.method, *spec.args, **kwargs)
            used = spec.tokens_used(out) if spec.tokens_used is not None else 0
        except BaseException as e:
            error = e
            raise
        finally:
            self.tracing.end(call, error=error, status="error" if error is not None else "ok")
            await call.use.settle(used, 0)
        return call, out

    def model_handle(self, model: str | None) -> tuple[str, DeploymentHandle]:
        """The served name and streaming handle of generating model ``model`` (None: the default).

        Raises:
            OpenAIError: 404 ``model_not_found``.
        """
        name = model or self.catalog.default_model
        if name not in self.handles.streaming:
            raise self._not_found(name)
        return name, self.handles.streaming[name]

    def _not_found(self, name: str) -> OpenAIError:
        return OpenAIError(
            f"the model '{name}' does not exist; available: {', '.join(self.catalog.known())}",
            404,
            "invalid_request_error",
            param="model",
            code="model_not_found",
        )

    async def _pick(self, spec: GenerateSpec) -> Call:
        """The :class:`Call` of a generating request: ``model: "auto"`` resolved by the routing
        rules (with an ``x-kvserve-route: auto:<rule>`` header), else the model it names."""
        headers = {}
        name = spec.body.model
        if name == AUTO_MODEL and self.routing is not None:
            tokens = (
                estimate_prompt_tokens(spec.messages)
                if spec.messages is not None
                else max((estimate_prompt_tokens(p) for p in spec.prompts or [""]), default=0)
            )
            name, rule = self.routing.choose(
                tokens, spec.params.max_tokens, user_text(spec.messages, spec.prompts), self.catalog.default_model
            )
            self.routes.inc({"model_name": name, "route": rule})
            headers["x-kvserve-route"] = f"auto:{rule}"
        call = await self._call(
            spec.request, name, spec.id_prefix, headers, stream=True, user=getattr(spec.body, "user", None)
        )
        call.n = spec.n
        return call

    async def _call(
        self,
        request: Request,
        name: str | None,
        id_prefix: str,
        headers: dict[str, str],
        *,
        stream: bool,
        user: str | None = None,
    ) -> Call:
        """The :class:`Call` of served name ``name`` (None: the default model): an embedding
        model's goes to its encoder (``stream`` False), a LoRA adapter's to its base model,
        with Serve's multiplexed model id for one loaded at run time; a model an A/B test
        splits to the variant the request is assigned (``user``: the body's ``user`` field).

        Raises:
            OpenAIError: 404 for an unknown model.
        """
        started = time.monotonic()
        base, entry = (None, None) if name in self.handles.encoders else await self.catalog.adapter_base(name)
        model = base or name or self.catalog.default_model
        if model not in self.handles.models and (stream or model not in self.handles.encoders):
            raise self._not_found(model)
        assignment = None
        if self.experiments and model in self.handles.models:
            assignment = self.experiments.assign(model, request.headers, user, key_name(request.scope))
        target = assignment.target if assignment is not None else model
        if assignment is not None:
            headers = {**headers, **assignment.headers()}
        return Call(
            request,
            request_id_of(request),
            random_id(id_prefix),
            model,
            self.handles.of(target, stream, entry),
            headers,
            int(time.time()),
            adapter=name if base is not None else None,
            adapter_version=entry.version if entry is not None else None,
            assignment=assignment,
            target=target,
            started=started,
        )

    @staticmethod
    def _requests(call: Call, spec: GenerateSpec) -> list[GenerateRequest]:
        """What goes to the replica: one request for a chat, one per prompt of a batch (each
        naming the batch's size, which the replica checks), with the engine's request ids and
        ``cache_salt`` (with API keys, the key's own: :meth:`KeyPolicy.cache_salt`; without, the
        client's, if any)."""
        salt = getattr(spec.body, "cache_salt", None)
        policy = request_policy(call.request.scope)
        if policy is not None:  # one tenant's cached prefixes are invisible to another
            salt = policy.cache_salt(salt)
        if spec.messages is not None:
            return [
                GenerateRequest(
                    messages=spec.messages,
                    tools=spec.tools,
                    sampling_params=spec.params,
                    n=spec.n,
                    request_id=call.response_id,
                    chat_template_kwargs=spec.chat_template_kwargs,
                    cache_salt=salt,
                )
            ]
        prompts = spec.prompts or []
        return [
            GenerateRequest(
                prompt=p,
                sampling_params=spec.params,
                n=spec.n,
                request_id=f"{call.response_id}-{i}",
                echo=spec.echo,
                num_prompts=len(prompts),
                cache_salt=salt,
            )
            for i, p in enumerate(prompts)
        ]

    async def _lookup(self, call: Call, spec: GenerateSpec) -> Lookup:
        """The response cache's verdict before any replica sees the request: a hit with the
        cached answer, a miss to store, or a bypass; ``NO_CACHE`` when the cache is off."""
        if self.cache is None:
            return NO_CACHE
        revision = await self.catalog.revision(call.model)
        if call.adapter_version is not None:
            revision += "+lora:" + call.adapter_version
        a = call.assignment
        if a is not None:  # each variant its own entries: a variant's hit rate is its own
            revision += f"+variant:{a.experiment}/{a.variant}"
        return await self.cache.lookup(
            call.served,
            revision,
            spec.endpoint,
            spec.body,
            request_options(spec.body, call.request.headers),
            owner=owner_id(call.request.scope),  # each key its own answers
            semantic_threshold=a.semantic_threshold if a is not None else None,
            variant=call.variant,
            warm=call.warm,
        )

    async def _admit(self, call: Call, prompt_tokens: int, max_tokens: int | None, priority: int) -> KeyUse:
        """Per-API-key admission of ``call`` (:meth:`KeyLimits.admit`): ``prompt_tokens``
        estimated + ``max_tokens`` reserved (None: up to the model's context; before any
        replica of a model without a configured ``max_model_len`` has published one, the prompt
        alone, settled with the real count as always).

        Raises:
            OpenAIError: as :meth:`KeyLimits.admit`.
        """
        policy = request_policy(call.request.scope)
        if max_tokens is None:
            max_tokens = 0
            if self.keys.reserves(policy):
                context = await self.catalog.max_model_len(call.model)
                max_tokens = 0 if context is None else context - prompt_tokens
        return await self.keys.admit(
            policy,
            key_name(call.request.scope),
            call.model,
            call.served,
            prompt_tokens,
            max_tokens,
            priority,
            variant=call.variant,
        )

    async def _open(self, call: Call, requests: list[GenerateRequest]) -> None:
        """``call.streams``: the replicas' streams of ``requests``, each up to its first chunk
        (all or none: the first refusal is raised, the others closed by the caller)."""
        background = call.warm or call.batch  # such work neither feeds nor meets the live traffic's marks
        shed = None if background else self.shedder.check(call.target, len(requests))
        if shed is not None:  # the replicas refused as full just now: no trip to them
            self.replicas.rejected.inc({"model_name": call.model, "reason": "queue_full", "variant": call.variant})
            raise shed
        for r in requests:  # warming gives way to live requests; batch work runs beside them, preempted
            r.priority, r.lora_name, r.sheddable, r.batch = call.use.priority, call.adapter, call.warm, call.batch
        results = await asyncio.gather(
            *(self.replicas.open(call, r, None if background else self.shedder) for r in requests),
            return_exceptions=True,
        )
        call.streams = [r for r in results if isinstance(r, ChunkStream)]
        for r in results:
            if isinstance(r, BaseException):
                raise r

    async def _fallback(self, call: Call, path: str, err: OpenAIError):
        """The upstream's answer to this request (``path`` under its base URL), which every
        local replica refused with ``err``; ``err`` itself when the upstream cannot be reached
        (the client then sees the local verdict and its Retry-After)."""
        self.fallbacks.inc(
            {"model_name": call.model, "reason": err.code or str(err.status_code), "variant": call.variant}
        )
        logger.info(
            "request %s: %s refused it (%s); sending it upstream", call.http_id, call.model, err.code or err.status_code
        )
        try:
            return await self.upstream.forward(path, await call.request.json(), call.served, call.http_id)
        except UpstreamError as e:
            logger.warning("request %s: fallback failed: %s", call.http_id, e)
            raise err from None

    def warn_unknown(self, body: BaseModel) -> None:
        """Log the request's unknown (ignored) fields, once per field name for this replica."""
        new = [f for f in unknown_fields(body) if f not in self._warned_fields]
        if new:
            self._warned_fields.update(new)
            logger.warning(
                "ignoring unknown request field(s) %s (accepted, no effect; logged once per field)",
                ", ".join(repr(f[:64]) for f in new[:20]),
            )


def _catalog(handles: ModelHandles, cards: list[ModelCard], board: FactsBoard | None) -> ModelCatalog:
    """The catalog of ``handles``' names from ``cards`` (a handle without one gets a card with
    its name only).

    Raises:
        ValueError: a card without a handle (a configured adapter's base not served).
    """
    by_name = {c.name: c for c in cards}
    for c in cards:
        if c.name not in handles.models and c.name not in handles.encoders:
            for a in c.lora_modules:
                raise ValueError(f"adapter {a!r}: its base model {c.name!r} is not served")
            raise ValueError(f"model card {c.name!r}: no deployment serves it")
    if not handles.models:
        raise ValueError("the gateway needs at least one model")
    return ModelCatalog(
        [by_name.get(n) or ModelCard(n) for n in handles.models],
        [by_name.get(n) or ModelCard(n, task="embed") for n in handles.encoders],
        board,
    )
