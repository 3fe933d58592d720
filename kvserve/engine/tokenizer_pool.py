"""Where the async front tokenizes prompts: threads in two lanes, so one large prompt never holds
up the tokenization of the others.

A 4 MiB prompt takes the tokenizer tens of seconds on a small CPU (``benchmarks/noisy_neighbor.py``
times it); behind a single tokenizer thread every other request would wait that long for its
first token. :class:`TokenizerPool` is a ``concurrent.futures.Executor`` (what
``loop.run_in_executor`` takes) with two thread pools: jobs whose arguments hold at most
``large_chars`` characters of text run in the *small* lane (``workers`` threads), larger ones in
the *large* lane (``large_workers`` threads), so large prompts queue only behind each other.
Each thread tokenizes with a tokenizer of its own (``InputProcessor.tokenizer`` is per thread);
Hugging Face's fast tokenizers release the GIL while they encode, so the lanes run at once.

The large lane's threads run at the lowest CPU priority (``large_nice``, Linux's per-thread
nice value, 19 by default): on a small machine a large prompt's tokenizing would otherwise take
a core from the engine's step, and every other stream's time per output token with it
(``benchmarks/noisy_neighbor.py``, the ``big_prompt`` scenario). At nice 19 the scheduler gives
such a thread about 1.5 % of a core the engine wants (CFS weights 15 against 1024), all of an
idle one, so large prompts are tokenized in the time the engine leaves.

Standard library only.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
from collections.abc import Callable

#: Default size, characters of text in a job's arguments, above which it runs in the large lane
#: (64 Ki characters: some 16k tokens of English, well over what an interactive prompt holds).
LARGE_PROMPT_CHARS = 64 << 10


#: Default nice value of the large lane's threads (the lowest priority; see the module docstring).
LARGE_LANE_NICE = 19


def lower_thread_priority(nice: int) -> None:
    """Set the calling thread's nice value to ``nice`` (Linux: ``setpriority`` on the thread's
    own id changes that thread alone). Raising it needs no privilege; where the platform has no
    per-thread priority, or refuses, nothing changes (the lane then runs at the process's)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), nice)
    except (AttributeError, OSError):
        pass


def text_chars(value, limit: int) -> int:
    """Characters of text in ``value`` (strings, and those inside lists, tuples, dicts and
    ``functools.partial`` arguments), counted up to just past ``limit`` (then it stops)."""
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, functools.partial):
            stack.extend(v.args)
            stack.extend(v.keywords.values())
    return total


class TokenizerPool(concurrent.futures.Executor):
    """Two lanes of tokenizer threads (see the module docstring).

    Args:
        workers: threads of the small lane (>= 1).
        large_workers: threads of the large lane (>= 1).
        large_chars: a job whose arguments hold more characters of text than this runs in the
            large lane (:func:`text_chars`).
        name: thread name prefix.
        large_nice: the nice value of the large lane's threads (0 to 19; None: the process's).

    Raises:
        ValueError: a lane without threads or a negative ``large_chars``.
    """

    def __init__(
        self,
        workers: int = 2,
        large_workers: int = 1,
        large_chars: int = LARGE_PROMPT_CHARS,
        name: str = "kvserve-tokenize",
        large_nice: int | None = LARGE_LANE_NICE,
    ):
        if workers < 1 or large_workers < 1 or large_chars < 0:
            raise ValueError(
                f"a tokenizer pool needs workers >= 1, large_workers >= 1 and large_chars >= 0, got "
                f"{workers}, {large_workers}, {large_chars}"
            )
        self.large_chars = large_chars
        self.workers, self.large_workers = workers, large_workers
        self.small = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=f"{name}-small")
        self.large_nice = large_nice
        self.large = concurrent.futures.ThreadPoolExecutor(
            large_workers,
            thread_name_prefix=f"{name}-large",
            initializer=None if large_nice is None else lower_thread_priority,
            initargs=() if large_nice is None else (large_nice,),
        )

    def lane(self, fn: Callable, args: tuple, kwargs: dict) -> concurrent.futures.ThreadPoolExecutor:
        """The lane a job runs in: large when its arguments hold more than ``large_chars``
        characters of text."""
        big = (
            text_chars((fn, args, kwargs) if isinstance(fn, functools.partial) else (args, kwargs), self.large_chars)
            > self.large_chars
        )
        return self.large if big else self.small

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        """Run ``fn(*args, **kwargs)`` in its lane; returns its future."""
        return self.lane(fn, args, kwargs).submit(fn, *args, **kwargs)

    def warm(self, fn: Callable[[], object]) -> None:
        """Start every thread of both lanes now and run ``fn()`` once in each (blocking), so the
        per-thread set-up it does (``InputProcessor.tokenizer``'s copy, ~0.3 s for SmolLM2's
        tokenizer) is paid at start-up, not by the first requests' time to first token.

        Raises:
            whatever ``fn`` raises.
        """
        for lane, n in ((self.small, self.workers), (self.large, self.large_workers)):
            barrier = threading.Barrier(n)  # each job holds its thread until all n have one

            def job():
                fn()
                barrier.wait(timeout=60)

            for f in [lane.submit(job) for _ in range(n)]:
                f.result()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Shut both lanes down (as ``ThreadPoolExecutor.shutdown``)."""
        self.small.shutdown(wait=wait, cancel_futures=cancel_futures)
        self.large.shutdown(wait=wait, cancel_futures=cancel_futures)
