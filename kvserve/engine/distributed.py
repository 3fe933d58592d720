"""Model parallelism over ``torch.distributed``: tensor parallelism (Megatron-LM, Shoeybi et al.
2019, sec. 3) inside each pipeline stage, pipeline parallelism (GPipe, Huang et al. 2019: layers
split into consecutive stages, micro-batches passed from stage to stage) across them.

The world is ``pipeline_parallel_size x tensor_parallel_size`` ranks; global rank
``stage * tp + t`` is tensor rank ``t`` of stage ``stage``. Tensor collectives run in the stage's
own group; activations go point to point from tensor rank ``t`` of one stage to tensor rank ``t``
of the next (every tensor rank holds the whole hidden state after its row-parallel all-reduce).

Without an initialised process group everything degrades to a single rank, so the engine
runs unchanged in one process. ``kvserve/cluster/`` starts the group (NCCL on GPU, gloo on CPU) and calls
:func:`init_model_parallel`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP = None  # this rank's tensor-parallel group; None: the whole world (no pipeline)
_PP = (0, 1)  # (this rank's stage, stages)
_TP = 1  # ranks per stage


def _on() -> bool:
    return dist.is_available() and dist.is_initialized()


def init_model_parallel(tensor_parallel_size: int, pipeline_parallel_size: int) -> None:
    """Split the initialised world into stages of ``tensor_parallel_size`` ranks (every rank
    calls this, in the same order, right after ``init_process_group``).

    Raises:
        ValueError: the world size is not ``tensor_parallel_size * pipeline_parallel_size``.
    """
    global _TP_GROUP, _PP, _TP
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != tensor_parallel_size * pipeline_parallel_size:
        raise ValueError(
            f"world size {world} != tensor_parallel_size {tensor_parallel_size} x "
            f"pipeline_parallel_size {pipeline_parallel_size}"
        )
    _TP_GROUP, _TP = None, tensor_parallel_size
    if pipeline_parallel_size > 1:
        for stage in range(pipeline_parallel_size):  # every rank creates every group (torch's rule)
            group = dist.new_group(list(range(stage * tensor_parallel_size, (stage + 1) * tensor_parallel_size)))
            if stage == rank // tensor_parallel_size:
                _TP_GROUP = group
    _PP = (rank // tensor_parallel_size, pipeline_parallel_size)


def tp_rank() -> int:
    return dist.get_rank(group=_TP_GROUP) if _on() else 0


def tp_size() -> int:
    return dist.get_world_size(group=_TP_GROUP) if _on() else 1


def pp_rank() -> int:
    """This rank's pipeline stage (0: it embeds the tokens)."""
    return _PP[0] if _on() else 0


def pp_size() -> int:
    return _PP[1] if _on() else 1


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, end)`` of part ``index`` when ``n`` items are split into ``parts`` contiguous
    parts as evenly as possible (the first ``n % parts`` parts get one more)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks of this stage (in place; returns ``x``)."""
    if tp_size() > 1:
        dist.all_reduce(x, group=_TP_GROUP)
    return x


def all_gather_last_dim(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate each tensor rank's ``x`` ``[..., sizes[rank]]`` along the last dimension."""
    if tp_size() == 1:
        return x
    parts = [torch.empty(*x.shape[:-1], s, dtype=x.dtype, device=x.device) for s in sizes]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor):
    """Start sending ``x`` to the same tensor rank of the next stage; returns the work handle
    (``wait()`` it before ``x`` is changed or freed)."""
    return dist.isend(x.contiguous(), dist.get_rank() + _TP)


def recv_from_previous_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Receive a tensor of ``shape`` and ``dtype`` from the same tensor rank of the previous
    stage (blocks until it arrives, or the process group's timeout fails it)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    dist.recv(x, dist.get_rank() - _TP)
    return x
