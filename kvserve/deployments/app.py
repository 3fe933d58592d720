"""The kvserve Serve application: ``OpenAIIngress`` in front of one ``LLMServer`` per model
(and an ``EmbeddingServer`` when an embedding model is configured).

``build_app`` is an application builder: ``serve run kvserve.deployments.app:build_app model=...``,
the ``import_path`` of ``kvserve/deployments/serve_config.yaml`` (``serve run`` / ``serve deploy``),
and what ``kvserve serve`` calls. Serve validates its ``args`` against :class:`AppArgs`.

Autoscaling: unless a model pins ``num_replicas``, its ``LLMServer`` deployment autoscales
with kvserve's queue + token-throughput policy (``kvserve/autoscaling/policy.py``, fed by
``LLMServer.record_autoscaling_stats``), between ``min_replicas`` (default 1, a warm pool) and
``max_replicas`` (default 8), with the knobs of the model's ``autoscaling`` section.
"""

# No ``from __future__ import annotations`` here: Serve reads the builder's parameter
# annotation at runtime to validate its arguments with AppArgs.
import logging
from typing import Any

from ray.serve import Application

from kvserve.autoscaling.policy import build_autoscaling_config
from kvserve.deployments.args import (
    APP_NAME,
    AppArgs,
    ModelArgs,
    app_args_from_config,
    fit_single_node,
    logical_cpus_needed,
)
from kvserve.deployments.contract.facts import ModelCard
from kvserve.deployments.gateway.deployment import OpenAIIngress
from kvserve.deployments.replica.embedding_server import EmbeddingServer
from kvserve.deployments.replica.llm_server import LLMServer
from kvserve.deployments.routing.prefix_router import router_config

logger = logging.getLogger("ray.serve")


def llm_deployment_options(m: ModelArgs, deployment_name: str, channels: int = 0) -> dict[str, Any]:
    """``LLMServer.options(...)`` for one model: replicas or autoscaling, resources, the
    placement group bundles of a tensor- or pipeline-parallel replica, and the prefix-aware request router
    (``kvserve/deployments/routing/prefix_router.py``) unless ``prefix_aware_routing`` is off. ``channels``:
    the gateway replicas that may each hold a channel to a replica (``kvserve/deployments/replica/channels.py``),
    on top of ``max_ongoing_requests`` (a channel is a Serve call that stays open)."""
    import os

    from kvserve.cluster.worker_group import tp_placement_group_bundles

    opts: dict[str, Any] = {
        "name": deployment_name,
        "max_ongoing_requests": m.ongoing_requests_bound() + channels,
        # Serve's own queue, in each caller's handle (requests waiting for the router to
        # pick a replica, or for one to start; not the replica's max_waiting_requests):
        # bounded at one replica's worth, so an overflow is a 429 at once, never an
        # unbounded wait
        "max_queued_requests": m.max_num_seqs + m.waiting_requests_bound(),
        "graceful_shutdown_timeout_s": m.graceful_shutdown_timeout_s,
    }
    if m.prefix_aware_routing and m.enable_prefix_caching:
        # a local model folder's tokenizer loads at once; else the one the replicas report
        local = os.path.abspath(m.model) if m.model and os.path.isdir(m.model) else None
        opts["request_router_config"] = router_config(
            m.block_size, m.prefix_routing_margin, local, kv_events=m.kv_aware_routing
        )
    knobs = m.autoscaling_knobs()
    if knobs is not None:
        opts["autoscaling_config"] = build_autoscaling_config(knobs, as_dict=True)
        opts["num_replicas"] = "auto"
    else:
        opts["num_replicas"] = m.num_replicas
    cuda = m.device == "cuda"
    if m.num_ranks > 1:
        opts["placement_group_bundles"] = tp_placement_group_bundles(
            m.num_ranks, "cuda" if cuda else "cpu", replica_cpus=m.replica_cpus, worker_cpus=m.worker_cpus
        )
        opts["placement_group_strategy"] = m.placement_group_strategy
        opts["ray_actor_options"] = {"num_cpus": m.replica_cpus, "num_gpus": 0}
        if m.replica_resources:
            opts["placement_group_bundles"][0].update(m.replica_resources)
    else:
        opts["ray_actor_options"] = {"num_cpus": m.replica_cpus, "num_gpus": 1 if cuda else 0}
    if m.replica_resources:
        opts["ray_actor_options"]["resources"] = dict(m.replica_resources)
    if m.max_replicas_per_node is not None:
        opts["max_replicas_per_node"] = m.max_replicas_per_node
    return opts


def _deployment_name(index: int, name: str) -> str:
    if index == 0:
        return "LLMServer"
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "-" for ch in name)
    return f"LLMServer-{safe}"


def build_app(args: AppArgs) -> Application:
    """Build the kvserve application (``serve run kvserve.deployments.app:build_app``).

    ``args`` may be an :class:`AppArgs` or a plain dict (validated here). The first model's
    deployment is named ``LLMServer`` (``serve.get_deployment_handle("LLMServer", "kvserve")``).
    Each deployment gets its configuration as objects (``LLMServer(model: ModelArgs)``; the
    gateway its sections and the models' cards, :func:`gateway_options`), as Ray Serve LLM's
    ``LLMServer(llm_config)``.
    """
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(dict(args or {}))
    handles, variants = {}, {}
    channels = args.gateway.ingress_num_replicas if args.gateway.replica_channels else 0
    deployments = args.deployments()  # one per model, or one per variant of a model in an A/B test
    for i, m in enumerate(args.model_list()):
        for d in (d for d in deployments if d.name == m.name):
            name = _deployment_name(i, m.name) + (f"-{d.variant}" if d.variant is not None else "")
            h = LLMServer.options(**llm_deployment_options(d, name, channels)).bind(d, args.tracing)
            handles.setdefault(m.name, h)  # a model in an A/B test: its first variant's (the control's)
            if d.variant is not None:
                variants.setdefault(m.name, {})[d.variant] = h
    # the ingress outlives its models' drain: a stream cut at their deadline still gets its error event
    drain_s = max(m.graceful_shutdown_timeout_s for m in deployments) + 10.0
    g, e = args.gateway, args.embeddings
    encoders = {}
    if e.embedding_model is not None:  # an encoder for /v1/embeddings (kvserve/deployments/replica/embedding_server.py)
        encoders[e.served_name()] = EmbeddingServer.options(
            num_replicas=e.embedding_num_replicas, ray_actor_options={"num_cpus": e.embedding_cpus}
        ).bind(e.embedding_model, e.served_name(), e.embedding_num_threads)
    return OpenAIIngress.options(
        num_replicas=g.ingress_num_replicas,
        max_ongoing_requests=g.ingress_max_ongoing_requests,
        graceful_shutdown_timeout_s=drain_s,
        ray_actor_options={
            "num_cpus": g.ingress_cpus,
            **({"resources": g.ingress_resources} if g.ingress_resources else {}),
        },
    ).bind(handles, encoders=encoders, variants=variants, **gateway_options(args))


def gateway_options(args: AppArgs) -> dict[str, Any]:
    """The gateway's constructor arguments besides the handles: the models' and the encoder's
    cards (the facts known at build time) and the configuration's sections, as objects."""
    first = {}  # a model in an A/B test: the card of its first variant (the control)
    for d in args.deployments():
        first.setdefault(d.name, d)
    cards = [ModelCard.of(first[m.name]) for m in args.model_list()]
    e = args.embeddings
    if e.embedding_model is not None:
        cards.append(ModelCard.of_encoder(e.embedding_model, e.served_name()))
    return {
        "cards": cards,
        "gateway": args.gateway,
        "limits": args.limits,
        "cache": args.cache,
        "routing": args.routing,
        "experiments": args.experiments,
        "tracing": args.tracing,
    }


__all__ = [
    "APP_NAME",
    "AppArgs",
    "ModelArgs",
    "build_app",
    "gateway_options",
    "llm_deployment_options",
    "fit_single_node",
    "app_args_from_config",
    "logical_cpus_needed",
]
