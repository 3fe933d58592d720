"""``OpenAIIngress``: the gateway as a Ray Serve deployment. Each replica builds its
:class:`~kvserve.deployments.gateway.core.Gateway` from what ``build_app`` bound (the models' handles,
their cards, the configuration's sections), then its HTTP app (:func:`~kvserve.deployments.gateway.api.build_api`, through Serve's late-bound
``__serve_build_asgi_app__``); the Python-handle methods (``generate``, ``drain``,
``cache_stats``) sit next to it."""

from __future__ import annotations

import asyncio

from ray import serve
from ray.serve.handle import DeploymentHandle

from kvserve.deployments.contract.config import CacheArgs, GatewayArgs, LimitArgs, TracingArgs
from kvserve.deployments.contract.experiments import ExperimentArgs
from kvserve.deployments.contract.routing_config import RoutingArgs
from kvserve.deployments.contract.facts import ModelCard
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.core import Gateway


@serve.deployment(name="OpenAIIngress", max_ongoing_requests=1024, graceful_shutdown_timeout_s=5)
@serve.ingress()
class OpenAIIngress:
    """Routes OpenAI requests to the ``LLMServer`` deployment of the requested model (as Ray
    Serve LLM's ingress, it is given the models' cards when the application is built).

    Args:
        models: served model name -> ``LLMServer`` handle; the first is the default for
            requests without ``model``.
        cards: the models' and encoders' :class:`~kvserve.deployments.contract.facts.ModelCard`.
        gateway, limits, cache, routing: the configuration's sections (None: defaults).
        encoders: embedding model name -> ``EmbeddingServer`` handle (``/v1/embeddings`` only).
        variants, experiments: the A/B tests' variant handles and configurations
            (:class:`~kvserve.deployments.gateway.core.Gateway`); ``tracing`` the OpenTelemetry section.

    Raises:
        ValueError: no model or a bad setting.
    """

    def __init__(
        self,
        models: dict[str, DeploymentHandle],
        cards: list[ModelCard] | None = None,
        *,
        gateway: GatewayArgs | None = None,
        limits: LimitArgs | None = None,
        cache: CacheArgs | None = None,
        routing: RoutingArgs | None = None,
        encoders: dict[str, DeploymentHandle] | None = None,
        variants: dict[str, dict[str, DeploymentHandle]] | None = None,
        experiments: list[ExperimentArgs] | None = None,
        tracing: TracingArgs | None = None,
    ):
        from kvserve.cluster import reset_niceness

        reset_niceness()  # Ray starts workers at niceness 15: latency-critical here
        self.gateway = Gateway(
            models,
            cards,
            gateway=gateway,
            limits=limits,
            cache=cache,
            routing=routing,
            encoders=encoders,
            variants=variants,
            experiments=experiments,
            tracing=tracing,
        )

    def __serve_build_asgi_app__(self):
        return build_api(self.gateway, app_status=self._app_status)

    async def _app_status(self):
        """This application's status from Serve's controller: ``DELETING`` while it drains,
        and its deployments' replica states."""
        app = serve.get_replica_context().app_name
        st = await asyncio.to_thread(serve.status)
        return st.applications.get(app)

    # ---- Python API (``serve.get_app_handle("kvserve")``) ---------------------------------
    async def drain(self) -> str:
        """Mark this gateway replica as draining (``/ready`` answers 503 ``draining`` so load
        balancers stop sending; requests are still served until Serve stops the replica).
        Returns the replica's id (``kvserve serve`` calls it until every replica has answered)."""
        self.gateway.draining = True
        return serve.get_replica_context().replica_id.unique_id

    async def generate(
        self,
        prompt: str | list[int] | None = None,
        sampling_params: dict | None = None,
        *,
        model: str | None = None,
        messages: list[dict] | None = None,
        tools: list[dict] | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ):
        """Stream ``LLMServer.generate`` items of ``model`` (default: the first model); for
        ``serve.get_app_handle(...).options(stream=True).generate.remote(...)``
        (``sampling_params`` may hold ``n``, ``structured_outputs``, ``logit_bias``, ...).

        Raises:
            ValueError: an unknown model, or what ``LLMServer.generate`` raises.
        """
        try:
            _, handle = self.gateway.model_handle(model)
        except OpenAIError as e:
            raise ValueError(e.message) from None
        gen = handle.generate.remote(
            prompt, sampling_params, messages=messages, tools=tools, request_id=request_id, priority=priority
        )
        try:
            async for item in gen:
                yield item
        finally:
            gen.cancel()

    async def cache_stats(self) -> dict:
        """This gateway replica's response cache counters and sizes (``{}`` when it is off)."""
        gw = self.gateway
        return await gw.cache.stats() if gw.cache is not None else {}


__all__ = ["OpenAIIngress"]
