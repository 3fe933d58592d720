"""The synchronous engine: add requests, call ``step()`` until they finish."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.executor import Executor, UniProcExecutor
from engine.kv_cache_manager import KVCacheManager
from engine.model_loader import load_config, load_tokenizer, resolve_model
from engine.model_runner import load_eos_token_ids
from engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler

logger = logging.getLogger("kvserve.engine")


def chat_template_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
    """Token ids of a conversation (``[{"role", "content"}, ...]``) under the tokenizer's chat
    template, with the assistant generation prompt appended.

    Raises:
        ValueError: the tokenizer has no chat template, or the messages are malformed.
    """
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as e:  # jinja errors on bad roles / content
        raise ValueError(f"could not apply the chat template: {e}") from e
    return tokenizer.encode(text, add_special_tokens=False)


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
        self.scheduler = Scheduler(kv, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy)
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_steps = 0
        self.max_running = 0
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0
        logger.info("engine ready: model=%s blocks=%d (%d tokens) max_model_len=%d", self.model_path,
                    num_blocks, capacity, self.max_model_len)

    # ---- requests -----------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` under the tokenizer's chat template (see :func:`chat_template_ids`)."""
        return chat_template_ids(self.tokenizer, messages, add_generation_prompt)

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                     priority: int = 0, arrival_time: float | None = None) -> Request:
        """Validate and tokenize a request without queueing it (safe to call while a step runs).

        Raises:
            ValueError: empty prompt, token ids out of the vocabulary, or a prompt of
                ``max_model_len`` tokens or more.
        """
        params = params or SamplingParams()
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("prompt is empty")
        vocab = self.hf_config.vocab_size
        if any((not isinstance(t, int)) or t < 0 or t >= vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(ids)} tokens; this model's context is {self.max_model_len} "
                             f"tokens (max_model_len), which must also leave room for at least one output token")
        return Request(request_id, ids, params, self.eos_token_ids,
                       prompt=prompt if isinstance(prompt, str) else None, priority=priority,
                       arrival_time=arrival_time, max_model_len=self.max_model_len)

    def enqueue(self, req: Request) -> None:
        """Hand a request from :meth:`make_request` to the scheduler.

        Raises:
            ValueError: a request with the same id is already in the engine.
        """
        self.scheduler.add_request(req)
        if req.params.detokenize:
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)
        self.num_prompt_tokens += req.num_prompt_tokens

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
        return self._output(req)

    def fail_request(self, request_id: str, error: str) -> RequestOutput | None:
        req = self.scheduler.requests.get(request_id)
        if req is None:
            return None
        req.error = error
        self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        return self._output(req)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- the step -----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one iteration. Returns an output for every request that got new tokens or
        finished in it."""
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if sched.finished_req_ids:  # let the runner drop state of finished requests
                self.executor.execute_model(sched)
            return []
        self.num_steps += 1
        self.max_running = max(self.max_running, len(sched.requests))
        result = self.executor.execute_model(sched)
        updated = self.scheduler.update_from_output(sched, result.sampled, result.logprobs)
        outputs = []
        for req in updated:
            self.num_generated_tokens += 1
            try:
                detok = self.detokenizers.get(req.request_id)
                stop = detok.update([req.all_token_ids[-1]]) if detok else None
                if stop is not None and not req.finished:
                    req.stop_reason = stop
                    self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
                elif stop is not None and req.status == RequestStatus.FINISHED_LENGTH:
                    # completed by the last allowed token (already finished and freed): a stop
                    req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            except Exception as e:  # one bad request must not take the batch down
                logger.exception("request %s failed in detokenization", req.request_id)
                req.error = f"{type(e).__name__}: {e}"
                self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            outputs.append(self._output(req, [req.all_token_ids[-1]]))
        return outputs

    def _output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        detok = self.detokenizers.get(req.request_id)
        finished = req.finished
        delta = detok.delta(finished) if detok else ""
        text = detok.text[:detok.emitted] if detok else ""
        out_ids = req.output_token_ids
        if finished:
            self.detokenizers.pop(req.request_id, None)
        comp = CompletionOutput(
            index=0, text=text, token_ids=out_ids,
            finish_reason=req.status.value if finished else None, stop_reason=req.stop_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            delta_text=delta, delta_token_ids=list(new_token_ids))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], finished,
                             req.metrics, error=req.error)

    # ---- introspection -------------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """Scheduler gauges plus counters: steps, generated/prompt tokens, max running batch."""
        s = self.scheduler.stats()
        s.update(num_steps=self.num_steps, max_running_batch=self.max_running,
                 num_generated_tokens=self.num_generated_tokens, num_prompt_tokens=self.num_prompt_tokens,
                 num_kv_blocks=self.scheduler.kv.num_blocks, free_kv_blocks=self.scheduler.kv.pool.num_free_blocks,
                 time=time.time())
        return s

    def shutdown(self) -> None:
        self.executor.shutdown()
