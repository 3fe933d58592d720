"""LoRA adapters as the gateway and the replicas both know them: the ``--lora-modules`` flag
(vLLM's ``name=path`` form or its JSON form) and its check, and the registry of adapters loaded
at run time (:class:`AdapterRegistry`, vLLM's ``/v1/load_lora_adapter``) in Ray's GCS key-value
store."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass

logger = logging.getLogger("ray.serve")


def parse_lora_module(text: str) -> tuple[str, str]:
    """argparse type of one ``--lora-modules`` entry: ``name=path`` or
    ``{"name": ..., "path": ...}`` (vLLM's two forms). Returns ``(name, path)``.

    Raises:
        argparse.ArgumentTypeError: neither form, or an empty name or path.
    """
    if text.lstrip().startswith("{"):
        try:
            d = json.loads(text)
            name, path = d["name"], d["path"]
        except (ValueError, KeyError, TypeError):
            raise argparse.ArgumentTypeError(f'expected name=path or {{"name": ..., "path": ...}}, got {text!r}')
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f'expected name=path or {{"name": ..., "path": ...}}, got {text!r}')
    if not str(name).strip() or not str(path).strip():
        raise argparse.ArgumentTypeError(f"an adapter needs a name and a path, got {text!r}")
    return str(name).strip(), str(path).strip()


def check_lora_modules(modules: dict[str, str] | None, model_name: str, enable_lora: bool) -> None:
    """The Serve config's ``lora_modules`` of one model (``{name: PEFT folder}``).

    Raises:
        ValueError: adapters without ``enable_lora``, an empty name, or a name equal to the model's.
    """
    if not modules:
        return
    if not enable_lora:
        raise ValueError("lora_modules needs enable_lora: true (--enable-lora)")
    for name, path in modules.items():
        if not name or not path:
            raise ValueError(f"lora_modules: an adapter needs a name and a path, got {name!r}: {path!r}")
        if name == model_name:
            raise ValueError(f"lora_modules: adapter name {name!r} is the base model's served name")


#: Namespace of the adapter registry in Ray's GCS key-value store.
REGISTRY_NAMESPACE = "kvserve"


#: Seconds between a replica's re-reads of the registry (an unloaded adapter leaves its
#: replicas' memory within this time; the gateway's view of other gateways' loads, too).
REGISTRY_REFRESH_S = 1.0


@dataclass(frozen=True)
class AdapterEntry:
    """An adapter loaded at run time: its name (what clients send as ``model``), its base
    model's served name, its PEFT folder (readable on every node that runs a replica of the
    base) and a ``version`` that changes on every load, so a name loaded again after an unload
    never reuses the old weights or cached answers."""

    name: str
    base: str
    path: str
    version: str

    @property
    def multiplexed_id(self) -> str:
        """The Serve multiplexed model id of this load (``name@version``): replicas report the
        ids they hold and routers prefer those replicas."""
        return f"{self.name}@{self.version}"


class AdapterRegistry:
    """The adapters of one Serve application loaded with ``POST /v1/load_lora_adapter``,
    kept in Ray's GCS key-value store (where Serve keeps its own state), so every gateway
    replica and every model replica sees one registry; it lives as long as the Ray cluster.
    Calls block on the GCS (about a millisecond): call them from a thread in async code.

    Raises:
        RuntimeError: (constructor) not in a process connected to Ray.
    """

    def __init__(self, app_name: str):
        from ray.experimental import internal_kv

        if not internal_kv._internal_kv_initialized():
            raise RuntimeError("the adapter registry needs a process connected to a Ray cluster")
        self._kv = internal_kv
        self.prefix = f"lora/{app_name}/"

    def put(self, entry: AdapterEntry, replace: bool = False) -> bool:
        """Register ``entry``; False when its name is taken and ``replace`` is False."""
        value = json.dumps(dataclasses.asdict(entry))
        existed = self._kv._internal_kv_put(
            self.prefix + entry.name, value, overwrite=replace, namespace=REGISTRY_NAMESPACE
        )
        return replace or not existed

    def get(self, name: str) -> AdapterEntry | None:
        """The entry of adapter ``name``, None when none is registered."""
        raw = self._kv._internal_kv_get(self.prefix + name, namespace=REGISTRY_NAMESPACE)
        return None if raw is None else AdapterEntry(**json.loads(raw))

    def delete(self, name: str) -> bool:
        """Unregister adapter ``name``; False when it was not registered."""
        return bool(self._kv._internal_kv_del(self.prefix + name, namespace=REGISTRY_NAMESPACE))

    def entries(self) -> dict[str, AdapterEntry]:
        """Every registered adapter, by name."""
        out = {}
        for key in self._kv._internal_kv_list(self.prefix, namespace=REGISTRY_NAMESPACE):
            e = self.get(key.decode()[len(self.prefix) :])
            if e is not None:
                out[e.name] = e
        return out


def serve_app_name() -> str | None:
    """The Serve application this process serves (None outside a Serve replica)."""
    try:
        from ray import serve

        return serve.get_replica_context().app_name
    except Exception:
        return None
