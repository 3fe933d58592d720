"""Tensor-parallel linear layers (Megatron-LM column/row parallelism).

Weights follow ``torch.nn.Linear``: ``[out_features, in_features]``. Each layer keeps only
its rank's shard and knows how to cut a full Hugging Face tensor into it (``load``).

Every matmul of the model goes through :func:`linear`: on CPU in float32 that is oneDNN's
linear (``torch.ops.mkldnn._linear_pointwise``) rather than ATen's ``F.linear``, which calls
MKL's sgemm. On this project's AMD box MKL takes an AVX2 path (so does HF transformers there)
while oneDNN uses AVX-512: a 64-request decode step's matmuls (17.3 GFLOP) take 53 instead of
119 ms (``benchmarks/results/step_times.json``). Both are IEEE float32 (results differ only in
summation order). ``KVSERVE_CPU_LINEAR=aten`` turns it off.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import all_reduce

#: ``"onednn"`` (default where torch has oneDNN) or ``"aten"``: how CPU float32 matmuls run.
CPU_LINEAR = os.environ.get("KVSERVE_CPU_LINEAR") or ("onednn" if torch.backends.mkldnn.is_available() else "aten")
if CPU_LINEAR not in ("onednn", "aten"):
    raise ValueError(f"KVSERVE_CPU_LINEAR must be 'onednn' or 'aten', got {CPU_LINEAR!r}")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``: ``x`` ``[..., in]``, ``weight`` ``[out, in]``, ``bias`` ``[out]``
    -> ``[..., out]`` in ``x.dtype``. CPU float32 runs oneDNN (see the module docstring),
    everything else ``F.linear``."""
    if (CPU_LINEAR == "onednn" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and not torch.is_grad_enabled()):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with the output features split across ranks.

    Args:
        in_features: input size.
        out_ranges: the global ``[start, end)`` output rows this rank holds, one range per
            fused sub-matrix (e.g. q, k, v or gate, up), concatenated in that order.
        bias: whether the (sharded) bias exists.
    """

    def __init__(self, in_features: int, out_ranges: list[tuple[int, int]], bias: bool = False):
        super().__init__()
        self.out_ranges = out_ranges
        self.sizes = [e - s for s, e in out_ranges]
        out = sum(self.sizes)
        self.weight = nn.Parameter(torch.empty(out, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out), requires_grad=False) if bias else None
        self.register_buffer("qweight", None)  # int8 weight [out, in] and its row scales after quantize()
        self.register_buffer("wscale", None)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        """Copy this rank's rows of sub-matrix ``part`` from the full ``tensor``
        (``[out, in]`` weight or ``[out]`` bias)."""
        s, e = self.out_ranges[part]
        off = sum(self.sizes[:part])
        getattr(self, name).data[off:off + e - s].copy_(tensor[s:e])

    def quantize(self) -> None:
        """Weight-only int8 (``EngineConfig.quantization == "int8"``): the float weight is
        replaced by int8 rows and per-row scales (``kernels.cpu_backend.quantize_int8``)."""
        from kernels import cpu_backend
        self.qweight, self.wscale = cpu_backend.quantize_int8(self.weight)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            from kernels.cpu_backend import int8_linear
            return int8_linear(x, self.qweight, self.wscale, self.bias)
        return linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """``y = x W^T`` with the input features split across ranks; partial sums are
    all-reduced. ``in_range`` is this rank's global ``[start, end)`` of input features."""

    def __init__(self, in_range: tuple[int, int], out_features: int):
        super().__init__()
        self.in_range = in_range
        self.weight = nn.Parameter(torch.empty(out_features, in_range[1] - in_range[0]), requires_grad=False)
        self.register_buffer("qweight", None)
        self.register_buffer("wscale", None)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(tensor[:, self.in_range[0]:self.in_range[1]])

    quantize = ColumnParallelLinear.quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            from kernels.cpu_backend import int8_linear
            return all_reduce(int8_linear(x, self.qweight, self.wscale))
        return all_reduce(linear(x, self.weight))
