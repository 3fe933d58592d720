"""What the kvserve application takes: :class:`AppArgs` (the Serve config's ``args``,
``kvserve serve``'s flags), assembled from the sections of :mod:`kvserve.deployments.contract.config`
(:class:`ModelArgs` per served model, :class:`GatewayArgs`, :class:`LimitArgs`,
:class:`CacheArgs`, :class:`RoutingArgs`, :class:`EmbeddingArgs`), which ``build_app`` passes
to the deployments as they are.

Here: the flat form (a section's field given at the top level), the checks that need more than
one section or another room (unique names, routing rules naming served models, tool-call
parsers, API key entries), and reading a Serve config file. This module imports neither Ray
nor torch: ``kvserve serve`` builds its flags from it before Ray's environment (auth,
loopback) is set.
"""

import dataclasses
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.deployments.cache import CacheSettings
from kvserve.deployments.contract.config import (
    ENGINE_FIELDS,
    RENAMED_MODEL_KEYS,
    SERVING_ENGINE_DEFAULTS,
    CacheArgs,
    EmbeddingArgs,
    EngineArgs,
    GatewayArgs,
    LimitArgs,
    ModelArgs,
    TracingArgs,
    renamed_model_keys,
)
from kvserve.deployments.contract.experiments import ExperimentArgs
from kvserve.deployments.contract.routing_config import RoutingArgs
from kvserve.deployments.gateway.tool_parsers import get_tool_parser
from kvserve.deployments.limits import TrustedProxies, policies_from_keys

__all__ = [
    "APP_NAME",
    "ENGINE_FIELDS",
    "SECTIONS",
    "SERVING_ENGINE_DEFAULTS",
    "AppArgs",
    "CacheArgs",
    "EmbeddingArgs",
    "EngineArgs",
    "GatewayArgs",
    "LimitArgs",
    "ModelArgs",
    "RoutingArgs",
    "TracingArgs",
    "app_args_from_config",
    "fit_single_node",
    "logical_cpus_needed",
]

#: Serve application name ``kvserve serve`` deploys (``serve.get_app_handle(APP_NAME)``).
APP_NAME = "kvserve"

#: The sections of :class:`AppArgs` besides ``models``, by name.
SECTIONS: dict[str, type[BaseModel]] = {
    "gateway": GatewayArgs,
    "limits": LimitArgs,
    "cache": CacheArgs,
    "routing": RoutingArgs,
    "embeddings": EmbeddingArgs,
    "tracing": TracingArgs,
}


class AppArgs(BaseModel):
    """Arguments of :func:`build_app` (``args`` of the Serve config, flags of ``kvserve serve``),
    in sections: ``models`` (each a :class:`ModelArgs`, the first being the default for
    requests without a ``model``), ``gateway``, ``limits``, ``cache``, ``routing``, ``embeddings``,
    ``tracing``, and ``experiments`` (A/B tests, :mod:`kvserve.deployments.contract.experiments`).

    The flat form that configs and flags use is accepted too: a section's field given at the
    top level (``api_keys: [...]``, ``cache_ttl_s: 60``) goes to its section, and model fields
    at the top level describe the one served model when ``models`` is not given (they are
    ignored when it is). :meth:`flat_fields` lists every flat name.
    """

    model_config = ConfigDict(extra="forbid")

    models: list[ModelArgs] = Field(default_factory=list)
    gateway: GatewayArgs = Field(default_factory=GatewayArgs)
    limits: LimitArgs = Field(default_factory=LimitArgs)
    cache: CacheArgs = Field(default_factory=CacheArgs)
    routing: RoutingArgs = Field(default_factory=RoutingArgs)
    embeddings: EmbeddingArgs = Field(default_factory=EmbeddingArgs)
    tracing: TracingArgs = Field(default_factory=TracingArgs)
    experiments: list[ExperimentArgs] = Field(
        default_factory=list,
        description="A/B tests of configurations: each splits one served model's requests "
        "between variants, each its own LLMServer deployment "
        "(kvserve/deployments/contract/experiments.py)",
    )

    @classmethod
    def flat_fields(cls) -> dict[str, Any]:
        """Every name the flat form takes (model fields and every section's), with its field."""
        out = dict(ModelArgs.model_fields)
        for section in SECTIONS.values():
            out.update(section.model_fields)
        return out

    def flat_value(self, name: str) -> Any:
        """The value of a flat name (a section's field, or the default model's; a renamed model
        setting by its old name too).

        Raises:
            KeyError: not a flat name.
        """
        name = RENAMED_MODEL_KEYS.get(name, name)
        for section in SECTIONS:
            part = getattr(self, section)
            if name in type(part).model_fields:
                return getattr(part, name)
        if name in ModelArgs.model_fields:
            return getattr(self.models[0], name)
        raise KeyError(name)

    @model_validator(mode="before")
    @classmethod
    def _from_flat(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        out: dict[str, Any] = {
            "models": data.pop("models", None) or [],
            "experiments": data.pop("experiments", None) or [],
        }
        for name, section in SECTIONS.items():
            given = data.pop(name, None)
            part = dict(given) if isinstance(given, dict) else {} if given is None else given
            if isinstance(part, dict):
                for key in list(data):
                    if key in section.model_fields:
                        part[key] = data.pop(key)
            out[name] = part
        own = renamed_model_keys(
            {k: data.pop(k) for k in list(data) if k in ModelArgs.model_fields or k in RENAMED_MODEL_KEYS}
        )
        if data:  # unknown keys: let the model name them
            out.update(data)
        if not out["models"]:
            out["models"] = [own]
        return out

    @model_validator(mode="after")
    def _check(self):
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"served model names must be unique, got {names}")
        for m in self.models:
            if m.tool_call_parser != "auto":
                get_tool_parser(m.tool_call_parser)  # an unknown name fails here
        if self.gateway.api_keys:
            policies_from_keys(self.gateway.api_keys)  # a bad entry fails here, naming its position, never the key
        TrustedProxies(self.gateway.forwarded_allow_ips)  # an entry that is no address or CIDR fails here
        if self.routing.model_routing is not None:
            self.routing.model_routing.check(names)
        encoder = self.embeddings.served_name()
        if encoder is not None and encoder in names:
            raise ValueError(f"the embedding model's name {encoder!r} is also a generating model's")
        if self.cache.response_cache and self.cache.cache_backend == "redis" and not self.limits.redis_url:
            raise ValueError("cache_backend redis needs redis_url (or $KVSERVE_REDIS_URL)")
        self.deployments()  # every variant's settings valid for its model
        return self

    def experiment_of(self, model: str) -> ExperimentArgs | None:
        """The experiment that splits served model ``model``'s requests, if any."""
        return next((e for e in self.experiments if e.model == model), None)

    def deployments(self) -> list[ModelArgs]:
        """One ``ModelArgs`` per ``LLMServer`` deployment: each model as configured, or, for a
        model in an experiment, one per variant (the model's settings with the variant's, and
        ``variant`` set), in the order of ``models`` and then of the variants.

        Raises:
            ValueError: an experiment of a model not served, two experiments of one model, two
                experiments with one name, a variant's settings the model does not take.
        """
        names = {m.name for m in self.models}
        seen_names, seen_models = set(), set()
        for e in self.experiments:
            if e.model not in names:
                raise ValueError(f"experiment {e.name!r}: model {e.model!r} is not served (served: {sorted(names)})")
            if e.model in seen_models:
                raise ValueError(f"model {e.model!r} is in two experiments: one experiment per model")
            if e.name in seen_names:
                raise ValueError(f"two experiments are named {e.name!r}")
            seen_names.add(e.name)
            seen_models.add(e.model)
        out = []
        for m in self.models:
            e = self.experiment_of(m.name)
            if e is None:
                out.append(m)
                continue
            base = m.model_dump(exclude_unset=True)
            for v in e.variants:
                try:
                    out.append(
                        ModelArgs.model_validate(
                            {**base, **v.model_settings(), "served_model_name": m.name, "variant": v.name}
                        )
                    )
                except ValueError as err:
                    raise ValueError(f"experiment {e.name!r}, variant {v.name!r}: {err}") from None
        return out

    def model_list(self) -> list[ModelArgs]:
        """The served models, the default first."""
        return list(self.models)

    def cache_settings(self) -> dict[str, Any]:
        """The gateway's ``kvserve.deployments.cache.CacheSettings`` (as a dict).

        Raises:
            ValueError: as :class:`~kvserve.deployments.cache.CacheSettings`.
        """
        return dataclasses.asdict(CacheSettings.of(self.cache, self.limits.redis_url))


def logical_cpus_needed(args: AppArgs) -> float:
    """Logical CPUs the application reserves at its initial / fixed size (ingress, replicas,
    tensor-parallel workers); ``kvserve serve`` starts a local Ray with at least this many."""
    total = args.gateway.ingress_cpus * args.gateway.ingress_num_replicas
    if args.embeddings.embedding_model is not None:
        total += args.embeddings.embedding_cpus * args.embeddings.embedding_num_replicas
    for m in args.deployments():
        knobs = m.autoscaling_knobs()
        n = m.num_replicas if m.num_replicas is not None else 1
        if knobs is not None:
            n = max(1, knobs.get("initial_replicas") or knobs.get("min_replicas") or 1)
        per = m.replica_cpus + (m.num_ranks * m.worker_cpus if m.num_ranks > 1 else 0.0)
        total += n * per
    return total


def fit_single_node(args: AppArgs, num_gpus: int) -> AppArgs:
    """Cap the default autoscaling bound of each model at what one node holds, for a Ray
    instance that ``kvserve serve`` starts on this machine alone (no cluster autoscaler
    could ever place more): GPU replicas at ``num_gpus // num_ranks``, CPU
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
        fit = max(1, num_gpus // m.num_ranks) if gpu else 1
        models.append(m.model_copy(update={"max_replicas": max(fit, knobs.get("min_replicas", 1))}))
    return args.model_copy(update={"models": models})


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
