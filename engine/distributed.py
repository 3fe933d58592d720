"""Tensor-parallel helpers over ``torch.distributed`` (Megatron-LM, Shoeybi et al. 2019, sec. 3).

Without an initialised process group everything degrades to a single rank, so the engine
runs unchanged in one process. ``cluster/`` starts the group (NCCL on GPU, gloo on CPU).
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def tp_rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def tp_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``n`` items are split into ``parts`` contiguous
    parts as evenly as possible (the first ``n % parts`` parts get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks (in place; returns ``x``)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather_last_dim(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate each rank's ``x`` ``[..., sizes[rank]]`` along the last dimension."""
    if tp_size() == 1:
        return x
    parts = [torch.empty(*x.shape[:-1], s, dtype=x.dtype, device=x.device) for s in sizes]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)
