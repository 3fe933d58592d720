"""A bounded pool of worker threads with a per-job deadline, for work a request brings that must
not stall anything else: grammar compiles and LoRA adapter loads (the engine core's input
thread, and every other request's, never wait for them).

* **Bounded queue.** At most ``max_queued`` jobs wait for a thread; :meth:`BoundedPool.submit`
  refuses more at once (:class:`PoolFullError`) instead of blocking its caller.
* **Deadline.** A job still running ``deadline_s`` seconds after it started fails at once (its
  future raises :class:`DeadlineExceededError`, a ``ValueError`` naming the limit). The work
  itself may not be interruptible (xgrammar compiles in C++): its thread runs on, its result
  ignored, and is *abandoned*: it no longer counts as one of the pool's ``workers``, a fresh
  thread takes its place, so the other jobs keep flowing. At most ``max_abandoned`` abandoned
  threads live at once; beyond that no replacement starts (the pool runs short of threads
  until one returns, and its bounded queue then refuses work): a flood of slow jobs costs a
  bounded number of threads, never an unbounded one.
* **Cancel.** :meth:`BoundedPool.cancel` drops a waiting job; a running one is abandoned as at
  its deadline (the caller, e.g. a client that disconnected, stops waiting at once).

Standard library only.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections import deque
from collections.abc import Callable


class PoolFullError(RuntimeError):
    """The pool's queue is full: the job was not queued (retry later; the server answers 429)."""


class DeadlineExceededError(ValueError):
    """A job ran past its deadline; the message names the limit."""


class _Job:
    __slots__ = ("fn", "args", "future", "deadline_s", "message", "started", "abandoned")

    def __init__(self, fn, args, deadline_s, message):
        self.fn, self.args = fn, args
        self.future: concurrent.futures.Future = concurrent.futures.Future()
        self.deadline_s, self.message = deadline_s, message
        self.started: float | None = None  # time.monotonic() when a thread took it
        self.abandoned = False


class BoundedPool:
    """Worker threads over a bounded FIFO queue, each job under an optional deadline.

    Args:
        name: thread name prefix (``kvserve-<name>``).
        workers: threads running jobs at once (>= 1).
        max_queued: most jobs waiting for a thread (>= 0; more are refused).
        max_abandoned: most threads left running past a deadline or a cancel at once
            (default: ``workers``).
        limit_name: the setting that sets ``max_queued``, named in :class:`PoolFullError`.

    Threads start on demand and stay (daemon threads): an engine that never compiles a
    grammar starts none.
    """

    def __init__(
        self, name: str, workers: int, max_queued: int, max_abandoned: int | None = None, limit_name: str = "max_queued"
    ):
        if workers < 1 or max_queued < 0:
            raise ValueError(f"a pool needs workers >= 1 and max_queued >= 0, got {workers}, {max_queued}")
        self.name, self.workers, self.max_queued = name, workers, max_queued
        self.max_abandoned = workers if max_abandoned is None else max_abandoned
        self.limit_name = limit_name
        self._cv = threading.Condition()
        self._queue: deque[_Job] = deque()
        self._running: list[_Job] = []
        self._threads = 0  # live worker threads that count (not abandoned)
        self._idle = 0
        self._abandoned = 0  # live threads still inside an abandoned job
        self._watchdog: threading.Thread | None = None
        self._closed = False
        self._ids = 0
        #: jobs that ran past their deadline / were cancelled while running (counters, for stats)
        self.num_timed_out = 0
        self.num_refused = 0

    # ---- public ---------------------------------------------------------------------------
    def submit(
        self, fn: Callable, *args, deadline_s: float | None = None, deadline_message: str | None = None
    ) -> concurrent.futures.Future:
        """Queue ``fn(*args)``; never blocks.

        Args:
            deadline_s: seconds the job may run once started (None: no deadline).
            deadline_message: the :class:`DeadlineExceededError`'s message at the deadline.

        Returns:
            a ``concurrent.futures.Future`` of the result: it raises what ``fn`` raised, or
            :class:`DeadlineExceededError`, or ``CancelledError`` after :meth:`cancel`.

        Raises:
            PoolFullError: ``max_queued`` jobs are waiting already, or the pool is shut down.
        """
        job = _Job(fn, args, deadline_s, deadline_message or f"the job ran past its deadline of {deadline_s} s")
        with self._cv:
            if self._closed:
                raise PoolFullError(f"the {self.name} pool is shut down")
            if len(self._queue) >= self.max_queued + self._idle:
                self.num_refused += 1
                raise PoolFullError(
                    f"the {self.name} queue is full: {len(self._queue)} waiting, the limit "
                    f"({self.limit_name}); retry later"
                )
            self._queue.append(job)
            job.future.job = job  # for cancel()
            if self._idle >= len(self._queue):
                self._cv.notify_all()  # an idle thread takes it (and the watchdog looks again)
            else:
                self._maybe_start()
            if deadline_s is not None:
                self._ensure_watchdog()
        return job.future

    def cancel(self, future: concurrent.futures.Future) -> None:
        """Stop waiting for ``future``'s job: a queued job is dropped, a running one abandoned
        (its thread replaced, its result ignored); the future raises ``CancelledError``."""
        job = getattr(future, "job", None)
        if job is None:
            return
        with self._cv:
            if job in self._queue:
                self._queue.remove(job)
            elif job in self._running:
                self._abandon(job)
        future.cancel() or (not future.done() and _settle(future, concurrent.futures.CancelledError()))

    def stats(self) -> dict[str, int]:
        """``queued``, ``running``, ``abandoned`` (threads still inside an abandoned job), ``timed_out``
        and ``refused`` (totals)."""
        with self._cv:
            return {
                "queued": len(self._queue),
                "running": len(self._running),
                "abandoned": self._abandoned,
                "timed_out": self.num_timed_out,
                "refused": self.num_refused,
            }

    def shutdown(self) -> None:
        """Refuse new jobs; queued ones are cancelled; running ones finish in their threads."""
        with self._cv:
            self._closed = True
            queued, self._queue = list(self._queue), deque()
            self._cv.notify_all()
        for job in queued:
            job.future.cancel()

    # ---- threads ----------------------------------------------------------------------------
    def _maybe_start(self) -> None:  # under the lock
        """Start a thread if fewer than ``workers`` count and the abandoned ones leave room."""
        if (
            not self._closed
            and self._threads < self.workers
            and self._threads + self._abandoned < self.workers + self.max_abandoned
        ):
            self._start_worker()

    def _start_worker(self) -> None:  # under the lock
        self._threads += 1
        self._ids += 1
        threading.Thread(target=self._work, name=f"kvserve-{self.name}-{self._ids}", daemon=True).start()

    def _ensure_watchdog(self) -> None:  # under the lock
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name=f"kvserve-{self.name}-deadline", daemon=True)
            self._watchdog.start()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._idle += 1
                    self._cv.wait()
                    self._idle -= 1
                if self._closed and not self._queue:
                    self._threads -= 1
                    return
                job = self._queue.popleft()
                if not job.future.set_running_or_notify_cancel():
                    continue
                job.started = time.monotonic()
                self._running.append(job)
                if job.deadline_s is not None:
                    self._cv.notify_all()  # the watchdog's next deadline
            try:
                value, error = job.fn(*job.args), None
            except BaseException as e:  # noqa: BLE001 (handed to the future)
                value, error = None, e
            with self._cv:
                if job in self._running:
                    self._running.remove(job)
                if job.abandoned:  # its place went to a fresh thread: this one leaves
                    self._abandoned -= 1
                    if self._threads < self.workers and not self._closed:  # none could start: rejoin
                        self._threads += 1
                    else:
                        return
                    continue
            _settle(job.future, error, value)

    def _abandon(self, job: _Job) -> None:  # under the lock
        job.abandoned = True
        self._running.remove(job)
        self._threads -= 1
        self._abandoned += 1
        if self._queue:
            self._maybe_start()  # else the next submit starts one

    def _watch(self) -> None:
        """The deadline thread: abandon each job past its deadline and fail its future (outside
        the lock: the future's callbacks run in this thread)."""
        while True:
            with self._cv:
                if self._closed:
                    return  # pools live as long as their engine; the watchdog leaves with shutdown
                now = time.monotonic()
                due = [j for j in self._running if j.deadline_s is not None and now - j.started >= j.deadline_s]
                for job in due:
                    self._abandon(job)
                    self.num_timed_out += 1
                if not due:
                    waits = [j.started + j.deadline_s - now for j in self._running if j.deadline_s is not None]
                    self._cv.wait(max(0.001, min(waits)) if waits else None)
                    continue
            for job in due:
                _settle(job.future, DeadlineExceededError(job.message))


def _settle(future: concurrent.futures.Future, error: BaseException | None, value=None) -> None:
    """Resolve ``future`` unless it is resolved already (a deadline or a cancel came first)."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)
    except concurrent.futures.InvalidStateError:
        pass
