"""Speculative decoding: cheap draft tokens, verified by the target model in one step.

Algorithm: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (sec. 2.3), and Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling". A proposer guesses up to ``k`` next tokens of a request; the scheduler
puts the request's last token plus the drafts into one step as query rows; the target's
logits at those ``k + 1`` positions decide how many drafts stand:

* greedy requests keep the longest run of drafts equal to the target's argmax, then the
  target's own token at the first mismatch (or the bonus token after ``k`` accepted drafts);
* sampled requests use rejection sampling (:func:`verify`): draft ``d`` at a position where
  the target's distribution (after penalties, temperature, top-k/top-p/min-p) is ``p`` is
  accepted with probability ``min(1, p(d) / q(d))``; on rejection the token is drawn from
  ``norm(max(0, p - q))``. Our drafts are deterministic (``q`` is one-hot at ``d``: n-gram
  lookup, and the draft model's argmax), so acceptance is ``p(d)`` and the residual is ``p``
  without ``d``, renormalised. Each output token is then distributed exactly as the target's
  (Leviathan et al., appendix A.1).

Proposers: :class:`NgramProposer` (prompt lookup decoding, Saxena 2023: the continuation of the
latest earlier occurrence of the request's last ``n`` tokens) and
:class:`engine.draft_model.DraftModelProposer` (a smaller model of the same tokenizer with its own
paged KV cache).

Back-off (:class:`DraftLengthPolicy`): a request drafts ``k_r`` tokens with ``k_r`` the largest
``k <= num_speculative_tokens`` whose ``k``-th draft still pays, ``alpha_r ** k > lambda``:
``alpha_r`` is the request's estimated per-token acceptance rate and ``lambda`` the measured cost
of one extra query row in target-token units (step-time regression). When drafts keep being
rejected, ``alpha_r`` falls below ``lambda`` and the request stops drafting; its estimate decays
back toward the prior, so it probes again later.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import numpy as np

METHODS = ("ngram", "draft_model")


@dataclass
class SpeculativeConfig:
    """``speculative_config`` of ``LLM(...)`` / ``kvserve serve --speculative-config JSON``
    (vLLM's keys).

    Attributes:
        method: ``"ngram"`` (prompt lookup) or ``"draft_model"`` (``model`` drafts).
        num_speculative_tokens: most draft tokens per request per step (``k``, >= 1).
        prompt_lookup_max, prompt_lookup_min: n-gram sizes tried, longest first (tokens).
        model: the draft model (local folder or hub id) for ``draft_model``; it must share the
            target's vocabulary.
        draft_tensor_parallel_size: must be 1 (the draft runs in the engine's process).
        adaptive: choose each request's draft length by measured acceptance and cost (False:
            always draft ``num_speculative_tokens`` when a proposal exists).

    Raises:
        ValueError: unknown keys, a bad method or value (the message names the key).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    draft_tensor_parallel_size: int = 1
    adaptive: bool = True

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpeculativeConfig | None":
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a dict (JSON object), got {type(d).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {unknown}; allowed: {sorted(known)}")
        d = dict(d)
        if "method" not in d:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        if "num_speculative_tokens" not in d:
            raise ValueError("speculative_config needs num_speculative_tokens")
        if d["method"] == "ngram" and "prompt_lookup_max" in d and "prompt_lookup_min" not in d:
            d["prompt_lookup_min"] = min(cls.prompt_lookup_min, d["prompt_lookup_max"])
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config {name} must be a positive integer, got {v!r}")
        if self.num_speculative_tokens > 32:
            raise ValueError(f"speculative_config num_speculative_tokens must be <= 32, got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError("speculative_config method 'draft_model' needs 'model' (a local folder or hub id)")
        if self.draft_tensor_parallel_size != 1:
            raise ValueError("speculative_config draft_tensor_parallel_size must be 1 (the draft runs in the "
                             "engine's process)")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")


class NgramProposer:
    """Prompt lookup decoding: find the latest earlier occurrence of the last ``n`` tokens
    (``n`` from ``max_n`` down to ``min_n``) in the request's prompt + output, and propose the
    tokens that followed it (up to ``k``). Vectorised with numpy: about 20 us for 2,000 tokens."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens for the sequence ``token_ids`` (empty: no match)."""
        L = len(token_ids)
        if k <= 0 or L < self.min_n + 1:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)  # starts 0..L-1-n
            hits = np.flatnonzero((windows == arr[L - n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n  # the latest occurrence; its continuation
                return arr[start:start + k].tolist()
        return []


@dataclass
class _Acceptance:
    accepted: float = 0.0  # decayed accepted drafts
    trials: float = 0.0  # decayed accept/reject decisions (accepted + a rejection if any)
    calls: int = 0  # draft_length calls (steps with a proposal)
    probe_at: int = 0  # while backed off: the call that probes again
    backoff: int = 1  # calls until the next probe (doubles after each failed probe)


@dataclass
class DraftLengthPolicy:
    """Per-request draft length from acceptance and measured cost (see the module docstring).

    Acceptance: ``alpha_r = (A + alpha_all * n0) / (N + n0)`` over counts of accepted drafts
    ``A`` and accept/reject decisions ``N`` that decay by ``decay`` per verification (a run of
    ``m`` accepted drafts of ``k`` is ``m`` successes plus one failure if ``m < k``: the
    maximum-likelihood estimate of a geometric acceptance). The prior ``alpha_all`` is the same
    estimate pooled over all requests (decaying by ``pool_decay``, itself starting at
    ``prior``), so a new request starts from what drafts have recently been worth here.

    Cost: decayed least squares of decode-only step time ``t = a + b * n`` over the number of
    query rows ``n`` (drafts included); one extra row costs ``lambda = b * B / (a + b * B)``
    target tokens at batch ``B`` (throughput ``(B + extra tokens) / (a + b * (B + drafts))``
    grows iff a draft's acceptance chance exceeds ``lambda``). ``extra_cost_s`` adds the
    proposer's own seconds per draft token (the draft model's forward).

    Defined for every input (step times come from a host that may be busy, a clock that may
    jump, or a proposer that may hang): a step time that is not finite, negative or above
    :attr:`MAX_STEP_S` is ignored; a fit that is not credible (fewer than two distinct row
    counts, a negative slope ``b``) is "no fit", and then
    ``lambda = prior_lambda``; a negative intercept ``a`` is taken as 0; ``lambda`` is clamped
    to ``[MIN_LAMBDA, 1]`` and ``alpha_r`` to ``[0, 1]``, so the draft length below is always an
    integer in ``[0, available]``.

    Draft length: the largest ``k`` whose ``k``-th draft pays, ``alpha_r ** k > lambda``. A
    request with ``alpha_r <= lambda`` is backed off: it drafts one token as a probe after
    1, 2, 4, ... (at most ``max_backoff``) steps with a proposal, so a workload whose drafts do
    not pay spends at most one row per ``max_backoff`` tokens on them once settled, and a
    request whose text turns repetitive is noticed.
    """

    #: Step times above this (seconds) are not a decode step's cost (a stalled host, a clock jump).
    MAX_STEP_S = 600.0
    #: Smallest cost of a draft row (target tokens): a free row would ask for ``max_k`` drafts
    #: whatever their acceptance, and ``log(0)`` is undefined.
    MIN_LAMBDA = 1e-3

    max_k: int
    adaptive: bool = True
    prior: float = 0.5
    n0: float = 2.0
    decay: float = 0.9
    pool_decay: float = 0.99
    prior_lambda: float = 0.1
    cost_decay: float = 0.97
    max_backoff: int = 64
    _req: dict[str, _Acceptance] = field(default_factory=dict)
    _pool: _Acceptance = field(default_factory=_Acceptance)
    _s: list[float] = field(default_factory=lambda: [0.0] * 5)  # w, wx, wy, wxx, wxy
    extra_cost_s: float = 0.0

    def pooled_alpha(self) -> float:
        """Acceptance estimate over all requests (the per-request prior)."""
        return (self._pool.accepted + self.prior * self.n0) / (self._pool.trials + self.n0)

    def alpha(self, request_id: str) -> float:
        """Per-token acceptance estimate of a request, in ``[0, 1]``."""
        st = self._req.get(request_id)
        a, n = (st.accepted, st.trials) if st else (0.0, 0.0)
        return min(1.0, max(0.0, (a + self.pooled_alpha() * self.n0) / (n + self.n0)))

    def step_cost(self) -> tuple[float, float] | None:
        """``(a, b)``: seconds of a decode-only step with no rows (``a >= 0``), and per query
        row (``b >= 0``); None while there is no credible fit (see the class docstring)."""
        w, x, y, xx, xy = self._s  # finite: record_step takes bounded times only
        if w <= 0:
            return None
        var = xx / w - (x / w) ** 2
        if not var >= 0.25:  # fewer than two distinct row counts (or rounding noise)
            return None
        b = (xy / w - (x / w) * (y / w)) / var
        if b < 0.0:  # a negative slope: noise, not a cost
            return None
        a = y / w - b * x / w
        return max(a, 0.0), b

    def cost_lambda(self, batch: int) -> float:
        """Cost of one draft row in target-token units at ``batch`` decoding requests, in
        ``[MIN_LAMBDA, 1]``."""
        ab = self.step_cost()
        extra = self.extra_cost_s if math.isfinite(self.extra_cost_s) and self.extra_cost_s > 0 else 0.0
        if ab is None or batch <= 0:
            lam = self.prior_lambda
        else:
            a, b = ab
            t = a + b * batch
            lam = (b + extra) * batch / t if t > 0 else self.prior_lambda
        if not math.isfinite(lam):
            lam = self.prior_lambda
        return min(1.0, max(self.MIN_LAMBDA, lam))

    def draft_length(self, request_id: str, available: int, batch: int) -> int:
        """Drafts to verify for a request with ``available`` proposed tokens: an integer in
        ``[0, min(available, max_k)]`` for any state of the estimates."""
        k = min(available, self.max_k)
        if not self.adaptive or k <= 0:
            return max(k, 0)
        st = self._req.setdefault(request_id, _Acceptance())
        st.calls += 1
        alpha, lam = self.alpha(request_id), self.cost_lambda(batch)
        if not alpha > lam:
            if st.calls < st.probe_at:
                return 0
            st.probe_at = st.calls + st.backoff
            st.backoff = min(2 * st.backoff, self.max_backoff)
            return 1
        st.backoff = 1
        if alpha >= 1:
            return k
        return max(1, min(k, int(math.log(lam) / math.log(alpha))))  # 0 < lam < alpha < 1: finite, >= 0

    def record_acceptance(self, request_id: str, num_drafts: int, num_accepted: int) -> None:
        """One verification: ``num_accepted`` of ``num_drafts`` drafts stood (clamped to
        ``[0, num_drafts]``)."""
        if num_drafts <= 0:
            return
        num_accepted = min(max(num_accepted, 0), num_drafts)
        trials = num_accepted + (num_accepted < num_drafts)
        for st, g in ((self._req.setdefault(request_id, _Acceptance()), self.decay), (self._pool, self.pool_decay)):
            st.accepted = g * st.accepted + num_accepted
            st.trials = g * st.trials + trials

    def record_step(self, seconds: float, num_rows: int) -> None:
        """A decode-only step's wall time (seconds) and query rows (drafts included). A time
        that is not finite, negative or above :attr:`MAX_STEP_S`, or a step of no rows, is
        ignored."""
        if not (isinstance(seconds, (int, float)) and 0.0 <= seconds <= self.MAX_STEP_S) or num_rows <= 0:
            return
        g = self.cost_decay
        s = self._s
        for i, v in enumerate((1.0, num_rows, seconds, num_rows * num_rows, num_rows * seconds)):
            s[i] = g * s[i] + v

    def forget(self, request_id: str) -> None:
        self._req.pop(request_id, None)
