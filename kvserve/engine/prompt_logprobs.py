"""Prompt logprobs: the log-probability of each prompt token given the tokens before it (+ top-k).

The hidden state at position ``p`` gives the logits of the prompt token at ``p + 1``, also when
``p + 1`` starts the next chunk of a chunked prefill (prompt tokens are known). Logits are
computed :data:`PROMPT_LOGPROBS_SLICE` rows at a time, so a long prompt never holds a
``[prompt_len, vocab]`` float32 tensor.
"""

from __future__ import annotations

import torch

from kvserve.engine.sched_output import SchedulerOutput

#: Prompt positions whose logits are computed at once for prompt_logprobs (rows x vocab fp32).
PROMPT_LOGPROBS_SLICE = 256


def prompt_logprobs(
    model, hidden: torch.Tensor, sched: SchedulerOutput, states: dict
) -> dict[str, list[tuple[int, dict[int, float]]]] | None:
    """Prompt logprobs of the step's requests that ask for them
    (``params.prompt_logprobs``), as ``{request_id: [(position, {token_id: logprob}), ...]}``:
    the prompt token at ``position`` first, then the top-k (plain Python values: picklable for a
    distributed executor). None when no request of the step asks (the common case costs one
    dict lookup per request).

    Args:
        model: the model (``compute_logits(hidden) -> [rows, vocab]``); every tensor-parallel
            rank runs the same calls (the LM head all-gathers).
        hidden: the step's hidden states ``[num_tokens, hidden_size]``, rows in ``sched`` order.
        sched: the step.
        states: the runner's :class:`~kvserve.engine.input_batch.RequestState` by request id.
    """
    out = {}
    offset = 0
    for sr in sched.requests:
        row0, offset = offset, offset + len(sr.token_ids)
        st = states[sr.request_id]
        k = st.params.prompt_logprobs
        end = min(sr.start + len(sr.token_ids), st.prompt_len - 1)  # last position + 1 that predicts a prompt token
        if k is None or end <= sr.start:
            continue
        prompt, entries = st.prompt_token_ids, []
        for a in range(sr.start, end, PROMPT_LOGPROBS_SLICE):
            b = min(a + PROMPT_LOGPROBS_SLICE, end)
            h = hidden[row0 + a - sr.start : row0 + b - sr.start]
            lp = model.compute_logits(h).float().log_softmax(dim=-1)
            targets = prompt[a + 1 : b + 1]
            actual = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
            if k:
                top_vals, top_ids = (t.tolist() for t in lp.topk(min(k, lp.shape[1]), dim=-1))
            for j, tok in enumerate(targets):
                d = {tok: actual[j]}
                if k:
                    d.update(zip(top_ids[j], top_vals[j]))
                entries.append((a + 1 + j, d))
        out[sr.request_id] = entries
    return out or None
