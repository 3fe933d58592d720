"""A LoRA adapter on the host: the request that names it and its weights read from a PEFT folder.

:class:`LoRARequest` is vLLM's shape (``lora_name``, ``lora_int_id``, ``lora_path``), the path a
Hugging Face PEFT folder (``adapter_config.json`` + ``adapter_model.safetensors``).
:meth:`LoRAWeights.load` reads one and checks it against the base model (rank, target modules,
shapes) before any device memory is touched, folding ``scaling = lora_alpha / r`` (``lora_alpha /
sqrt(r)`` with rsLoRA) into ``B``. Placing adapters on the device is :mod:`kvserve.engine.lora_slots`.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import torch

#: PEFT's module names -> (the fused layer of :mod:`kvserve.engine.models.llama`, the part in it).
TARGETS: dict[str, tuple[str, int]] = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}


@dataclass(frozen=True)
class LoRARequest:
    """A request's adapter (vLLM's ``LoRARequest``).

    Attributes:
        lora_name: the adapter's name (what clients send as ``model``).
        lora_int_id: a positive integer id, unique per adapter in the engine.
        lora_path: a PEFT folder: ``adapter_config.json`` and ``adapter_model.safetensors``.
        lora_version: which load of ``lora_name`` this is (a digest of its files, or the
            registry's version of a run-time load): part of the root of its prompts' KV block
            hashes, so a name loaded again with other weights never reuses the old KV.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    lora_version: str = ""

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")


@dataclass
class LoRAWeights:
    """One adapter on the host: ``weights[(layer, module)] = (A [r, in], B [out, r] * scaling)``,
    float32, unsharded, for the PEFT module names of :data:`TARGETS`."""

    name: str
    lora_id: int
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @classmethod
    def load(cls, request: LoRARequest, cfg, max_rank: int) -> "LoRAWeights":
        """Read and check ``request.lora_path`` against the base model's Hugging Face ``cfg``.

        Raises:
            ValueError: the folder is not a PEFT LoRA adapter, its rank exceeds ``max_rank``,
                it adapts a module kvserve does not (embeddings, LM head, ``modules_to_save``),
                has biases or DoRA, or a tensor does not fit the base model's shapes (another
                base model); the message names the file and field.
        """
        path = request.lora_path
        cfg_path = os.path.join(path, "adapter_config.json")
        try:
            with open(cfg_path) as f:
                ac = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"LoRA adapter '{request.lora_name}': cannot read {cfg_path}: {e}") from None
        where = f"LoRA adapter '{request.lora_name}'"
        if str(ac.get("peft_type", "LORA")).upper() != "LORA":
            raise ValueError(f"{where}: peft_type {ac.get('peft_type')!r} is not LORA")
        rank, alpha = int(ac.get("r", 0)), float(ac.get("lora_alpha", ac.get("r", 0)))
        if rank < 1:
            raise ValueError(f"{where}: rank r={rank} must be positive")
        if rank > max_rank:
            raise ValueError(f"{where}: rank {rank} exceeds max_lora_rank {max_rank}")
        for key, bad in (
            ("bias", lambda v: v not in (None, "none")),
            ("use_dora", bool),
            ("modules_to_save", bool),
            ("fan_in_fan_out", bool),
            ("rank_pattern", bool),
            ("alpha_pattern", bool),
            ("layers_to_transform", bool),
        ):
            if bad(ac.get(key)):
                raise ValueError(f"{where}: {key}={ac.get(key)!r} is not supported")
        scaling = alpha / math.sqrt(rank) if ac.get("use_rslora") else alpha / rank
        tensors = _read_tensors(path, where)
        hidden, inter = cfg.hidden_size, cfg.intermediate_size
        head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        shapes = {
            "q_proj": (hidden, q),
            "k_proj": (hidden, kv),
            "v_proj": (hidden, kv),
            "o_proj": (q, hidden),
            "gate_proj": (hidden, inter),
            "up_proj": (hidden, inter),
            "down_proj": (inter, hidden),
        }
        pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for name, t in tensors.items():
            layer, module, which = _parse_key(name, where)
            if module not in TARGETS:
                raise ValueError(
                    f"{where}: module {module!r} ({name}) is not supported; kvserve adapts {', '.join(TARGETS)}"
                )
            if not 0 <= layer < cfg.num_hidden_layers:
                raise ValueError(f"{where}: {name} names layer {layer}; the base model has {cfg.num_hidden_layers}")
            pairs.setdefault((layer, module), {})[which] = t
        out = cls(request.lora_name, request.lora_int_id, rank)
        for (layer, module), ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{where}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
            a, b = ab["A"].float(), ab["B"].float()
            n_in, n_out = shapes[module]
            if tuple(a.shape) != (rank, n_in) or tuple(b.shape) != (n_out, rank):
                raise ValueError(
                    f"{where}: layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B "
                    f"{tuple(b.shape)} do not fit the base model ([{rank}, {n_in}] / "
                    f"[{n_out}, {rank}]): an adapter of another base model?"
                )
            out.weights[(layer, module)] = (a.contiguous(), (b * scaling).contiguous())
        if not out.weights:
            raise ValueError(f"{where}: no LoRA weights in {path}")
        return out


def _read_tensors(path: str, where: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    st = os.path.join(path, "adapter_model.safetensors")
    if os.path.exists(st):
        try:
            return load_file(st)
        except Exception as e:  # a corrupt file fails this load alone
            raise ValueError(f"{where}: cannot read {st}: {str(e).splitlines()[0][:200]}") from None
    raise ValueError(f"{where}: {st} not found (only safetensors adapters are read)")


def _parse_key(name: str, where: str) -> tuple[int, str, str]:
    """``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`` -> ``(3, "q_proj", "A")``."""
    parts = name.split(".")
    try:
        i = parts.index("layers")
        which = next(p for p in parts if p in ("lora_A", "lora_B"))
        module = parts[parts.index(which) - 1]
        return int(parts[i + 1]), module, which[-1]
    except (ValueError, StopIteration, IndexError):
        raise ValueError(f"{where}: unexpected tensor {name!r} (not a per-layer lora_A / lora_B weight)") from None
