"""RMSNorm (Zhang & Sennrich 2019), computed in float32 like Hugging Face's LlamaRMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from kvserve.kernels import cpu_backend, gpu_ops


class RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension (``hidden_size``).

    ``forward(x, residual)`` first adds ``residual`` and returns ``(normed, x + residual)``,
    the pre-norm decoder's fused add. On CPU float32 ``[N, hidden]`` inputs both run as one
    C++ pass (``kvserve.kernels.cpu_backend``), on CUDA ``[N, hidden]`` or ``[N, heads, head_dim]``
    inputs one Triton kernel (``kvserve.kernels.gpu_ops``); both update ``residual`` in place.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(tensor)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)

    #: added to ``weight`` by the fused CPU kernel (Gemma stores ``weight - 1``)
    weight_offset = 0.0

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if x.dim() == 2 and cpu_backend.use_fused_ops(x):  # one pass instead of ~7 ATen ops
            if residual is None:
                return cpu_backend.rms_norm(x, self.weight, self.eps, self.weight_offset)
            return cpu_backend.add_rms_norm(x, residual, self.weight, self.eps, self.weight_offset)
        if gpu_ops.use_fused_ops(x) and x.stride(-1) == 1 and (residual is None or x.dim() == 2):
            gemma = self.weight_offset == 1.0  # GemmaRMSNorm: 1 + weight, in float32
            if residual is None:
                return gpu_ops.ops().rms_norm(x, self.weight, self.eps, gemma)
            return gpu_ops.ops().rms_norm(x, self.weight, self.eps, gemma, residual=residual), residual
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: ``x / sqrt(mean(x^2) + eps) * (1 + weight)``, the whole product in
    float32 and cast back at the end (Hugging Face's ``Gemma3RMSNorm``; checkpoints store the
    offset ``weight``, initialised to 0). Same ``forward(x, residual)`` contract as
    :class:`RMSNorm`; ``x`` ``[..., hidden_size]``."""

    weight_offset = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self.weight.data.zero_()

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)
