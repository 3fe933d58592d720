"""What the engine reports about itself, by vLLM V1's names (``v1/metrics/stats.py``).

One :class:`IterationStats` per step that ran the model (what it ran, with the scheduler's
:class:`SchedulerStats` snapshot at its end), one :class:`FinishedRequestStats` per request that
left it, and the counters of ``LLMEngine.get_stats``.

:class:`EngineStats` keeps the counters and hands the records to the stat loggers (the serving
layer's rates and Prometheus metrics, the autoscaler's inputs); a logger that raises is logged
and skipped, the step goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.sched_output import SchedulerOutput

logger = logging.getLogger("kvserve.engine")


@dataclass
class SchedulerStats:
    """A snapshot of the scheduler's queues and the KV cache (vLLM V1's ``SchedulerStats``): what
    the queue gauges show, at a step's end (:attr:`IterationStats.scheduler_stats`) or between
    steps.

    Attributes:
        num_running: requests running (in the last step's batch).
        num_waiting: requests waiting to be scheduled.
        kv_cache_usage: fraction of KV blocks in use, 0..1.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0


@dataclass
class IterationStats:
    """What one engine step ran, for stat loggers (vLLM V1's ``IterationStats``), with the
    scheduler's snapshot at its end (``num_running``, ``num_waiting``, ``kv_cache_usage``: its
    :attr:`scheduler_stats`): the serving layer's token rates, capacities and Prometheus
    metrics, the autoscaler's inputs and the mixed-step budget all read these instead of
    wrapping the executor.

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
        running_lora_adapters, waiting_lora_adapters: names of the LoRA adapters of the running
            and the waiting requests after the step (sorted; None when LoRA is off).
        external_prefix_cache_hits: of ``prefix_cache_queries``, the tokens loaded back from the
            host KV tier instead of computed (vLLM's name for hits below the pool).
        kv_offload_saved_bytes, kv_offload_loaded_bytes: bytes the step copied into the host
            tier (evicted blocks) and back into the pool.
        kv_offload_load_seconds: seconds the driver rank spent on the step's loads.
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
    running_lora_adapters: list[str] | None = None
    waiting_lora_adapters: list[str] | None = None
    external_prefix_cache_hits: int = 0
    kv_offload_saved_bytes: int = 0
    kv_offload_loaded_bytes: int = 0
    kv_offload_load_seconds: float = 0.0

    @property
    def scheduler_stats(self) -> SchedulerStats:
        """The step's queue and KV cache snapshot."""
        return SchedulerStats(self.num_running, self.num_waiting, self.kv_cache_usage)

    @classmethod
    def of_step(cls, sched: SchedulerOutput, start: float, end: float, num_waiting: int) -> "IterationStats":
        """The scheduler's side of a step whose model call ran from ``start`` to ``end`` (seconds);
        the token side is added after the update (:meth:`EngineStats.record_tokens`; ``num_sampled``
        by :meth:`EngineStats.end_step`, once stop strings have cut the tokens)."""
        num_decodes = sum(len(sr.token_ids) - len(sr.spec_token_ids) == 1 and sr.new is None for sr in sched.requests)
        num_rows = sched.num_batched_tokens - sched.num_draft_tokens
        return cls(
            start,
            end,
            num_rows - num_decodes,
            num_decodes,
            0,
            len(sched.requests),
            num_waiting,
            sched.num_preempted,
            sched.prefix_cache_queries,
            sched.prefix_cache_hits,
        )


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
        """The stats of ``req``, which has left the engine (``time.time()`` seconds)."""
        m = req.metrics
        end = m.finished_time or time.time()

        def span(a, b):
            return None if a is None or b is None else max(0.0, b - a)

        return cls(
            req.request_id,
            req.status.value,
            max(0.0, end - m.arrival_time),
            span(m.arrival_time, m.first_scheduled_time if m.first_scheduled_time is not None else end),
            span(m.first_scheduled_time, m.first_token_time),
            span(m.first_token_time, end),
            req.num_prompt_tokens,
            req.num_output_tokens,
            m.num_cached_tokens,
            req.max_output_tokens,
        )


class EngineStats:
    """The engine's counters and stat loggers. A logger that raises is skipped (the step goes on);
    its traceback is logged the first time, later failures of the same logger at debug level.

    Attributes:
        num_steps: steps that ran the model (also those where it failed).
        max_running: most requests in one step.
        num_prompt_tokens: prompt tokens of the requests enqueued.
        num_generated_tokens: tokens sampled (counted before stop strings cut any off).
        stat_loggers: callables given the :class:`IterationStats` of every step that ran the model.
        request_loggers: callables given the :class:`FinishedRequestStats` of every request that
            leaves the engine.
    """

    def __init__(self):
        self.num_steps = 0
        self.max_running = 0
        self.num_prompt_tokens = 0
        self.num_generated_tokens = 0
        self.stat_loggers: list[Callable[[IterationStats], None]] = []
        self.request_loggers: list[Callable[[FinishedRequestStats], None]] = []
        self._broken: set[tuple[str, int]] = set()  # (what, id of the hook) logged once

    def begin_step(self, reqs: Iterable[Request]) -> dict[str, float | None]:
        """Count a step of the requests ``reqs``. Returns each one's last-token time (None before
        its first token; ``time.time()`` seconds) for :meth:`record_tokens`."""
        last_token = {req.request_id: req.metrics.last_token_time for req in reqs}
        self.num_steps += 1
        self.max_running = max(self.max_running, len(last_token))
        return last_token

    def record_tokens(
        self, m: IterationStats | None, updated: list[Request], last_token: dict[str, float | None]
    ) -> None:
        """After the update: count the tokens the requests ``updated`` got, and put their time to
        first token or inter-token latency (from ``last_token``, :meth:`begin_step`'s) into ``m``
        (None: the model call failed and was isolated, no metrics)."""
        self.num_generated_tokens += sum(len(req.new_token_ids) for req in updated)
        if m is None:
            return
        for req in updated:
            prev = last_token.get(req.request_id)
            if prev is None:
                m.num_prompt_tokens += req.num_prompt_tokens
                m.time_to_first_tokens.append(req.metrics.first_token_time - req.metrics.arrival_time)
            else:
                m.inter_token_latencies.append(req.metrics.last_token_time - prev)

    def end_step(self, m: IterationStats | None, updated: list[Request], kv: KVCacheManager) -> None:
        """After the outputs (stop strings have cut the tokens): complete ``m`` with the tokens
        sampled and the KV cache usage, and give it to every stat logger (nothing if None)."""
        if m is None:
            return
        m.num_sampled = sum(len(r.new_token_ids) for r in updated)
        m.kv_cache_usage = kv.usage()
        for log in self.stat_loggers:
            try:
                log(m)
            except Exception:
                self.log_broken("stat logger", log)

    def log_finished(self, req: Request) -> None:
        """Give ``req`` (which has left the engine) to the request loggers, once per request."""
        if not self.request_loggers or getattr(req, "stats_logged", False):
            return
        req.stats_logged = True
        stats = FinishedRequestStats.of(req)
        for log in self.request_loggers:
            try:
                log(stats)
            except Exception:
                self.log_broken("request logger", log)

    def log_broken(self, what: str, hook: object = None) -> None:
        """A side-path hook (stat or request logger, speculation bookkeeping) raised: log it
        with its traceback the first time, then once per hook only at debug level. Call it in
        the ``except`` block."""
        key = (what, id(hook))
        if key in self._broken:
            logger.debug("%s failed again", what, exc_info=True)
            return
        self._broken.add(key)
        logger.exception("%s failed (skipped; the step goes on)", what)
