"""Per-API-key limits for the gateway: key policies, a token-bucket rate limiter (in-process,
or shared by all ingress replicas through Redis) and failed-auth throttling per client address.

No Ray here and no Redis needed to import it; :class:`RateLimiter` talks to Redis only when it
is given a ``redis_url``. Four modules, one concern each:

1. :mod:`kvserve.deployments.limits.policies` -- :class:`KeyPolicy`, one API key and its limits (``rpm``,
   ``tpm``, ``priority``, ``name``), read from a key file (:func:`load_key_file`) or from
   ``--api-key`` / ``KVSERVE_API_KEYS`` entries (:func:`policies_from_keys`);
   :func:`find_policy` finds a request's key in constant time.
2. :mod:`kvserve.deployments.limits.rate_limiter` -- :class:`RateLimiter`, two token buckets per key
   (requests and tokens per minute), in this process or in Redis; :class:`RateLimited` (wait,
   429) and :class:`NeverFits` (the request can never pass).
3. :mod:`kvserve.deployments.limits.auth_throttle` -- :class:`AuthFailureThrottle`: after
   ``max_failures`` missing or wrong keys from one client within ``window_s``, its further wrong
   keys get 429 (sliding window log; valid keys are never throttled); :func:`client_address`,
   the client behind trusted proxies (``X-Forwarded-For``, rightmost untrusted hop).
4. :mod:`kvserve.deployments.limits.key_limits` -- :class:`KeyLimits`, the gateway's per-key admission
   (the buckets as OpenAI errors, the per-key metrics), and :class:`KeyUse`, one admitted
   request's reservation, settled when it ends.

How the gateway uses it, per request::

    wait = throttle.retry_after(client_ip)          # before looking at the key
    if wait is not None: -> 429, Retry-After: ceil(wait)
    policy = find_policy(bearer_token, policies)
    if policy is None: throttle.record_failure(client_ip); -> 401
    ... parse the body, count prompt tokens ...
    grant = await limiter.acquire(policy, prompt_tokens + max_tokens)   # RateLimited -> 429, NeverFits -> 400
    try: ... generate ...
    finally: await limiter.settle(grant, prompt_tokens + completion_tokens)
"""

from kvserve.deployments.limits.auth_throttle import AuthFailureThrottle, TrustedProxies, client_address
from kvserve.deployments.limits.policies import (
    KeyPolicy,
    find_policy,
    key_name,
    load_key_file,
    parse_key_lines,
    policies_from_keys,
)
from kvserve.deployments.limits.rate_limiter import Grant, NeverFits, RateLimited, RateLimiter

__all__ = [
    "AuthFailureThrottle",
    "Grant",
    "KeyPolicy",
    "NeverFits",
    "RateLimited",
    "RateLimiter",
    "TrustedProxies",
    "client_address",
    "find_policy",
    "key_name",
    "load_key_file",
    "parse_key_lines",
    "policies_from_keys",
]
