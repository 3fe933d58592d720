"""LoRA adapters as the gateway sees them: those of the Serve config (``lora_modules``) and
those loaded at run time with vLLM's ``POST /v1/load_lora_adapter`` /
``POST /v1/unload_lora_adapter`` (admin key), kept in the application's
:class:`~kvserve.deployments.contract.adapters.AdapterRegistry` so every gateway and model replica shares them.

Loading at run time is off unless the server names at least one allowed root
(``--lora-allowed-root``, ``lora_allowed_roots``; vLLM gates it behind
``VLLM_ALLOW_RUNTIME_LORA_UPDATING``): then a load asks one replica of the base model to
resolve the path (symlinks, ``..``) under those roots and to read and check the adapter
(``LLMServer.check_lora_adapter``: rank, target modules, shapes, files; a bad adapter is a 400
with the reason and nothing is registered; a path that is missing, outside the roots or
unreadable gets one and the same 400, so a load cannot probe the server's files), then
registers its resolved path. Replicas load it on their first
request for it (Serve's model multiplexing: requests go to a replica that holds it when one can
take them) and free it within :data:`~kvserve.deployments.contract.adapters.REGISTRY_REFRESH_S` of an unload. The
gateway that served the load or unload sees it at once, other gateway replicas within the same
time.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

from fastapi import Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, Field

from kvserve.deployments.contract.adapters import REGISTRY_REFRESH_S, AdapterEntry, AdapterRegistry, serve_app_name
from kvserve.deployments.contract.routing_config import AUTO_MODEL
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.admin import admin_denied
from kvserve.deployments.gateway.errors import as_client_error, request_id_of

logger = logging.getLogger("ray.serve")


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's ``/v1/load_lora_adapter`` body, plus ``model``: the base model's served name
    (needed only when the gateway serves several models)."""

    lora_name: str = Field(min_length=1, max_length=256, pattern=r"^\S+$")
    lora_path: str = Field(min_length=1, max_length=4096)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name instead of refusing
    model: str | None = None


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's ``/v1/unload_lora_adapter`` body (``lora_int_id`` is accepted and not used: ids
    are each replica's own)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None


class AdapterDirectory:
    """The adapters loaded at run time, as this gateway sees the registry: read through a cache
    of at most :data:`~kvserve.deployments.contract.adapters.REGISTRY_REFRESH_S` seconds (misses too: a mistyped name
    costs one registry read per that time). The configured ones are the catalog's
    (:attr:`~kvserve.deployments.gateway.catalog.ModelCatalog.adapters`)."""

    def __init__(self):
        app = serve_app_name()
        self.registry = AdapterRegistry(app) if app is not None else None
        self._seen: dict[str, tuple[float, AdapterEntry | None]] = {}  # name -> (monotonic read time, entry)
        self._all: tuple[float, dict[str, AdapterEntry]] = (-1e9, {})

    async def lookup(self, name: str) -> AdapterEntry | None:
        """The run-time adapter ``name``, None when there is none."""
        if self.registry is None:
            return None
        now = time.monotonic()
        t, entry = self._seen.get(name, (-1e9, None))
        if now - t > REGISTRY_REFRESH_S:
            entry = await asyncio.to_thread(self.registry.get, name)
            self._seen[name] = (now, entry)
            if len(self._seen) > 4096:  # names clients sent: bounded
                self._seen.pop(next(iter(self._seen)))
        return entry

    async def dynamic(self) -> dict[str, AdapterEntry]:
        """Every run-time adapter, by name."""
        if self.registry is None:
            return {}
        t, entries = self._all
        if time.monotonic() - t > REGISTRY_REFRESH_S:
            entries = await asyncio.to_thread(self.registry.entries)
            self._all = (time.monotonic(), entries)
        return entries

    def note(self, name: str, entry: AdapterEntry | None) -> None:
        """This gateway loaded (``entry``) or unloaded (None) adapter ``name``: seen at once."""
        self._seen[name] = (time.monotonic(), entry)
        self._all = (-1e9, {})


def _bad(message: str, param: str | None = None, status: int = 400, code: str | None = None) -> OpenAIError:
    return OpenAIError(message, status, "invalid_request_error", param=param, code=code)


async def load_adapter(gw, body: LoadLoRAAdapterRequest, request: Request):
    """``POST /v1/load_lora_adapter``: check the adapter on a replica of its base model, then
    register it for every replica (see the module docstring). 200 with vLLM's text.

    Raises:
        OpenAIError: 403 ``runtime_lora_disabled`` (no allowed root configured), 400 (a name in
            use, a base model not served or not given, a path missing, outside the roots or
            unreadable (one message for the three), an adapter that does not fit or load: the
            replica's reason), 404 (no such base model), 503 (no replica answered, or the
            registry is unavailable outside Ray Serve).
    """
    denied = admin_denied(gw, request, "LoRA adapters")
    if denied is not None:
        return denied
    roots = list(gw.args.lora_allowed_roots or [])
    if not roots:
        raise OpenAIError(
            "loading LoRA adapters at run time is disabled on this server: start it with "
            "--lora-allowed-root DIR (lora_allowed_roots) to allow adapters under DIR",
            403,
            "permission_error",
            code="runtime_lora_disabled",
        )
    lora = gw.lora
    if lora.registry is None:
        raise _bad(
            "adapters can be loaded at run time only in a Ray Serve application", status=503, code="lora_unavailable"
        )
    name = body.lora_name
    if name in gw.models or name in gw.catalog.adapters or name == AUTO_MODEL:
        raise _bad(f"'{name}' is the name of a served model or configured adapter", "lora_name")
    if body.model is None and len(gw.models) > 1:
        raise _bad(
            f"this server serves several models: name the adapter's base with 'model' ({', '.join(gw.models)})", "model"
        )
    base, _ = gw.model_handle(body.model)
    old = await lora.lookup(name)
    if old is not None and not body.load_inplace:
        raise _bad(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    try:
        path, reason = await gw.models[base].check_lora_adapter.remote(name, body.lora_path, roots)
    except Exception as e:
        err = as_client_error(e)
        if err is None:
            logger.error("request %s: checking adapter %s failed", request_id_of(request), name, exc_info=e)
            err = OpenAIError(
                f"no replica of '{base}' could check the adapter (request id {request_id_of(request)})",
                503,
                "server_error",
                code="model_unavailable",
            )
        raise err from None
    if reason is not None:
        raise _bad(f"adapter '{name}' cannot be loaded: {reason}", "lora_path", code="invalid_adapter")
    entry = AdapterEntry(name, base, path, os.urandom(6).hex())  # the path as the replica resolved it
    if not await asyncio.to_thread(lora.registry.put, entry, body.load_inplace):
        raise _bad(f"The lora adapter '{name}' has already been loaded.", "lora_name")
    lora.note(name, entry)
    logger.info("adapter %s of %s loaded from %s", name, base, entry.path)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(gw, body: UnloadLoRAAdapterRequest, request: Request):
    """``POST /v1/unload_lora_adapter``: unregister a run-time adapter; new requests for it get
    404 at once (other gateway replicas: within a second), replicas free it within
    :data:`~kvserve.deployments.contract.adapters.REGISTRY_REFRESH_S`, requests already running finish.

    Raises:
        OpenAIError: 404 for a name that is not loaded, 400 for a configured adapter (remove it
            from the config instead).
    """
    denied = admin_denied(gw, request, "LoRA adapters")
    if denied is not None:
        return denied
    name = body.lora_name
    if name in gw.catalog.adapters:
        raise _bad(f"adapter '{name}' is configured (lora_modules): remove it from the config", "lora_name")
    registry = gw.lora.registry
    if registry is None or not await asyncio.to_thread(registry.delete, name):
        raise _bad(f"The lora adapter '{name}' cannot be found.", "lora_name", 404, "model_not_found")
    gw.lora.note(name, None)
    logger.info("adapter %s unloaded", name)
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")
