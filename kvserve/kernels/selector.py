"""Which attention backend an engine runs: decided once, from what each backend supports.

Rules (:func:`select_attention_backend`):

1. A backend named by the ``requested`` argument, else by ``KVSERVE_ATTENTION_BACKEND``, is used
   if it supports the settings, else it is a ``ValueError`` that names the reason (e.g.
   ``flash_attn`` with ``block_size`` 16).
2. Otherwise the first of ``flash_attn`` -> ``triton`` -> ``cpu`` -> ``torch`` that runs on the
   device natively and supports the dtype, block size and head_dim, and whose packages import.
   So on CUDA flash-attn wins only where it really runs (fp16/bf16, ``block_size % 256 == 0``,
   flash-attn >= 2.6 installed), Triton otherwise, torch if Triton is missing; on CPU it is
   ``cpu`` (our C++ kernel) for float32 and bfloat16, torch for other dtypes (the Triton interpreter is never
   chosen automatically).

The choice is logged once at INFO on ``kvserve.attention``, with why the backends before it were
passed over. Reading capabilities imports no kernels: backends import theirs when built.
"""

from __future__ import annotations

import logging
import os

import torch

from kvserve.kernels.backend import AttentionBackend
from kvserve.kernels.cpu_backend import CpuBackend
from kvserve.kernels.flash_attn_backend import FlashAttnBackend
from kvserve.kernels.torch_backend import TorchBackend
from kvserve.kernels.triton_backend import TritonBackend

logger = logging.getLogger("kvserve.attention")

#: Every backend by name, in the order of automatic preference (fastest first).
BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (FlashAttnBackend, TritonBackend, CpuBackend, TorchBackend)
}

ENV_VAR = "KVSERVE_ATTENTION_BACKEND"


def select_attention_backend(
    device: torch.device | str, dtype: torch.dtype, block_size: int, head_dim: int, requested: str | None = None
) -> type[AttentionBackend]:
    """The backend class for an engine with these settings (build it with ``cls()``).

    Args:
        device: the engine's device; dtype: its KV cache dtype; block_size: tokens per KV
            block; head_dim: per attention head.
        requested: a name from :data:`BACKENDS`; None: ``KVSERVE_ATTENTION_BACKEND``, and if
            that is unset or empty, the automatic choice.

    Raises:
        ValueError: an unknown backend name, or a requested backend that cannot run with these
            settings (the message says why).
    """
    device = torch.device(device)
    name = requested or os.environ.get(ENV_VAR) or None
    if name is not None:
        if name not in BACKENDS:
            raise ValueError(f"attention_backend must be one of {tuple(BACKENDS)}, got {name!r}")
        reason = BACKENDS[name].unsupported_reason(device, dtype, block_size, head_dim, requested=True)
        if reason:
            raise ValueError(f"attention_backend={name!r} cannot run here: {reason}")
        source = "requested" if requested else f"from {ENV_VAR}"
        logger.info("attention backend: %s (%s)", name, source)
        return BACKENDS[name]
    skipped = []
    for cls in BACKENDS.values():
        reason = cls.unsupported_reason(device, dtype, block_size, head_dim)
        if reason is None:
            why = "; ".join(skipped) or f"the first that supports {device.type}"
            logger.info("attention backend: %s (%s)", cls.name, why)
            return cls
        skipped.append(f"{cls.name} skipped: {reason}")
    raise ValueError(
        f"no attention backend supports device {device}, dtype {dtype}, "
        f"block_size {block_size}, head_dim {head_dim}: {'; '.join(skipped)}"
    )
