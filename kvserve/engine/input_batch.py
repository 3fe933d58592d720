"""A step's inputs: what the runner keeps of each request, and the flat batch built from a schedule.

:class:`RequestState` is the runner's copy of a running request (its tokens, sampling params,
seeded generator, adapter, pooling state), kept up to date by :func:`update_states` from each
:class:`~kvserve.engine.sched_output.SchedulerOutput`, which also gives the step's sampling rows.
:func:`build_batch` flattens the scheduled slices into the model's inputs: token ids and
positions of every row, the attention metadata (``cu_seqlens_q``, ``seq_lens``, block tables,
slot mapping) and the rows that sample.
"""

from __future__ import annotations

import torch

from kvserve.engine.layers.sampler import SamplingRow, logit_bias_tensors
from kvserve.engine.pooling import PoolingState
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.sched_output import SchedulerOutput
from kvserve.kernels.backend import AttentionMetadata


class RequestState:
    """The runner's state of one request: ``token_ids`` (prompt and output so far, as computed),
    ``prompt_len``, ``params``, its seeded ``generator`` (None: unseeded), ``prompt_token_ids``
    (kept only with ``params.prompt_logprobs``), ``lora`` (its ``kvserve.engine.lora.LoRARequest``,
    None: the base model), ``pooling`` (an embedding request's
    :class:`~kvserve.engine.pooling.PoolingState`) and ``logit_bias``: ``params.logit_bias`` as
    ``(ids int64 [k], values float32 [k])`` on the runner's device, built once here
    (:func:`~kvserve.engine.layers.sampler.logit_bias_tensors`; None: no bias)."""

    __slots__ = ("prompt_len", "token_ids", "params", "generator", "prompt_token_ids", "lora", "pooling", "logit_bias")

    def __init__(self, prompt_len: int, params: SamplingParams, generator: torch.Generator | None):
        self.prompt_len, self.params, self.generator = prompt_len, params, generator
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] = []
        self.lora = None
        self.pooling = None
        self.logit_bias = None


def update_states(
    states: dict[str, RequestState],
    pooling: set[str],
    sched: SchedulerOutput,
    device: torch.device,
    eos_token_ids: set[int],
) -> list[SamplingRow]:
    """Bring ``states`` (by request id) up to date with ``sched``: forget its finished requests,
    add its new ones (and the embedding requests to ``pooling``), and take in each slice's
    tokens. Returns the step's sampling rows in logits-row order: one per request that samples,
    ``k + 1`` for one that verifies ``k`` drafts (each row predicts the token after its
    position; stop and EOS ids are masked while ``min_tokens`` is not reached)."""
    for rid in sched.finished_req_ids:
        states.pop(rid, None)
        pooling.discard(rid)
    rows = []
    for sr in sched.requests:
        st = states.get(sr.request_id)
        if sr.new is not None:
            p = sr.new.params
            gen = st.generator if st is not None else None
            if gen is None and p.seed is not None:
                gen = torch.Generator(device=device).manual_seed(p.seed)
            st = states[sr.request_id] = RequestState(len(sr.new.prompt_token_ids), p, gen)
            st.token_ids = list(sr.new.computed_token_ids)  # history before a prefix-cache hit
            st.lora = sr.new.lora_request
            st.logit_bias = logit_bias_tensors(p.logit_bias, device)  # once, not at every step
            if sr.new.pooling is not None:
                st.pooling = PoolingState(sr.new.pooling, len(sr.new.prompt_token_ids))
                pooling.add(sr.request_id)
            if p.prompt_logprobs is not None:
                st.prompt_token_ids = sr.new.prompt_token_ids
        del st.token_ids[sr.start :]
        st.token_ids.extend(sr.token_ids)
        if not sr.sample:
            continue
        k = len(sr.spec_token_ids)
        end = len(st.token_ids)
        p, need_hist = st.params, st.params.needs_penalties
        for j in range(k + 1):  # position end-1-k+j predicts the token after it
            n_out = end - k + j - st.prompt_len  # output tokens before this position
            masked = []
            if n_out < p.min_tokens:
                masked = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else eos_token_ids))
            # the histories are copied only for penalties: a copy per row and step costs
            # O(length) of host time at every step of a long output
            rows.append(
                SamplingRow(
                    p,
                    st.generator,
                    st.token_ids[: st.prompt_len] if need_hist else [],
                    st.token_ids[st.prompt_len : st.prompt_len + n_out] if need_hist else [],
                    masked,
                    sr.spec_token_ids[j] if j < k else None,
                    st.logit_bias,
                )
            )
    return rows


def build_batch(
    requests: list, block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    """The flat batch of ``requests`` (a step's ``ScheduledRequest`` list, or a micro-batch of
    it): ``(input_ids, positions, meta, sample_idx)``, input ids and positions int64
    ``[num_tokens]`` on ``device``, the attention metadata, and the rows that sample (int64: the
    last row of a sampling slice, or with drafts its last ``1 + k`` rows)."""
    bs = block_size
    input_ids, positions, slots, qlens, slens, sample_idx = [], [], [], [], [], []
    for sr in requests:
        n = len(sr.token_ids)
        input_ids.extend(sr.token_ids)
        pos = range(sr.start, sr.start + n)
        positions.extend(pos)
        bt = sr.block_table
        slots.extend(bt[p // bs] * bs + p % bs for p in pos)
        qlens.append(n)
        slens.append(sr.start + n)
        if sr.sample:  # the last row, or with drafts the last 1 + k rows (each verifies one)
            sample_idx.extend(range(len(input_ids) - 1 - len(sr.spec_token_ids), len(input_ids)))
    width = max(len(sr.block_table) for sr in requests)
    tables = [sr.block_table + [0] * (width - len(sr.block_table)) for sr in requests]
    cu = [0]
    for n in qlens:
        cu.append(cu[-1] + n)
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(slens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_lens_cpu=qlens,
        seq_lens_cpu=slens,
        max_seqlen_q=max(qlens),
        max_seqlen_k=max(slens),
    )
    return (
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        meta,
        torch.tensor(sample_idx, dtype=torch.long, device=device),
    )
