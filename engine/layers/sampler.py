"""Batched token sampling: penalties, greedy and random rows in one call."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs for one sampling position."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids_masked: list[int]  # token ids forbidden at this step (min_tokens)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place on float32 ``logits`` ``[n, vocab]``: repetition penalty (CTRL, Keskar et al.
    2019: divide positive / multiply negative logits of prompt and output tokens), then
    OpenAI's frequency and presence penalties over output tokens."""
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if r.stop_ids_masked:
            logits[i, r.stop_ids_masked] = float("-inf")
        if not p.needs_penalties:
            continue
        out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)),
                                dtype=torch.long, device=logits.device)
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(out):
            counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits ``[n, vocab]`` outside top-k (``k <= 0`` = off), the top-p nucleus
    (Holtzman et al. 2020) and min-p (probability < min_p * max probability) with -inf.
    Which filters run is decided from ``params`` on the host (no device sync)."""
    vocab, dev = logits.shape[1], logits.device
    top_k = torch.tensor([p.top_k for p in params], device=dev)
    top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
    min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
    if any(p.top_k > 0 or p.top_p < 1 for p in params):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= k[:, None]
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop |= cum >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if any(p.min_p > 0 for p in params):
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


class Sampler:
    """Picks one token per row of ``logits``.

    Greedy rows (temperature 0) take the argmax; random rows are scaled by temperature,
    filtered (top-k, top-p, min-p) and sampled with ``torch.multinomial``, using the row's
    own generator when it has a seed.
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]):
        """Args: float32 ``logits`` ``[n, vocab]``, one :class:`SamplingRow` per row.

        Returns ``(tokens, logprobs)``: a list of ``n`` token ids, and per row either None or a
        dict ``{token_id: logprob}`` with the sampled token and the top ``params.logprobs``
        tokens (log-probabilities of the model's raw distribution).
        """
        logits = logits.float()
        n = logits.shape[0]
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_lp) else None
        apply_penalties(logits, rows)
        tokens = logits.argmax(dim=-1)
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        if rand:
            dev = logits.device
            sub = logits[rand] / torch.tensor([rows[i].params.temperature for i in rand], device=dev)[:, None]
            sub = _filter(sub, [rows[i].params for i in rand])
            probs = sub.softmax(dim=-1)
            seeded = [j for j, i in enumerate(rand) if rows[i].generator is not None]
            unseeded = [j for j, i in enumerate(rand) if rows[i].generator is None]
            if unseeded:
                picks = torch.multinomial(probs[unseeded], 1).squeeze(1)
                tokens[[rand[j] for j in unseeded]] = picks
            for j in seeded:
                tokens[rand[j]] = torch.multinomial(probs[j], 1, generator=rows[rand[j]].generator)[0]
        token_list = tokens.tolist()
        logprobs = [None] * n
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if not want_lp[i]:
                    continue
                d = {token_list[i]: float(raw_logprobs[i, token_list[i]])}
                if r.params.logprobs:
                    vals, ids = raw_logprobs[i].topk(r.params.logprobs)
                    d.update(zip(ids.tolist(), vals.tolist()))
                logprobs[i] = d
        return token_list, logprobs
