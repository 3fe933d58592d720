"""Helpers of the ``deployments.limits`` tests (test_key_policies.py, test_rate_limiter.py,
test_rate_limiter_redis.py, test_auth_throttle.py): a clock the test sets, and ``run`` (``asyncio.run``)."""

import asyncio


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def run(coro):
    return asyncio.run(coro)
