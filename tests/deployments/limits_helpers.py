"""Helpers of the ``kvserve.deployments.limits`` tests (test_key_policies.py, test_rate_limiter.py,
test_rate_limiter_redis.py, test_auth_throttle.py): ``run`` (``asyncio.run``) and a clock the test
sets (``helpers.FakeClock``)."""

from asyncio import run  # noqa: F401  (the limits tests take both from here)

from helpers import FakeClock  # noqa: F401
