"""The synchronous engine: add requests, call ``step()`` until they finish."""
from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from collections.abc import Callable

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import Executor, UniProcExecutor
from engine.kv_cache_manager import KVCacheManager
from engine.model_loader import load_config, load_tokenizer, resolve_model
from engine.model_runner import ModelRunnerOutput, load_eos_token_ids
from engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.spec_decode import DraftLengthPolicy, NgramProposer, SpeculativeConfig
from engine.structured_output import StructuredOutputs

logger = logging.getLogger("kvserve.engine")


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                      tools: list[dict] | None = None) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) under the tokenizer's chat
    template, with the assistant generation prompt appended. ``tools`` (OpenAI's
    ``{"type": "function", "function": {...}}`` list) go to the template as transformers'
    ``apply_chat_template(tools=...)`` defines.

    Raises:
        ValueError: the tokenizer has no chat template, or the messages are malformed.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             tools=tools or None)
    except Exception as e:  # jinja errors on bad roles / content
        raise ValueError(f"could not apply the chat template: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)


class PromptTooLongError(ValueError):
    """The prompt leaves no room for an output token within ``max_model_len``."""


def parse_prompt(prompt: str | list[int] | dict) -> tuple[str | None, list[int] | None]:
    """vLLM's prompt forms: a string, a list of token ids, ``{"prompt": str}`` (TextPrompt) or
    ``{"prompt_token_ids": [...]}`` (TokensPrompt). Returns ``(text, token_ids)``, exactly one
    of them not None.

    Raises:
        ValueError: a dict with neither key, both, or any other key; a value of the wrong type.
    """
    if isinstance(prompt, dict):
        unknown = set(prompt) - {"prompt", "prompt_token_ids"}
        if unknown or len(prompt) != 1:
            raise ValueError("a dict prompt takes exactly one of 'prompt' (text) or 'prompt_token_ids'"
                             + (f"; unknown key(s): {sorted(unknown)}" if unknown else ""))
        (key, value), = prompt.items()
        if key == "prompt" and not isinstance(value, str):
            raise ValueError(f"prompt must be a string, got {type(value).__name__}")
        if key == "prompt_token_ids" and not isinstance(value, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be a list of integers, got {type(value).__name__}")
        prompt = value
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    raise ValueError(f"a prompt is a string, a list of token ids or a dict, got {type(prompt).__name__}")


def encode_prompt(tokenizer, prompt: str | list[int] | dict) -> list[int]:
    """Token ids of a prompt in any of :func:`parse_prompt`'s forms (text is encoded with the
    tokenizer's special tokens, e.g. BOS).

    Raises:
        ValueError: see :func:`parse_prompt`.
    """
    text, ids = parse_prompt(prompt)
    return tokenizer.encode(text, add_special_tokens=True) if text is not None else ids


@dataclass
class StepMetrics:
    """What one engine step did, for stat loggers (vLLM's ``SchedulerStats`` + ``IterationStats``):
    the serving layer's token rates, capacities and Prometheus metrics, the autoscaler's inputs
    and the mixed-step budget all read these instead of wrapping the executor.

    Attributes:
        start, end: :attr:`LLMEngine.clock` seconds (``time.monotonic()``) around the model call.
        num_prefill_tokens: prompt (or recomputed) tokens computed.
        num_decode_tokens: decode tokens computed (one per decoding request).
        num_sampled: tokens sampled (= generation tokens of this step).
        num_running: requests in the step's batch.
        num_waiting: requests still waiting after the step was scheduled.
        num_preemptions: requests preempted (by recompute) to schedule this step.
        prefix_cache_queries, prefix_cache_hits: prompt tokens looked up in the prefix cache
            by requests (re)scheduled this step, and those found (vLLM's counters' units).
        kv_cache_usage: fraction of KV blocks in use after the step, 0..1.
        num_prompt_tokens: prompt tokens of the requests that got their first token this step
            (vLLM's ``prompt_tokens``: each prompt counted once, however it was chunked).
        time_to_first_tokens: seconds from arrival to first token, of those requests.
        inter_token_latencies: seconds since the previous token, of every other request that
            got a token this step (a preempted request's includes its recompute).
        num_drafts, num_draft_tokens, num_accepted_tokens: speculative decoding: requests that
            verified drafts, drafts verified, drafts accepted (vLLM's ``spec_decode_*`` units).
        accepted_per_position: accepted drafts by position in the draft (index 0 = first).
    """

    start: float
    end: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_sampled: int
    num_running: int
    num_waiting: int
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    kv_cache_usage: float = 0.0
    num_prompt_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)


@dataclass
class FinishedRequestStats:
    """One request that left the engine (finished, aborted or failed), for stat loggers
    (vLLM's ``FinishedRequestStats``). Times in seconds; a phase the request never reached
    is None (an aborted waiting request has no prefill).

    Attributes:
        finish_reason: ``stop``, ``length``, ``abort`` or ``error``.
        e2e_latency: arrival to finish.
        queue_time: arrival to first scheduled (waiting in the queue).
        prefill_time: first scheduled to first token.
        decode_time: first token to finish.
        num_prompt_tokens, num_generation_tokens, num_cached_tokens: token counts.
        max_tokens: the request's output limit (``max_tokens``, capped by the context).
    """

    request_id: str
    finish_reason: str
    e2e_latency: float
    queue_time: float | None
    prefill_time: float | None
    decode_time: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    max_tokens: int

    @classmethod
    def of(cls, req: Request) -> "FinishedRequestStats":
        m = req.metrics
        end = m.finished_time or time.time()

        def span(a, b):
            return None if a is None or b is None else max(0.0, b - a)

        return cls(req.request_id, req.status.value, max(0.0, end - m.arrival_time),
                   span(m.arrival_time, m.first_scheduled_time if m.first_scheduled_time is not None else end),
                   span(m.first_scheduled_time, m.first_token_time), span(m.first_token_time, end),
                   req.num_prompt_tokens, req.num_output_tokens, m.num_cached_tokens, req.max_output_tokens)


class StepFailedError(RuntimeError):
    """The model step failed for every request in it, each one alone too, so the failure
    cannot be pinned on a request (a broken executor or device, an engine bug). The requests
    are still in the engine; the caller decides (the async engine checks the executor's
    health, then fails them or declares the engine dead). ``__cause__`` is the first error.

    Attributes:
        request_ids: the requests of the failed step.
    """

    def __init__(self, request_ids: list[str], error: BaseException):
        super().__init__(f"engine step failed for all {len(request_ids)} request(s) in it: "
                         f"{type(error).__name__}: {error}")
        self.request_ids = request_ids


class MixedStepBudget:
    """Sizes the prefill tokens of a step that also carries decodes from measured step times,
    so that it takes at most ``slowdown`` x a decode-only step (the token budget of
    Sarathi-Serve's stall-free batching, Agrawal et al. 2024, sec. 4.3, measured online
    instead of profiled).

    Cost model: ``t = D + n_prefill * b`` seconds, with ``D`` the median of the last
    :attr:`DECODE_WINDOW` decode-only step times (a median, so a few slow steps from a busy
    host do not inflate the target) and ``b`` (seconds per prefill token) a ratio of decayed sums over
    steps with prefill: ``sum(t - D [if the step had decodes]) / sum(n_prefill)``, so large
    chunks weigh most and the attention cost of long contexts is tracked as it grows. A
    prefill-only step counts its whole time (a slight overestimate of ``b``: conservative).
    Then ``tokens = (slowdown - 1) * D / b``, clamped to ``[min_tokens, max_tokens]``. If
    mixed steps carry a fixed overhead ``E`` (e.g. eager mode beside CUDA-graph decodes), the
    iteration still converges to steps of ``slowdown * D``. Until both ``D`` and ``b`` have
    been measured the budget is ``initial_tokens``.

    Args:
        slowdown: target ratio (> 1) of a mixed step's time to a decode-only step's.
        max_tokens: upper clamp (the step budget, ``max_num_batched_tokens``).
        min_tokens: lower clamp, so prefills always progress (tokens). Small: deep into a long
            prompt a chunk's attention over the whole context costs ~5 ms per token on a 2-core
            CPU (SmolLM2, 7k context), so the target may need chunks of ~20 tokens.
        initial_tokens: budget before measurements (tokens).
        alpha: weight of the newest step in the averages.
    """

    #: Decode-only steps behind the median ``D``.
    DECODE_WINDOW = 32

    def __init__(self, slowdown: float, max_tokens: int, min_tokens: int = 8, initial_tokens: int = 256,
                 alpha: float = 0.2):
        self.slowdown, self.alpha = slowdown, alpha
        self.max_tokens = max_tokens
        self.min_tokens = min(min_tokens, max_tokens)
        self.initial_tokens = min(initial_tokens, max_tokens)
        self._decode_times: deque[float] = deque(maxlen=self.DECODE_WINDOW)
        self._prefill_s = 0.0  # decayed sum of prefill seconds
        self._prefill_n = 0.0  # decayed sum of prefill tokens

    def record(self, seconds: float, num_prefill_tokens: int, num_decodes: int) -> None:
        """Add one step's wall time (seconds) and its token counts. A time that is not finite
        or is negative (a clock that jumped) is ignored."""
        if not (isinstance(seconds, (int, float)) and 0.0 <= seconds < math.inf):
            return
        a = self.alpha
        if num_prefill_tokens == 0:
            if num_decodes:
                self._decode_times.append(seconds)
            return
        if num_decodes and self.decode_s is None:
            return  # cannot split a mixed step's time yet
        prefill_s = max(seconds - (self.decode_s if num_decodes else 0.0), 0.0)
        self._prefill_s = (1 - a) * self._prefill_s + a * prefill_s
        self._prefill_n = (1 - a) * self._prefill_n + a * num_prefill_tokens

    @property
    def decode_s(self) -> float | None:
        """``D``: median seconds of the recent decode-only steps (None before the first)."""
        return statistics.median(self._decode_times) if self._decode_times else None

    @property
    def seconds_per_prefill_token(self) -> float | None:
        return self._prefill_s / self._prefill_n if self._prefill_n else None

    @property
    def tokens(self) -> int:
        """Prefill tokens allowed in the next step that carries decodes: an integer in
        ``[min_tokens, max_tokens]`` whatever the recorded times were."""
        b = self.seconds_per_prefill_token
        if self.decode_s is None or b is None:
            return self.initial_tokens
        if b <= 0:
            return self.max_tokens
        tokens = (self.slowdown - 1) * self.decode_s / b
        if not math.isfinite(tokens):  # b underflowed to a denormal: prefill is free
            return self.max_tokens
        return int(max(self.min_tokens, min(self.max_tokens, tokens)))


class LLMEngine:
    """Continuous-batching engine over a paged KV cache.

    ``step()`` = scheduler.schedule() -> executor.execute_model() -> sampler -> scheduler
    update -> incremental detokenization and stop strings.

    Args:
        config: engine configuration.
        executor_factory: ``(config, model_path) -> Executor``; default in-process
            (tensor_parallel_size 1). Pass a distributed executor for more ranks.

    Raises:
        ValueError: a bad config, unknown model, or ``max_model_len`` over the KV pool.
    """

    def __init__(self, config: EngineConfig,
                 executor_factory: Callable[[EngineConfig, str], Executor] | None = None):
        self.config = config
        self.model_path = str(resolve_model(config.model))
        self.tokenizer = load_tokenizer(self.model_path)
        self.hf_config = load_config(self.model_path)
        self.eos_token_ids = load_eos_token_ids(self.model_path, self.hf_config)
        if self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        factory = executor_factory or UniProcExecutor
        self.executor = factory(config, self.model_path)
        num_blocks = self.executor.determine_num_blocks()
        self.executor.init_kv_cache(num_blocks)
        capacity = num_blocks * config.block_size
        model_max = self.hf_config.max_position_embeddings
        if config.max_model_len is not None:
            if config.max_model_len > model_max:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the model's "
                                 f"max_position_embeddings {model_max}")
            if config.max_model_len > capacity:
                raise ValueError(f"max_model_len {config.max_model_len} exceeds the KV cache capacity "
                                 f"{capacity} tokens ({num_blocks} blocks); give it more memory")
            self.max_model_len = config.max_model_len
        else:
            self.max_model_len = min(model_max, capacity)
        kv = KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy,
                                   mixed_prefill_tokens=config.mixed_step_prefill_tokens,
                                   long_prefill_threshold=self.max_model_len // 25)
        self.mixed_budget = (MixedStepBudget(config.mixed_step_slowdown, config.max_num_batched_tokens)
                             if config.mixed_step_prefill_tokens is None else None)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        #: Grammar compiler (xgrammar, built on the first request with ``structured_outputs``).
        self.structured_outputs = StructuredOutputs(self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids)
        #: Requests in the engine that have a grammar (empty: a step does no grammar work).
        self.grammar_requests: dict[str, Request] = {}
        self.num_steps = 0
        self.max_running = 0
        #: Seconds for every timing-driven policy (mixed-step budget, draft length, step
        #: metrics); tests replace it with a noisy fake clock.
        self.clock: Callable[[], float] = time.monotonic
        self._broken_loggers: set[tuple[str, int]] = set()  # (what, id of the hook) logged once
        #: Callables given the :class:`StepMetrics` of every step that ran the model.
        self.stat_loggers: list[Callable[[StepMetrics], None]] = []
        #: Callables given the :class:`FinishedRequestStats` of every request that leaves the engine.
        self.request_loggers: list[Callable[[FinishedRequestStats], None]] = []
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        self.spec = SpeculativeConfig.from_dict(config.speculative_config)
        self.proposer = None
        if self.spec is not None:
            self.draft_policy = DraftLengthPolicy(self.spec.num_speculative_tokens, self.spec.adaptive)
            if self.spec.method == "ngram":
                self.proposer = NgramProposer(self.spec.prompt_lookup_min, self.spec.prompt_lookup_max)
            else:
                from engine.draft_model import DraftModelProposer
                self.proposer = DraftModelProposer(self.spec, config, self.hf_config.vocab_size, num_blocks)
            #: totals: requests that verified drafts, drafts verified, drafts accepted, by position
            self.spec_counts = dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
            self.spec_accepted_per_position = [0] * self.spec.num_speculative_tokens
            self.scheduler.on_finish = self._release_speculation
        logger.info("engine ready: model=%s blocks=%d (%d tokens) max_model_len=%d", self.model_path,
                    num_blocks, capacity, self.max_model_len)

    # ---- requests -----------------------------------------------------------
    def tokenize(self, prompt: str | list[int] | dict) -> list[int]:
        """Token ids of a prompt (see :func:`encode_prompt`)."""
        return encode_prompt(self.tokenizer, prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> list[int]:
        """Token ids of ``messages`` under the tokenizer's chat template (see :func:`chat_template_ids`)."""
        return chat_template_ids(self.tokenizer, messages, add_generation_prompt, tools)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validate and tokenize a request without queueing it (safe to call while a step runs).

        Besides :class:`SamplingParams`' own checks, the ones that need the model:
        ``stop_token_ids`` and ``logit_bias`` keys must be in the vocabulary, ``logprobs`` at most the vocabulary
        size, and with ``min_tokens`` the forbidden ids (stop ids and EOS) must leave a token
        to sample. ``top_k`` above the vocabulary size is clamped by the sampler (keeps all).

        Raises:
            ValueError: empty prompt, token ids out of the vocabulary, a prompt of
                ``max_model_len`` tokens or more, a non-integer ``priority``, or sampling
                parameters the model cannot honour (the message starts with the field name).
        """
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        vocab = self.hf_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}), "
                             f"got {max(params.stop_token_ids)}")
        if params.logit_bias and max(params.logit_bias) >= vocab:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab}), got {max(params.logit_bias)}")
        if params.logprobs is not None and params.logprobs > vocab:
            raise ValueError(f"logprobs must be at most the vocabulary size {vocab}, got {params.logprobs}")
        if params.min_tokens and len(set(params.stop_token_ids) | (
                set() if params.ignore_eos else self.eos_token_ids)) >= vocab:
            raise ValueError("stop_token_ids with min_tokens forbid every token of the vocabulary")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        if any((not isinstance(t, int)) or isinstance(t, bool) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(f"prompt is {len(ids)} tokens; this model's context is {self.max_model_len} "
                             f"tokens (max_model_len), which must also leave room for at least one output token")
        grammar = (None if params.structured_outputs is None  # compiled here, off the step loop (cached)
                   else self.structured_outputs.request_grammar(params.structured_outputs))
        req = Request(request_id, ids, params, self.eos_token_ids,
                      prompt=parse_prompt(prompt)[0], priority=priority,
                      arrival_time=arrival_time, max_model_len=self.max_model_len)
        req.grammar = grammar
        return req

    def enqueue(self, req: Request) -> None:
        """Hand a request from :meth:`make_request` to the scheduler.

        Raises:
            ValueError: a request with the same id is already in the engine.
        """
        self.scheduler.add_request(req)
        if req.params.detokenize:
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
        self.num_prompt_tokens += req.num_prompt_tokens
        if req.grammar is not None:
            self.grammar_requests[req.request_id] = req

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validate, tokenize and queue a request (see :meth:`make_request`, :meth:`enqueue`)."""
        req = self.make_request(request_id, prompt, params, priority, arrival_time)
        self.enqueue(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its blocks; returns its final output (or None if unknown)."""
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        return self._final_output(req)

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        req.error = error
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._final_output(req)

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
        if self.mixed_budget is not None:
            self.scheduler.mixed_prefill_tokens = self.mixed_budget.tokens
        kv, preempted0 = self.scheduler.kv, self.scheduler.num_preemptions
        queries0, hits0 = kv.prefix_queries, kv.prefix_hits
        if self.proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.finished_req_ids:  # let the runner drop state of finished requests
                try:
                    self.executor.execute_model(sched)
                except Exception as e:
                    raise StepFailedError([], e) from e
            return []
        self.num_steps += 1
        self.max_running = max(self.max_running, len(sched.requests))
        step_reqs = {sr.request_id: self.scheduler.requests[sr.request_id] for sr in sched.requests}
        last_token = {rid: req.metrics.last_token_time for rid, req in step_reqs.items()}
        prompt_only = [r for sr in sched.requests  # max_tokens=0: finish without a token
                       if not sr.sample and (r := step_reqs[sr.request_id]).max_output_tokens == 0]
        grammar_fill = self._fill_grammar_bitmask(sched) if self.grammar_requests else None
        t0 = self.clock()
        m = None
        try:
            result, failed = self.executor.execute_model(sched), {}
        except Exception as e:
            result, failed = self._isolate(sched, e)
        else:
            num_decodes = sum(len(sr.token_ids) - len(sr.spec_token_ids) == 1 and sr.new is None
                              for sr in sched.requests)
            num_rows = sched.num_batched_tokens - sched.num_draft_tokens
            m = StepMetrics(t0, self.clock(), num_rows - num_decodes, num_decodes,
                            sum(sr.sample for sr in sched.requests), len(sched.requests),
                            len(self.scheduler.waiting), self.scheduler.num_preemptions - preempted0,
                            kv.prefix_queries - queries0, kv.prefix_hits - hits0)
            if self.mixed_budget is not None:
                self.mixed_budget.record(m.end - m.start, m.num_prefill_tokens, m.num_decode_tokens)
        outputs = [self._fail(self.scheduler.requests[rid], "the model step", err) for rid, err in failed.items()]
        outputs += self._grammar_failures(grammar_fill)
        update_errors: dict[str, BaseException] = {}
        updated = self.scheduler.update_from_output(sched, result.sampled, result.logprobs, result.prompt_logprobs,
                                                    errors=update_errors)
        outputs += [self._fail(step_reqs[rid], "its output update", err) for rid, err in update_errors.items()]
        if self.proposer is not None:
            try:
                self._record_speculation(sched, m)
            except Exception:
                self._log_broken("speculation bookkeeping")
        outputs.extend(self._final_output(r) for r in prompt_only if r.status is RequestStatus.FINISHED_LENGTH)
        if self.grammar_requests:
            outputs += self._advance_grammars(updated)
        if m is not None:
            for req in updated:
                prev = last_token.get(req.request_id)
                if prev is None:
                    m.num_prompt_tokens += req.num_prompt_tokens
                    m.time_to_first_tokens.append(req.metrics.first_token_time - req.metrics.arrival_time)
                else:
                    m.inter_token_latencies.append(req.metrics.last_token_time - prev)
        for req in updated:
            self.num_generated_tokens += len(req.new_token_ids)
            if req.status is RequestStatus.FINISHED_ERROR:  # failed in its grammar: output given
                continue
            try:
                self._detokenize(req)
                outputs.append(self._output(req, req.new_token_ids))
            except Exception as e:  # one bad request must not take the batch down
                outputs.append(self._fail(req, "detokenization or output assembly", e, req.new_token_ids))
        if m is not None:
            m.num_sampled = sum(len(r.new_token_ids) for r in updated)
            m.kv_cache_usage = kv.usage()
            for log in self.stat_loggers:
                try:
                    log(m)
                except Exception:
                    self._log_broken("stat logger", log)
        return outputs

    def _fail(self, req: Request, where: str, error: BaseException, new_token_ids: list[int] = ()) -> RequestOutput:
        """Fail ``req`` alone (``FINISHED_ERROR``, blocks freed, ``req.error`` set unless it
        already is) after ``error`` in ``where``; returns its final output (``new_token_ids``:
        the step's tokens it carries), built without the detokenizer if that is what fails."""
        logger.error("request %s failed in %s: %s: %s", req.request_id, where, type(error).__name__, error,
                     exc_info=error)
        req.error = req.error or f"{type(error).__name__}: {error}"
        if req.request_id in self.scheduler.requests:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        else:  # already left the queues (e.g. finished by length in the same step)
            req.status = RequestStatus.FINISHED_ERROR
        return self._final_output(req, new_token_ids)

    def _final_output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        """The output of a request that has left the engine, which never raises: if the
        detokenizer fails while it is assembled, an output without the text delta."""
        try:
            return self._output(req, new_token_ids)
        except Exception as e:
            logger.error("request %s: output assembly failed (%s: %s); its final output carries no text delta",
                         req.request_id, type(e).__name__, e)
            self.detokenizers.pop(req.request_id, None)
            self.grammar_requests.pop(req.request_id, None)
            req.grammar = None
            return self._output(req, new_token_ids)

    def _log_broken(self, what: str, hook: object = None) -> None:
        """A side-path hook (stat or request logger, speculation bookkeeping) raised: log it
        with its traceback the first time, then once per hook only at debug level."""
        key = (what, id(hook))
        if key in self._broken_loggers:
            logger.debug("%s failed again", what, exc_info=True)
            return
        self._broken_loggers.add(key)
        logger.exception("%s failed (skipped; the step goes on)", what)

    def _detokenize(self, req: Request) -> None:
        """Feed the step's new tokens to the request's detokenizer one at a time; at a stop
        string, drop the tokens after the one that completed it (several arrive per step with
        speculative decoding) and finish the request (``stop``)."""
        detok = self.detokenizers.get(req.request_id)
        if detok is None:
            return
        new = req.new_token_ids
        for i, tok in enumerate(new):
            stop = detok.update([tok])
            if stop is None:
                continue
            extra = len(new) - 1 - i
            if extra:
                del req.all_token_ids[-extra:]
                if req.params.logprobs is not None:
                    del req.logprobs[-extra:]
                req.new_token_ids = new[:i + 1]
            if not req.finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.status == RequestStatus.FINISHED_LENGTH:
                # completed by the last allowed token (already finished and freed): a stop
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            return

    # ---- speculative decoding ------------------------------------------------
    def _propose(self) -> None:
        """Set each running request's drafts for the next step (see ``engine.spec_decode``).
        Only requests in decode (one token to compute) without a grammar, not
        :attr:`Request.spec_disabled`, and only while at least two output tokens remain; the
        draft length comes from :attr:`draft_policy`. A proposer or policy that raises on a
        request, or proposes ids outside the vocabulary, turns drafting off for that request
        (:meth:`_stop_drafting`); nothing raises out of here."""
        reqs = []
        for req in self.scheduler.running:
            req.spec_token_ids = []
            if (req.num_tokens - req.num_computed_tokens == 1 and req.grammar is None and not req.spec_disabled
                    and req.max_output_tokens - req.num_output_tokens > 1):
                reqs.append(req)
        if not reqs:
            return
        k_max, batch = self.spec.num_speculative_tokens, len(self.scheduler.running)

        def room(req: Request) -> int:  # drafts + the step's own token stay within max_tokens
            return min(k_max, req.max_output_tokens - req.num_output_tokens - 1)

        if isinstance(self.proposer, NgramProposer):
            for req in reqs:
                try:
                    draft = self.proposer.propose(req.all_token_ids, room(req))
                    req.spec_token_ids = self._checked_drafts(
                        draft[:self.draft_policy.draft_length(req.request_id, len(draft), batch)])
                except Exception as e:
                    self._stop_drafting(req, e)
            return
        want = []
        for req in reqs:
            try:
                if (k := self.draft_policy.draft_length(req.request_id, room(req), batch)) > 0:
                    want.append((req, k))
            except Exception as e:
                self._stop_drafting(req, e)
        if not want:
            return
        t0 = self.clock()
        try:
            drafts = self.proposer.propose(want)
        except Exception as e:  # which request? each alone, from a clean draft state
            logger.warning("draft model failed on a batch of %d (%s: %s); retrying each request alone",
                           len(want), type(e).__name__, e)
            for req, _ in want:
                self.proposer.forget(req.request_id)
            drafts = {}
            for req, k in want:
                try:
                    drafts.update(self.proposer.propose([(req, k)]))
                except Exception as e1:
                    self._stop_drafting(req, e1)
        rounds = max(k for _, k in want)
        per_token = (self.clock() - t0) / (rounds * len(want))
        p = self.draft_policy
        if math.isfinite(per_token) and per_token >= 0:  # a clock that jumped back says nothing
            p.extra_cost_s = per_token if not p.extra_cost_s else 0.8 * p.extra_cost_s + 0.2 * per_token
        for req, _ in want:
            if req.spec_disabled:
                continue
            try:
                req.spec_token_ids = self._checked_drafts(drafts.get(req.request_id, []))
            except Exception as e:
                self._stop_drafting(req, e)

    def _checked_drafts(self, draft: list[int]) -> list[int]:
        """``draft`` as a list of Python ints in the vocabulary.

        Raises:
            ValueError: a draft id that is not an integer in ``[0, vocab_size)``.
        """
        vocab = self.hf_config.vocab_size
        out = [int(t) for t in draft]
        if any(t < 0 or t >= vocab or t != d for t, d in zip(out, draft)):
            raise ValueError(f"proposed draft ids outside the vocabulary [0, {vocab}): {draft}")
        return out

    def _stop_drafting(self, req: Request, error: BaseException) -> None:
        """The proposer or the draft-length policy failed on ``req``: it goes on without drafts
        (and its proposer state is dropped)."""
        logger.error("speculative decoding turned off for request %s: its proposer failed: %s: %s",
                     req.request_id, type(error).__name__, error, exc_info=error)
        req.spec_disabled, req.spec_token_ids = True, []
        try:
            self._release_speculation(req)
        except Exception:
            logger.exception("releasing the draft state of request %s failed", req.request_id)

    def _release_speculation(self, req: Request) -> None:
        """A request left the engine: drop its acceptance estimate and draft-model state."""
        self.draft_policy.forget(req.request_id)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(req.request_id)

    def _record_speculation(self, sched: SchedulerOutput, m: StepMetrics | None) -> None:
        """After a step: acceptance per request (for the draft-length policy and the counters)
        and, for a decode-only step, its time and rows (the policy's cost model)."""
        per_pos = [0] * self.spec.num_speculative_tokens
        drafts = tokens = accepted = 0
        for sr in sched.requests:
            k = len(sr.spec_token_ids)
            if not k or sr.request_id not in sched.num_accepted:
                continue
            a = sched.num_accepted[sr.request_id]
            self.draft_policy.record_acceptance(sr.request_id, k, a)
            drafts, tokens, accepted = drafts + 1, tokens + k, accepted + a
            for j in range(a):
                per_pos[j] += 1
        c = self.spec_counts
        c["num_drafts"] += drafts
        c["num_draft_tokens"] += tokens
        c["num_accepted_tokens"] += accepted
        self.spec_accepted_per_position = [x + y for x, y in zip(self.spec_accepted_per_position, per_pos)]
        if m is not None:
            m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens = drafts, tokens, accepted
            m.accepted_per_position = per_pos
            if m.num_prefill_tokens == 0:
                self.draft_policy.record_step(m.end - m.start, sched.num_batched_tokens)

    def _fill_grammar_bitmask(self, sched: SchedulerOutput):
        """Structured outputs: set ``sched.grammar_req_ids`` and ``sched.grammar_bitmask`` (int32
        ``[k, ceil(vocab / 32)]``) for the ``k`` requests of the step that sample and have a
        grammar (xgrammar, Dong et al. 2024). With an in-process executor the bitmask is a
        ``Future``, filled in a worker thread while the model's forward runs (the sampler waits
        for it); else it is filled here. Finished requests leave :attr:`grammar_requests` here too.

        Returns:
            None, or ``(requests, errors, bitmask or its future)`` for :meth:`_grammar_failures`.
        """
        for rid in sched.finished_req_ids:
            self.grammar_requests.pop(rid, None)
        reqs = [self.grammar_requests[sr.request_id] for sr in sched.requests
                if sr.sample and sr.request_id in self.grammar_requests]
        if not reqs:
            return None
        errors: dict[int, Exception] = {}
        grammars = [r.grammar for r in reqs]
        sched.grammar_req_ids = [r.request_id for r in reqs]
        if getattr(self.executor, "in_process", False):
            sched.grammar_bitmask = self.structured_outputs.bitmask_async(grammars, errors)
        else:
            sched.grammar_bitmask = self.structured_outputs.bitmask(grammars, errors)
        return reqs, errors, sched.grammar_bitmask

    def _grammar_failures(self, pending) -> list[RequestOutput]:
        """After the step: wait for the bitmask fill (the matchers are free again), then fail
        alone each request whose matcher raised in it (should not happen; its sampled token is
        dropped). Returns their final outputs."""
        if pending is None:
            return []
        reqs, errors, fill = pending
        if hasattr(fill, "result"):  # a Future
            try:
                fill.result()
            except Exception as e:  # the fill itself broke (not one matcher): every row is suspect
                errors.update({i: e for i in range(len(reqs)) if i not in errors})
        outs = []
        for i, e in errors.items():
            req = reqs[i]
            if req.finished:
                continue
            req.error = f"structured_outputs: {type(e).__name__}: {e}"
            outs.append(self._fail(req, "its grammar bitmask", e))
        return outs

    def _advance_grammars(self, updated: list[Request]) -> list[RequestOutput]:
        """Structured outputs, after a step: feed each unfinished grammar request's new token to
        its matcher. A complete grammar finishes the request (``stop``): when the matcher
        terminated (it accepted a stop token the request itself does not stop on, e.g. with
        ``ignore_eos``), or when only a stop token may follow while ``min_tokens`` forbids it.
        A request whose token the grammar rejects (or whose matcher raises) fails alone: returns
        those requests' final outputs."""
        outs = []
        for req in updated:
            g = req.grammar
            if g is None or req.finished:
                continue
            try:
                rejected = g.accept(req.all_token_ids, req.num_prompt_tokens)
                if rejected is not None:
                    raise RuntimeError(f"structured_outputs: the grammar rejected token {rejected}")
                if g.is_terminated() or (
                        req.num_output_tokens < req.params.min_tokens and not req.params.ignore_eos
                        and g.only_stop_allowed(self.structured_outputs.stop_token_ids, self.hf_config.vocab_size)):
                    req.stop_reason = None
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            except Exception as e:  # one bad request must not take the batch down
                outs.append(self._fail(req, "its grammar", e, req.new_token_ids))
        return outs

    def _isolate(self, sched: SchedulerOutput, error: Exception) -> tuple[ModelRunnerOutput, dict[str, Exception]]:
        """After ``execute_model(sched)`` raised ``error``: find the request(s) that make it fail.

        Bisection: re-run the step's requests in halves (smaller ``SchedulerOutput`` objects), splitting
        every half that fails again, down to single requests. Re-running is safe: the K/V of
        the same tokens is written to the same slots, the runner's per-request state update
        is idempotent and the sampler restores seeded generators when it raises;
        ``finished_req_ids`` go with the first sub-call (dropping runner state twice is
        harmless). Costs at most ``2 * f * log2(n)`` extra calls for ``f`` failing requests
        among ``n``.

        Returns:
            The merged output of the requests that ran, and ``{request_id: exception}`` of
            those that fail alone.

        Raises:
            StepFailedError: every request fails alone (or the step has one request), so
                the failure is not attributable to a request.
        """
        reqs = sched.requests
        if len(reqs) < 2:
            raise StepFailedError([sr.request_id for sr in reqs], error) from error
        logger.warning("step of %d requests failed (%s: %s); isolating the failing request(s)",
                       len(reqs), type(error).__name__, error)
        sampled, logprobs, prompt_logprobs, failed = {}, {}, {}, {}

        def run(part, finished_ids):
            try:
                out = self.executor.execute_model(SchedulerOutput(
                    part, finished_ids, grammar_req_ids=sched.grammar_req_ids, grammar_bitmask=sched.grammar_bitmask))
            except Exception as e:
                if len(part) == 1:
                    failed[part[0].request_id] = e
                    return
                mid = len(part) // 2
                run(part[:mid], finished_ids)
                run(part[mid:], [])
                return
            sampled.update(out.sampled)
            logprobs.update(out.logprobs or {})
            prompt_logprobs.update(out.prompt_logprobs or {})

        mid = len(reqs) // 2
        run(reqs[:mid], sched.finished_req_ids)
        run(reqs[mid:], [])
        if len(failed) == len(reqs):
            raise StepFailedError([sr.request_id for sr in reqs], error) from error
        for rid, e in failed.items():
            logger.error("request %s failed alone and is finished with an error: %s: %s",
                         rid, type(e).__name__, e)
        return ModelRunnerOutput(sampled, logprobs or None, prompt_logprobs or None), failed

    def _output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        detok = self.detokenizers.get(req.request_id)
        finished = req.finished
        delta = detok.delta(finished) if detok else ""
        text = detok.text[:detok.emitted] if detok else ""
        out_ids = req.output_token_ids
        if finished:
            self.detokenizers.pop(req.request_id, None)
            self.grammar_requests.pop(req.request_id, None)
            req.grammar = None  # frees the matcher
            if self.request_loggers and not getattr(req, "stats_logged", False):
                req.stats_logged = True
                stats = FinishedRequestStats.of(req)
                for log in self.request_loggers:
                    try:
                        log(stats)
                    except Exception:
                        self._log_broken("request logger", log)
        comp = CompletionOutput(
            index=0, text=text, token_ids=out_ids,
            finish_reason=req.status.value if finished else None, stop_reason=req.stop_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            delta_text=delta, delta_token_ids=list(new_token_ids))
        # prompt logprobs once the prompt is done: on the first output with a token and the final one
        plp = req.prompt_logprobs if (finished or req.num_output_tokens == 1) and req.prompt_logprobs_done else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], finished,
                             req.metrics, error=req.error, prompt_logprobs=plp)

    # ---- introspection -------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """Scheduler gauges plus counters: steps, generated/prompt tokens, max running batch."""
        s = self.scheduler.stats()
        s.update(num_steps=self.num_steps, max_running_batch=self.max_running,
                 num_generated_tokens=self.num_generated_tokens, num_prompt_tokens=self.num_prompt_tokens,
                 num_kv_blocks=self.scheduler.kv.num_blocks, free_kv_blocks=self.scheduler.kv.pool.num_free_blocks,
                 time=time.time())
        if self.proposer is not None:
            c = self.spec_counts
            s.update({f"spec_decode_{k}": v for k, v in c.items()})
            s["spec_decode_acceptance_rate"] = c["num_accepted_tokens"] / c["num_draft_tokens"] if c["num_draft_tokens"] else 0.0
            # vLLM's mean acceptance length: tokens per verifying step, the bonus token included
            s["spec_decode_mean_acceptance_length"] = (
                1 + c["num_accepted_tokens"] / c["num_drafts"] if c["num_drafts"] else 0.0)
            s["spec_decode_num_accepted_tokens_per_pos"] = list(self.spec_accepted_per_position)
        return s

    def shutdown(self) -> None:
        self.executor.shutdown()
        self.structured_outputs.close()
