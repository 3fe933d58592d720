"""Failed-auth throttling per client address: :class:`AuthFailureThrottle` -- after
``max_failures`` missing or wrong keys from one client address within ``window_s``, that
address waits (sliding window log).
"""
from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable


class AuthFailureThrottle:
    """Slows down key guessing: after ``max_failures`` missing or wrong keys from one client
    address within ``window_s`` seconds, that address must wait until the oldest of them
    leaves the window (sliding window log of the last ``max_failures`` failure times).

    Memory is bounded: at most ``max_clients`` addresses, least recently failed evicted
    first (an attacker with that many addresses can push a throttled one out; it has that
    many addresses to guess from anyway). Check :meth:`retry_after` before looking at the
    key, and do not record failures for requests refused by it.

    Raises:
        ValueError: ``max_failures`` < 1, ``window_s`` <= 0 or ``max_clients`` < 1.
    """

    def __init__(self, max_failures: int = 20, window_s: float = 60.0, max_clients: int = 10000,
                 clock: Callable[[], float] = time.monotonic):
        if max_failures < 1 or not window_s > 0 or max_clients < 1:
            raise ValueError(f"need max_failures >= 1, window_s > 0, max_clients >= 1; got "
                             f"{max_failures}, {window_s}, {max_clients}")
        self.max_failures = max_failures
        self.window_s = window_s
        self.max_clients = max_clients
        self._clock = clock
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()

    def __len__(self) -> int:
        """Number of client addresses tracked."""
        return len(self._failures)

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try again (> 0), or None when it may try now."""
        times = self._failures.get(client)
        if times is None:
            return None
        now = self._clock()
        while times and times[0] <= now - self.window_s:
            times.popleft()
        if not times:
            del self._failures[client]
            return None
        if len(times) < self.max_failures:
            return None
        return times[0] + self.window_s - now

    def record_failure(self, client: str) -> None:
        """Count a missing or wrong key from ``client``."""
        times = self._failures.get(client)
        if times is None:
            times = self._failures[client] = deque(maxlen=self.max_failures)
            while len(self._failures) > self.max_clients:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(client)
        times.append(self._clock())

    def record_success(self, client: str) -> None:
        """Forget ``client``'s failures (it sent a valid key)."""
        self._failures.pop(client, None)
