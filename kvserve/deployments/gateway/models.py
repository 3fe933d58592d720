"""``GET /v1/models`` and ``GET /v1/models/{model}``: the cards of the gateway's
:class:`~kvserve.deployments.gateway.catalog.ModelCatalog` (given at build time, completed by what
replicas publish when they load; no replica is called), with the replicas' placement for an
admin key."""

from __future__ import annotations

import asyncio
import logging
import time

from kvserve.deployments.contract.routing_config import AUTO_MODEL
from kvserve.deployments.gateway.catalog import ModelCatalog

logger = logging.getLogger("ray.serve")


#: Seconds a read of the replicas' placement (Serve's controller) is reused by ``/v1/models``.
PLACEMENT_TTL_S = 2.0
_placement: tuple[float, dict] = (0.0, {})


async def replica_placement() -> dict[tuple[str, str], list[dict]]:
    """``{(app, deployment): [{"replica_id", "node_id", "node_ip", "state"}, ...]}`` from Serve's
    controller (read at most every :data:`PLACEMENT_TTL_S` seconds); ``{}`` when it cannot be
    read (the cards then leave ``replicas`` out)."""
    global _placement
    if time.monotonic() - _placement[0] < PLACEMENT_TTL_S:
        return _placement[1]
    try:
        import ray
        from ray.serve.context import _get_global_client

        if not ray.is_initialized():  # a gateway outside Ray (tests): asking would start a Ray instance
            raise RuntimeError("Ray is not running here")
        details = await asyncio.to_thread(lambda: _get_global_client().get_serve_details())
        out = {
            (app, dep): [
                {k: r.get(k) for k in ("replica_id", "node_id", "node_ip", "state")} for r in d.get("replicas", [])
            ]
            for app, a in details.get("applications", {}).items()
            for dep, d in a.get("deployments", {}).items()
        }
    except Exception as e:  # the cards go without placement
        logger.info("reading the replicas' placement failed (%s)", type(e).__name__)
        out = {}
    _placement = (time.monotonic(), out)
    return out


async def list_models(gw, placement: bool = False) -> dict:
    """``GET /v1/models``: every served model's card, each embedding model's, each LoRA
    adapter's (configured or loaded at run time); with routing rules, also ``auto``
    (with as long a context as the smallest model it may pick). With ``placement`` (the
    caller holds an admin key: internal topology is the operators'), a served model's and an
    encoder's card also name their ``replicas``: each one's id, state, and node (id and IP),
    as Serve's controller has them; without it, vLLM's plain cards."""
    catalog: ModelCatalog = gw.catalog
    where_is = await replica_placement() if placement else {}

    async def card(name: str, handle) -> dict:
        d = await catalog.card(name)
        where = where_is.get((getattr(handle, "app_name", None), getattr(handle, "deployment_name", None)))
        if where is not None:
            d["replicas"] = where
        return d

    data = [await card(n, h) for n, h in gw.models.items()]
    cards = {d["id"]: d for d in data}
    data += [await card(n, h) for n, h in gw.encoders.items()]
    data += [adapter_card(cards[base], a) for a, base in catalog.adapters.items()]
    data += [adapter_card(cards[e.base], a) for a, e in (await catalog.lora.dynamic()).items() if e.base in cards]
    if gw.routing is not None:
        auto = {k: v for k, v in data[0].items() if k != "replicas"}  # a rule's choice, no replicas of its own
        known = [d["max_model_len"] for d in data if d["max_model_len"] is not None]
        data.append({**auto, "id": AUTO_MODEL, "root": AUTO_MODEL, "max_model_len": min(known, default=None)})
    return {"object": "list", "data": data}


async def retrieve_model(gw, model_id: str) -> dict:
    """``GET /v1/models/{model}``: one card (vLLM's, without placement); 404 for a name that
    is not served."""
    catalog: ModelCatalog = gw.catalog
    if model_id == AUTO_MODEL and gw.routing is not None:
        return next(m for m in (await list_models(gw))["data"] if m["id"] == AUTO_MODEL)
    base, _ = await catalog.adapter_base(model_id)
    if base is not None:
        return adapter_card(await catalog.card(base), model_id)
    if model_id not in gw.encoders:
        gw.model_handle(model_id)  # 404 for a name that is not served
    return await catalog.card(model_id)


def adapter_card(base: dict, adapter: str) -> dict:
    """A LoRA adapter's card: its base model's, with the adapter's ``id`` and ``root`` and the
    base as ``parent`` (vLLM's card for an adapter; the adapter's path stays private)."""
    return {**base, "id": adapter, "root": adapter, "parent": base["id"]}
