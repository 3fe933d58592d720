"""Calibration of the float8 KV cache (``kv_cache_dtype="fp8"``): one scale for K and one for V
per layer, measured once at load, after the weights, on a short fixed text."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from kvserve.engine.model_loader import load_tokenizer
from kvserve.kernels.torch_backend import FP8_MAX

#: Text whose keys and values set the float8 KV cache's per-layer scales
#: (:func:`calibrate_kv_scales`): prose, a conversation, code and numbers.
KV_CALIBRATION_TEXT = (
    "The history of science is the study of how people have come to understand the natural world, "
    "from the first astronomers who charted the stars to the physicists who split the atom. "
    "User: Can you explain how a hash table works?\nAssistant: A hash table stores key-value pairs. "
    "It computes an index from each key with a hash function and keeps the value in that slot.\n"
    "def fibonacci(n):\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n"
    "In 1969, 3 astronauts flew 384,400 km to the Moon; 12 people have walked on it since, "
    "and the last did so on 14 December 1972."
)


#: How far past the calibration text's largest |K| / |V| a layer's float8 scale reaches before
#: values clamp at +-448. Calibration sees the base model on one text; LoRA adapters (which can
#: move K and V far: a 2x margin clamped a rank-4 q/v adapter's values, which
#: ``tests/engine/test_kv_fp8.py`` catches by an adapter's embedding through a float8 cache) and
#: unusual prompts go past it. e4m3's relative step is 2^-3 over its whole normal range (2^-6 ..
#: 448, a range of 2^15), so headroom costs precision only to values below max/1800, whose
#: absolute error stays under 4e-5 of the max.
KV_SCALE_HEADROOM = 16.0


@torch.inference_mode()
def calibrate_kv_scales(
    model_path: str | Path,
    layers: nn.ModuleList,
    device: torch.device,
    prefill: Callable[[torch.Tensor], tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]],
) -> None:
    """Set ``k_scale`` and ``v_scale`` (floats) of each layer's ``self_attn``: the model runs
    :data:`KV_CALIBRATION_TEXT` (encoded by the tokenizer of ``model_path``), and each layer's
    scale is ``KV_SCALE_HEADROOM * max|x| / 448`` (see :data:`KV_SCALE_HEADROOM`).

    Args:
        model_path: the model folder.
        layers: the model's decoder layers.
        device: the model's device.
        prefill: runs one prompt, int64 token ids ``[n]``, through the model with temporary
            caches in the model dtype (``ModelRunner._prefill_alone``); returns the hidden
            states and per layer the ``(K, V)`` caches ``[blocks, block_size, kv_heads,
            head_dim]`` whose first ``n`` slots hold the prompt's.
    """
    ids = load_tokenizer(model_path).encode(KV_CALIBRATION_TEXT)
    _, caches = prefill(torch.tensor(ids, dtype=torch.long, device=device))
    for layer, (k, v) in zip(layers, caches):
        a = layer.self_attn
        k, v = (c.view(-1, a.num_kv_heads, a.head_dim)[: len(ids)] for c in (k, v))
        a.k_scale = max(KV_SCALE_HEADROOM * float(k.abs().max()) / FP8_MAX, 1e-8)
        a.v_scale = max(KV_SCALE_HEADROOM * float(v.abs().max()) / FP8_MAX, 1e-8)
