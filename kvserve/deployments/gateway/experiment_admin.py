"""The A/B tests' endpoints, all behind the admin key: ``GET /v1/experiments`` (each experiment's
configuration, live weights and the differences between its variants), ``GET
/v1/experiments/{name}`` (the same for one, with its variants' request samples, ``?since=`` Unix
seconds) and ``POST /v1/experiments/{name}/weights`` (new live weights, for every gateway
replica, without a restart). The assignment and the samples: :mod:`kvserve.deployments.gateway.experiments`."""

from __future__ import annotations

import logging

from fastapi import Request
from pydantic import BaseModel, ConfigDict

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.admin import admin_denied
from kvserve.deployments.gateway.errors import request_id_of

logger = logging.getLogger("ray.serve")


class SetWeightsRequest(BaseModel):
    """``POST /v1/experiments/{name}/weights``: ``{"weights": {"A": 90, "B": 10}}`` (relative
    weights; a variant not named gets 0)."""

    model_config = ConfigDict(extra="forbid")

    weights: dict[str, float]


def _not_found(gw, name: str) -> OpenAIError:
    known = ", ".join(sorted(gw.experiments.by_name)) or "none"
    return OpenAIError(
        f"no experiment named {name!r} (configured: {known})",
        404,
        "invalid_request_error",
        param="name",
        code="experiment_not_found",
    )


async def list_experiments(gw, request: Request):
    """Every experiment without its samples (admin key)."""
    denied = admin_denied(gw, request, "experiments")
    if denied is not None:
        return denied
    data = []
    for name in gw.experiments.by_name:
        d = gw.experiments.describe(name, since=float("inf"))
        d.pop("samples")
        data.append(d)
    return {"object": "list", "data": data}


async def get_experiment(gw, request: Request, name: str, since: float | None = None):
    """One experiment with its variants' samples since ``since`` (admin key)."""
    denied = admin_denied(gw, request, "experiments")
    if denied is not None:
        return denied
    if name not in gw.experiments.by_name:
        raise _not_found(gw, name)
    return gw.experiments.describe(name, since)


async def set_weights(gw, request: Request, name: str, body: SetWeightsRequest):
    """Set an experiment's live weights (admin key): ``{"object": "experiment.weights", "name",
    "weights"}`` as set."""
    denied = admin_denied(gw, request, "experiments")
    if denied is not None:
        return denied
    if name not in gw.experiments.by_name:
        raise _not_found(gw, name)
    try:
        weights = await gw.experiments.set_weights(name, body.weights)
    except ValueError as e:
        raise OpenAIError(str(e), 400, "invalid_request_error", param="weights", code="invalid_weights") from None
    except Exception as e:
        rid = request_id_of(request)
        logger.error("request %s: storing experiment %s's weights failed", rid, name, exc_info=e)
        raise OpenAIError(
            f"the weights could not be stored (request id {rid})", 503, "server_error", code="weights_unavailable"
        ) from None
    return {"object": "experiment.weights", "name": name, "weights": weights}
