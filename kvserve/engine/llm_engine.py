"""The synchronous engine: add requests, call ``step()`` until they finish."""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from kvserve.engine import dtype_probe
from kvserve.engine.config import EngineConfig
from kvserve.engine.draft_model import DraftModelProposer
from kvserve.engine.executor import Executor
from kvserve.engine.input_processor import (  # noqa: F401  (re-exported: the engine-level names of these)
    InputProcessor,
    PromptTooLongError,
    chat_template_ids,
    encode_prompt,
    parse_prompt,
    render_chat_template,
)
from kvserve.engine import kv_offload
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.kv_events import KVEventBatch, KVEventRecorder
from kvserve.engine.kv_offload import HostKVTier, KVBlockCopy
from kvserve.engine.mixed_step_budget import MixedStepBudget
from kvserve.engine.layers.w4a16 import resolve_quantization
from kvserve.engine.model_loader import load_config, load_tokenizer, resolve_model
from kvserve.engine.model_runner import ModelRunnerOutput, load_eos_token_ids
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.request import Request, RequestOutput, RequestStatus
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sched_output import SchedulerOutput
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.spec_decode import NgramProposer, SpeculativeConfig, Speculator
from kvserve.engine.stats import EngineStats, FinishedRequestStats, IterationStats
from kvserve.engine.step_isolation import StepFailedError, isolate_failing_requests
from kvserve.engine.structured_output import GrammarLimits, StructuredOutputs

logger = logging.getLogger("kvserve.engine")
#: KV event batches kept for a consumer that has not taken them (older ones are dropped: the
#: consumer sees a gap in the numbering and asks for a snapshot)
KV_EVENT_BACKLOG = 4096


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    ``step()`` = schedule (:class:`Scheduler`) -> execute (the executor's model runner and
    sampler) -> update (the scheduler appends the tokens and finishes requests at EOS, a stop
    token or their length) -> output (:class:`OutputProcessor`: detokenization and stop strings,
    which the scheduler then acts on), with speculative decoding (:class:`Speculator`), grammars
    (:class:`StructuredOutputs`) and stats (:class:`EngineStats`) hooked in between.

    Prompts become requests in :attr:`input_processor` (:class:`InputProcessor`: parsing, chat
    templates, validation). The output processor finds stop strings and returns them; the
    scheduler finishes those requests and frees their blocks (:meth:`_output`).

    Args:
        config: engine configuration.
        executor_factory: ``(config, model_path) -> Executor``; default: the executor of
            ``config.distributed_executor_backend`` (:meth:`Executor.get_class`: in-process for
            one rank, else Ray actors or local processes). Pass one to place the ranks yourself
            (e.g. a ``kvserve.cluster.worker_group.RayWorkerGroup`` in a Serve replica's placement group).

    Raises:
        ValueError: a bad config, unknown model, or ``max_model_len`` over the KV pool.
        ImportError: the chosen backend's module is missing (``"ray"`` without Ray).
    """

    def __init__(self, config: EngineConfig, executor_factory: Callable[[EngineConfig, str], Executor] | None = None):
        self.model_path = str(resolve_model(config.model))
        self.tokenizer = load_tokenizer(self.model_path)
        self.hf_config = load_config(self.model_path)
        self.eos_token_ids = load_eos_token_ids(self.model_path, self.hf_config)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.config = config = self._resolve_config(config)
        factory = executor_factory or Executor.get_class(config)
        self.executor = factory(config, self.model_path)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.init_kv_cache(num_blocks)
        self.max_model_len = self._max_model_len(num_blocks)
        #: Prompt parsing, chat templates and request validation (:class:`InputProcessor`).
        self.input_processor = InputProcessor(
            self.tokenizer,
            vocab_size=self.hf_config.vocab_size,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            enable_lora=config.enable_lora,
        )
        #: KV cache events of each step (None: ``enable_kv_cache_events`` off); see :meth:`take_kv_events`
        self.kv_events = KVEventRecorder() if config.enable_kv_cache_events else None
        self._kv_event_batches: deque[KVEventBatch] = deque(maxlen=KV_EVENT_BACKLOG)
        self._kv_event_lock = threading.Lock()  # the step thread records, a front's thread takes
        #: batches recorded since the engine started (their numbering: :meth:`take_kv_events`)
        self.kv_event_seq = 0
        #: seconds the driver rank spent loading blocks back from the host tier
        self.kv_load_seconds = 0.0
        #: K+V bytes of one block of the whole model (the host tier's unit)
        self.kv_block_bytes = kv_offload.bytes_per_block(
            self.hf_config, config.block_size, 1 if config.kv_cache_dtype == "fp8" else config.torch_dtype.itemsize
        )
        self.scheduler = self._build_scheduler(num_blocks)
        #: Counters and stat loggers.
        self.stats = EngineStats()
        #: Callables given the :class:`IterationStats` of every step that ran the model (the list
        #: of :attr:`stats`).
        self.stat_loggers: list[Callable[[IterationStats], None]] = self.stats.stat_loggers
        #: Callables given the :class:`FinishedRequestStats` of every request that leaves the
        #: engine (the list of :attr:`stats`).
        self.request_loggers: list[Callable[[FinishedRequestStats], None]] = self.stats.request_loggers
        #: Grammar compiler (xgrammar, built on the first request with ``structured_outputs``)
        #: and the requests that have a grammar.
        self.structured_outputs = StructuredOutputs(
            self.tokenizer,
            self.hf_config.vocab_size,
            self.eos_token_ids,
            limits=GrammarLimits.from_dict(config.structured_outputs_config),
        )
        self._finish_stopped = functools.partial(self.scheduler.finish_stopped, stop_reason=None)
        #: Detokenization, stop strings and the outputs (:class:`OutputProcessor`).
        self.output_processor = OutputProcessor(self.tokenizer, self._request_finished)
        #: Seconds for every timing-driven policy (mixed-step budget, draft length, step
        #: metrics); tests replace it with a noisy fake clock.
        self.clock: Callable[[], float] = time.monotonic
        #: Speculative decoding's engine side, None without ``speculative_config``.
        self.speculator = self._build_speculator(num_blocks)
        if self.speculator is not None:
            self.scheduler.on_finish = self.speculator.release
        logger.info(
            "engine ready: model=%s blocks=%d (%d tokens) max_model_len=%d",
            self.model_path,
            num_blocks,
            num_blocks * config.block_size,
            self.max_model_len,
        )

    # ---- building the engine (each once, from __init__) ------------------------------------
    def _resolve_config(self, config: EngineConfig) -> EngineConfig:
        """``config`` with what the checkpoint decides filled in, once here so that every rank of the
        executor runs the same: a 4-bit checkpoint's own quantization, and ``dtype="auto"``'s choice.

        Raises:
            ValueError: more pipeline stages than the model has layers.
        """
        quantization = resolve_quantization(config.quantization, self.hf_config)  # a 4-bit checkpoint's own
        if quantization != config.quantization:
            config = dataclasses.replace(config, quantization=quantization)
        if config.dtype == "auto":
            dtype, why = dtype_probe.auto_dtype(config, self.hf_config)
            logger.info("dtype auto -> %s", why)
            config = dataclasses.replace(config, dtype=str(dtype).removeprefix("torch."))
        if config.pipeline_parallel_size > self.hf_config.num_hidden_layers:
            raise ValueError(
                f"pipeline_parallel_size {config.pipeline_parallel_size} exceeds num_hidden_layers "
                f"{self.hf_config.num_hidden_layers} (each stage needs a layer)"
            )
        return config

    def _max_model_len(self, num_blocks: int) -> int:
        """The context (tokens) the engine serves: ``config.max_model_len``, or the smaller of the
        model's ``max_position_embeddings`` and the KV pool of ``num_blocks`` blocks.

        Raises:
            ValueError: ``max_model_len`` over either.
        """
        config = self.config
        capacity = num_blocks * config.block_size
        model_max = self.hf_config.max_position_embeddings
        if config.max_model_len is None:
            if capacity < model_max:
                logger.warning(
                    "max_model_len is %d tokens, the KV cache's capacity (%d blocks), below the model's "
                    "%d: give the cache more memory for longer contexts",
                    capacity,
                    num_blocks,
                    model_max,
                )
            return min(model_max, capacity)
        if config.max_model_len > model_max:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {model_max}"
            )
        if config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the KV cache capacity "
                f"{capacity} tokens ({num_blocks} blocks); give it more memory"
            )
        return config.max_model_len

    def _build_scheduler(self, num_blocks: int) -> Scheduler:
        """The scheduler over a :class:`KVCacheManager` of ``num_blocks`` blocks, with the host tier
        ``kv_offloading_size`` holds (none when it holds no block) and the mixed-step budget."""
        config = self.config
        slots = kv_offload.num_slots(config.kv_offloading_size, self.kv_block_bytes)
        tier = HostKVTier(slots, self.kv_events) if slots else None
        if config.kv_offloading_size and not slots:
            logger.warning(
                "kv_offloading_size %s GiB holds no block of this model: no host tier", config.kv_offloading_size
            )
        kv = KVCacheManager(
            num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            self.kv_events,
            tier,
            hash_seed=config.prefix_caching_hash_seed,
        )
        return Scheduler(
            kv,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.scheduling_policy,
            mixed_prefill_tokens=config.mixed_step_prefill_tokens,
            long_prefill_threshold=self.max_model_len // 25,
            mixed_budget=MixedStepBudget.for_config(config),
            max_loras=config.max_loras if config.enable_lora else 0,
        )

    def _build_speculator(self, num_blocks: int) -> Speculator | None:
        """Speculative decoding's engine side (``speculative_config``: n-gram lookup or a draft
        model with a KV pool of ``num_blocks`` blocks), None without it."""
        spec = SpeculativeConfig.from_dict(self.config.speculative_config)
        if spec is None:
            return None
        if spec.method == "ngram":
            proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            proposer = DraftModelProposer(spec, self.config, self.hf_config.vocab_size, num_blocks)
        return Speculator(spec, proposer, self.hf_config.vocab_size)

    @property
    def mixed_budget(self) -> MixedStepBudget | None:
        """The scheduler's mixed-step budget (None: ``mixed_step_prefill_tokens`` is fixed, or
        CUDA graphs are on: :meth:`MixedStepBudget.for_config`).
        Assignable (a benchmark swaps estimators)."""
        return self.scheduler.mixed_budget

    @mixed_budget.setter
    def mixed_budget(self, budget: MixedStepBudget | None) -> None:
        self.scheduler.mixed_budget = budget

    # ---- requests -----------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict) -> list[int]:
        """Token ids of a prompt (:meth:`InputProcessor.tokenize`).

        Raises:
            ValueError: a malformed prompt.
        """
        return self.input_processor.tokenize(prompt)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` (and ``tools``) under the tokenizer's chat template
        (:meth:`InputProcessor.chat_template_ids`).

        Raises:
            ValueError: no chat template, or malformed messages.
        """
        return self.input_processor.chat_template_ids(messages, tools, add_generation_prompt=add_generation_prompt)

    def add_lora(self, lora_request) -> None:
        """Load a LoRA adapter (:class:`kvserve.engine.lora.LoRARequest`) into every rank's host cache
        (a no-op when loaded); requests naming it then run with it.

        Raises:
            ValueError: LoRA is off (``enable_lora``), or the adapter does not load or fit
                (its rank, modules or shapes; see :meth:`kvserve.engine.lora.LoRAWeights.load`).
        """
        if not self.config.enable_lora:
            raise ValueError("this engine serves no LoRA adapters: start it with enable_lora=True")
        self.executor.add_lora(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (False: it was not loaded; requests already running keep theirs
        until they end, as the adapter is loaded again for them)."""
        return self.config.enable_lora and self.executor.remove_lora(lora_int_id)

    def make_request(
        self,
        request_id: str,
        prompt: str | list[int] | dict,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request=None,
        pooling_params=None,
    ) -> Request:
        """Validate and tokenize a request without queueing it (safe to call while a step runs):
        :meth:`InputProcessor.process_inputs` (prompt forms, sampling parameters against the
        model, the prompt against ``max_model_len``), then the request's grammar is compiled
        (``structured_outputs``, cached) and its LoRA adapter loaded, off the step loop.

        ``pooling_params`` (:class:`kvserve.engine.pooling.PoolingParams`) makes an embedding request:
        ``params`` are ignored (its prompt is computed, nothing is generated, ``max_tokens=0``),
        the prompt may fill the whole context, and its final output carries ``pooled``.

        Raises:
            ValueError: empty prompt, token ids out of the vocabulary, a prompt of
                ``max_model_len`` tokens or more (:class:`PromptTooLongError`), a non-integer
                ``priority``, sampling parameters the model cannot honour (the message starts
                with the field name), a grammar that does not compile, or a LoRA adapter that
                LoRA being off, or the adapter itself, rules out.
        """
        req = self.input_processor.process_inputs(
            request_id,
            prompt,
            params,
            priority=priority,
            arrival_time=arrival_time,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        if req.params.structured_outputs is not None:  # compiled here, off the step loop (cached)
            req.grammar = self.structured_outputs.request_grammar(
                req.params.structured_outputs, req.params.reasoning_end_token_ids
            )
        if lora_request is not None:
            self.add_lora(lora_request)  # loads and checks the adapter now, off the step loop
        return req

    def enqueue(self, req: Request) -> None:
        """Hand a request from :meth:`make_request` to the scheduler.

        Raises:
            ValueError: a request with the same id is already in the engine.
        """
        self.scheduler.add_request(req)
        self.output_processor.add_request(req)
        self.stats.num_prompt_tokens += req.num_prompt_tokens
        self.structured_outputs.add_request(req)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        lora_request=None,
        pooling_params=None,
    ) -> Request:
        """Validate, tokenize and queue a request (see :meth:`make_request`, :meth:`enqueue`);
        ``lora_request``: its adapter (:class:`kvserve.engine.lora.LoRARequest`), None: the base model;
        ``pooling_params``: an embedding request (:mod:`kvserve.engine.pooling`)."""
        req = self.make_request(request_id, prompt, params, priority, arrival_time, lora_request, pooling_params)
        self.enqueue(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (or None if unknown)."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self.output_processor.final_output(req)

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        """Finish a request with an error (``finish_reason "error"``, ``error`` set, blocks
        freed); returns its final output (or None if unknown)."""
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        req.error = error
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self.output_processor.final_output(req)

    def _fail(self, req: Request, where: str, error: BaseException, new_token_ids: list[int] = ()) -> RequestOutput:
        """Fail ``req`` alone after ``error`` in ``where`` (words for the log): ``FINISHED_ERROR``,
        blocks freed (the scheduler), ``req.error`` set unless it already is; returns its final
        output (``new_token_ids``: the step's tokens it carries), built without the detokenizer if
        that is what fails."""
        logger.error(
            "request %s failed in %s: %s: %s", req.request_id, where, type(error).__name__, error, exc_info=error
        )
        req.error = req.error or f"{type(error).__name__}: {error}"
        if req.request_id in self.scheduler.requests:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        else:  # already left the queues (e.g. finished by length in the same step)
            req.status = RequestStatus.FINISHED_ERROR
        return self.output_processor.final_output(req, new_token_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for every request that got new tokens or
        finished in it (also those that failed alone: ``finish_reason == "error"``).

        What may raise out of ``step()``, and why (everything else is isolated):

        * :class:`StepFailedError`: the model step failed for every request of the step, each
          alone too (:meth:`_isolate`), so the executor or device is suspect; nothing was
          updated and the requests are still in the engine, for the caller to judge.
        * An exception from ``scheduler.schedule()`` or the KV cache manager: engine code with
          no per-request input beyond token counts; a failure there means the engine's own
          bookkeeping is broken, and going on could hand one request's blocks to another.

        Per-request hooks fail that request alone (``finish_reason "error"``, ``error`` set,
        blocks freed): the model step (by bisection), grammar bitmask fill and advance,
        the scheduler's per-request update (tokens, logprobs, prompt logprobs, stop tokens),
        detokenization and stop strings, and output assembly. A proposer (n-gram or draft
        model) or the draft-length policy that raises on a request turns drafting off for that
        request, which goes on without drafts. Stat loggers, request loggers and speculation
        bookkeeping that raise are logged (once per logger) and skipped.
        """
        if self.speculator is not None:
            self.speculator.propose(self.scheduler.running, self.clock)
        sched = self.scheduler.schedule()  # 1. schedule
        if sched.is_empty:
            self._drop_finished(sched)
            return []
        reqs = {sr.request_id: self.scheduler.requests[sr.request_id] for sr in sched.requests}
        last_token = self.stats.begin_step(reqs.values())
        grammar = self.structured_outputs.fill_bitmask(sched, getattr(self.executor, "in_process", False))
        result, failed, m = self._execute(sched)  # 2. execute
        fail = self._fail
        outputs = [fail(reqs[rid], "the model step", e) for rid, e in failed.items()]
        outputs += [fail(r, "its grammar bitmask", e) for r, e in self.structured_outputs.fill_failures(grammar)]
        updated, update_outputs = self._update(sched, result, reqs, m)  # 3. update
        outputs += update_outputs
        self.stats.record_tokens(m, updated, last_token)
        outputs += self._output(updated)  # 4. output
        self._end_step(m, updated)
        return outputs

    def _end_step(self, m: IterationStats | None, updated: list[Request]) -> None:
        """The step's stats, and its KV cache events as one batch (what scheduling evicted and
        loaded, and the blocks the update cached)."""
        self.stats.end_step(m, updated, self.scheduler.kv)
        if self.kv_events is not None:
            self._keep_kv_events()

    def _drop_finished(self, sched: SchedulerOutput) -> None:
        """A step with nothing to run still tells the runner which requests finished (it drops
        their state).

        Raises:
            StepFailedError: the executor raised (no request is to blame).
        """
        if sched.finished_req_ids:
            try:
                self.executor.execute_model(sched)
            except Exception as e:
                raise StepFailedError([], e) from e

    def _execute(self, sched: SchedulerOutput) -> tuple[ModelRunnerOutput, dict[str, Exception], IterationStats | None]:
        """Run the model on ``sched``. A call that raises is re-run in parts to find the requests
        that fail alone (:func:`~kvserve.engine.step_isolation.isolate_failing_requests`); one that succeeds gets the step's metrics, whose time
        also feeds the scheduler's mixed-step budget.

        Returns:
            The output, ``{request_id: exception}`` of the requests that failed alone, and the
            :class:`IterationStats` (None after an isolation: the time is not one step's).

        Raises:
            StepFailedError: see :func:`~kvserve.engine.step_isolation.isolate_failing_requests`.
        """
        t0 = self.clock()
        try:
            result = self.executor.execute_model(sched)
        except Exception as e:
            return *isolate_failing_requests(self.executor, sched, e), None
        m = IterationStats.of_step(sched, t0, self.clock(), len(self.scheduler.waiting))
        if sched.kv_transfer:  # the host tier's share of the step
            m.external_prefix_cache_hits = sched.host_cache_hits
            m.kv_offload_saved_bytes = len(sched.kv_transfer.saves) * self.kv_block_bytes
            m.kv_offload_loaded_bytes = len(sched.kv_transfer.loads) * self.kv_block_bytes
            m.kv_offload_load_seconds = getattr(result, "kv_load_seconds", 0.0)
            self.kv_load_seconds += m.kv_offload_load_seconds
        if self.config.enable_lora:  # vLLM's lora_requests_info
            m.running_lora_adapters, m.waiting_lora_adapters = (
                sorted({r.lora_request.lora_name for r in q if r.lora_request is not None})
                for q in (self.scheduler.running, self.scheduler.waiting)
            )
        if self.scheduler.mixed_budget is not None:
            self.scheduler.mixed_budget.record(m.end - m.start, m.num_prefill_tokens, m.num_decode_tokens)
        return result, {}, m

    def _update(
        self, sched: SchedulerOutput, result: ModelRunnerOutput, reqs: dict[str, Request], m: IterationStats | None
    ) -> tuple[list[Request], list[RequestOutput]]:
        """After the model call: the scheduler appends the sampled tokens (stop tokens, length;
        a request whose update raises fails alone), speculation records what was accepted (into
        ``m`` too), ``max_tokens=0`` requests whose prompt is done give their final output, and
        the grammars advance (a request whose grammar rejects its token fails alone). ``reqs``:
        the step's requests by id.

        Returns:
            The requests that got tokens (each one's ``new_token_ids``), and the outputs of the
            requests that finished or failed here.
        """
        errors: dict[str, BaseException] = {}
        updated = self.scheduler.update_from_output(
            sched, result.sampled, result.logprobs, result.prompt_logprobs, errors=errors, pooled=result.pooled
        )
        fail = self._fail
        outputs = [fail(reqs[rid], "its output update", e) for rid, e in errors.items()]
        if self.speculator is not None:
            try:
                self.speculator.record(sched, m)
            except Exception:
                self.stats.log_broken("speculation bookkeeping")
        outputs += [
            self.output_processor.final_output(r)
            for sr in sched.requests  # max_tokens=0: no token
            if not sr.sample
            and (r := reqs[sr.request_id]).max_output_tokens == 0
            and r.status is RequestStatus.FINISHED_LENGTH
        ]
        outputs += [
            fail(r, "its grammar", e, r.new_token_ids)
            for r, e in self.structured_outputs.advance(updated, self._finish_stopped)
        ]
        return updated, outputs

    def _output(self, updated: list[Request]) -> list[RequestOutput]:
        """After the update, the outputs of the requests that got tokens (``updated``): the
        output processor detokenizes their new tokens and finds stop strings; the scheduler
        finishes the requests that reached one (dropping the step's tokens after it, freeing
        their blocks) and those whose detokenizer raised (they fail alone); then the output
        processor builds the outputs (a request whose output assembly raises fails alone)."""
        found = self.output_processor.detokenize(updated)
        outputs = [self._fail(r, "detokenization", e, r.new_token_ids) for r, e in found.failed]
        for stop in found.stops:
            if stop.request.status is not RequestStatus.FINISHED_ERROR:
                self.scheduler.finish_stopped(stop.request, stop.stop, stop.num_dropped_tokens)
        built, failed = self.output_processor.make_outputs(updated)
        return outputs + built + [self._fail(r, "output assembly", e, r.new_token_ids) for r, e in failed]

    def _request_finished(self, req: Request) -> None:
        """The final output of ``req`` is being built: free its grammar matcher, report its stats."""
        self.structured_outputs.release(req)
        self.stats.log_finished(req)

    # ---- KV cache events -----------------------------------------------------
    def _keep_kv_events(self) -> None:
        with self._kv_event_lock:
            batch = self.kv_events.take(time.time())
            if batch is not None:
                self._kv_event_batches.append(batch)
                self.kv_event_seq += 1

    def take_kv_events(self) -> tuple[int, list[KVEventBatch]]:
        """The KV event batches (one per step that changed the cache) recorded since the last
        call, oldest first, and the number of the last one (batches are numbered from 1 since
        the engine started). When more than :data:`KV_EVENT_BACKLOG` batches waited, the oldest
        were dropped: ``seq - len(batches)`` is then past the caller's last number, and the
        caller should rebuild from :meth:`kv_cache_snapshot`. ``(0, [])`` with events off.
        Safe from any thread (batches are kept under a lock; the events of a step still being
        scheduled come with the next call)."""
        if self.kv_events is None:
            return 0, []
        with self._kv_event_lock:
            out = list(self._kv_event_batches)
            self._kv_event_batches.clear()
            return self.kv_event_seq, out

    def kv_cache_snapshot(self) -> tuple[int, KVEventBatch]:
        """Everything the pool and the host tier hold now, as ``BlockStored`` events (one per
        block), after the batches up to number ``seq`` (returned first): a consumer that starts
        from it applies only later batches. Call it from the thread that steps the engine."""
        if self.kv_events is not None:
            self._keep_kv_events()
        return self.kv_event_seq, self.scheduler.kv.snapshot(time.time())

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (pool and host tier; an ``AllBlocksCleared`` event).
        Returns False, changing nothing, while requests are running (their blocks are in use)."""
        if self.scheduler.has_unfinished():
            return False
        self.scheduler.kv.reset_prefix_cache()
        if self.kv_events is not None:
            self._keep_kv_events()
        return True

    def export_kv_blocks(self, block_hashes: list[int]) -> list[KVBlockCopy]:
        """Copies of the cached pool blocks named by ``block_hashes`` (those the pool still holds
        with their metadata: events or a host tier must be on), every rank's bytes, in the
        order asked, for a tier outside the engine. Call it from the thread that steps the
        engine (the bytes must not change under the copy)."""
        found = self.scheduler.kv.cached_blocks(block_hashes)
        if not found:
            return []
        shards = self.executor.read_kv_blocks([b for _, b, _ in found])  # per rank: [n, bytes]
        return [KVBlockCopy(h, meta, [rank[i] for rank in shards]) for i, (h, _, meta) in enumerate(found)]

    def import_kv_blocks(self, blocks: list[KVBlockCopy]) -> int:
        """Put blocks from outside the engine (:meth:`export_kv_blocks` of an engine of the same
        model, KV dtype, block size and parallel layout) into the host tier, from where a request
        whose prefix reaches them loads them instead of computing them. Blocks the pool or the
        tier already hold are skipped; at most the tier's size is taken (the first ones). Call it
        from the thread that steps the engine. Returns the number of blocks put in.

        Raises:
            ValueError: no host tier (``kv_offloading_size``), or blocks of another layout
                (checked before anything changes).
        """
        kv = self.scheduler.kv
        tier = kv.host_tier
        if tier is None:
            raise ValueError("importing KV blocks needs the host tier: set kv_offloading_size")
        ranks = self.config.tensor_parallel_size * self.config.pipeline_parallel_size
        if any(len(b.shards) != ranks for b in blocks):
            raise ValueError(f"KV block copies of another parallel layout ({ranks} ranks here)")
        if any(b.nbytes != self.kv_block_bytes for b in blocks):
            raise ValueError(
                f"KV block copies of another size than this engine's {self.kv_block_bytes} bytes "
                "(another model, KV dtype or block size)"
            )
        take = []
        for b in blocks:
            if len(take) == tier.num_slots:
                break
            if kv.pool.lookup(b.block_hash) is None and b.block_hash not in tier:
                take.append(b)
        if not take:
            return 0
        import numpy as np

        shards = [np.stack([b.shards[r] for b in take]) for r in range(ranks)]
        slots = []
        for b in take:
            slot = tier.insert(b.block_hash, tuple(b.meta))
            if slot is None:  # pinned slots only: nothing more fits this step
                break
            slots.append(slot)
        try:
            self.executor.write_kv_slots(slots, [s[: len(slots)] for s in shards])
        except BaseException:
            tier.discard([b.block_hash for b in take[: len(slots)]])  # their slots hold nothing valid
            raise
        finally:
            if self.kv_events is not None:
                self._keep_kv_events()
        return len(slots)

    # ---- introspection -------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """Scheduler gauges plus counters: steps, generated/prompt tokens, max running batch, and
        with speculative decoding the ``spec_decode_*`` totals (:meth:`Speculator.stats`)."""
        s = self.scheduler.stats()
        st = self.stats
        s.update(
            num_steps=st.num_steps,
            max_running_batch=st.max_running,
            num_generated_tokens=st.num_generated_tokens,
            num_prompt_tokens=st.num_prompt_tokens,
            num_kv_blocks=self.scheduler.kv.num_blocks,
            free_kv_blocks=self.scheduler.kv.pool.num_free_blocks,
            time=time.time(),
        )
        tier = self.scheduler.kv.host_tier
        if tier is not None:  # the host tier below the pool (vLLM's kv offloading)
            block = self.kv_block_bytes
            s.update(
                kv_offload_blocks=len(tier),
                kv_offload_capacity_blocks=tier.num_slots,
                kv_offload_hit_tokens=self.scheduler.kv.host_hits,
                kv_offload_saved_bytes=tier.num_saved * block,
                kv_offload_loaded_bytes=tier.num_loaded * block,
                kv_offload_load_seconds=self.kv_load_seconds,
                kv_offload_imported_blocks=tier.num_imported,
                kv_offload_imported_hit_tokens=tier.num_imported_loaded * self.config.block_size,
            )
        if self.speculator is not None:
            s.update(self.speculator.stats())
        return s

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.structured_outputs.close()
