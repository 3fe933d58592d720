"""A replica's bounded admission (:class:`Admission`): the one place that decides whether a
request fits a replica now (429 ``queue_full``) or ever (400 ``too_large``); its default bounds
are :func:`~kvserve.deployments.contract.config.default_admission_bounds` (with the configuration)."""
from __future__ import annotations

import time
from collections import deque

from kvserve.deployments.contract.config import default_admission_bounds
from kvserve.deployments.contract.types import GenerationError

__all__ = ["Admission", "OverloadedError", "default_admission_bounds"]


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
    """

    def __init__(self, max_num_seqs: int, max_waiting_requests: int, max_prompt_tokens: int):
        if min(max_num_seqs, max_waiting_requests, max_prompt_tokens) < 1:
            raise ValueError(f"admission bounds must be positive, got max_num_seqs={max_num_seqs}, "
                             f"max_waiting_requests={max_waiting_requests}, max_prompt_tokens={max_prompt_tokens}")
        self.max_num_seqs, self.max_requests, self.max_prompt_tokens = (max_num_seqs, max_waiting_requests,
                                                                        max_prompt_tokens)
        self.in_flight = 0
        self.queued_requests = 0
        self.queued_tokens = 0
        self.finished: deque[float] = deque()  # end times of the last 60 s
        self.refused: deque[float] = deque()  # times of the queue_full refusals of the last 60 s
        self.started: deque[tuple[float, int]] = deque()  # (first-token time, prompt tokens), last 60 s

    @property
    def max_in_flight(self) -> int:
        return self.max_num_seqs + self.max_requests

    def never_fits(self, choices: int, prompts: int = 1) -> GenerationError | None:
        """Why a request of ``prompts`` prompts with ``choices`` choices each (a completions
        batch arrives as one request per prompt, each naming the batch's size) can never be in
        flight at once on this replica, as a ``too_large`` error (400); None when it can. The
        one check of a request's size against a replica's capacity: the gateway only renders it.
        """
        need = choices * prompts
        if need <= 1 or need <= self.max_in_flight:
            return None
        if prompts > 1:
            return GenerationError("too_large", f"{prompts} prompts x {choices} choices in one request; a replica of "
                                                f"this model takes at most {self.max_in_flight} requests at once "
                                                "(max_num_seqs + max_waiting_requests), so this request can never be "
                                                "admitted: send fewer prompts or choices per request", param="prompt")
        return GenerationError("too_large", f"n={choices} choices need {choices} requests at once; a replica of this "
                                            f"model takes at most {self.max_in_flight} (max_num_seqs + "
                                            "max_waiting_requests)")

    def admit(self, num_prompt_tokens: int) -> GenerationError | None:
        """Take a slot for a prompt of ``num_prompt_tokens`` tokens, or say why not: a
        :class:`GenerationError` ``too_large`` (400) or ``queue_full`` (429, with
        ``retry_after_s``)."""
        if num_prompt_tokens > self.max_prompt_tokens:
            return GenerationError("too_large", f"the prompt is {num_prompt_tokens} tokens; a replica queues at most "
                                                f"{self.max_prompt_tokens} prompt tokens (max_queued_prompt_tokens)")
        if self.in_flight >= self.max_in_flight:
            self.refused.append(time.monotonic())
            return GenerationError("queue_full", f"the model is at capacity ({self.in_flight} requests running or "
                                                 "queued), retry later", self.retry_after())
        if self.queued_requests and self.queued_tokens + num_prompt_tokens > self.max_prompt_tokens:
            self.refused.append(time.monotonic())
            return GenerationError("queue_full", f"the model's queue is full ({self.queued_tokens} prompt tokens "
                                                 "waiting), retry later", self.retry_after())
        self.in_flight += 1
        self.queued_requests += 1
        self.queued_tokens += num_prompt_tokens
        return None

    def start(self, num_prompt_tokens: int) -> None:
        """The request got its first token: it leaves the queue (still in flight)."""
        self.queued_requests -= 1
        self.queued_tokens -= num_prompt_tokens
        self.started.append((time.monotonic(), num_prompt_tokens))

    def end(self, num_prompt_tokens: int, started: bool) -> None:
        """The request ended (finished, failed, aborted), ``started`` or still queued."""
        self.in_flight -= 1
        if not started:
            self.queued_requests -= 1
            self.queued_tokens -= num_prompt_tokens
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
