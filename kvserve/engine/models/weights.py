"""Loading Hugging Face checkpoints into kvserve's decoder models (shared by every architecture).

A model's modules that own weights have ``load(param_name, full_tensor, part)`` and cut the full
tensor to this tensor-parallel rank's shard themselves (``kvserve/engine/layers``). Hugging Face names map
onto the module tree after dropping the ``model.`` prefix; q/k/v and gate/up projections are fused
into ``qkv_proj`` and ``gate_up_proj`` (``part`` says which slice).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from kvserve.engine.layers.w4a16 import W4_TENSORS

#: Hugging Face projection name -> (fused module name, part index).
FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def load_hf_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], tied: bool) -> None:
    """Load ``(name, tensor)`` pairs in Hugging Face naming into ``model``.

    Args:
        model: a decoder whose weight-owning modules have ``load`` (see module docstring).
        weights: e.g. ``kvserve.engine.model_loader.iter_safetensors(path)``.
        tied: the LM head shares the embedding (``tie_word_embeddings``): a stored
            ``lm_head.weight`` is skipped and not expected.

    Raises:
        ValueError: a tensor name the model does not know, weights left unloaded, or 4-bit
            tensors that do not fit their layer (``kvserve.engine.layers.w4a16``).
    """
    modules = dict(model.named_modules())
    loaded = set()
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        if tied and name == "lm_head.weight":
            continue
        name = name.removeprefix("model.")
        mod_name, _, param = name.rpartition(".")
        part = 0
        for src, (dst, idx) in FUSED.items():
            if mod_name.endswith(src):
                mod_name, part = mod_name[: -len(src)] + dst, idx
                break
        mod = modules.get(mod_name)
        if mod is None or not hasattr(mod, "load"):
            raise ValueError(f"unexpected weight {name!r} in checkpoint")
        mod.load(param, tensor, part)
        loaded.add((mod_name, "weight" if param in W4_TENSORS else param, part))  # a 4-bit weight's tensors
    expected = sum(
        (3 if n.endswith("qkv_proj") else 2 if n.endswith("gate_up_proj") else 1)
        * (2 if getattr(m, "bias", None) is not None else 1)
        for n, m in modules.items()
        if hasattr(m, "load")
    )
    if tied:
        expected -= 1
    if len(loaded) != expected:
        raise ValueError(f"checkpoint loaded {len(loaded)} of {expected} weight tensors")
    for m in modules.values():
        if hasattr(m, "finish_load"):
            m.finish_load()  # 4-bit layers build their weight from the tensors they kept


def stage_weights(
    weights: Iterable[tuple[str, torch.Tensor]], start: int, end: int, first: bool, last: bool, tied: bool
) -> Iterator[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs a pipeline stage holding layers ``[start, end)`` loads, its
    layers renumbered from 0: the embedding on the first stage, the final norm and LM head on the
    last (a tied LM head on a last stage that is not the first loads the embedding's tensor)."""
    for name, tensor in weights:
        short = name.removeprefix("model.")
        if short.startswith("layers."):
            index, _, rest = short[len("layers.") :].partition(".")
            if start <= int(index) < end:
                yield f"layers.{int(index) - start}.{rest}", tensor
        elif short.startswith("embed_tokens."):
            if first:
                yield name, tensor
            if tied and last and not first:
                yield "lm_head.weight", tensor
        elif short.startswith("norm.") or name.startswith("lm_head."):
            if last:
                yield name, tensor
        else:
            yield name, tensor
