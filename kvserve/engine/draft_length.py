"""How many tokens each request drafts: per-request acceptance against the measured cost of a row.

A request drafts ``k_r`` tokens with ``k_r`` the largest ``k <= num_speculative_tokens`` whose
``k``-th draft still pays, ``alpha_r ** k > lambda``: ``alpha_r`` is the request's estimated
per-token acceptance rate and ``lambda`` the measured cost of one extra query row in
target-token units (step-time regression). When drafts keep being rejected, ``alpha_r`` falls
below ``lambda`` and the request stops drafting; its estimate decays back toward the prior, so
it probes again later.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


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
