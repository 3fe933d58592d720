"""The configuration sections both sides of the walls read, as pydantic models passed as objects
(Serve pickles a deployment's init arguments): :class:`ModelArgs` (one served model: its
``LLMServer`` replicas and its card), :class:`GatewayArgs`, :class:`LimitArgs`,
:class:`CacheArgs`, :class:`RoutingArgs` (with :class:`ModelRouting` and :class:`UpstreamArgs`)
and :class:`EmbeddingArgs`. ``kvserve/deployments/args.py`` assembles them into the application's
arguments (``AppArgs``, the flat form, the CLI's flags).

The engine settings of ``ModelArgs`` are generated from ``engine.EngineConfig``'s fields
(type, default, help), so the engine, the Serve config and the CLI cannot drift; where serving
wants another default it says so, with the reason, in :data:`SERVING_ENGINE_DEFAULTS`.

A section validates what it can see alone; what needs another room (a tool parser's name, an
API key entry's syntax) is checked where the application is assembled (``AppArgs``) and again
where it is used. This module imports neither Ray nor torch.
"""

import os
import warnings
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from kvserve.deployments.contract.adapters import check_lora_modules
from kvserve.deployments.contract.encoder import served_name as encoder_served_name
from kvserve.deployments.contract.reasoning import REASONING_PARSERS
from kvserve.engine.config import EngineConfig, engine_fields

#: Default most missing or wrong API keys one client address may send per minute before its
#: requests get 429 without being checked (a key-guessing brake; a correct key resets nothing).
DEFAULT_AUTH_FAILURES_PER_MINUTE = 20

#: Default largest request body, bytes (4 MiB: a 128k-token prompt as text or as token ids
#: is well under 1 MiB).
DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_FILE_BYTES = 64 << 20

#: Default most prompts in one ``/v1/completions`` request (``max_prompts_per_request``).
DEFAULT_MAX_PROMPTS_PER_REQUEST = 64


#: Model settings renamed: ``{old key: new key}``. The old key is still accepted (with a
#: ``FutureWarning``) so existing Serve configs and Helm values keep working.
RENAMED_MODEL_KEYS: dict[str, str] = {"max_queued_requests": "max_waiting_requests"}

#: Engine settings where serving deliberately differs from ``engine.EngineConfig``'s default:
#: ``{field: (default, reason)}``. Everything else is the engine's own default.
SERVING_ENGINE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "max_num_seqs": (
        64,
        "a replica's inter-token latency grows with its batch (a 64-request CPU decode step "
        "is slow on a small CPU, benchmarks/step_times.py); past that the autoscaler adds replicas "
        "instead of deepening one",
    ),
    "scheduling_policy": (
        "priority",
        "per-API-key priorities reach the scheduler (equal priorities run in arrival order, as fcfs)",
    ),
}


def _engine_args_model() -> type[BaseModel]:
    """A pydantic model with one field per ``EngineConfig`` field (type, default, help),
    the serving defaults above applied: the base of :class:`ModelArgs`."""
    spec = {}
    for name, typ, default, help_ in engine_fields():
        default, why = SERVING_ENGINE_DEFAULTS.get(name, (default, None))
        spec[name] = (typ, Field(default, description=help_ + (f" (serving default {default}: {why})" if why else "")))
    return create_model("EngineArgs", __config__=ConfigDict(extra="forbid", protected_namespaces=()), **spec)


EngineArgs = _engine_args_model()
#: Fields of ModelArgs that go to ``engine.EngineConfig`` (all of its fields).
ENGINE_FIELDS = tuple(EngineArgs.model_fields)


def default_admission_bounds(max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int) -> tuple[int, int]:
    """A replica's default admission bounds ``(max_waiting_requests, max_queued_prompt_tokens)``.

    Requests (waiting behind a full batch of ``max_num_seqs``): a 64th of a batch, at least 1
    (a GPU replica with ``max_num_seqs`` 256 lets 4 wait). While the batch is full, a waiting
    request waits for running ones to finish, and requests admitted together finish together,
    so a queue of ``n`` can wait for a whole cohort, not ``n`` average completions; beyond the
    queue a client is better served by a 429 and a retry on another replica (or after the
    autoscaler added one) than by a wait that grows with the overload. How the TTFT of admitted
    requests and the goodput under overload depend on this bound: ``benchmarks/load_test.py``.
    Prompt tokens: four full-budget prefill steps (``4 * max_num_batched_tokens``), and never
    less than one longest prompt (``max_model_len``), so every prompt the model takes can be
    admitted by an idle replica.
    """
    return max(1, max_num_seqs // 64), max(max_model_len, 4 * max_num_batched_tokens)


def default_batch_requests(max_num_seqs: int) -> int:
    """A replica's default ``max_batch_requests``: half its batch (``max_num_seqs // 2``), at
    least 1. Batch-API requests never hold more than this many of a replica's ``max_num_seqs``
    slots, so idle capacity goes to batch work while live traffic keeps room to arrive; a live
    request that finds the batch full of batch work preempts one (the engine's priority
    scheduling), so the share bounds how much batch work a burst of live requests preempts,
    and how many recomputes that costs."""
    return max(1, max_num_seqs // 2)


def renamed_model_keys(data: Any) -> Any:
    """``data`` (a model's settings as a dict) with each key of :data:`RENAMED_MODEL_KEYS`
    given under its new name, and a ``FutureWarning`` naming the rename; anything else as given.

    Raises:
        ValueError: a setting given under both its old and its new name, with different values.
    """
    if not isinstance(data, dict) or not any(k in data for k in RENAMED_MODEL_KEYS):
        return data
    data = dict(data)
    for old, new in RENAMED_MODEL_KEYS.items():
        if old not in data:
            continue
        value = data.pop(old)
        if new in data and data[new] != value:
            raise ValueError(f"{old} is the old name of {new}: give one of them")
        data[new] = value
        msg = f"the model setting {old} is deprecated, it is now {new} (--{new.replace('_', '-')})"
        warnings.warn(msg, FutureWarning, stacklevel=2)
    return data


class ModelArgs(EngineArgs):
    """One model = one ``LLMServer`` deployment: the engine's settings (generated from
    ``engine.EngineConfig``) plus how the deployment serves it."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    served_model_name: Optional[str] = Field(None, description="name clients send as `model` (default: model)")
    num_replicas: Optional[int] = Field(
        None, ge=0, description="fixed replica count; unset: autoscale with kvserve's policy"
    )
    min_replicas: Optional[int] = Field(None, ge=0, description="autoscaling lower bound (policy default 1)")
    max_replicas: Optional[int] = Field(None, ge=1, description="autoscaling upper bound (policy default 8)")
    autoscaling: Optional[dict[str, Any]] = Field(
        None, description="autoscaling knobs (see kvserve/autoscaling/policy.py KVServeAutoscalingConfig)"
    )
    max_ongoing_requests: Optional[int] = Field(
        None,
        ge=1,
        description="requests Serve routes to one replica at once (default: max_num_seqs + "
        "2 * max_waiting_requests + max_batch_requests, so the replica's own admission "
        "decides)",
    )
    max_waiting_requests: Optional[int] = Field(
        None,
        ge=1,
        description="requests a replica admits to wait behind a full batch (max_num_seqs) before 429s "
        "(default: max(1, max_num_seqs // 64)); was max_queued_requests, still accepted. "
        "Serve's own handle queue (its deployment option max_queued_requests) holds "
        "max_num_seqs + this many per caller",
    )
    max_queued_prompt_tokens: Optional[int] = Field(
        None,
        ge=1,
        description="prompt tokens a replica queues before 429s (default: "
        "max(max_model_len, 4 * max_num_batched_tokens))",
    )
    max_batch_requests: Optional[int] = Field(
        None,
        ge=1,
        description="Batch-API requests a replica runs at once, at most max_num_seqs (default: "
        "max(1, max_num_seqs // 2)); one is admitted only while fewer than max_num_seqs "
        "requests are in flight, and live requests are admitted as if no batch work ran "
        "(they preempt running batch requests, which resume with their tokens kept)",
    )
    request_timeout_s: Optional[float] = Field(
        600.0,
        gt=0,
        description="a request running longer is aborted (blocks freed) and ends with a 504 / "
        "an SSE error event; null: no limit",
    )
    graceful_shutdown_timeout_s: float = Field(
        60.0,
        ge=0,
        description="on scale-down or shutdown a replica stops taking requests and finishes its "
        "streams for up to this long before it exits",
    )
    stream_interval: int = Field(
        0,
        ge=0,
        description="engine outputs per streamed chunk (vLLM's --stream-interval; the first token and the "
        "last chunk always go at once): k >= 1 every k tokens; 0 (auto) every token while fewer "
        "than 16 requests run on the replica, then 1 + running // 16, so a loaded replica sends "
        "about 16 messages per engine step",
    )
    tool_call_parser: str = Field(
        "auto",
        description="how tool calls are read from this model's text under tool_choice auto (vLLM's "
        "names: hermes, llama3_json, mistral, pythonic, qwen3_coder, qwen3_xml; "
        "kvserve/deployments/gateway/tool_parsers/); auto: the one the model's chat template writes "
        "calls for (kvserve/engine/chat_templates.py: tool_parser_for_template), hermes for a template "
        "that knows no tools",
    )
    reasoning_parser: Optional[str] = Field(
        None,
        description="split a reasoning model's output into reasoning and content (vLLM's --reasoning-parser: "
        "deepseek_r1, qwen3; kvserve/deployments/contract/reasoning.py): chat's reasoning_content, the "
        "Responses API's reasoning item, the Messages API's thinking block; tool calls and "
        "structured outputs apply after the reasoning. None: the output is all content",
    )
    prefix_aware_routing: bool = Field(
        True,
        description="route each request to the replica that most recently served the longest prefix of its "
        "prompt (kvserve/deployments/routing/prefix_router.py); off: Serve's power of two choices",
    )
    kv_aware_routing: bool = Field(
        False,
        description="route on the replicas' KV cache events (kvserve/deployments/routing/kv_router.py): each "
        "replica publishes what its KV pool and host tier hold and its load "
        "(enable_kv_cache_events is then on), and the router sends a request where cached "
        "prefix and load cost the fewest tokens; needs prefix_aware_routing and prefix caching",
    )
    kv_cluster_tier_size: Optional[float] = Field(
        None,
        ge=0,
        description="GiB of the cluster KV tier in Ray's object store (kvserve/deployments/replica/kv_cluster.py), "
        "shared by the application's replicas of a model: blocks a replica computes are put "
        "there, and a replica missing a prefix the cluster holds loads it instead of computing "
        "it (never waiting longer than computing would take); needs kv_offloading_size (loads "
        "go through the host tier) and prefix caching; turns KV events on. None or 0: no "
        "cluster tier",
    )
    prefix_routing_margin: int = Field(
        8,
        ge=0,
        description="prefix-aware routing gives way to the least-loaded replica when the preferred one "
        "has more than this many ongoing requests more",
    )
    pooling_type: Literal["last", "mean"] = Field(
        "last",
        description="how /v1/embeddings pools this model's final hidden states: the last token's "
        "(e5-mistral style, vLLM's default for decoders) or the mean over the input",
    )
    lora_modules: Optional[dict[str, str]] = Field(
        None,
        description="LoRA adapters served with this model, {name: PEFT folder} (vLLM's --lora-modules "
        "name=path ...); clients send the name as `model`; needs enable_lora",
    )
    placement_group_strategy: Literal["STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD"] = Field(
        "STRICT_PACK",
        description="where a tensor-parallel replica's ranks go: STRICT_PACK (default, as on GPUs: one "
        "node, loopback collectives), PACK, SPREAD or STRICT_SPREAD (ranks on several nodes: "
        "collectives over the nodes' network, which must be the cluster's private one)",
    )
    max_replicas_per_node: Optional[int] = Field(
        None,
        ge=1,
        description="Serve's bound on this model's replicas per node (spreads them over nodes); not "
        "with several ranks per replica (Serve refuses it with placement groups)",
    )
    collective_timeout_s: float = Field(
        300.0,
        gt=0,
        description="a tensor-parallel collective waiting longer for a rank fails the step (a rank on "
        "a dead node ends its requests with an error instead of hanging them)",
    )
    torch_num_threads: Optional[int] = Field(None, ge=1)
    engine_core_process: bool = Field(
        True,
        description="a one-rank replica steps its engine in a process of its own (vLLM's EngineCore; "
        "kvserve/engine/engine_core.py), so the replica's Python (Serve, streams, metrics) never holds "
        "the GIL a step needs; off: the engine steps in a thread of the replica's process. "
        "Tensor- and pipeline-parallel replicas step in their worker actors either way",
    )
    replica_cpus: float = Field(1.0, ge=0)
    replica_resources: Optional[dict[str, float]] = Field(
        None,
        description='custom Ray resources each replica asks for, e.g. {"node-type-a": 1} to tie it to a '
        "node type the autoscaler can add (with several ranks: in rank 0's bundle, with the replica)",
    )
    worker_cpus: float = Field(1.0, ge=0, description="CPUs per tensor- or pipeline-parallel worker actor")
    variant: Optional[str] = Field(
        None,
        description="the variant of an A/B test this deployment serves (set from the app's experiments, "
        "kvserve/deployments/contract/experiments.py; the `variant` label of its metrics)",
    )
    cost_per_replica_hour: Optional[float] = Field(
        None,
        ge=0,
        description="what one replica of this model costs per hour, in your currency (a node's "
        "price divided by the replicas it holds): kvserve:cost_per_million_output_tokens "
        "and the response cache's saved cost are priced with it; unset: no cost metrics",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return renamed_model_keys(data)

    @model_validator(mode="after")
    def _check(self):
        EngineConfig(**self.engine_args())  # the engine's own range checks, at validation time
        if self.distributed_executor_backend == "mp":
            raise ValueError(
                "distributed_executor_backend 'mp' (local processes) is for the offline LLM: a Serve "
                "replica runs its ranks as Ray actors in its placement group ('ray', the default)"
            )
        if self.num_replicas is not None and (
            self.autoscaling is not None or self.min_replicas is not None or self.max_replicas is not None
        ):
            raise ValueError("give either num_replicas or autoscaling bounds (min/max_replicas, autoscaling)")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        if self.max_replicas_per_node is not None and self.num_ranks > 1:
            raise ValueError(
                "max_replicas_per_node cannot be combined with tensor_parallel_size or "
                "pipeline_parallel_size > 1 (Serve does not allow it with placement groups); use "
                "placement_group_strategy for the ranks"
            )
        check_lora_modules(self.lora_modules, self.name, self.enable_lora)
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning_parser {self.reasoning_parser!r}; choose one of {', '.join(REASONING_PARSERS)}"
            )
        if self.kv_cluster_tier_size and not (self.kv_offloading_size and self.enable_prefix_caching):
            raise ValueError(
                "kv_cluster_tier_size needs kv_offloading_size (blocks from the cluster tier load through "
                "the host tier) and enable_prefix_caching"
            )
        return self

    @property
    def name(self) -> str:
        from kvserve.engine.model_loader import DEFAULT_MODEL

        return self.served_model_name or self.model or DEFAULT_MODEL

    @property
    def deployment_key(self) -> str:
        """What tells this model's deployments apart: the served name, and ``name@variant`` for
        a variant of an experiment (the key its replicas publish their facts under, and the
        gateway's handles, shedding and channels use)."""
        return self.name if self.variant is None else f"{self.name}@{self.variant}"

    def engine_args(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ENGINE_FIELDS}

    def waiting_requests_bound(self) -> int:
        """``max_waiting_requests``, or its default (see :func:`default_admission_bounds`)."""
        return self.max_waiting_requests or default_admission_bounds(self.max_num_seqs, 1, 1)[0]

    def batch_requests_bound(self) -> int:
        """``max_batch_requests`` (at most ``max_num_seqs``), or its default (see
        :func:`default_batch_requests`)."""
        return min(self.max_batch_requests or default_batch_requests(self.max_num_seqs), self.max_num_seqs)

    def ongoing_requests_bound(self) -> int:
        """Serve's ``max_ongoing_requests`` of a replica: its batch, its queue, as many again
        for requests being refused, and batch work's share (live requests are admitted as if
        no batch work ran), so the replica's own admission (not Serve's handle queue) decides
        while replicas run."""
        return self.max_ongoing_requests or (
            self.max_num_seqs + 2 * self.waiting_requests_bound() + self.batch_requests_bound()
        )

    @property
    def num_ranks(self) -> int:
        """Worker actors per replica: ``tensor_parallel_size * pipeline_parallel_size`` (1: the
        engine runs in the replica itself)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def autoscaling_knobs(self) -> Optional[dict[str, Any]]:
        """Knobs of kvserve's autoscaling policy for this model (``{}``: all defaults), or None
        when ``num_replicas`` pins a fixed fleet."""
        if self.num_replicas is not None:
            return None
        knobs = dict(self.autoscaling or {})
        if self.min_replicas is not None:
            knobs["min_replicas"] = self.min_replicas
        if self.max_replicas is not None:
            knobs["max_replicas"] = self.max_replicas
        return knobs


class GatewayArgs(BaseModel):
    """The gateway's section of :class:`AppArgs`: keys, the request gate, its replicas."""

    model_config = ConfigDict(extra="forbid")

    api_keys: Optional[list[str]] = Field(
        None,
        description="if set, require `Authorization: Bearer <key>`; default: $KVSERVE_API_KEYS "
        "(comma-separated) or the lines of api_keys_file. An entry may carry per-key "
        "settings after the key: `name=.. rpm=.. tpm=.. priority=..` (kvserve/deployments/limits/)",
    )
    api_keys_file: Optional[str] = Field(
        None,
        description="a file with one API key per line, each optionally "
        "followed by name=/rpm=/tpm=/priority= (read where "
        "the app is built; a Kubernetes secret mounts as one)",
    )
    admin_api_keys: Optional[list[str]] = Field(
        None,
        description="keys of the admin endpoints (DELETE /v1/cache, POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter); default $KVSERVE_ADMIN_API_KEYS (comma-separated); none: "
        "those endpoints answer 403",
    )
    lora_allowed_roots: Optional[list[str]] = Field(
        None,
        description="folders (absolute paths) under which POST /v1/load_lora_adapter may read adapters, "
        "resolved with symlinks and '..' on the replica's node (--lora-allowed-root, "
        "repeatable); none: loading adapters at run time is off (vLLM: "
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )
    auth_failures_per_minute: int = Field(
        DEFAULT_AUTH_FAILURES_PER_MINUTE,
        ge=1,
        description="missing or wrong API keys one client may send per minute before its wrong keys get 429 "
        "(valid keys are checked first and never throttled; a valid key clears its client's count)",
    )
    forwarded_allow_ips: list[str] = Field(
        default_factory=list,
        description="addresses or CIDRs of the proxies in front of the gateway (load "
        "balancer, ingress) whose X-Forwarded-For names the client for the "
        "wrong-key throttle: the rightmost hop not in this list (uvicorn's "
        "--forwarded-allow-ips rule); empty: the connection's peer, the header "
        "ignored",
    )
    metrics_per_key: bool = Field(
        False,
        description="label kvserve:api_key_requests_total and kvserve:api_key_tokens_total with each API "
        "key's name (its name=, never the key); off: their api_key label is empty for every "
        "key (anonymous without keys), so the open /metrics names no tenant",
    )
    allowed_origins: Optional[list[str]] = Field(
        None,
        description="CORS: origins whose browser pages may call the API; default: * when API keys are set "
        "(a page still needs a key) and none without keys (no web page can read an open "
        "server); [] turns CORS off",
    )
    max_request_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="larger bodies get 413")
    max_file_bytes: int = Field(
        DEFAULT_MAX_FILE_BYTES,
        ge=1,
        description="largest upload to POST /v1/files (the Batch API's input files; larger "
        "get 413); each key's files together are bounded by its share of "
        "cache_max_bytes (cache_max_bytes divided among the API keys)",
    )
    batch_concurrency: int = Field(
        8,
        ge=1,
        description="requests of one batch job in flight at once (the Batch "
        "API; each at the lowest priority, within each replica's "
        "max_batch_requests)",
    )
    max_files_per_key: int = Field(
        1000,
        ge=1,
        description="files one API key may keep (uploads and batch outputs; more uploads get 400 quota_exceeded)",
    )
    max_active_batches_per_key: int = Field(
        4,
        ge=1,
        description="batches of one API key validating, running or "
        "finalizing at once (more get 429 "
        "too_many_active_batches)",
    )
    max_prompts_per_request: int = Field(
        DEFAULT_MAX_PROMPTS_PER_REQUEST, ge=1, description="most prompts in one /v1/completions request"
    )
    ingress_num_replicas: int = Field(1, ge=1)
    replica_channels: bool = Field(
        True,
        description="each gateway replica receives its requests' tokens from each model replica on one "
        "stream, one message per engine step (kvserve/deployments/replica/channels.py); off: one Serve "
        "message per chunk and request",
    )
    ingress_cpus: float = Field(1.0, ge=0, description="logical CPUs of each ingress replica")
    ingress_resources: Optional[dict[str, float]] = Field(
        None,
        description='custom Ray resources of each ingress replica, e.g. {"head": 0.01} with a head started '
        "with --resources '{\"head\": 1}' keeps the ingress on the head node",
    )
    ingress_max_ongoing_requests: int = Field(1024, ge=1)

    @field_validator("lora_allowed_roots")
    @classmethod
    def _absolute_roots(cls, v):
        if v and not all(r and os.path.isabs(r) for r in v):
            raise ValueError("lora_allowed_roots: each root must be an absolute path")
        return v

    @field_validator("api_keys", "admin_api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v):
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @model_validator(mode="after")
    def _keys_from_env_or_file(self):
        """Keys never need to be on a command line (visible in ``ps``): ``api_keys_file`` or
        ``$KVSERVE_API_KEYS`` fill ``api_keys`` when it is not given. (An entry's settings are
        read by ``kvserve.deployments.limits``: ``AppArgs`` and the gateway check them.)"""
        if self.api_keys is None and self.api_keys_file:
            try:
                with open(self.api_keys_file) as f:
                    keys = [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]
            except OSError as e:
                raise ValueError(f"api_keys_file: cannot read {self.api_keys_file!r}: {e.strerror}") from None
            if not keys:
                raise ValueError(f"api_keys_file {self.api_keys_file!r} holds no key")
            self.api_keys = keys
        elif self.api_keys is None and os.environ.get("KVSERVE_API_KEYS", "").strip():
            self.api_keys = self._split_keys(os.environ["KVSERVE_API_KEYS"])
        if self.admin_api_keys is None and os.environ.get("KVSERVE_ADMIN_API_KEYS", "").strip():
            self.admin_api_keys = self._split_keys(os.environ["KVSERVE_ADMIN_API_KEYS"])
        if self.admin_api_keys and any(len(k.split()) != 1 for k in self.admin_api_keys):
            raise ValueError("admin_api_keys: an admin key is one word (no spaces, no attributes)")
        return self


class LimitArgs(BaseModel):
    """The per-key limits' section of :class:`AppArgs`."""

    model_config = ConfigDict(extra="forbid")

    rate_limit_rpm: Optional[float] = Field(
        None, ge=0, description="default requests per minute of each API key (a key's rpm= overrides it)"
    )
    rate_limit_tpm: Optional[float] = Field(
        None,
        ge=0,
        description="default tokens per minute of each API key, prompt + max_tokens reserved, "
        "settled with the tokens used",
    )
    redis_url: Optional[str] = Field(
        None,
        description="Redis that all ingress replicas share their per-key limits through (default "
        "$KVSERVE_REDIS_URL; without it each ingress replica enforces limit / replicas)",
    )

    @model_validator(mode="after")
    def _redis_from_env(self):
        if self.redis_url is None and os.environ.get("KVSERVE_REDIS_URL", "").strip():
            self.redis_url = os.environ["KVSERVE_REDIS_URL"].strip()
        return self


class CacheArgs(BaseModel):
    """The response caches' section of :class:`AppArgs` (``kvserve/deployments/cache/``)."""

    model_config = ConfigDict(extra="forbid")

    response_cache: bool = Field(
        True,
        description="exact response cache in the ingress: deterministic requests (temperature 0 or a seed) "
        "answered again without a replica (kvserve/deployments/cache/)",
    )
    cache_backend: Literal["memory", "redis"] = Field(
        "memory", description="memory: per ingress replica; redis: shared by all ingress replicas (needs redis_url)"
    )
    cache_ttl_s: float = Field(3600.0, gt=0, description="seconds a cached answer lives")
    cache_max_entries: int = Field(10_000, ge=1, description="cached answers kept (least recently used go first)")
    cache_max_bytes: int = Field(256 << 20, ge=1, description="bytes of cached answers kept (default 256 MiB)")
    cache_shared_across_keys: bool = Field(
        False,
        description="let every API key hit the answers every other key cached (exact and semantic); default "
        "false: each key only its own (keys of different tenants never see each other's)",
    )
    semantic_cache: Literal["off", "opt-in", "on"] = Field(
        "off",
        description="semantic response cache (all-MiniLM-L6-v2 embeddings of the last user message): off, "
        'opt-in (requests send "cache": {"semantic": true}) or on (every cacheable request '
        "unless it declines); true/false mean on/off",
    )
    semantic_cache_threshold: float = Field(
        0.92, gt=0, le=1, description="cosine similarity a semantic hit needs (0.92: benchmarks/cache.py)"
    )
    semantic_cache_max_entries: int = Field(10_000, ge=1, description="semantic cache vectors per ingress replica")
    request_log_dir: Optional[str] = Field(
        None,
        description="opt-in request log that cache warming reads (kvserve warm): one JSONL file per ingress "
        "replica in this folder, rotated and bounded (kvserve/deployments/gateway/request_log.py); unset: "
        "no log",
    )
    request_log_prompts: Literal["hash", "store"] = Field(
        "hash",
        description="what the request log keeps of a request: hash (a fingerprint: which requests recur, "
        "not what they say; nothing to replay) or store (the request itself, which kvserve warm "
        "replays)",
    )
    request_log_max_bytes: int = Field(64 << 20, ge=1, description="bytes of a request log file before it rotates")
    request_log_backups: int = Field(4, ge=0, description="rotated request log files kept per ingress replica")

    @field_validator("semantic_cache", mode="before")
    @classmethod
    def _semantic_bool(cls, v):
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class TracingArgs(BaseModel):
    """OpenTelemetry traces (``kvserve/telemetry/tracing.py``): the gateway's and the replicas' spans of
    each request, exported over OTLP. Off unless an endpoint is given."""

    model_config = ConfigDict(extra="forbid")

    otlp_traces_endpoint: Optional[str] = Field(
        None,
        description="OTLP endpoint traces go to (vLLM's --otlp-traces-endpoint), e.g. http://collector:4317 "
        "(grpc) or http://collector:4318/v1/traces (http/protobuf); default "
        "$OTEL_EXPORTER_OTLP_TRACES_ENDPOINT; unset: no tracing, at no cost",
    )
    otlp_traces_protocol: Optional[Literal["grpc", "http/protobuf"]] = Field(
        None, description="OTLP protocol (default $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or grpc)"
    )
    otlp_traces_sample_ratio: Optional[float] = Field(
        None,
        ge=0,
        le=1,
        description="share of traces kept, parent-based (a client's sampled traceparent is "
        "followed); default: $OTEL_TRACES_SAMPLER / _ARG (the SDK's default: all)",
    )

    @model_validator(mode="after")
    def _endpoint_from_env(self):
        if self.otlp_traces_endpoint is None and os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
            self.otlp_traces_endpoint = os.environ["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip()
        return self


class EmbeddingArgs(BaseModel):
    """The embedding models' section of :class:`AppArgs`: sentence-embedding encoders served
    for ``/v1/embeddings`` only, each its own ``EmbeddingServer`` deployment
    (``kvserve/deployments/replica/embedding_server.py``)."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    embedding_model: Optional[str] = Field(
        None,
        description="a sentence-transformers model folder to serve for /v1/embeddings, or 'bundled' for "
        "all-MiniLM-L6-v2 (installed with kvserve); unset: no encoder (served generating models "
        "still answer /v1/embeddings with pooled hidden states)",
    )
    embedding_served_name: Optional[str] = Field(
        None,
        description="the encoder's name in requests (default: sentence-transformers/all-MiniLM-L6-v2 for the "
        "bundled one, else the folder's name)",
    )
    embedding_num_replicas: int = Field(1, ge=1)
    embedding_cpus: float = Field(0.25, ge=0, description="logical CPUs of each encoder replica")
    embedding_num_threads: int = Field(1, ge=1, description="torch threads of each encoder replica")

    def served_name(self) -> Optional[str]:
        """The encoder's served name (None without one)."""
        if self.embedding_model is None:
            return None
        return encoder_served_name(self.embedding_model, self.embedding_served_name)
