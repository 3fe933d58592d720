"""Rotary position embedding (RoFormer, Su et al. 2021, sec. 3.4), Hugging Face "rotate half"
layout, with Llama 3 frequency scaling (``rope_scaling.rope_type == "llama3"``) and linear
position interpolation (``"linear"``: positions divided by ``factor``, Chen et al. 2023; Gemma 3's
global layers from 4B up)."""

from __future__ import annotations

import math

import torch
from torch import nn

from kvserve.kernels import cpu_backend, gpu_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * out / factor + smooth * out
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, out)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to ``q`` ``[n, heads, head_dim]`` and ``k`` ``[n, kv_heads, head_dim]``
    at integer ``positions`` ``[n]`` (cos/sin cached for ``max_position`` positions).

    Raises:
        ValueError: an unsupported ``rope_scaling`` type.
    """

    def __init__(self, head_dim: int, max_position: int, base: float, scaling: dict | None = None):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type not in ("default", None):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported (default, llama3, linear)")
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """Returns the rotated ``(q, k)``; on CPU they are rotated in place by one C++ pass
        (``kvserve.kernels.cpu_backend.rotary``), on CUDA by one Triton kernel (``kvserve.kernels.gpu_ops``)."""
        if (
            q.dim() == 3
            and cpu_backend.use_fused_ops(q)
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and q.stride(1) == q.shape[2]
            and k.stride(1) == k.shape[2]
        ):
            return cpu_backend.rotary(q, k, positions, self.cos, self.sin)
        if q.dim() == 3 and gpu_ops.use_fused_ops(q) and q.stride(-1) == 1 and k.stride(-1) == 1:
            return gpu_ops.ops().rotary(q, k, positions, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1).to(q.dtype)
        sin = self.sin[positions].unsqueeze(1).to(q.dtype)
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        return q, k
