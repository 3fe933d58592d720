"""The models a gateway serves: each model's :class:`~deployments.contract.types.ServerInfo`
(read once from its replicas; the weights revision re-read in the background) and the
``GET /v1/models`` cards."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import time

from openai.types import Model
from ray.serve.handle import DeploymentHandle

from deployments.contract.openai_errors import OpenAIError
from deployments.contract.types import ServerInfo
from deployments.gateway.errors import as_client_error
from deployments.gateway.streams import background
from deployments.routing.model_routing import AUTO_MODEL

logger = logging.getLogger("ray.serve")

#: Seconds between re-reads of a model's weights revision (the response cache's key): a
#: replica restarted on new weights stops old cached answers within this time.
REVISION_REFRESH_S = 10.0


class ModelDirectory:
    """Each served model's :class:`ServerInfo`, asked of its replicas once (the facts are set
    when a replica loads: the context length depends on the KV pool it measured).

    The call goes through the model's bounded handle queue like any request, so under a burst
    it can be refused (``BackPressureError``): one fetch runs at a time and is retried for up
    to 30 s while generation requests drain.
    """

    def __init__(self, models: dict[str, DeploymentHandle]):
        self.models = models
        self._info: dict[str, ServerInfo] = {}
        self._lock = asyncio.Lock()
        self._revision_checked: dict[str, float] = {}
        self.created = int(time.time())

    async def info(self, name: str) -> ServerInfo:
        """The model's facts.

        Raises:
            OpenAIError: 429 ``queue_full`` if the queue stayed full, 503 if no replica is up.
        """
        from ray.serve.exceptions import BackPressureError

        if name in self._info:
            return self._info[name]
        async with self._lock:
            deadline = time.monotonic() + 30.0
            while name not in self._info:
                try:
                    self._info[name] = await self.models[name].server_info.remote()
                except BackPressureError as e:
                    if time.monotonic() > deadline:
                        raise as_client_error(e) from None
                    await asyncio.sleep(0.2)
                except (OpenAIError, asyncio.CancelledError):
                    raise
                except Exception as e:
                    err = as_client_error(e)
                    if err is None:
                        raise
                    raise err from None
        return self._info[name]

    async def revision(self, name: str) -> str:
        """The weights revision of the model, re-read in the background every
        :data:`REVISION_REFRESH_S` seconds."""
        info = await self.info(name)
        now = time.monotonic()
        if now - self._revision_checked.setdefault(name, now) > REVISION_REFRESH_S:
            self._revision_checked[name] = now
            # in a context of its own: a handle call made in this request's context shares the
            # request's Serve id with its generate call, and Serve's router matches replicas to
            # requests by that id (a concurrent call left the generate call pending forever)
            background(self._refresh(name), context=contextvars.Context())
        return info.revision

    async def _refresh(self, name: str) -> None:
        try:
            info = await self.models[name].server_info.remote()
        except Exception as e:  # the old info stays; the next request tries again later
            logger.info("model %s: re-reading server_info failed (%s)", name, type(e).__name__)
            return
        if info.revision != self._info[name].revision:
            logger.info("model %s: weights revision is now %s (older cached answers are not served)", name,
                        info.revision)
        self._info[name] = info

    async def card(self, name: str) -> Model:
        """OpenAI's ``Model`` for a served name, plus vLLM's ``max_model_len`` and ``root``
        (the served name: paths of the server stay private), the KV cache's dtype
        (``kv_cache_dtype``: ``auto`` or ``fp8``), the weights' ``quantization`` (None,
        ``int8`` or ``fp8``) and ``speculative_config`` (None, or its ``method`` and
        ``num_speculative_tokens``), ``tensor_parallel_size`` and ``pipeline_parallel_size``."""
        info = await self.info(name)
        return Model(id=name, object="model", created=self.created, owned_by="kvserve", root=name,
                     max_model_len=info.max_model_len, kv_cache_dtype=info.kv_cache_dtype,
                     quantization=info.quantization, speculative_config=info.speculative_config,
                     tensor_parallel_size=info.tensor_parallel_size,
                     pipeline_parallel_size=info.pipeline_parallel_size)


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
        out = {(app, dep): [{k: r.get(k) for k in ("replica_id", "node_id", "node_ip", "state")}
                            for r in d.get("replicas", [])]
               for app, a in details.get("applications", {}).items() for dep, d in a.get("deployments", {}).items()}
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
    where_is = await replica_placement() if placement else {}

    async def card(name: str, handle) -> dict:
        d = (await gw.directory.card(name)).model_dump()
        where = where_is.get((getattr(handle, "app_name", None), getattr(handle, "deployment_name", None)))
        if where is not None:
            d["replicas"] = where
        return d

    data = [await card(n, h) for n, h in gw.models.items()]
    cards = {d["id"]: d for d in data}
    data += [await card(n, h) for n, h in gw.encoders.items()]
    data += [adapter_card(cards[base], a) for a, base in gw.adapters.items()]
    data += [adapter_card(cards[e.base], a) for a, e in (await gw.lora.dynamic()).items() if e.base in cards]
    if gw.routing is not None:
        auto = {k: v for k, v in data[0].items() if k != "replicas"}  # a rule's choice, no replicas of its own
        data.append({**auto, "id": AUTO_MODEL, "root": AUTO_MODEL,
                     "max_model_len": min(d["max_model_len"] for d in data)})
    return {"object": "list", "data": data}


async def retrieve_model(gw, model_id: str) -> dict:
    """``GET /v1/models/{model}``: one card (vLLM's, without placement); 404 for a name that
    is not served."""
    if model_id == AUTO_MODEL and gw.routing is not None:
        return next(m for m in (await list_models(gw))["data"] if m["id"] == AUTO_MODEL)
    base, _ = await gw.adapter_base(model_id)
    if base is not None:
        return adapter_card((await gw.directory.card(base)).model_dump(), model_id)
    if model_id not in gw.encoders:
        gw.model_handle(model_id)  # 404 for a name that is not served
    return (await gw.directory.card(model_id)).model_dump()


def adapter_card(base: dict, adapter: str) -> dict:
    """A LoRA adapter's card: its base model's, with the adapter's ``id`` and ``root`` and the
    base as ``parent`` (vLLM's card for an adapter; the adapter's path stays private)."""
    return {**base, "id": adapter, "root": adapter, "parent": base["id"]}
