"""The kvserve Serve application: ``OpenAIIngress`` in front of one ``LLMServer`` per model.

``build_app`` is an application builder: ``serve run deployments.app:build_app model=...``,
the ``import_path`` of ``deployments/serve_config.yaml`` (``serve run`` / ``serve deploy``),
and what ``kvserve serve`` calls. Serve validates its ``args`` against :class:`AppArgs`.

Autoscaling: unless a model pins ``num_replicas``, its ``LLMServer`` deployment autoscales
with kvserve's queue + token-throughput policy (``autoscaling/policy.py``, fed by
``LLMServer.record_autoscaling_stats``), between ``min_replicas`` (default 1, a warm pool) and
``max_replicas`` (default 8), with the knobs of the model's ``autoscaling`` section.
"""
# No ``from __future__ import annotations`` here: Serve reads the builder's parameter
# annotation at runtime to validate its arguments with AppArgs.
import logging
import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from ray.serve import Application

from autoscaling.policy import build_autoscaling_config
from deployments.gate import DEFAULT_MAX_BODY_BYTES
from deployments.ingress import DEFAULT_MAX_PROMPTS_PER_REQUEST, OpenAIIngress
from deployments.llm_server import LLMServer

logger = logging.getLogger("ray.serve")

#: Serve application name ``kvserve serve`` deploys (``serve.get_app_handle(APP_NAME)``).
APP_NAME = "kvserve"

#: Fields of ModelArgs that go to ``engine.EngineConfig``.
ENGINE_FIELDS = ("model", "tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len",
                 "kv_cache_memory_bytes", "num_kv_blocks", "block_size", "dtype", "device",
                 "enable_prefix_caching", "seed", "scheduling_policy", "attention_backend", "enforce_eager",
                 "gpu_memory_utilization", "mixed_step_prefill_tokens", "mixed_step_slowdown")


class ModelArgs(BaseModel):
    """One model = one ``LLMServer`` deployment."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: Optional[str] = Field(None, description="local HF folder, hub id, or None for SmolLM2-135M-Instruct")
    served_model_name: Optional[str] = Field(None, description="name clients send as `model`")
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    max_model_len: Optional[int] = Field(None, ge=2)
    kv_cache_memory_bytes: Optional[int] = Field(None, ge=1)
    num_kv_blocks: Optional[int] = Field(None, ge=1)
    block_size: int = Field(16, ge=1)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'cuda' gives each replica (or each tensor-parallel rank) one GPU")
    enable_prefix_caching: bool = True
    seed: int = 0
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    attention_backend: Optional[str] = None
    enforce_eager: bool = False
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    mixed_step_prefill_tokens: Optional[int] = Field(
        None, ge=0, description="prefill tokens in a step that carries decodes (None: auto, 0: no cap)")
    mixed_step_slowdown: float = Field(2.5, gt=1, description="auto cap: a mixed step ~ this x a decode step")

    num_replicas: Optional[int] = Field(
        None, ge=0, description="fixed replica count; unset: autoscale with kvserve's policy")
    min_replicas: Optional[int] = Field(None, ge=0, description="autoscaling lower bound (policy default 1)")
    max_replicas: Optional[int] = Field(None, ge=1, description="autoscaling upper bound (policy default 8)")
    autoscaling: Optional[dict[str, Any]] = Field(
        None, description="autoscaling knobs (see autoscaling/policy.py KVServeAutoscalingConfig)")
    max_ongoing_requests: int = Field(256, ge=1, description="requests one replica takes at once (>= max_num_seqs)")
    max_queued_requests: int = Field(-1, description="handle queue bound before 429s (-1: unbounded)")
    torch_num_threads: Optional[int] = Field(None, ge=1)
    replica_cpus: float = Field(1.0, ge=0)
    worker_cpus: float = Field(1.0, ge=0, description="CPUs per tensor-parallel worker actor")

    @model_validator(mode="after")
    def _check(self):
        if self.num_replicas is not None and (
                self.autoscaling is not None or self.min_replicas is not None or self.max_replicas is not None):
            raise ValueError("give either num_replicas or autoscaling bounds (min/max_replicas, autoscaling)")
        if self.min_replicas is not None and self.max_replicas is not None and self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must be <= max_replicas")
        return self

    @property
    def name(self) -> str:
        from engine.model_loader import DEFAULT_MODEL

        return self.served_model_name or self.model or DEFAULT_MODEL

    def engine_args(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ENGINE_FIELDS}

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


class AppArgs(ModelArgs):
    """Arguments of :func:`build_app` (``args`` of the Serve config, flags of ``kvserve serve``).

    The top-level model fields describe the served model; ``models`` serves several (each
    entry a :class:`ModelArgs`, the first one being the default for requests without a
    ``model``), in which case the top-level model fields are ignored.
    """

    models: list[ModelArgs] = Field(default_factory=list)
    api_keys: Optional[list[str]] = Field(
        None, description="if set, require `Authorization: Bearer <key>`; default: $KVSERVE_API_KEYS "
                          "(comma-separated) or the lines of api_keys_file")
    api_keys_file: Optional[str] = Field(None, description="a file with one API key per line (read where the "
                                                           "app is built)")
    max_request_body_bytes: int = Field(DEFAULT_MAX_BODY_BYTES, ge=1, description="larger bodies get 413")
    max_prompts_per_request: int = Field(DEFAULT_MAX_PROMPTS_PER_REQUEST, ge=1,
                                         description="most prompts in one /v1/completions request")
    ingress_num_replicas: int = Field(1, ge=1)
    ingress_cpus: float = Field(1.0, ge=0, description="logical CPUs of each ingress replica")
    ingress_max_ongoing_requests: int = Field(1024, ge=1)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _split_keys(cls, v):
        if isinstance(v, str):
            return [k.strip() for k in v.split(",") if k.strip()]
        return v

    @model_validator(mode="after")
    def _keys_from_env_or_file(self):
        """Keys never need to be on a command line (visible in ``ps``): ``api_keys_file`` or
        ``$KVSERVE_API_KEYS`` fill ``api_keys`` when it is not given."""
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
        return self

    @model_validator(mode="after")
    def _unique_names(self):
        names = [m.name for m in self.model_list()]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique, got {names}")
        return self

    def model_list(self) -> list[ModelArgs]:
        if self.models:
            return list(self.models)
        own = {k: getattr(self, k) for k in ModelArgs.model_fields}
        return [ModelArgs(**own)]


def logical_cpus_needed(args: AppArgs) -> float:
    """Logical CPUs the application reserves at its initial / fixed size (ingress, replicas,
    tensor-parallel workers); ``kvserve serve`` starts a local Ray with at least this many."""
    total = args.ingress_cpus * args.ingress_num_replicas
    for m in args.model_list():
        knobs = m.autoscaling_knobs()
        n = m.num_replicas if m.num_replicas is not None else 1
        if knobs is not None:
            n = max(1, knobs.get("initial_replicas") or knobs.get("min_replicas") or 1)
        per = m.replica_cpus + (m.tensor_parallel_size * m.worker_cpus if m.tensor_parallel_size > 1 else 0.0)
        total += n * per
    return total


def fit_single_node(args: AppArgs, num_gpus: int) -> AppArgs:
    """Cap the default autoscaling bound of each model at what one node holds, for a Ray
    instance that ``kvserve serve`` starts on this machine alone (no cluster autoscaler
    could ever place more): GPU replicas at ``num_gpus // tensor_parallel_size``, CPU
    replicas at 1 (one CPU engine already runs a torch thread per core). Models with an
    explicit ``max_replicas`` or ``num_replicas`` are left as given, and the cap is never
    below ``min_replicas``.
    """
    models = []
    for m in args.model_list():
        knobs = m.autoscaling_knobs()
        if knobs is None or "max_replicas" in knobs:
            models.append(m)
            continue
        gpu = m.device == "cuda" or (m.device == "auto" and num_gpus > 0)
        fit = max(1, num_gpus // m.tensor_parallel_size) if gpu else 1
        models.append(m.model_copy(update={"max_replicas": max(fit, knobs.get("min_replicas", 1))}))
    top = {k: getattr(args, k) for k in AppArgs.model_fields if k != "models"}
    return AppArgs.model_validate({**top, "models": [m.model_dump() for m in models]})


def llm_deployment_options(m: ModelArgs, deployment_name: str) -> dict[str, Any]:
    """``LLMServer.options(...)`` for one model: replicas or autoscaling, resources, and the
    placement group bundles of a tensor-parallel replica."""
    from cluster.worker_group import tp_placement_group_bundles

    opts: dict[str, Any] = {"name": deployment_name,
                            "max_ongoing_requests": max(m.max_ongoing_requests, m.max_num_seqs),
                            "max_queued_requests": m.max_queued_requests}
    knobs = m.autoscaling_knobs()
    if knobs is not None:
        opts["autoscaling_config"] = build_autoscaling_config(knobs, as_dict=True)
        opts["num_replicas"] = "auto"
    else:
        opts["num_replicas"] = m.num_replicas
    cuda = m.device == "cuda"
    if m.tensor_parallel_size > 1:
        opts["placement_group_bundles"] = tp_placement_group_bundles(
            m.tensor_parallel_size, "cuda" if cuda else "cpu", replica_cpus=m.replica_cpus,
            worker_cpus=m.worker_cpus)
        opts["placement_group_strategy"] = "STRICT_PACK"
        opts["ray_actor_options"] = {"num_cpus": m.replica_cpus, "num_gpus": 0}
    else:
        opts["ray_actor_options"] = {"num_cpus": m.replica_cpus, "num_gpus": 1 if cuda else 0}
    return opts


def _deployment_name(index: int, name: str) -> str:
    if index == 0:
        return "LLMServer"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)
    return f"LLMServer-{safe}"


def build_app(args: AppArgs) -> Application:
    """Build the kvserve application (``serve run deployments.app:build_app``).

    ``args`` may be an :class:`AppArgs` or a plain dict (validated here). The first model's
    deployment is named ``LLMServer`` (``serve.get_deployment_handle("LLMServer", "kvserve")``).
    """
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(dict(args or {}))
    handles = {}
    for i, m in enumerate(args.model_list()):
        opts = llm_deployment_options(m, _deployment_name(i, m.name))
        worker_options = {"num_cpus": m.worker_cpus}
        handles[m.name] = LLMServer.options(**opts).bind(
            m.engine_args(), m.name, m.torch_num_threads, worker_options)
    return OpenAIIngress.options(num_replicas=args.ingress_num_replicas,
                                 max_ongoing_requests=args.ingress_max_ongoing_requests,
                                 ray_actor_options={"num_cpus": args.ingress_cpus}).bind(
        handles, args.api_keys, max_request_body_bytes=args.max_request_body_bytes,
        max_prompts_per_request=args.max_prompts_per_request)


def app_args_from_config(path: str, app_name: str = APP_NAME) -> dict[str, Any]:
    """The ``args`` of an application in a Serve config file (or a plain YAML dict of args)."""
    import yaml

    with open(path) as f:
        data = yaml.safe_load(f) or {}
    if "applications" in data:
        apps = data["applications"]
        for a in apps:
            if a.get("name") == app_name:
                return dict(a.get("args") or {})
        if len(apps) == 1:
            return dict(apps[0].get("args") or {})
        raise ValueError(f"no application named {app_name!r} in {path}")
    return dict(data)


__all__ = ["APP_NAME", "AppArgs", "ModelArgs", "build_app", "llm_deployment_options", "fit_single_node",
           "app_args_from_config", "logical_cpus_needed"]
