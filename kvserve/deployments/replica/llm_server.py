"""``LLMServer``: the Serve deployment that owns one :class:`engine.AsyncLLMEngine` per replica.

The gateway streams a typed :class:`~kvserve.deployments.contract.types.GenerateRequest` with
``handle.options(stream=True).stream.remote(request)``; any Ray job streams with
``handle.options(stream=True).generate.remote(prompt, sampling_params)``. Every item is a
:class:`~kvserve.deployments.contract.types.GenerationChunk` (a plain dataclass), so a caller needs
neither the engine nor torch. Cancelling the stream (an HTTP client that disconnects, or
``gen.cancel()``) aborts the request in the engine and returns its KV blocks to the pool.

With ``tensor_parallel_size > 1`` the replica starts a :class:`kvserve.cluster.worker_group.RayWorkerGroup`
(one Ray actor per rank, in the placement group Serve reserved for the replica) and hands
it to the engine as its executor; the scheduler, detokenizer and sampling bookkeeping stay
in the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from typing import Any

from ray import serve

from kvserve.cluster import reset_niceness
from kvserve.deployments.contract.adapters import serve_app_name
from kvserve.deployments.contract.config import ModelArgs, TracingArgs, default_admission_bounds
from kvserve.deployments.contract.facts import FactsBoard, LoadedFacts, ModelCard
from kvserve.deployments.contract.kv_cluster_directory import kv_layout
from kvserve.deployments.contract.openai_errors import random_id
from kvserve.deployments.contract.prefix import REPORTED_HASHES, replica_hash_seed, tokenizer_probe
from kvserve.deployments.contract.reasoning import REASONING_PARSERS, prompt_reasoning, reasons_first
from kvserve.deployments.contract.types import (
    GenerateRequest,
    GenerationChunk,
    GenerationError,
    ServerInfo,
    model_revision,
)
from kvserve.deployments.replica.admission import Admission, OverloadedError
from kvserve.deployments.replica.channels import GatewayChannels
from kvserve.deployments.replica.kv_cluster import ClusterKVConnector
from kvserve.deployments.replica.kv_publisher import KVEventPublisher
from kvserve.deployments.replica.lora import ReplicaAdapters, UnknownAdapterError, check_adapter
from kvserve.deployments.replica.pooling import PoolingEndpoints
from kvserve.deployments.replica.prefix_report import RecentPrefixes
from kvserve.deployments.replica.recent_requests import RecentRequests
from kvserve.deployments.replica.request_runner import RequestRunner, engine_dead
from kvserve.deployments.replica.step_rates import RATE_WINDOW_S, StepRateTracker
from kvserve.engine.input_processor import prompt_cache_salt
from kvserve.engine.kv_cache_manager import engine_root_hash
from kvserve.engine.protocol import EngineClient
from kvserve.engine.stats import SchedulerStats
from kvserve.telemetry.metrics import ClusterTierMetrics, PrometheusStatLogger
from kvserve.telemetry.tracing import tracing as otlp_tracing

logger = logging.getLogger("ray.serve")

#: Python's GIL switch interval in a replica (seconds; Python's default is 0.005). The step
#: thread needs the GIL back after every torch op while the event loop streams tokens; with
#: the default it waited up to 5 ms each time; the shorter interval raised the HTTP streaming
#: throughput of ``benchmarks/serving.py``.
GIL_SWITCH_INTERVAL_S = 2e-4


def default_torch_threads(tensor_parallel_size: int = 1) -> int:
    """CPU threads for one engine process (Ray sets ``OMP_NUM_THREADS`` to the actor's
    ``num_cpus``, 1 by default, which would leave most cores idle on a CPU replica)."""
    return max(1, (os.cpu_count() or 1) // max(1, tensor_parallel_size))


def _exception(err: GenerationError) -> Exception:
    """The exception a Python-handle caller of ``generate`` gets for an error chunk."""
    from kvserve.engine.async_engine import EngineDeadError

    if err.code == "queue_full":
        return OverloadedError(err)
    if err.code == "engine_dead":
        return EngineDeadError(err.message)
    if err.code == "timeout":
        return TimeoutError(err.message)
    return ValueError(err.message) if err.status < 500 else RuntimeError(err.message)


def _replica_id() -> str:
    """This Serve replica's id (the ``replica`` label), or the process id outside Serve."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:
        return f"pid-{os.getpid()}"


@serve.deployment(
    name="LLMServer",
    max_ongoing_requests=256,
    health_check_period_s=2,
    health_check_timeout_s=60,
    graceful_shutdown_timeout_s=60,
)
class LLMServer(PoolingEndpoints):
    """One model, one :class:`engine.AsyncLLMEngine` per replica (as Ray Serve LLM's
    ``LLMServer(llm_config)``).

    Args:
        model: the model's :class:`~kvserve.deployments.contract.config.ModelArgs` (or their dict): the
            engine's settings (``EngineConfig``'s fields), the served name, the admission bounds
            (``max_waiting_requests``, ``max_queued_prompt_tokens``; defaults
            :func:`~kvserve.deployments.contract.config.default_admission_bounds`; batch work's
            share ``max_batch_requests``, default
            :func:`~kvserve.deployments.contract.config.default_batch_requests`), ``request_timeout_s``
            (a request still running after this many seconds is aborted, its KV blocks freed,
            and ends with error ``timeout``, 504; None: no limit), ``stream_interval`` (engine
            outputs per chunk; 0: auto), ``lora_modules`` (``{name: PEFT folder}``, loaded at
            start), ``pooling_type`` (how ``embed`` pools), ``torch_num_threads`` (default: all
            cores on a single-rank CPU replica, :func:`default_torch_threads`), and the options of
            the tensor- or pipeline-parallel worker actors (``worker_cpus``, ``collective_timeout_s``).

    When it has loaded, the replica publishes what it learned (``max_model_len``, the weights'
    revision) on the application's :class:`~kvserve.deployments.contract.facts.FactsBoard` for the
    gateway, and again when its model folder's revision changes (checked on Serve's health check).

    Raises:
        ValueError: (constructor) a bad setting, or a configured adapter that does not load.
    """

    def __init__(self, model: ModelArgs | dict | None = None, tracing: TracingArgs | None = None):
        import torch

        from kvserve.engine.async_engine import AsyncLLMEngine
        from kvserve.engine.config import EngineConfig
        from kvserve.engine.executor import UniProcExecutor

        reset_niceness()
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        m = model if isinstance(model, ModelArgs) else ModelArgs.model_validate(dict(model or {}))
        config = EngineConfig(**m.engine_args())
        if config.prefix_caching_hash_seed is None:  # one seed for the app's replicas (and routers)
            config = dataclasses.replace(config, prefix_caching_hash_seed=replica_hash_seed())
        #: the root of the engine's KV block-hash chains (the routers and the cluster tier hash alike)
        self.hash_root = engine_root_hash(config.prefix_caching_hash_seed)
        if (m.kv_aware_routing and m.prefix_aware_routing and config.enable_prefix_caching) or m.kv_cluster_tier_size:
            # what the KV-aware router reads, and what the cluster tier saves
            config = dataclasses.replace(config, enable_kv_cache_events=True)
        tp = config.tensor_parallel_size * config.pipeline_parallel_size  # worker actors
        torch.set_num_threads(m.torch_num_threads or default_torch_threads(1))
        self.stats = StepRateTracker(config.max_num_seqs, config.max_num_batched_tokens)

        if tp > 1:
            from kvserve.cluster.worker_group import RayWorkerGroup

            wopts = {
                "num_cpus": m.worker_cpus,
                "collective_timeout_s": m.collective_timeout_s,
                "torch_num_threads": m.torch_num_threads or default_torch_threads(tp),
            }

            def inner_factory(cfg, path):
                return RayWorkerGroup(cfg, path, **wopts)
        else:
            inner_factory = UniProcExecutor

        t0 = time.time()
        #: the engine's front, and all this replica uses of the engine (kvserve/engine/protocol.py)
        self.engine: EngineClient
        if tp == 1 and m.engine_core_process:
            from kvserve.engine.core_client import MPAsyncLLMEngine

            self.engine = MPAsyncLLMEngine.from_config(config, torch_num_threads=torch.get_num_threads())
        else:
            self.engine = AsyncLLMEngine.from_config(config, executor_factory=inner_factory)
        self.model_name = m.name
        self.deployment_key = m.deployment_key  # name@variant for a variant of an A/B test
        self.card = ModelCard.of(m)
        self.adapters = ReplicaAdapters(
            self.engine,
            m.lora_modules,
            self.model_name,  # a bad one fails here
            config.enable_lora,
            config.max_cpu_loras or config.max_loras,
        )

        d_req, d_tok = default_admission_bounds(
            config.max_num_seqs, config.max_num_batched_tokens, self.engine.max_model_len
        )
        self.admission = Admission(
            config.max_num_seqs,
            m.max_waiting_requests or d_req,
            m.max_queued_prompt_tokens or d_tok,
            m.batch_requests_bound(),
        )
        self.request_timeout_s = m.request_timeout_s
        self.stream_interval, self.pooling_type = m.stream_interval, m.pooling_type
        self.reasoning_parser = m.reasoning_parser
        self.reasoning_end_ids = None  # the end marker's token ids (structured outputs start after it)
        if m.reasoning_parser is not None:
            end = REASONING_PARSERS[m.reasoning_parser][1]
            self.reasoning_end_ids = self.engine.tokenizer.encode(end, add_special_tokens=False)
        self.tool_call_parser = m.tool_call_parser  # "auto": the one the chat template writes calls for
        if self.tool_call_parser == "auto":
            from kvserve.engine.chat_templates import tool_parser_for_template

            self.tool_call_parser = tool_parser_for_template(getattr(self.engine.tokenizer, "chat_template", None))
        self.metrics = PrometheusStatLogger(
            self.model_name,
            _replica_id(),
            variant=m.variant or "",
            cost_per_hour=m.cost_per_replica_hour,
            speculative=config.speculative_config is not None,
            lora=config.max_loras if config.enable_lora else None,
        )

        def on_step(m):
            self.stats.record(m)
            self.metrics.record_step(m)

        self.engine.add_stat_logger(on_step, self.metrics.record_finished)
        # what the prefix-aware router learns from this replica (record_routing_stats)
        n_blocks = int(self.engine.get_stats().get("num_kv_blocks") or REPORTED_HASHES)
        self.prefixes = RecentPrefixes(config.block_size, limit=min(REPORTED_HASHES, n_blocks), root=self.hash_root)
        self._tokenizer_probe = tokenizer_probe(self.engine.tokenize, self.engine.input_processor.chat_template_ids)
        self.recent = RecentRequests()  # finished requests' timings
        self.replica_id = _replica_id()
        self.channels = GatewayChannels()  # one stream per gateway replica (kvserve/deployments/replica/channels.py)
        t = tracing or TracingArgs()
        self.runner = RequestRunner(
            self.engine,
            self.admission,
            self.recent,
            self.model_name,
            m.request_timeout_s,
            m.stream_interval,
            m.variant or "",
            otlp_tracing(t.otlp_traces_endpoint, t.otlp_traces_protocol, t.otlp_traces_sample_ratio),
        )
        self.max_model_len = self.engine.max_model_len
        self.revision = model_revision(self.engine.model_path)
        self.facts = FactsBoard.of_this_app()
        self._publish()
        #: publishes the engine's KV cache events to the application's hub (KV-aware routing), None: off
        self.kv_publisher = self.kv_cluster = None
        app = serve_app_name()
        if (
            m.kv_cluster_tier_size and app is not None
        ):  # the cluster KV tier (kvserve/deployments/replica/kv_cluster.py)
            self.kv_cluster = self._cluster_tier(m, config, app)
            self.engine.kv_connector = self.kv_cluster
        if config.enable_kv_cache_events and app is not None:
            self.kv_publisher = KVEventPublisher(
                self.engine,
                self.replica_id,
                app,
                listener=self.kv_cluster,
                layout=self.kv_cluster.layout if self.kv_cluster else "",
            )
        logger.info(
            "LLMServer %s ready in %.1fs (tp=%d, pp=%d, max_model_len=%d)",
            self.model_name,
            time.time() - t0,
            config.tensor_parallel_size,
            config.pipeline_parallel_size,
            self.max_model_len,
        )

    def _cluster_tier(self, m: ModelArgs, config, app: str) -> ClusterKVConnector:
        """This replica's side of the cluster KV tier, for blocks of this engine's layout."""
        cfg = self.engine.config
        layout = kv_layout(
            m.name,
            str(cfg.dtype),
            cfg.kv_cache_dtype,
            cfg.block_size,
            cfg.tensor_parallel_size,
            cfg.pipeline_parallel_size,
            revision=self.revision,
            quantization=cfg.quantization,
            variant=m.variant or "",
        )
        slots = int(self.engine.get_stats().get("kv_offload_capacity_blocks", 0))
        return ClusterKVConnector(
            self.engine,
            self.replica_id,
            app,
            layout,
            int(m.kv_cluster_tier_size * (1 << 30)),
            config.block_size,
            max_import_blocks=max(1, slots // 2),
            hash_root=self.hash_root,
            metrics=ClusterTierMetrics(self.model_name, self.replica_id, m.variant or ""),
        )

    def _publish(self) -> None:
        """Put this replica's :class:`LoadedFacts` on the application's board (a no-op outside Serve)."""
        if self.facts is not None:
            config = self.engine.config
            cost = self.metrics.cost.per_million() if self.metrics.cost is not None else None
            self.facts.put(
                self.deployment_key,
                LoadedFacts(
                    self.max_model_len,
                    self.revision,
                    self.card.digest,
                    config.dtype,
                    config.quantization,
                    cost,
                    self.tool_call_parser,
                    self.engine.input_processor.max_token_bytes,
                ),
            )
            self._published_cost = cost

    async def _republish_if_cost_moved(self) -> None:
        """Publish again when the measured cost per million output tokens moved by more than 1 %
        since it was last published (the gateway prices cache hits with it). Logged on failure."""
        if self.metrics.cost is None or self.facts is None:
            return
        cost, old = self.metrics.cost.per_million(), getattr(self, "_published_cost", None)
        if cost is None or (old is not None and abs(cost - old) <= 0.01 * old):
            return
        try:
            await asyncio.to_thread(self._publish)
        except Exception as e:
            logger.warning("model %s: publishing the measured cost failed (%s)", self.model_name, type(e).__name__)

    async def _republish_if_revised(self) -> None:
        """Publish again when the model folder's revision changed (new weights on disk: the
        gateway's response cache must not answer from the old ones). A failure is logged only."""
        try:
            revision = await asyncio.to_thread(model_revision, self.engine.model_path)
            if revision != self.revision:
                self.revision = revision
                await asyncio.to_thread(self._publish)
                logger.info("model %s: weights revision is now %s", self.model_name, revision)
        except Exception as e:
            logger.warning("model %s: publishing the weights revision failed (%s)", self.model_name, type(e).__name__)

    # ---- generation ---------------------------------------------------------------------
    async def stream(self, request: GenerateRequest) -> AsyncIterator[GenerationChunk]:
        """Stream one request: one :class:`~kvserve.deployments.contract.types.GenerationChunk` per
        engine step that gives it tokens (``text``, ``token_ids``, ``finished``,
        ``finish_reason``, token counts, ``logprobs`` when asked for); the last has
        ``finished=True``. The gateway's seam.

        A request that cannot run, or stops early, ends with a chunk whose ``error`` says why
        (:class:`~kvserve.deployments.contract.types.GenerationError`: ``context_length_exceeded``,
        ``invalid_value``, ``too_large`` 400; ``queue_full`` 429; ``timeout`` 504;
        ``engine_dead`` 503): per-request problems are never raised (so bad requests log no
        tracebacks). The replica is where a request's size is checked, once, against the real
        numbers: ``n`` choices times the batch's ``num_prompts`` against what it holds in flight
        (``too_large``, :meth:`Admission.never_fits`), and the context: the prompt leaves room for
        one output token and, when ``max_tokens`` is set, prompt plus ``max_tokens`` fit
        ``max_model_len`` (``context_length_exceeded``). A cache-warming request
        (``request.sheddable``) gives way to live ones (``warming_deferred`` 429); a Batch-API
        request (``request.batch``) is admitted within the replica's batch share and is never
        stopped for live traffic (:class:`~kvserve.deployments.replica.request_runner.RequestRunner`).

        With ``n > 1`` the replica runs ``n`` engine requests (ids ``<request_id>-<i>``; a
        given ``seed`` becomes ``seed + i``) and interleaves their chunks, each tagged with
        its ``index`` and ending with its own ``finished`` chunk. The first runs alone until
        its prompt is computed, so the others find the prompt's KV blocks in the prefix cache
        instead of computing them again.

        Raises:
            RuntimeError: a failure of the engine itself (not of the request).
        """
        from kvserve.engine.async_engine import EngineDeadError
        from kvserve.engine.input_processor import PromptTooLongError

        params, n = request.sampling_params, request.n
        request_id = request.request_id or random_id("req")
        self.admission.note_refused(request.shed_requests)  # the gateway's refusals count as demand
        try:
            request.check()
            too_large = self.admission.never_fits(n, max(1, int(request.num_prompts)), batch=request.batch)
            if too_large is not None:  # the one size check: the gateway renders it as it is
                yield GenerationChunk.failed(too_large)
                return
            lora = await self.adapters.resolve(request.lora_name)
            if request.messages is not None:
                ids = await self.engine.apply_chat_template(
                    request.messages, request.tools, request.chat_template_kwargs
                )
            else:
                ids = await self.engine.encode(request.prompt)
            self.engine.input_processor.check_context_length(len(ids), params.max_tokens)
        except EngineDeadError:
            yield engine_dead()
            return
        except (ValueError, TypeError) as e:
            code = (
                "context_length_exceeded"
                if isinstance(e, PromptTooLongError)
                else "model_not_found"
                if isinstance(e, UnknownAdapterError)
                else "invalid_value"
            )
            yield GenerationChunk.failed(GenerationError(code, str(e)))
            return
        salt = request.cache_salt or prompt_cache_salt(request.prompt)
        self.prefixes.add(ids, request.lora_name, salt)
        reasoning = ""  # where the chat prompt leaves a reasoning model
        if self.reasoning_parser is not None and request.messages is not None:
            reasoning = prompt_reasoning(self.engine.tokenizer.decode(ids[-16:]), self.reasoning_parser)
            if params.structured_outputs is not None and reasons_first(self.reasoning_parser, reasoning):
                params = dataclasses.replace(params, reasoning_end_token_ids=self.reasoning_end_ids)
        prompt_text = None
        if request.echo:
            prompt_text = request.prompt if isinstance(request.prompt, str) else self.engine.tokenizer.decode(ids)
        if n == 1:
            chunks = self.runner.run(
                ids,
                params,
                request_id,
                request.priority,
                prompt_text=prompt_text,
                lora=lora,
                trace=request.trace_context,
                sheddable=request.sheddable,
                cache_salt=salt,
                batch=request.batch,
            )
        else:
            chunks = self.runner.fan_out(
                ids,
                params,
                request_id,
                request.priority,
                n,
                prompt_text,
                lora,
                trace=request.trace_context,
                sheddable=request.sheddable,
                cache_salt=salt,
                batch=request.batch,
            )
        first = True
        async for chunk in self.channels.route(chunks, request.channel, self.replica_id):
            if first:
                chunk.prompt_reasoning, first = reasoning, False
            yield chunk

    async def channel(self, gateway_id: str, replica_id: str | None = None) -> AsyncIterator[dict[str, list]]:
        """The channel of gateway replica ``gateway_id`` (:mod:`kvserve.deployments.replica.channels`):
        a hello naming this replica (``{"replica": id}``), then ``{channel key: [GenerationChunk,
        ...]}`` per engine step for every request of that gateway here whose first chunk said
        ``via_channel``. Ends after :data:`~kvserve.deployments.replica.channels.CHANNEL_IDLE_S` seconds
        unused. ``replica_id``: the replica the gateway meant (its router sends the call there)."""
        async for batch in self.channels.serve(gateway_id, self.replica_id):
            yield batch

    async def generate(
        self,
        prompt: str | list[int] | dict | None = None,
        sampling_params: dict | None = None,
        *,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
        echo: bool = False,
        lora_name: str | None = None,
    ) -> AsyncIterator[GenerationChunk]:
        """:meth:`stream` for Python-handle callers
        (``handle.options(stream=True).generate.remote(prompt, {"max_tokens": 16})``), with a
        request that cannot run raised instead of returned as an error chunk. The arguments
        are :class:`~kvserve.deployments.contract.types.GenerateRequest`'s; ``sampling_params`` is a dict
        of :class:`engine.SamplingParams` fields plus ``n`` (choices, default 1).

        Raises:
            ValueError: invalid sampling parameters, messages or prompt (e.g. longer than
                the model's context); raised before anything is generated.
            OverloadedError: the replica's queue is full (retry later).
            EngineDeadError: the engine (or one of its tensor-parallel workers) died.
            TimeoutError: the request ran past the server's ``request_timeout_s``.
            RuntimeError: the request failed inside the engine after it started.
        """
        request = GenerateRequest.of(
            prompt,
            sampling_params,
            messages=messages,
            tools=tools,
            lora_name=lora_name,
            request_id=request_id or "",
            priority=priority,
            echo=echo,
        )
        async for chunk in self.stream(request):
            if chunk.error is not None:
                raise _exception(chunk.error)
            yield chunk

    async def complete(
        self,
        prompt: str | list[int] | dict | None = None,
        sampling_params: dict | None = None,
        *,
        messages: list[dict] | None = None,
        request_id: str | None = None,
        tools: list[dict] | None = None,
        priority: int = 0,
    ) -> GenerationChunk | list[GenerationChunk]:
        """Non-streaming :meth:`generate`: one finished chunk with the whole ``text``,
        ``token_ids`` (and ``logprobs`` if asked for); with ``n > 1`` in ``sampling_params``,
        a list of them by choice index.

        Raises:
            ValueError, OverloadedError, EngineDeadError, RuntimeError: as :meth:`generate`.
        """
        n = (sampling_params or {}).get("n", 1)
        wholes = [GenerationChunk(index=i) for i in range(n if isinstance(n, int) and n > 1 else 1)]
        async for chunk in self.generate(
            prompt, sampling_params, messages=messages, tools=tools, request_id=request_id, priority=priority
        ):
            wholes[chunk.index].extend(chunk)
        return wholes if len(wholes) > 1 else wholes[0]

    # ---- introspection ------------------------------------------------------------------
    def recent_request_metrics(self, request_ids: list[str] | None = None) -> dict[str, dict]:
        """Engine-side timings (``time.time()`` seconds) of recently finished requests, by
        request id (the gateway uses ``<response id>-<choice index>`` for completions and the
        response id for chat): lets a client split its TTFT into engine and serving path."""
        return self.recent.get(request_ids)

    def server_info(self) -> ServerInfo:
        """What this model's replicas are, for Python-handle callers and operators (see
        :class:`~kvserve.deployments.contract.types.ServerInfo`; the gateway reads the board instead)."""
        cfg = self.engine.config
        return ServerInfo(
            name=self.model_name,
            max_model_len=self.max_model_len,
            tensor_parallel_size=cfg.tensor_parallel_size,
            pipeline_parallel_size=cfg.pipeline_parallel_size,
            kv_cache_dtype=cfg.kv_cache_dtype,
            quantization=cfg.quantization,
            speculative_config=self.card.speculative_config,
            lora_modules=list(self.adapters.static),
            max_waiting_requests=self.admission.max_requests,
            max_in_flight_requests=self.admission.max_in_flight,
            max_queued_prompt_tokens=self.admission.max_prompt_tokens,
            tool_call_parser=self.tool_call_parser,
            revision=model_revision(self.engine.model_path),  # the response cache's invalidation
            workers=(
                self.engine.executor.placement_group_info()
                if hasattr(self.engine.executor, "placement_group_info")
                else None
            ),
        )

    async def check_lora_adapter(
        self, name: str, path: str, allowed_roots: list[str] | None = None
    ) -> tuple[str | None, str | None]:
        """``(real path, None)`` when PEFT folder ``path`` may be adapter ``name`` here (under
        one of ``allowed_roots`` as this node resolves it, readable, fitting the model),
        ``(None, why not)`` otherwise (``/v1/load_lora_adapter``; :func:`kvserve.deployments.replica.lora.check_adapter`)."""
        return await asyncio.to_thread(check_adapter, self.engine, name, path, tuple(allowed_roots or ()))

    def get_stats(self) -> dict[str, float]:
        """The engine's gauges and counters (``kv_cache_usage``, ``num_running_requests``,
        ``max_running_batch``, ``num_generated_tokens``, ...), the step-rate metrics, the
        requests in flight by kind (``num_live_requests``, ``num_warm_requests``: cache warming's,
        ``num_batch_requests``: the Batch API's) and the gateway channels' counts
        (:meth:`GatewayChannels.stats`)."""
        s = dict(self.engine.get_stats())
        s.update(asdict(self.stats.snapshot()))
        s["engine_busy_s"] = self.stats.busy_s  # seconds in engine steps since the replica started
        s["num_live_requests"], s["num_warm_requests"] = self.runner.live, len(self.runner.warm)
        s["num_batch_requests"] = self.admission.batch_in_flight  # batch-API requests admitted, not yet ended
        s.update(self.channels.stats())
        if self.kv_cluster is not None:
            s.update(self.kv_cluster.stats())
        return s

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Per-replica metrics for the custom autoscaling policy (``kvserve/autoscaling/policy.py``):
        queue and batch gauges from the scheduler, the requests refused as full (the bounded
        queue's and the gateway's shedding) in the last :data:`RATE_WINDOW_S` s, token rates over
        the last :data:`RATE_WINDOW_S` s of engine steps, the capacities measured on full-ish steps
        and the mean prompt of the requests served (see :class:`StepRateTracker`)."""
        s = self.engine.get_stats()
        rates = self.stats.snapshot()
        return {
            "num_waiting_requests": float(s["num_waiting_requests"] + s.get("num_pending_requests", 0)),
            # with admission bounded, overload shows as 429s, not as a queue: the policy counts these as
            # waiting demand and prices them at the served requests' mean prompt (no prompt of theirs is known)
            "num_refused_requests": float(self.admission.recently_refused(RATE_WINDOW_S)),
            "num_waiting_prefill_tokens": float(s["num_waiting_prefill_tokens"]),
            "num_running_requests": float(s["num_running_requests"]),
            **{k: float(v) for k, v in asdict(rates).items()},
            "kv_cache_usage": float(s["kv_cache_usage"]),
        }

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the prefix-aware router (``kvserve/deployments/routing/prefix_router.py``) learns from this replica, polled
        by Serve's controller every ``request_routing_stats_period_s`` and sent to every router: the chained
        block hashes of the prompt prefixes it served recently (oldest first; at most ``REPORTED_HASHES``
        and its KV pool's block count), the block size, the model folder, the tokenizer probe and the
        roots of its hash chains (``prefix_hash_roots``: the base model's and each configured adapter's)."""
        self._start_kv_tasks()
        return {
            "prefix_hashes": self.prefixes.report(),
            "block_size": self.prefixes.block_size,
            "model_path": str(self.engine.model_path),
            "tokenizer_probe": self._tokenizer_probe,
            "prefix_hash_roots": self.adapters.hash_roots(self.hash_root),
        }

    async def health(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Liveness now, for the ingress's ``/health`` (cheap; never cached): the engine's
        step loop is alive and its executor answers its health check within ``timeout_s``
        seconds: the engine core's health thread (never behind a grammar compile or an adapter
        load), or with tensor parallelism every worker's ping (beside a long step, not behind
        it). Concurrent probes share one check. A full queue is still alive.

        Only a real failure is fatal (the core process gone, the executor's check raising); a
        check slower than ``timeout_s`` fails this probe alone (the gateway's ``/health`` is then
        503) and touches no request.

        Raises:
            EngineDeadError: the step loop died, the core process or a worker is gone, or the
                executor failed its check (this replica is then unhealthy for Serve too, which
                replaces it).
            TimeoutError: no answer within ``timeout_s`` (the engine and its requests go on).
        """
        await self.engine.check_health_async(timeout_s)
        s = self.engine.get_stats()  # the queue gauges also move while no step runs
        self.metrics.record_scheduler_stats(
            SchedulerStats(
                int(s["num_running_requests"]),
                int(s["num_waiting_requests"] + s.get("num_pending_requests", 0)),
                float(s["kv_cache_usage"]),
            )
        )
        return {"status": "ok"}

    async def ready(self, recent_s: float = 10.0, timeout_s: float = 30.0) -> dict[str, Any]:
        """Readiness, for the ingress's ``/ready``: alive (:meth:`health`) and serving, i.e.
        the engine ran a step in the last ``recent_s`` seconds or a 1-token probe request
        finishes within ``timeout_s`` seconds.

        Raises:
            EngineDeadError: as :meth:`health`.
            TimeoutError: the probe did not finish in time.
        """
        from kvserve.engine.sampling_params import SamplingParams

        await self.health()
        if self.stats.last_end and time.monotonic() - self.stats.last_end < recent_s:
            return {"status": "ok", "probe": False}
        t0 = time.monotonic()
        async with asyncio.timeout(timeout_s):
            probe = GenerateRequest(
                prompt="ready?",
                sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                request_id=f"ready-{os.urandom(6).hex()}",
            )
            async for chunk in self.stream(probe):
                if chunk.error is not None and chunk.error.code != "queue_full":
                    raise RuntimeError(f"readiness probe failed: {chunk.error.code}")
        return {"status": "ok", "probe": True, "probe_s": round(time.monotonic() - t0, 3)}

    async def check_health(self) -> None:
        """Serve's periodic health check (every ``health_check_period_s``): see :meth:`health`,
        with 30 s to answer (Serve replaces a replica only after several failed checks in a
        row, so one slow answer costs nothing); it also publishes the weights' revision again
        when the model folder changed."""
        await self.health(timeout_s=30.0)
        await self._republish_if_revised()
        await self._republish_if_cost_moved()
        self._start_kv_tasks()

    def _start_kv_tasks(self) -> None:
        """Start the KV event publisher and the cluster tier's saves on the replica's event loop
        (idempotent)."""
        if self.kv_publisher is not None:
            self.kv_publisher.start()
        if self.kv_cluster is not None:
            self.kv_cluster.start()

    async def __del__(self):  # Serve calls this on graceful replica shutdown
        with contextlib.suppress(Exception):
            if self.kv_publisher is not None:
                await self.kv_publisher.stop()
            if self.kv_cluster is not None:
                await self.kv_cluster.stop()
        with contextlib.suppress(Exception):
            await self.engine.shutdown()
