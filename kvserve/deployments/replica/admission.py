"""A replica's bounded admission (:class:`Admission`): the one place that decides whether a
request fits a replica now (429 ``queue_full``) or ever (400 ``too_large``), and the share batch
work gets; its default bounds are :func:`~kvserve.deployments.contract.config.default_admission_bounds`
and :func:`~kvserve.deployments.contract.config.default_batch_requests` (with the configuration)."""

from __future__ import annotations

import time
from collections import deque

from kvserve.deployments.contract.config import default_admission_bounds, default_batch_requests
from kvserve.deployments.contract.types import GenerationError

__all__ = ["Admission", "OverloadedError", "default_admission_bounds", "default_batch_requests"]


class Admission:
    """Bounded admission of one replica. A request is *in flight* from admission to its end,
    and *queued* until its first token (waiting for a batch slot, or in prefill). The replica
    takes at most ``max_num_seqs + max_waiting_requests`` requests in flight (a full batch and a
    bounded queue behind it) and ``max_prompt_tokens`` queued prompt tokens. A request over
    either bound is refused at once (429 with ``Retry-After``) instead of waiting without
    bound; one that could never fit (its prompt alone over ``max_prompt_tokens``) is a 400.
    Accounting runs on the replica's event loop (no lock needed).

    ``Retry-After`` estimate, seconds: the time the queue ahead takes to drain at the rates
    measured over the last minute (requests by their completion rate, prompt tokens by the
    rate first tokens came), clamped to [1, 60].

    Batch-API requests (``batch=True``) get a bounded share: at most ``max_batch_requests`` of
    them in flight, and one is admitted only while fewer than ``max_num_seqs`` requests of any
    kind are (batch work never waits in the queue behind a full batch, so it never takes a
    waiting slot from live traffic). Live requests do not see batch work: the bounds above
    count live requests (and their queued prompt tokens) only, so a live request is admitted
    whenever it would be with no batch work on the replica; the engine's priority scheduling
    then preempts a running batch request for it (``scheduling_policy="priority"``, the serving
    default). A refused batch request is a ``queue_full`` like any other, but it is not counted
    as demand the queue turned away (:meth:`recently_refused`: the autoscaler sizes for live
    traffic).

    Args:
        max_num_seqs: the engine's ``max_num_seqs``.
        max_waiting_requests: live requests admitted to wait behind a full batch.
        max_prompt_tokens: live prompt tokens queued at most (``max_queued_prompt_tokens``).
        max_batch_requests: batch-API requests in flight at most (None: :func:`default_batch_requests`
            of ``max_num_seqs``; more than ``max_num_seqs`` is taken as ``max_num_seqs``).

    Raises:
        ValueError: a bound under 1.
    """

    def __init__(
        self,
        max_num_seqs: int,
        max_waiting_requests: int,
        max_prompt_tokens: int,
        max_batch_requests: int | None = None,
    ):
        if max_batch_requests is None:
            max_batch_requests = default_batch_requests(max_num_seqs)
        if min(max_num_seqs, max_waiting_requests, max_prompt_tokens, max_batch_requests) < 1:
            raise ValueError(
                f"admission bounds must be positive, got max_num_seqs={max_num_seqs}, "
                f"max_waiting_requests={max_waiting_requests}, max_prompt_tokens={max_prompt_tokens}, "
                f"max_batch_requests={max_batch_requests}"
            )
        self.max_num_seqs, self.max_requests, self.max_prompt_tokens = (
            max_num_seqs,
            max_waiting_requests,
            max_prompt_tokens,
        )
        self.max_batch_requests = min(max_batch_requests, max_num_seqs)
        self.in_flight = 0  # every request in flight (live and batch)
        self.queued_requests = 0
        self.queued_tokens = 0
        self.batch_in_flight = 0  # of those, batch-API requests
        self.batch_queued_requests = 0
        self.batch_queued_tokens = 0
        self.finished: deque[float] = deque()  # end times of the last 60 s
        self.refused: deque[float] = deque()  # times of the queue_full refusals of the last 60 s
        self.started: deque[tuple[float, int]] = deque()  # (first-token time, prompt tokens), last 60 s

    @property
    def max_in_flight(self) -> int:
        return self.max_num_seqs + self.max_requests

    def never_fits(self, choices: int, prompts: int = 1, batch: bool = False) -> GenerationError | None:
        """Why a request of ``prompts`` prompts with ``choices`` choices each (a completions
        batch arrives as one request per prompt, each naming the batch's size) can never be in
        flight at once on this replica, as a ``too_large`` error (400); None when it can. The
        one check of a request's size against a replica's capacity: the gateway only renders it.
        ``batch``: a Batch-API request, against ``max_batch_requests``.
        """
        need = choices * prompts
        if batch and need > self.max_batch_requests:
            return GenerationError(
                "too_large",
                f"{need} requests at once ({prompts} prompts x {choices} choices) in "
                f"a batch job's request; a replica of this model runs at most "
                f"{self.max_batch_requests} batch requests at once "
                "(max_batch_requests): send fewer prompts or choices per request",
                param="prompt" if prompts > 1 else None,
            )
        if need <= 1 or need <= self.max_in_flight:
            return None
        if prompts > 1:
            return GenerationError(
                "too_large",
                f"{prompts} prompts x {choices} choices in one request; a replica of "
                f"this model takes at most {self.max_in_flight} requests at once "
                "(max_num_seqs + max_waiting_requests), so this request can never be "
                "admitted: send fewer prompts or choices per request",
                param="prompt",
            )
        return GenerationError(
            "too_large",
            f"n={choices} choices need {choices} requests at once; a replica of this "
            f"model takes at most {self.max_in_flight} (max_num_seqs + "
            "max_waiting_requests)",
        )

    def admit(self, num_prompt_tokens: int, batch: bool = False) -> GenerationError | None:
        """Take a slot for a prompt of ``num_prompt_tokens`` tokens, or say why not: a
        :class:`GenerationError` ``too_large`` (400) or ``queue_full`` (429, with
        ``retry_after_s``). ``batch``: a batch-API request, admitted within its share (see the
        class docstring)."""
        if num_prompt_tokens > self.max_prompt_tokens:
            return GenerationError(
                "too_large",
                f"the prompt is {num_prompt_tokens} tokens; a replica queues at most "
                f"{self.max_prompt_tokens} prompt tokens (max_queued_prompt_tokens)",
            )
        if batch:
            if self.batch_in_flight >= self.max_batch_requests or self.in_flight >= self.max_num_seqs:
                return GenerationError(
                    "queue_full",
                    f"batch work has its share of the model ({self.batch_in_flight} "
                    f"batch requests of max_batch_requests {self.max_batch_requests}, "
                    f"{self.in_flight} requests of max_num_seqs {self.max_num_seqs} "
                    "in flight), retry later",
                    self.retry_after(),
                )
            if self.queued_requests and self.queued_tokens + num_prompt_tokens > self.max_prompt_tokens:
                return GenerationError(
                    "queue_full",
                    f"the model's queue is full ({self.queued_tokens} prompt tokens waiting), retry later",
                    self.retry_after(),
                )
        else:
            live_in_flight = self.in_flight - self.batch_in_flight
            live_queued = self.queued_requests - self.batch_queued_requests
            live_tokens = self.queued_tokens - self.batch_queued_tokens
            if live_in_flight >= self.max_in_flight:
                self.refused.append(time.monotonic())
                return GenerationError(
                    "queue_full",
                    f"the model is at capacity ({live_in_flight} requests running or queued), retry later",
                    self.retry_after(),
                )
            if live_queued and live_tokens + num_prompt_tokens > self.max_prompt_tokens:
                self.refused.append(time.monotonic())
                return GenerationError(
                    "queue_full",
                    f"the model's queue is full ({live_tokens} prompt tokens waiting), retry later",
                    self.retry_after(),
                )
        self.in_flight += 1
        self.queued_requests += 1
        self.queued_tokens += num_prompt_tokens
        if batch:
            self.batch_in_flight += 1
            self.batch_queued_requests += 1
            self.batch_queued_tokens += num_prompt_tokens
        return None

    def start(self, num_prompt_tokens: int, batch: bool = False) -> None:
        """The request got its first token: it leaves the queue (still in flight); ``batch``
        as it was admitted."""
        self.queued_requests -= 1
        self.queued_tokens -= num_prompt_tokens
        if batch:
            self.batch_queued_requests -= 1
            self.batch_queued_tokens -= num_prompt_tokens
        self.started.append((time.monotonic(), num_prompt_tokens))

    def end(self, num_prompt_tokens: int, started: bool, batch: bool = False) -> None:
        """The request ended (finished, failed, aborted), ``started`` or still queued;
        ``batch`` as it was admitted."""
        self.in_flight -= 1
        if batch:
            self.batch_in_flight -= 1
        if not started:
            self.queued_requests -= 1
            self.queued_tokens -= num_prompt_tokens
            if batch:
                self.batch_queued_requests -= 1
                self.batch_queued_tokens -= num_prompt_tokens
        self.finished.append(time.monotonic())

    def note_refused(self, n: int) -> None:
        """Count ``n`` requests refused as full elsewhere (a gateway's load shedding) now."""
        self.refused.extend([time.monotonic()] * max(0, min(n, 100_000)))

    def recently_refused(self, window_s: float) -> int:
        """Requests refused as ``queue_full`` in the last ``window_s`` seconds: demand the bounded
        queue turned away, which the autoscaler counts as waiting (it would have queued)."""
        now = time.monotonic()
        while self.refused and self.refused[0] < now - 60.0:
            self.refused.popleft()
        return sum(1 for t in self.refused if t >= now - window_s)

    def retry_after(self) -> float:
        now = time.monotonic()
        while self.finished and self.finished[0] < now - 60.0:
            self.finished.popleft()
        while self.started and self.started[0][0] < now - 60.0:
            self.started.popleft()
        est = 1.0
        if self.finished:
            span = max(1.0, now - self.finished[0])
            est = max(est, (self.in_flight - self.max_num_seqs + 1) / (len(self.finished) / span))
        if self.started and self.queued_tokens:
            span = max(1.0, now - self.started[0][0])
            est = max(est, self.queued_tokens / max(sum(n for _, n in self.started) / span, 1e-9))
        return float(min(60.0, est))


class OverloadedError(RuntimeError):
    """The replica's queue is full (a Python caller without ``return_errors``); ``error``
    holds the :class:`GenerationError` with ``retry_after_s``."""

    def __init__(self, error: GenerationError):
        super().__init__(error.message)
        self.error = error
