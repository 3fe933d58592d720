"""The rate limiter: :class:`RateLimiter` keeps two token buckets per API key (Turner 1986;
burst = one minute's worth, refill = limit / 60 per second): one for requests, one for tokens.
A request takes 1 request and ``cost`` tokens (prompt tokens + ``max_tokens``, reserved up
front) from both buckets at once or from neither; when the answer is done the caller settles
with the tokens actually used and the unused part goes back (capped at the bucket's capacity).
A request whose cost exceeds a whole bucket can never pass: :class:`NeverFits`.

Two backends: buckets in this process (each limit divided among the ingress replicas), or
shared by all ingress replicas through Redis (Lua scripts on Redis's clock), with the local
buckets as the fallback while Redis is down. Importing this module needs no Redis; the limiter
talks to Redis only when it is given a ``redis_url``.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.deployments.contract.redis_url import safe_url
from kvserve.deployments.limits.policies import KeyPolicy

logger = logging.getLogger("ray.serve")


class RateLimited(Exception):
    """A limit is reached for now: answer 429 with ``Retry-After: retry_after_header``.

    Attributes:
        limit: ``"requests"`` or ``"tokens"``: the bucket that refused (the one with the
            longer wait when both did).
        limit_per_minute: that limit as configured for the key (before ``divide_by``).
        retry_after_s: seconds until the bucket holds enough again (> 0).
        key_name: the key's label (for logs; not in the message).
    """

    def __init__(self, limit: str, limit_per_minute: float, retry_after_s: float, key_name: str = ""):
        self.limit = limit
        self.limit_per_minute = limit_per_minute
        self.retry_after_s = retry_after_s
        self.key_name = key_name
        super().__init__(
            f"rate limit reached: this API key may use {limit_per_minute:g} {limit} per minute; "
            f"retry after {self.retry_after_header} s"
        )

    @property
    def retry_after_header(self) -> str:
        """``retry_after_s`` rounded up to whole seconds, at least 1 (for ``Retry-After``)."""
        return str(max(1, math.ceil(self.retry_after_s)))


class NeverFits(ValueError):
    """The request costs more than a whole bucket: it can never pass, waiting will not help.

    ``limit == "tokens"``: prompt tokens + ``max_tokens`` exceed the key's tokens per minute
    (answer 400: lower ``max_tokens`` or shorten the prompt). ``limit == "requests"``: the
    key's requests per minute is 0, it may make no requests (answer 403 or 429).

    Attributes: ``limit``, ``limit_per_minute`` (as configured), ``cost`` (tokens or 1).
    """

    def __init__(self, limit: str, limit_per_minute: float, cost: int):
        self.limit = limit
        self.limit_per_minute = limit_per_minute
        self.cost = cost
        if limit == "tokens":
            msg = (
                f"request needs {cost} tokens (prompt + max_tokens) but this API key may use only "
                f"{limit_per_minute:g} tokens per minute; lower max_tokens or shorten the prompt"
            )
        else:
            msg = "this API key may make no requests (its limit is 0 requests per minute)"
        super().__init__(msg)


@dataclass
class Grant:
    """What :meth:`RateLimiter.acquire` took, for :meth:`RateLimiter.settle`.

    ``backend``: ``"none"`` (no limit applied), ``"local"`` (in-process buckets) or
    ``"redis"``. ``reserved_tokens``: the cost taken from the token bucket.
    """

    policy: KeyPolicy
    reserved_tokens: int
    backend: str
    settled: bool = False

    @property
    def name(self) -> str:
        return self.policy.name


@dataclass
class _Bucket:
    """An in-process token bucket: ``level`` of ``capacity``, refilled at ``rate`` per second."""

    capacity: float
    rate: float
    level: float
    stamp: float

    def refill(self, now: float) -> None:
        if now > self.stamp:
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
            self.stamp = now

    def wait(self, amount: float) -> float:
        """Seconds until ``level`` reaches ``min(amount, capacity)`` (0: now). A cost above
        the capacity passes from a full bucket and leaves it in debt (see RateLimiter)."""
        need = min(amount, self.capacity)
        if self.level >= need - 1e-9:
            return 0.0
        return (need - self.level) / self.rate


# Both buckets of a key, checked and taken in one step on Redis's clock. KEYS[1]: request
# bucket, KEYS[2]: token bucket (hashes {level, ts}, ts in ms). ARGV[1], ARGV[2]: requests
# and tokens per minute (< 0: no such limit, bucket untouched); ARGV[3]: cost in tokens.
# Returns {1, 0, ''} when taken, else {0, wait in ms, 'requests' | 'tokens'}. A missing hash
# is a full bucket; each hash expires when it would be full again.
_ACQUIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local limits = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local amounts = {1, tonumber(ARGV[3])}
local names = {'requests', 'tokens'}
local levels = {}
local wait, which = 0, ''
for i = 1, 2 do
  local cap = limits[i]
  if cap > 0 then
    local rate = cap / 60000
    local h = redis.call('HMGET', KEYS[i], 'level', 'ts')
    local level = cap
    if h[1] and h[2] then
      level = math.min(cap, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rate)
    end
    levels[i] = level
    local need = math.min(amounts[i], cap)
    if level < need - 1e-9 then
      local w = (need - level) / rate
      if w > wait then wait, which = w, names[i] end
    end
  end
end
if wait > 0 then return {0, math.ceil(wait), which} end
for i = 1, 2 do
  local cap = limits[i]
  if cap > 0 then
    local level = levels[i] - amounts[i]
    redis.call('HSET', KEYS[i], 'level', level, 'ts', now)
    redis.call('PEXPIRE', KEYS[i], math.ceil((cap - level) / (cap / 60000)) + 1000)
  end
end
return {1, 0, ''}
"""

# Give back (or, negative, take) tokens: KEYS[1]: token bucket; ARGV[1]: tokens per minute
# (> 0); ARGV[2]: tokens to give back. The level is capped at the capacity.
_SETTLE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local cap = tonumber(ARGV[1])
local rate = cap / 60000
local h = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = cap
if h[1] and h[2] then
  level = math.min(cap, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rate)
end
level = math.min(cap, level + tonumber(ARGV[2]))
redis.call('HSET', KEYS[1], 'level', level, 'ts', now)
redis.call('PEXPIRE', KEYS[1], math.ceil((cap - level) / rate) + 1000)
return 1
"""


def _limit(value: float | None, default: float | None) -> float | None:
    """A key's effective limit per minute: its own, else the default; None when unlimited."""
    v = value if value is not None else default
    return None if v is None or math.isinf(v) else float(v)


class RateLimiter:
    """Requests-per-minute and tokens-per-minute token buckets per API key.

    Buckets (Turner 1986, "token bucket"): capacity = one minute's worth of the limit, refill
    = limit / 60 per second, full at start. :meth:`acquire` takes 1 from the request bucket
    and ``cost_tokens`` from the token bucket, both or neither; a cost above the capacity of
    a bucket passes only from a full one and leaves it in debt (so a limit below 1 request
    per minute, or a replica's share of the token limit, still admits what the whole limit
    admits, and the long-run rate stays the limit). :meth:`settle` gives back what the answer
    did not use.

    Without ``redis_url`` the buckets live in this process and each limit is divided by
    ``divide_by`` (the number of ingress replicas): N replicas then admit about the limit
    together -- about, because the router may not spread one key's requests evenly, so a
    key sending all its traffic through one replica gets only 1/N of it.

    With ``redis_url`` (``redis://[:password@]host:port/db``, Redis >= 5) all replicas share
    the exact limit: one Lua script checks and takes both buckets atomically on Redis's clock (``TIME``,
    not the replicas' clocks); each bucket is a hash ``{prefix}{<key name>}:req|tok`` that
    expires when it would be full again. If Redis fails or does not answer within
    ``redis_timeout_s``, the limiter logs one warning, uses the local divided buckets, and
    tries Redis again after ``redis_retry_s`` (one info line when it answers again): an
    outage neither fails requests nor lifts the limits.

    Args:
        default_rpm, default_tpm: limits for keys whose policy has none (None: unlimited).
        redis_url: share the limits through this Redis; None: in-process only.
        divide_by: number of ingress replicas sharing the limits without Redis (>= 1).
        clock: monotonic seconds for the local buckets and the Redis retry pause (tests inject
            a fake one); the Redis buckets use Redis's clock.
        key_prefix: prefix of the Redis keys.
        redis_timeout_s: connect and command timeout for Redis, seconds.
        redis_retry_s: after a Redis failure, seconds on the local buckets before trying again.

    Raises:
        ValueError: a negative or NaN default, or ``divide_by`` < 1.
    """

    def __init__(
        self,
        default_rpm: float | None = None,
        default_tpm: float | None = None,
        *,
        redis_url: str | None = None,
        divide_by: int = 1,
        clock: Callable[[], float] = time.monotonic,
        key_prefix: str = "kvserve:rl:",
        redis_timeout_s: float = 0.5,
        redis_retry_s: float = 5.0,
    ):
        for label, v in (("default_rpm", default_rpm), ("default_tpm", default_tpm)):
            if v is not None and not v >= 0:
                raise ValueError(f"{label} must be >= 0 or None, got {v!r}")
        if int(divide_by) != divide_by or divide_by < 1:
            raise ValueError(f"divide_by must be an integer >= 1, got {divide_by!r}")
        self.default_rpm = default_rpm
        self.default_tpm = default_tpm
        self.divide_by = int(divide_by)
        self.key_prefix = key_prefix
        self._clock = clock
        self._local: dict[tuple[str, str], _Bucket] = {}
        self._redis = None
        self._redis_url = redis_url
        self._redis_retry_s = redis_retry_s
        self._redis_down_until = -math.inf
        self._redis_warned = False
        if redis_url:
            import redis.asyncio as aioredis  # only when asked: importing this module needs no Redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry

            # One quick retry (a pooled connection gone stale), no backoff: a request must not
            # wait seconds for a Redis that is down; the local fallback answers instead.
            self._redis = aioredis.Redis.from_url(
                redis_url,
                socket_timeout=redis_timeout_s,
                socket_connect_timeout=redis_timeout_s,
                retry=Retry(NoBackoff(), 1),
            )
            self._acquire_script = self._redis.register_script(_ACQUIRE_LUA)
            self._settle_script = self._redis.register_script(_SETTLE_LUA)

    # -- limits

    def limits(self, policy: KeyPolicy) -> tuple[float | None, float | None]:
        """(requests, tokens) per minute that apply to ``policy``; None: unlimited."""
        return (
            _limit(policy.requests_per_minute, self.default_rpm),
            _limit(policy.tokens_per_minute, self.default_tpm),
        )

    def enabled_for(self, policy: KeyPolicy) -> bool:
        """Whether any limit applies to this key (else acquire/settle are no-ops)."""
        rpm, tpm = self.limits(policy)
        return rpm is not None or tpm is not None

    # -- acquire / settle

    async def acquire(self, policy: KeyPolicy, cost_tokens: int) -> Grant:
        """Take one request and ``cost_tokens`` tokens (prompt + max output tokens) for ``policy``.

        Returns:
            The :class:`Grant` to pass to :meth:`settle` once the answer is done.

        Raises:
            RateLimited: a bucket is short now (nothing was taken); see ``retry_after_s``.
            NeverFits: ``cost_tokens`` exceeds the key's tokens per minute, or its requests
                per minute is 0: the request can never pass.
            ValueError: ``cost_tokens`` < 0.
        """
        if cost_tokens < 0:
            raise ValueError(f"cost_tokens must be >= 0, got {cost_tokens}")
        rpm, tpm = self.limits(policy)
        if rpm == 0:
            raise NeverFits("requests", 0.0, 1)
        if tpm is not None and cost_tokens > tpm:
            raise NeverFits("tokens", tpm, cost_tokens)
        if tpm == 0:  # and so cost_tokens == 0: nothing to take
            tpm = None
        if rpm is None and tpm is None:
            return Grant(policy, cost_tokens, "none")
        if self._redis_usable():
            try:
                allowed, wait_ms, which = await self._acquire_script(
                    keys=self._redis_keys(policy.name), args=[_arg(rpm), _arg(tpm), cost_tokens]
                )
            except Exception as e:  # noqa: BLE001 -- any Redis trouble: fall back, never fail the request
                self._redis_failed(e)
            else:
                self._redis_ok()
                if int(allowed):
                    return Grant(policy, cost_tokens, "redis")
                which = which.decode() if isinstance(which, bytes) else str(which)
                raise RateLimited(which, rpm if which == "requests" else tpm, int(wait_ms) / 1000, policy.name)
        return self._local_acquire(policy, rpm, tpm, cost_tokens)

    async def settle(self, grant: Grant, used_tokens: int) -> None:
        """Give back the part of the reservation the answer did not use (``reserved -
        used_tokens``; a negative difference is taken), capped at the bucket's capacity.
        Call it once per grant (later calls do nothing), also when the request failed or was
        cancelled (with the tokens computed so far). Never raises: Redis errors are logged."""
        try:
            if grant.settled or grant.backend == "none":
                return
            grant.settled = True
            tpm = self.limits(grant.policy)[1]
            delta = grant.reserved_tokens - max(0, int(used_tokens))
            if not tpm or delta == 0:
                return
            if grant.backend == "redis":
                if not self._redis_usable():
                    return  # the reservation stays taken: errs on the safe side
                try:
                    await self._settle_script(keys=self._redis_keys(grant.policy.name)[1:], args=[_arg(tpm), delta])
                except Exception as e:  # noqa: BLE001
                    self._redis_failed(e)
                else:
                    self._redis_ok()
                return
            b = self._local_bucket(grant.policy.name, "tokens", tpm)
            b.refill(self._clock())
            b.level = min(b.capacity, b.level + delta)
        except Exception:
            logger.warning("rate limiter: settle failed for %s", grant.policy.name, exc_info=True)

    async def aclose(self) -> None:
        """Close the Redis connections (if any)."""
        if self._redis is not None:
            await self._redis.aclose()

    # -- in-process buckets

    def _local_bucket(self, name: str, kind: str, per_minute: float) -> _Bucket:
        cap = per_minute / self.divide_by
        b = self._local.get((name, kind))
        if b is None:
            b = self._local[(name, kind)] = _Bucket(cap, cap / 60.0, cap, self._clock())
        elif b.capacity != cap:  # the key's limit changed: keep the level, within the new capacity
            b.capacity, b.rate, b.level = cap, cap / 60.0, min(b.level, cap)
        return b

    def _local_acquire(self, policy: KeyPolicy, rpm: float | None, tpm: float | None, cost: int) -> Grant:
        now = self._clock()
        taken: list[tuple[_Bucket, float]] = []
        wait, which = 0.0, ""
        for kind, per_minute, amount in (("requests", rpm, 1), ("tokens", tpm, cost)):
            if per_minute is None:
                continue
            b = self._local_bucket(policy.name, kind, per_minute)
            b.refill(now)
            w = b.wait(amount)
            if w > wait:
                wait, which = w, kind
            taken.append((b, amount))
        if wait > 0:
            raise RateLimited(which, rpm if which == "requests" else tpm, wait, policy.name)
        for b, amount in taken:  # no await since the check: atomic on the event loop
            b.level -= amount
        return Grant(policy, cost, "local")

    # -- Redis

    def _redis_keys(self, name: str) -> list[str]:
        # Hash tag {name}: both keys of a key name land in one Redis Cluster slot.
        return [f"{self.key_prefix}{{{name}}}:req", f"{self.key_prefix}{{{name}}}:tok"]

    def _redis_usable(self) -> bool:
        return self._redis is not None and self._clock() >= self._redis_down_until

    def _redis_failed(self, err: BaseException) -> None:
        self._redis_down_until = self._clock() + self._redis_retry_s
        if not self._redis_warned:
            self._redis_warned = True
            logger.warning(
                "rate limiter: Redis at %s failed (%s: %s); limits fall back to this replica's "
                "1/%d share until it answers again",
                safe_url(self._redis_url or ""),
                type(err).__name__,
                err,
                self.divide_by,
            )

    def _redis_ok(self) -> None:
        if self._redis_warned:
            self._redis_warned = False
            logger.info("rate limiter: Redis answers again; limits are shared again")


def _arg(per_minute: float | None) -> float:
    """A limit as the Lua scripts take it: the number, or -1 for no limit."""
    return -1 if per_minute is None else per_minute
