"""``GET /health``, ``GET /ready`` and ``GET /metrics`` (open without an API key)."""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import Response

from kvserve.deployments.gateway.errors import error_response
from kvserve.telemetry.metrics import cached_render

logger = logging.getLogger("ray.serve")


def _engine_dead(exc: BaseException) -> bool:
    return type(getattr(exc, "cause", exc)).__name__ == "EngineDeadError"


def _timed_out(exc: BaseException) -> bool:
    """The replica's own probe timed out (its engine is busy, not dead: ``LLMServer.health``)."""
    return isinstance(getattr(exc, "cause", exc), TimeoutError)


async def health(gw) -> dict | Response:
    """200 when every model's server (embedding models' too) answers its health probe now (no caching: a dead
    engine, a dead tensor-parallel worker or a replica still loading is a 503 at once). A probe
    the replica does not answer in time is a 503 ``not responding`` for that probe alone: it
    never marks the engine dead nor touches a request (``LLMServer.health``)."""

    async def probe(name: str) -> str | None:
        try:
            await asyncio.wait_for(gw.handles.all()[name].health.remote(), gw.probe_timeout_s)
            return None
        except asyncio.TimeoutError:
            return "not responding"
        except Exception as e:  # the details (Ray's actor ids, addresses) go to the log only
            logger.warning("health probe of model %s failed", name, exc_info=e)
            return (
                "engine stopped, being replaced"
                if _engine_dead(e)
                else "not responding"
                if _timed_out(e)
                else "not available"
            )

    problems = dict(zip(gw.handles.all(), await asyncio.gather(*(probe(n) for n in gw.handles.all()))))
    bad = {n: p for n, p in problems.items() if p is not None}
    if bad:
        msg = "; ".join(f"{n}: {p}" for n, p in bad.items())
        return error_response(503, f"not ready: {msg}", "server_error", code="unhealthy")
    return {"status": "ok", "models": list(gw.handles.all())}


class Readiness:
    """``GET /ready`` (for load balancers, Kubernetes' readinessProbe): 200 when every model
    has a replica that stepped recently or answers a 1-token probe; 503 with the reason
    (``loading``, ``draining``, ``not responding``) otherwise. A full queue is ready."""

    def __init__(self, gw, app_status):
        """``app_status``: an async callable giving Serve's status of this application (its
        deployments' replica states), or None where there is no Serve."""
        self.gw, self.app_status = gw, app_status

    async def __call__(self) -> dict | Response:
        gw = self.gw
        if gw.draining:
            return error_response(
                503,
                "not ready: draining (the server is shutting down)",
                "server_error",
                code="draining",
                headers={"Retry-After": "5"},
            )

        async def probe(name: str) -> str | None:
            try:
                await asyncio.wait_for(gw.handles.all()[name].ready.remote(), gw.probe_timeout_s)
                return None
            except asyncio.TimeoutError:
                reason = "not responding"
            except Exception as e:  # one line, no traceback: a failing probe is expected while replicas restart
                reason = "engine stopped, being replaced" if _engine_dead(e) else "not available"
                logger.warning("readiness probe of model %s failed: %s", name, type(getattr(e, "cause", e)).__name__)
            try:  # the status as of now, not as of before the probe waited
                status = await self.app_status() if self.app_status is not None else None
            except Exception:
                status = None
            handle = gw.handles.all()[name]
            deployment = getattr(handle, "deployment_name", None) or getattr(handle.deployment_id, "name", "")
            dep = status.deployments.get(deployment) if status is not None else None
            states = {str(getattr(k, "value", k)): v for k, v in (dep.replica_states or {}).items()} if dep else {}
            if states.get("STARTING", 0) + states.get("RECOVERING", 0):
                return "loading (a replica is starting)"
            return reason

        problems = dict(zip(gw.handles.all(), await asyncio.gather(*(probe(n) for n in gw.handles.all()))))
        bad = {n: p for n, p in problems.items() if p is not None}
        if bad:
            msg = "; ".join(f"{n}: {p}" for n, p in bad.items())
            return error_response(
                503, f"not ready: {msg}", "server_error", code="not_ready", headers={"Retry-After": "5"}
            )
        return {"status": "ready", "models": list(gw.handles.all())}


async def metrics() -> Response:
    """Prometheus exposition of every kvserve process on this node (the engines' vLLM-named
    metrics, the gateway's, the autoscaler's); see :mod:`kvserve.telemetry.metrics`. Calls at once
    share renders (:class:`kvserve.telemetry.registry.CoalescedRender`): one read of the files at a time."""
    body, ctype = await asyncio.to_thread(cached_render)
    return Response(body, media_type=ctype)
