"""LoRA adapters on the serving side: the ``--lora-modules`` flag (vLLM's ``name=path`` form or
its JSON form), its check in the Serve config, and each replica's table of the adapters it
serves (loaded at start). The adapters' ``/v1/models`` cards are
:func:`deployments.gateway.models.adapter_card`; the engine side (batched multi-adapter layers,
slots) is :mod:`engine.lora`."""
from __future__ import annotations

import argparse
import json
import os


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
            raise argparse.ArgumentTypeError(f"expected name=path or {{\"name\": ..., \"path\": ...}}, got {text!r}")
    else:
        name, sep, path = text.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected name=path or {{\"name\": ..., \"path\": ...}}, got {text!r}")
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


def adapter_table(modules: dict[str, str] | None) -> dict:
    """``{name: engine.lora.LoRARequest}`` of a replica's adapters (ids 1, 2, ... in the
    given order; ids are the engine's own, never seen by clients); paths made absolute."""
    from engine.lora import LoRARequest

    return {name: LoRARequest(name, i + 1, os.path.abspath(os.path.expanduser(path)))
            for i, (name, path) in enumerate((modules or {}).items())}


class UnknownAdapterError(ValueError):
    """A request names an adapter this replica does not serve (code ``model_not_found``, 404)."""


def load_adapters(llm_engine, modules: dict[str, str] | None) -> dict:
    """Load a replica's adapters into its engine (``engine.LLMEngine``) at start-up, so a bad
    one fails the replica's start with the reason. Returns :func:`adapter_table`.

    Raises:
        ValueError: an adapter does not load or fit the model (see ``engine.lora.LoRAWeights.load``).
    """
    table = adapter_table(modules)
    for r in table.values():
        llm_engine.add_lora(r)
    return table


def resolve_adapter(table: dict, name: str | None):
    """The ``LoRARequest`` of adapter ``name`` (None: the base model).

    Raises:
        UnknownAdapterError: the replica serves no adapter of that name.
    """
    if name is None:
        return None
    if name not in table:
        raise UnknownAdapterError(f"the model '{name}' does not exist on this server")
    return table[name]
