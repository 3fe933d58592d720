"""Per-API-key admission as the gateway runs it: :class:`KeyLimits` (a key's token buckets and
its metrics) hands each admitted request a :class:`KeyUse`, which gives back the unused
reservation when the request ends.

The buckets are :class:`~kvserve.deployments.limits.rate_limiter.RateLimiter`'s; the metrics are
``kvserve:api_key_requests_total`` and ``kvserve:api_key_tokens_total`` (:mod:`kvserve.telemetry.metrics`).
Refusals come out as OpenAI errors (:class:`~kvserve.deployments.contract.openai_errors.OpenAIError`).
"""

from __future__ import annotations

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.limits.policies import KeyPolicy
from kvserve.deployments.limits.rate_limiter import Grant, NeverFits, RateLimited, RateLimiter
from kvserve.telemetry.metrics import api_key_requests, api_key_tokens, rejected


class KeyLimits:
    """The gateway's per-key admission: token buckets (``limiter``) and per-key counters.

    Args:
        limiter: the buckets (in this process or shared through Redis).
        per_key_labels: label the per-key counters with each key's name (``metrics_per_key``);
            off (the default), their ``api_key`` label is empty for every key (``anonymous``
            without keys), so the open ``/metrics`` names no tenant.
    """

    def __init__(self, limiter: RateLimiter, per_key_labels: bool = False):
        self.limiter = limiter
        self.per_key_labels = per_key_labels
        self._tokens, self._requests, self._rejected = api_key_tokens(), api_key_requests(), rejected()

    def label(self, key: str) -> str:
        """The ``api_key`` label of key name ``key`` (see ``per_key_labels``)."""
        return key if self.per_key_labels or key == "anonymous" else ""

    def reserves(self, policy: KeyPolicy | None) -> bool:
        """Whether admitting a request of ``policy`` takes tokens from a bucket (then the caller
        must know how many the request may use)."""
        return policy is not None and self.limiter.enabled_for(policy)

    async def admit(
        self,
        policy: KeyPolicy | None,
        key: str,
        model: str,
        served: str,
        prompt_tokens: int,
        max_tokens: int,
        priority: int,
        *,
        variant: str = "",
    ) -> "KeyUse":
        """Admit one request of ``key`` (``policy``: its limits, None for an open gateway) to
        ``served`` (``model``: the base model, for the refusal counter): ``prompt_tokens``
        estimated + ``max_tokens`` reserved (:meth:`KeyUse.settle` returns what was not used)
        and the priority it runs at (a request may lower its own precedence, never raise it
        above its key's: the larger number wins, lower runs first). ``variant``: the A/B test
        variant the request was assigned (its metrics' label).

        Raises:
            OpenAIError: 429 ``rate_limit_exceeded`` (with ``Retry-After``), 400 ``too_large``
                (more tokens than the key may use per minute), 403 (the key may send nothing).
        """
        grant = None
        if self.reserves(policy):
            try:
                grant = await self.limiter.acquire(policy, prompt_tokens + max(0, max_tokens))
            except RateLimited as e:
                self._rejected.inc({"model_name": model, "reason": "rate_limited", "variant": variant})
                raise OpenAIError(
                    str(e), 429, "rate_limit_error", code="rate_limit_exceeded", retry_after_s=e.retry_after_s
                ) from None
            except NeverFits as e:
                if e.limit == "requests":
                    raise OpenAIError(
                        "this API key may not send requests", 403, "permission_error", code="permission_denied"
                    ) from None
                raise OpenAIError(str(e), 400, param="max_tokens", code="too_large") from None
        self._requests.inc({"api_key": self.label(key), "model_name": served, "variant": variant})
        return KeyUse(
            self, key, served, grant, max(priority, policy.priority if policy is not None else priority), variant
        )

    async def settle(self, use: "KeyUse", prompt_tokens: int, generation_tokens: int) -> None:
        """Count what ``use`` used and give the rest of its reservation back (see :meth:`KeyUse.settle`)."""
        labels = {"api_key": self.label(use.key), "model_name": use.model, "variant": use.variant}
        self._tokens.inc({**labels, "kind": "prompt"}, prompt_tokens)
        self._tokens.inc({**labels, "kind": "generation"}, generation_tokens)
        if use.grant is not None:
            await self.limiter.settle(use.grant, prompt_tokens + generation_tokens)


class KeyUse:
    """One admitted request's use of its API key: the limiter's grant, the key's name, the
    served model and the priority the request runs at. Made by :meth:`KeyLimits.admit`."""

    def __init__(self, limits: KeyLimits, key: str, model: str, grant: Grant | None, priority: int, variant: str = ""):
        self._limits, self.key, self.model, self.grant, self.priority = limits, key, model, grant, priority
        self.variant = variant
        self.done = False

    async def settle(self, prompt_tokens: int, generation_tokens: int) -> None:
        """Count the tokens the request used (once; later calls do nothing) and give the unused
        reservation back."""
        if self.done:
            return
        self.done = True
        await self._limits.settle(self, prompt_tokens, generation_tokens)
