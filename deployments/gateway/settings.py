"""The settings of one gateway replica (:class:`GatewaySettings`), filled by ``build_app``."""
from __future__ import annotations

from dataclasses import dataclass

from deployments.gateway.gate import DEFAULT_AUTH_FAILURES_PER_MINUTE, DEFAULT_MAX_BODY_BYTES

#: Default most prompts in one ``/v1/completions`` request (``max_prompts_per_request``).
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64

@dataclass
class GatewaySettings:
    """What one gateway replica enforces and where it sends requests (``build_app`` fills it
    from :class:`deployments.args.AppArgs`).

    Attributes:
        api_keys: key entries (``"<key> [name=..] [rpm=..] [tpm=..] [priority=..]"``); None: no key.
        admin_api_keys: keys that may administer the response cache (accepted by the gate too).
        max_request_body_bytes, auth_failures_per_minute, allowed_origins: the gate's.
        max_prompts_per_request: the most prompts of one completions request.
        health_timeout_s: seconds a probe of a model may take.
        rate_limit_rpm, rate_limit_tpm: default per-key limits (requests, tokens per minute).
        redis_url: the limits' and caches' shared store (None: each replica its own share).
        ingress_num_replicas: how many gateway replicas share the limits without Redis.
        cache: :class:`~deployments.cache.CacheSettings` fields (None: defaults, exact cache on).
        model_routing: the rules of ``model: "auto"`` (:class:`~deployments.routing.model_routing.ModelRouting`).
        upstream: the fallback for requests every replica refuses (:class:`~deployments.routing.model_routing.UpstreamArgs`).
        adapters: LoRA adapters clients may name as ``model``: ``{adapter name: its base model's name}``.
        lora_allowed_roots: folders under which ``POST /v1/load_lora_adapter`` may read adapters
            (resolved on the replica's node); None or empty: loading at run time is off.
    """

    api_keys: list[str] | None = None
    admin_api_keys: list[str] | None = None
    max_request_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    auth_failures_per_minute: int = DEFAULT_AUTH_FAILURES_PER_MINUTE
    allowed_origins: list[str] | None = None
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST
    health_timeout_s: float = 5.0
    rate_limit_rpm: float | None = None
    rate_limit_tpm: float | None = None
    redis_url: str | None = None
    ingress_num_replicas: int = 1
    cache: dict | None = None
    model_routing: dict | None = None
    upstream: dict | None = None
    adapters: dict[str, str] | None = None
    lora_allowed_roots: list[str] | None = None
