"""Iteration-level continuous batching under a token budget.

Each step (Orca, Yu et al. 2022, sec. 3: iteration-level scheduling) the scheduler picks
how many tokens of which requests to compute, at most ``max_num_batched_tokens`` in all
and at most ``max_num_seqs`` running requests. There is no prefill/decode phase flag: a
request simply has ``num_tokens - num_computed_tokens`` tokens left to compute (1 for a
decode, more for a prompt, a resumed prompt or a recompute after preemption), as in
vLLM v1. Running requests go first, decodes before unfinished prefills; then waiting
requests are admitted; a prompt that does not fit the remaining budget is chunked
(chunked prefill, Agrawal et al. 2023 "SARATHI"), so one step can mix decodes and prefill
chunks. In a step that carries decodes, the prefill of a long request (more tokens than
``mixed_prefill_tokens`` and ``long_prefill_threshold``) gets a chunk of at most
``mixed_prefill_tokens`` and only one long prefill runs (Sarathi-Serve, Agrawal et al. 2024,
"stall-free batching"; vLLM's ``long_prefill_token_threshold``), so a long prompt is
prefilled in small chunks beside running streams instead of stalling them, while short
prompts are admitted whole (a burst of chat requests starts together); a step without
decodes gets the whole budget. The cap is fixed (``mixed_step_prefill_tokens``) or set before
every step by a :class:`MixedStepBudget` from measured step times. When the KV pool runs dry,
the lowest-priority, latest-arriving running request is preempted by recompute: its blocks are
freed and it goes back to the waiting queue. Under the priority policy a waiting request of
strictly better priority does not wait behind a full batch (``max_num_seqs`` running) of
worse ones either: the worst running request is preempted the same way at the start of the
step, so the better one enters in that step (:meth:`Scheduler._preempt_for_priority`). A
preempted request keeps its generated tokens; it recomputes their KV when it runs again (with
prefix caching, mostly from its own cached blocks).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.mixed_step_budget import MixedStepBudget
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sched_output import NewRequestData, ScheduledRequest, SchedulerOutput

logger = logging.getLogger("kvserve.engine")


class Scheduler:
    """Owns the waiting and running queues and the :class:`KVCacheManager`.

    Args:
        kv: the block manager.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget of one step.
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (``Request.priority``, lower
            first, then arrival; a waiting request of strictly lower ``priority`` than a
            running one preempts it when ``max_num_seqs`` requests run, as vLLM's priority
            scheduling does).
        mixed_prefill_tokens: in a step that also has decodes, the largest chunk of a long
            prefill (None or 0: no cap); may be changed between steps.
        mixed_budget: sets :attr:`mixed_prefill_tokens` at the start of every :meth:`schedule`
            from measured step times (its :meth:`MixedStepBudget.record` is fed by the engine);
            None: the cap stays as set.
        long_prefill_threshold: a request with more tokens in all than this (and than the
            cap) is long (tokens; the engine passes 4 % of ``max_model_len``, vLLM's default), so
            ordinary prompts are admitted whole even while the cap is small.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: str = "fcfs",
        mixed_prefill_tokens: int | None = None,
        long_prefill_threshold: int = 0,
        mixed_budget: MixedStepBudget | None = None,
        max_loras: int = 0,
    ):
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.mixed_prefill_tokens = mixed_prefill_tokens
        self.mixed_budget = mixed_budget
        self.long_prefill_threshold = long_prefill_threshold
        self.max_loras = max_loras
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._finished_ids: list[str] = []
        self.num_preemptions = 0
        #: called with each request that leaves (finished, aborted or failed), after its blocks
        #: are freed (the engine releases per-request state kept elsewhere, e.g. a draft model's)
        self.on_finish: "Callable[[Request], None] | None" = None

    # ---- queues ----------------------------------------------------------------
    def _key(self, req: Request) -> tuple:
        return req.sort_key() if self.policy == "priority" else (0, req.metrics.arrival_time)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, req, key=self._key)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Take ``req`` out of the queues with a final ``status`` and free its blocks."""
        if req.request_id not in self.requests:
            return
        req.status = status
        req.metrics.finished_time = time.time()
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_ids.append(req.request_id)
        if self.on_finish is not None:
            try:
                self.on_finish(req)
            except Exception:  # a release hook must not undo a finish that has happened
                logger.exception("on_finish hook failed for request %s", req.request_id)

    def finish_stopped(self, req: Request, stop_reason: int | str | None, num_dropped_tokens: int = 0) -> None:
        """Finish ``req`` as stopped (``FINISHED_STOPPED``, ``stop_reason``) by something the
        output processor found, e.g. a stop string: first its last ``num_dropped_tokens``
        tokens (those the step appended after the one that stopped it) leave its tokens,
        ``new_token_ids`` and logprobs, then it leaves the queues and its blocks are freed. A
        request this step already finished (its length limit, EOS or a stop token came after
        the stop) is freed already: it only becomes stopped with ``stop_reason``. A request
        that failed or was aborted keeps its status.

        Raises:
            ValueError: ``num_dropped_tokens`` negative or more than the step's new tokens.
        """
        if not 0 <= num_dropped_tokens <= len(req.new_token_ids):
            raise ValueError(
                f"num_dropped_tokens must be in [0, {len(req.new_token_ids)}] (the step's new "
                f"tokens of request {req.request_id}), got {num_dropped_tokens}"
            )
        if num_dropped_tokens:
            del req.all_token_ids[-num_dropped_tokens:]
            if req.params.logprobs is not None:
                del req.logprobs[-num_dropped_tokens:]
            req.new_token_ids = req.new_token_ids[:-num_dropped_tokens]
        if req.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return
        req.stop_reason = stop_reason
        if req.finished:  # finished (and freed) by this step's update: a stop came first
            req.status = RequestStatus.FINISHED_STOPPED
        else:
            self.finish(req, RequestStatus.FINISHED_STOPPED)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        bisect.insort(self.waiting, req, key=self._key)

    def _preempt_for_priority(self) -> list[Request]:
        """Under the priority policy, make room in a full batch (``max_num_seqs`` running) for
        waiting requests of strictly better priority: each waiting request past the free slots,
        in priority order, whose ``priority`` is lower than the worst running request's (the
        lowest priority, the latest arrival) preempts that one (by recompute, :meth:`_preempt`:
        its generated tokens are kept), until the worst running request is no worse. A waiting
        request whose LoRA adapter would not fit ``max_loras`` beside the running ones preempts
        nothing. Returns the requests preempted (none under ``fcfs``, when the free slots take
        every waiting request, or when none is strictly better than a running one)."""
        free = self.max_num_seqs - len(self.running)  # the first ``free`` waiting requests fit as it is
        if self.policy != "priority" or len(self.waiting) <= free:
            return []
        victims: list[Request] = []
        for req in self.waiting[free:]:  # the victims join the queue behind the requests they make room for
            if not self.running:
                break
            victim = max(self.running, key=self._key)
            if victim.priority <= req.priority:
                break  # the queue is in priority order: no later request is better either
            if self.max_loras and req.lora_request is not None:
                loras = {
                    r.lora_request.lora_int_id for r in self.running if r is not victim and r.lora_request is not None
                }
                if req.lora_request.lora_int_id not in loras and len(loras) >= self.max_loras:
                    continue
            self._preempt(victim)
            victims.append(victim)
        return victims

    # ---- one step --------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Pick this step's work (see the module docstring): first, under the priority policy,
        preempt running requests for strictly better waiting ones (:meth:`_preempt_for_priority`);
        then running requests (:meth:`_schedule_running`, preempting for KV blocks when the pool
        runs dry); then waiting requests (:meth:`_schedule_waiting`), unless this step had to
        preempt for KV blocks. ``num_preempted`` of the output counts both kinds of preemption."""
        if self.mixed_budget is not None:
            self.mixed_prefill_tokens = self.mixed_budget.tokens
        queries0, hits0, host0 = self.kv.prefix_queries, self.kv.prefix_hits, self.kv.host_hits
        step = _Step(self.max_num_batched_tokens, self.mixed_prefill_tokens, self.long_prefill_threshold)
        evicted = {r.request_id for r in self._preempt_for_priority()}  # room for better waiting requests
        self._schedule_running(step)
        if not step.preempted:
            self._schedule_waiting(step, evicted)
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(
            step.out,
            finished,
            step.preempted + len(evicted),
            self.kv.prefix_queries - queries0,
            self.kv.prefix_hits - hits0,
            kv_transfer=self.kv.take_transfer(),
            host_cache_hits=self.kv.host_hits - host0,
        )

    def _schedule_running(self, step: "_Step") -> None:
        """Running requests, decodes first, then unfinished prefills, each in priority order.
        A decode takes its drafts when they fit (drafts never preempt anyone); a request whose
        tokens find no KV blocks preempts the worst request not scheduled yet (itself last)."""
        for req in sorted(self.running, key=lambda r: (r.num_tokens - r.num_computed_tokens > 1, self._key(r))):
            if step.budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted below, as a victim
            left = req.num_tokens - req.num_computed_tokens
            n = min(left, step.budget) if left == 1 else step.prefill_chunk(req, left)
            if n <= 0:
                continue  # a second long prefill waits for a later step
            drafts = step.drafts_of(req) if left == 1 else []
            if drafts and self.kv.allocate_slots(req, n + len(drafts)):
                step.emit(req, n, new=False, drafts=drafts)
                continue
            while not self.kv.allocate_slots(req, n):
                victim = max((r for r in self.running if r.request_id not in step.scheduled), key=self._key)
                self._preempt(victim)
                step.preempted += 1
                if victim is req:
                    break
            else:
                step.emit(req, n, new=False)

    def _schedule_waiting(self, step: "_Step", evicted: set[str]) -> None:
        """Waiting requests, in queue order, while the budget and ``max_num_seqs`` allow, each
        with its prefix-cache hits (device pool, then host tier). A request whose LoRA adapter
        would be one too many for the step's slots (``max_loras``) waits and later ones may go;
        the first that does not fit ends the loop. A request preempted for priority in this step
        (``evicted``) does not come back in it (everything queued before it is better; nothing
        after it is)."""
        loras = (
            set()
            if not self.max_loras
            else {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}
        )
        skip = 0
        while len(self.waiting) > skip and step.budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[skip]
            if req.request_id in evicted:
                break
            lora = req.lora_request
            if lora is not None and lora.lora_int_id not in loras and len(loras) >= self.max_loras:
                skip += 1
                continue
            # prompt_logprobs need the logits of every prompt position: no prefix-cache hits (as vLLM)
            # (and mean pooling needs the hidden state of every prompt position)
            every = req.prompt_logprobs is not None or (req.pooling is not None and req.pooling.needs_every_position)
            hits = [] if every else self.kv.get_computed_blocks(req)
            loads = [] if every else self.kv.get_offloaded_blocks(req, len(hits))  # the host tier's
            n = step.prefill_chunk(req, req.num_tokens - (len(hits) + len(loads)) * self.kv.block_size)
            if n <= 0 or not self.kv.allocate_slots(req, n, hits, loads):
                break
            self.waiting.pop(skip)
            if lora is not None:
                loras.add(lora.lora_int_id)
            self.running.append(req)
            req.status = RequestStatus.RUNNING
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = time.time()
            step.emit(req, n, new=True)

    def update_from_output(
        self,
        sched: SchedulerOutput,
        sampled: dict[str, int | list[int]],
        logprobs: dict[str, dict[int, float] | list[dict[int, float]]] | None = None,
        prompt_logprobs: dict[str, list[tuple[int, dict[int, float]]]] | None = None,
        errors: dict[str, BaseException] | None = None,
        pooled: dict[str, list[float]] | None = None,
    ) -> list[Request]:
        """Advance computed-token counts, record prompt logprobs (``{request_id: [(position,
        {token_id: logprob})]}``), append sampled tokens, finish requests that hit EOS / a stop
        token / their length limit, and ``max_tokens=0`` requests whose prompt is computed
        (``FINISHED_LENGTH``, no token). Returns the requests that got tokens (each one's
        ``new_token_ids``).

        Speculative decoding: a request that verified ``k`` drafts gets a list of ``m + 1``
        tokens (``m`` accepted drafts, then the target's own token); its computed count grows
        by ``m + 1`` (its last token and the accepted drafts), tokens after a stop token or the
        length limit are dropped, blocks past its tokens are returned (the rejected drafts' KV
        slots), and ``sched.num_accepted`` records ``m``.

        ``errors``: when given, a request whose update raises (e.g. a malformed logprobs entry
        or a token missing from ``sampled``) is recorded as ``{request_id: exception}`` and
        left for the caller to fail (the engine finishes it with ``FINISHED_ERROR``); the other
        requests are updated. Without it, the exception propagates.

        ``pooled``: the embeddings of pooling requests whose prompt the step finished
        (``{request_id: vector}``), kept on the request before it finishes."""
        now = time.time()
        updated = []
        for sr in sched.requests:
            req = self.requests.get(sr.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            try:
                if pooled and sr.request_id in pooled:
                    req.pooled = pooled[sr.request_id]
                if self._update_one(sr, req, sched, sampled, logprobs, prompt_logprobs, now):
                    updated.append(req)
            except Exception as e:
                if errors is None:
                    raise
                errors[sr.request_id] = e
        return updated

    def _update_one(
        self, sr, req: Request, sched: SchedulerOutput, sampled, logprobs, prompt_logprobs, now: float
    ) -> bool:
        """:meth:`update_from_output` for one running request; True if it got tokens."""
        if prompt_logprobs and sr.request_id in prompt_logprobs:
            req.add_prompt_logprobs(prompt_logprobs[sr.request_id])
        if not sr.sample:
            req.num_computed_tokens += len(sr.token_ids)
            self.kv.cache_blocks(req)
            if req.max_output_tokens == 0 and req.num_computed_tokens >= req.num_tokens:
                self.finish(req, RequestStatus.FINISHED_LENGTH)
            return False
        toks = sampled[sr.request_id]
        toks = toks if isinstance(toks, list) else [toks]
        lps = logprobs.get(sr.request_id) if logprobs else None
        lps = lps if isinstance(lps, list) or lps is None else [lps]
        if sr.spec_token_ids:
            sched.num_accepted[sr.request_id] = len(toks) - 1
            req.num_computed_tokens += len(toks)  # its last token + the accepted drafts
        else:
            req.num_computed_tokens += len(sr.token_ids)
        req.new_token_ids = []
        for i, tok in enumerate(toks):
            req.append_token(tok)
            req.new_token_ids.append(tok)
            if lps is not None:
                req.logprobs.append(lps[i])
            if req.check_stop_token():
                break
        self.kv.cache_blocks(req)
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        if req.finished:
            self.finish(req, req.status)
        elif sr.spec_token_ids:
            self.kv.trim(req)
        return True

    # ---- stats -----------------------------------------------------------------
    def _uncached(self, req: Request) -> int:
        """Tokens ``req`` (waiting) would compute if scheduled now: those past its prefix found in
        the pool and then the host tier."""
        if req.prompt_logprobs is not None or (req.pooling is not None and req.pooling.needs_every_position):
            return req.num_tokens - req.num_computed_tokens
        hits = self.kv.get_computed_blocks(req)
        loads = self.kv.get_offloaded_blocks(req, len(hits))
        return req.num_tokens - (len(hits) + len(loads)) * self.kv.block_size

    def stats(self) -> dict[str, float]:
        """Queue and cache gauges (counts, tokens, fractions)."""
        bs = self.kv.block_size
        allocated = sum(len(r.block_table) for r in self.running) * bs
        used = sum(r.num_computed_tokens for r in self.running)
        mid_prefill = sum(
            r.num_tokens - r.num_computed_tokens for r in self.running if r.num_tokens - r.num_computed_tokens > 1
        )
        out = {
            "num_running_requests": len(self.running),
            "num_waiting_requests": len(self.waiting),
            # prompt tokens not yet computed: waiting requests and running ones mid-(chunked) prefill
            "num_waiting_prefill_tokens": sum(r.num_tokens - r.num_computed_tokens for r in self.waiting) + mid_prefill,
            "kv_cache_usage": self.kv.usage(),
            "kv_allocated_slots": allocated,
            "kv_used_slots": used,
            "prefix_cache_hit_rate": self.kv.hit_rate(),
            "num_preemptions": self.num_preemptions,
        }
        if self.kv.events is not None:  # with KV events on (a KV-aware router reads it): of the waiting
            # prefill tokens, those the requests would compute (a prefix in the pool or tier is not work);
            # a lookup per waiting block, so not in every engine's per-step stats
            out["num_waiting_uncached_tokens"] = sum(self._uncached(r) for r in self.waiting) + mid_prefill
        return out


class _Step:
    """One :meth:`Scheduler.schedule` call's budget and what it scheduled so far.

    Attributes:
        budget: tokens left of ``max_num_batched_tokens``.
        cap, long_threshold: the mixed-step prefill cap (None or 0: none) and the length above
            which a request is long (tokens; see :class:`Scheduler`).
        out: the step's :class:`ScheduledRequest` list, in order; ``scheduled`` their ids.
        num_decodes: decodes scheduled (a step with any caps long prefills).
        long_chunk_taken: a long prefill already has this step's chunk.
        preempted: requests preempted for KV blocks (then no waiting request is admitted).
    """

    def __init__(self, budget: int, cap: int | None, long_threshold: int):
        self.budget, self.cap, self.long_threshold = budget, cap, long_threshold
        self.out: list[ScheduledRequest] = []
        self.scheduled: set[str] = set()
        self.num_decodes = 0
        self.long_chunk_taken = False
        self.preempted = 0

    def prefill_chunk(self, req: Request, left: int) -> int:
        """Tokens of ``req``'s prefill (``left`` tokens to go) in this step: all that fit the
        budget, except in a step with decodes, where a long request (more tokens in all than the
        cap and the threshold: its tail is long too, at the deepest context) gets at most the
        cap, and only one long request runs (0: not in this step)."""
        cap = self.cap
        if not self.num_decodes or not cap or req.num_tokens <= max(cap, self.long_threshold):
            return min(left, self.budget)
        if self.long_chunk_taken:
            return 0
        self.long_chunk_taken = True
        return min(left, cap, self.budget)

    def drafts_of(self, req: Request) -> list[int]:
        """The request's drafts that fit: the step budget (one row is its own token) and its
        output limit (the step emits up to ``k + 1`` tokens, never past max_tokens)."""
        k = min(len(req.spec_token_ids), self.budget - 1, req.max_output_tokens - req.num_output_tokens - 1)
        return req.spec_token_ids[: max(k, 0)]

    def emit(self, req: Request, n: int, new: bool, drafts: list[int] = ()) -> None:
        """Schedule ``n`` of ``req``'s tokens from ``num_computed_tokens`` (and ``drafts`` after
        them), with its whole :class:`NewRequestData` when ``new``; spends the budget and counts
        a decode (one token to compute, drafts or not)."""
        start = req.num_computed_tokens
        self.out.append(
            ScheduledRequest(
                req.request_id,
                req.all_token_ids[start : start + n] + list(drafts),
                start,
                list(req.block_table),
                sample=start + n == req.num_tokens and req.max_output_tokens > 0,  # max_tokens=0: prompt only
                new=NewRequestData(
                    req.request_id,
                    req.prompt_token_ids,
                    req.params,
                    req.all_token_ids[:start],
                    req.lora_request,
                    req.pooling,
                )
                if new
                else None,
                spec_token_ids=list(drafts),
            )
        )
        self.scheduled.add(req.request_id)
        self.budget -= n + len(drafts)
        if not new and req.num_tokens - start == 1:  # one token to compute (drafts or not): a decode
            self.num_decodes += 1
