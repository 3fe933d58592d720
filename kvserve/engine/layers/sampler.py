"""Batched token sampling: penalties, greedy and random rows in one call."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.engine.grammar_bitmask import apply_token_bitmask
from kvserve.engine.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    """What the sampler needs for one sampling position."""

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    stop_ids_masked: list[int]  # token ids forbidden at this step (min_tokens)
    #: speculative decoding: the draft token proposed for this position, verified here
    #: (see :meth:`Sampler.__call__`); None for an ordinary row or a bonus position.
    draft_token: int | None = None
    #: ``params.logit_bias`` as tensors, built once when the request is admitted
    #: (:func:`logit_bias_tensors`; ``kvserve.engine.input_batch.RequestState``); None: built from
    #: ``params.logit_bias`` at each step (rows made by hand, e.g. in tests).
    logit_bias: tuple[torch.Tensor, torch.Tensor] | None = None


def logit_bias_tensors(
    bias: dict[int, float] | None, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """OpenAI's ``logit_bias`` ``{token_id: bias}`` as ``(ids, values)``: int64 ``[k]`` and
    float32 ``[k]`` on ``device`` (None for no bias), what :func:`apply_logit_bias` adds each step
    without touching the dict again."""
    if not bias:
        return None
    ids = torch.tensor(list(bias.keys()), dtype=torch.long, device=device)
    return ids, torch.tensor(list(bias.values()), dtype=torch.float32, device=device)


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place on float32 ``logits`` ``[n, vocab]``: repetition penalty (CTRL, Keskar et al.
    2019: divide positive / multiply negative logits of prompt and output tokens), then
    OpenAI's frequency and presence penalties over output tokens, then -inf for the row's
    forbidden stop ids (last, so no penalty can turn -inf into NaN: ``-inf * 0``).

    Raises:
        IndexError: a forbidden stop id outside the vocabulary.
    """
    vocab = logits.shape[1]
    for i, r in enumerate(rows):
        p = r.params
        if p.needs_penalties:
            out = torch.tensor(r.output_token_ids, dtype=torch.long, device=logits.device)
            if p.repetition_penalty != 1.0:
                seen = torch.tensor(
                    sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), dtype=torch.long, device=logits.device
                )
                vals = logits[i, seen]
                logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
            if (p.frequency_penalty or p.presence_penalty) and len(out):
                counts = torch.bincount(out, minlength=vocab).to(logits.dtype)
                logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if r.stop_ids_masked:
            logits[i, r.stop_ids_masked] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """In place on float32 ``logits`` ``[n, vocab]``: add each row's ``logit_bias`` (OpenAI's
    ``{token_id: bias}``; the row's tensors, :attr:`SamplingRow.logit_bias`, built once per
    request) in one indexed add over every biased row of the batch (``index_put_`` with
    ``accumulate``: the rows' ids concatenated, each paired with its row index); rows without a
    bias are untouched and cost nothing. A -inf logit stays -inf (biases are finite).

    Raises:
        IndexError: a biased token id outside the vocabulary (``LLMEngine.make_request``
            rejects those).
    """
    rows_at, ids, vals = [], [], []
    for i, r in enumerate(rows):
        t = r.logit_bias if r.logit_bias is not None else logit_bias_tensors(r.params.logit_bias, logits.device)
        if t is not None:
            rows_at.append(i)
            ids.append(t[0])
            vals.append(t[1])
    if not rows_at:
        return
    dev = logits.device
    all_ids = ids[0] if len(ids) == 1 else torch.cat(ids)
    row_idx = torch.repeat_interleave(
        torch.tensor(rows_at, device=dev), torch.tensor([len(t) for t in ids], device=dev)
    )
    logits.index_put_(
        (row_idx, all_ids.to(dev)),
        (vals[0] if len(vals) == 1 else torch.cat(vals)).to(device=dev, dtype=logits.dtype),
        accumulate=True,
    )


def _filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Mask logits ``[n, vocab]`` outside top-k (``k <= 0`` = off, ``k >= vocab`` keeps every
    token), the top-p nucleus (Holtzman et al. 2020) and min-p (probability < min_p * max
    probability) with -inf. The most likely token always survives (a ``top_p`` that rounds
    to 0 in float32 keeps just it), so no row is left all -inf. Which filters run is decided
    from ``params`` on the host (no device sync)."""
    vocab, dev = logits.shape[1], logits.device
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]  # huge top_k: no int64 overflow
    if any(k < vocab or p.top_p < 1 for k, p in zip(ks, params)):
        top_k = torch.tensor(ks, device=dev)
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=torch.float32)
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        drop = ranks >= top_k[:, None]
        probs = sorted_logits.softmax(dim=-1)
        cum = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop |= cum >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, idx, sorted_logits)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=torch.float32)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def draw(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token id per row of ``probs`` ``[n, vocab]`` (non-negative, not necessarily
    normalised) -> int64 ``[n]``, by inverse-CDF sampling: one uniform per row against the
    row's float64 cumulative sum (the first index whose cumulative sum exceeds it, so a
    zero-probability token is never drawn). ``torch.multinomial`` draws the same distribution
    but costs far more per row at a large vocabulary on CPU (``benchmarks/step_times.py`` times
    the sampler within a step).

    Raises:
        RuntimeError: a row whose sum is not finite and positive (NaN or inf logits), as
            ``torch.multinomial`` does.
    """
    c = probs.double().cumsum(dim=-1)
    total = c[:, -1:]
    if not bool((torch.isfinite(total) & (total > 0)).all()):
        raise RuntimeError("probability tensor contains either inf, nan or element < 0, or a row sums to 0")
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device, generator=generator) * total
    u = torch.minimum(u, torch.nextafter(total, torch.zeros_like(total)))  # strictly below the total
    return torch.searchsorted(c, u, right=True).squeeze(1)


class Sampler:
    """Picks one token per row of ``logits``.

    Greedy rows (temperature 0) take the argmax; random rows are scaled by temperature,
    filtered (top-k, top-p, min-p) and sampled (:func:`draw`), using the row's own generator
    when it has a seed.

    A row with a ``draft_token`` (speculative decoding) verifies it instead: greedy rows accept
    it iff it is the argmax; random rows accept it with probability ``p(draft)`` under the
    row's final distribution ``p`` and otherwise draw from ``p`` with the draft removed,
    renormalised: rejection sampling for a one-hot draft distribution (Leviathan et al. 2023,
    sec. 2.3), so the row's token is distributed exactly as ``p``.
    """

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], grammar=None):
        """Args: float32 ``logits`` ``[n, vocab]``, one :class:`SamplingRow` per row, and
        ``grammar``: None, or ``(bitmask int32 [k, ceil(vocab / 32)], row indices list[int] of
        length k)`` (structured outputs, see ``kvserve.engine.grammar_bitmask.bitmask_rows``): tokens
        whose bit is 0 get -inf in those rows, after penalties and logit_bias, before
        temperature / top-k / top-p / min-p (so greedy and sampled rows both stay in the grammar).

        Returns ``(tokens, logprobs, accepted)``: a list of ``n`` token ids, per row either None
        or a dict ``{token_id: logprob}`` with the row's token and the top ``params.logprobs``
        tokens (log-probabilities of the model's raw distribution), and per row None (no draft)
        or whether its ``draft_token`` was accepted (then the row's token is the draft).

        If it raises, every row's generator is back in the state it had on entry, so the
        engine can re-run the step (failure isolation) and seeded rows still draw the same.

        Raises:
            IndexError: a masked stop token id or a ``logit_bias`` token id outside the
                vocabulary (``LLMEngine.make_request`` rejects those).
        """
        gens = [r.generator for r in rows if r.generator is not None]
        states = [g.get_state() for g in gens]
        try:
            return self._sample(logits, rows, grammar)
        except BaseException:
            for g, s in zip(gens, states):
                g.set_state(s)
            raise

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], grammar=None):
        logits = logits.float()
        n = logits.shape[0]
        want_lp = [r.params.logprobs is not None for r in rows]
        raw_logprobs = logits.log_softmax(dim=-1) if any(want_lp) else None
        apply_penalties(logits, rows)
        apply_logit_bias(logits, rows)
        if grammar is not None:
            apply_token_bitmask(logits, *grammar)
        tokens = logits.argmax(dim=-1)
        accepted: list[bool | None] = [None] * n
        rand = [i for i, r in enumerate(rows) if not r.params.greedy]
        greedy_drafts = [i for i, r in enumerate(rows) if r.draft_token is not None and r.params.greedy]
        if greedy_drafts:
            top = tokens[greedy_drafts].tolist()
            for i, t in zip(greedy_drafts, top):
                accepted[i] = t == rows[i].draft_token
        if rand:
            dev = logits.device
            sub = logits[rand] / torch.tensor([rows[i].params.temperature for i in rand], device=dev)[:, None]
            # a tiny repetition_penalty or temperature can overflow logits to +inf; softmax of a
            # row with +inf is NaN, so cap them at the largest float (ties among them)
            sub = sub.clamp_(max=torch.finfo(sub.dtype).max)
            sub = _filter(sub, [rows[i].params for i in rand])
            probs = sub.softmax(dim=-1)
            drafted = [j for j, i in enumerate(rand) if rows[i].draft_token is not None]
            if drafted:
                self._verify_drafts(probs, [rand[j] for j in drafted], drafted, rows, tokens, accepted)
            seeded = [j for j, i in enumerate(rand) if rows[i].generator is not None and rows[i].draft_token is None]
            unseeded = [j for j, i in enumerate(rand) if rows[i].generator is None and rows[i].draft_token is None]
            if unseeded:
                picks = draw(probs[unseeded])
                tokens[[rand[j] for j in unseeded]] = picks
            for j in seeded:
                tokens[rand[j]] = draw(probs[j : j + 1], rows[rand[j]].generator)[0]
        token_list = tokens.tolist()
        logprobs = [None] * n
        if raw_logprobs is not None:
            for i, r in enumerate(rows):
                if not want_lp[i]:
                    continue
                d = {token_list[i]: float(raw_logprobs[i, token_list[i]])}
                if r.params.logprobs:
                    vals, ids = raw_logprobs[i].topk(min(r.params.logprobs, raw_logprobs.shape[1]))
                    d.update(zip(ids.tolist(), vals.tolist()))
                logprobs[i] = d
        return token_list, logprobs, accepted

    @staticmethod
    def _verify_drafts(
        probs: torch.Tensor,
        row_ids: list[int],
        prob_rows: list[int],
        rows: list[SamplingRow],
        tokens: torch.Tensor,
        accepted: list,
    ) -> None:
        """Rejection sampling of one-hot drafts, in place on ``tokens`` / ``accepted``:
        ``row_ids[j]`` (a logits row) verifies its draft under ``probs[prob_rows[j]]``. The
        uniform draw and, on rejection, the residual draw use the row's generator when seeded."""
        dev, n = probs.device, len(row_ids)
        drafts = torch.tensor([rows[i].draft_token for i in row_ids], device=dev)
        p = probs[prob_rows]
        seeded = [j for j, i in enumerate(row_ids) if rows[i].generator is not None]
        u = torch.rand(n, device=dev)  # unseeded rows: one draw for all (seeded rows redrawn below)
        for j in seeded:
            u[j] = torch.rand(1, device=dev, generator=rows[row_ids[j]].generator)[0]
        residual = p.clone()
        residual[torch.arange(n, device=dev), drafts] = 0.0
        # accept with probability p(draft); a p one-hot at the draft (empty residual) always accepts
        ok = (u < p.gather(1, drafts[:, None])[:, 0]) | (residual.sum(dim=1) <= 0)
        ok_list = ok.tolist()
        rejected = [j for j in range(n) if not ok_list[j]]
        picks = drafts.clone()
        plain = [j for j in rejected if rows[row_ids[j]].generator is None]
        if plain:
            picks[plain] = draw(residual[plain])
        for j in rejected:
            g = rows[row_ids[j]].generator
            if g is not None:
                picks[j] = draw(residual[j : j + 1], g)[0]
        tokens[row_ids] = picks
        for j, i in enumerate(row_ids):
            accepted[i] = ok_list[j]
