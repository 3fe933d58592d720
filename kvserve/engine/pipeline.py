"""Pipeline parallelism: one stage's part of a step (GPipe, Huang et al. 2019, sec. 2: the layers
split into consecutive stages, the batch into micro-batches that follow each other through them).

Every stage runs every step with the same ``SchedulerOutput`` (the scheduler runs once, in the
engine) and cuts the step's requests into the same micro-batches. Stage ``s`` runs micro-batch
``m`` as soon as stage ``s - 1`` has sent its activations, then starts sending them on and takes
micro-batch ``m + 1``: with ``M`` micro-batches over ``S`` stages a step takes ``M + S - 1``
micro-batch slots instead of ``M * S``. The pipeline drains at the end of each step (the next
step's tokens depend on this one's samples), which costs ``S - 1`` slots per step; vLLM keeps
it full by scheduling another batch of other requests meanwhile (its virtual engines), which
this engine does not do yet. Only the last stage computes logits, samples, pools and returns
the step's output.
"""

from __future__ import annotations

import torch

from kvserve.engine.distributed import recv_from_previous_stage, send_to_next_stage


def micro_batches(requests: list, n: int) -> list[list]:
    """``requests`` (a step's scheduled requests, in order) cut into at most ``n`` contiguous,
    non-empty groups of about equal token counts (fewer when there are fewer requests)."""
    n = max(1, min(n, len(requests)))
    total = sum(len(sr.token_ids) for sr in requests)
    groups, current, seen = [], [], 0
    for i, sr in enumerate(requests):
        current.append(sr)
        seen += len(sr.token_ids)
        groups_left, requests_left = n - len(groups) - 1, len(requests) - i - 1
        if (
            groups_left > 0
            and requests_left > 0
            and (seen * n >= total * (len(groups) + 1) or requests_left == groups_left)
        ):
            groups.append(current)
            current = []
    groups.append(current)
    return groups


@torch.inference_mode()
def pipeline_forward(runner, requests: list) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run this stage's layers (``runner.model``) over every micro-batch of ``requests``, one
    per stage (``pipeline_parallel_size``).

    Returns:
        On the last stage the final hidden states ``[num_tokens, hidden]`` of the whole step (rows
        in ``requests`` order) and the int64 indices of the rows that sample; ``(None, None)`` on
        the other stages.

    Raises:
        RuntimeError (torch.distributed's): a neighbouring stage failed or did not answer within
            the process group's timeout.
    """
    model = runner.model
    outs, sample_rows, pending, offset = [], [], [], 0
    for group in micro_batches(requests, runner.config.pipeline_parallel_size):
        ids, positions, meta, sample_idx = runner._prepare(group)
        intermediate = None
        if not model.first_stage:  # (hidden, residual) of these rows from the previous stage
            x = recv_from_previous_stage((2, ids.shape[0], model.cfg.hidden_size), runner.dtype, runner.device)
            intermediate = (x[0], x[1])
        out = model(ids, positions, meta, intermediate)
        if model.last_stage:
            outs.append(out)
            sample_rows.append(sample_idx + offset)
        else:
            x = torch.stack(out)
            pending.append((send_to_next_stage(x), x))  # keep x alive until sent
        offset += ids.shape[0]
    for work, _ in pending:
        work.wait()
    if not model.last_stage:
        return None, None
    return torch.cat(outs), torch.cat(sample_rows)
