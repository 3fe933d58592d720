"""Which decoder-layer steps take the fused Triton kernels on CUDA (:mod:`kvserve.kernels.triton_layer_ops`).

The layers of :mod:`kvserve.engine.layers` ask :func:`use_fused_ops` and call the kernels through
:func:`ops`; everywhere else (CPU, Triton not installed, ``KVSERVE_TRITON_LAYER_OPS=0``, autograd)
they run their ATen ops. Triton is an optional extra: nothing here imports it until a CUDA tensor
asks.
"""

from __future__ import annotations

import functools
import os

import torch

#: ``KVSERVE_TRITON_LAYER_OPS=0`` keeps every layer on ATen's ops on CUDA too (for comparison).
FUSED_OPS = os.environ.get("KVSERVE_TRITON_LAYER_OPS", "1") != "0"
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@functools.cache
def ops():
    """The kernel module :mod:`kvserve.kernels.triton_layer_ops` (imported on first use), or None when
    Triton cannot be imported here."""
    try:
        from kvserve.kernels import triton_layer_ops
    except ImportError:
        return None
    return triton_layer_ops


def use_fused_ops(x: torch.Tensor) -> bool:
    """Whether the layers should run the Triton kernels on ``x``: a CUDA tensor of float32,
    float16 or bfloat16 under inference (no autograd), Triton importable, not switched off."""
    return FUSED_OPS and x.is_cuda and x.dtype in _DTYPES and not torch.is_grad_enabled() and ops() is not None
