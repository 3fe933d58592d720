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

The engine's side (:class:`Speculator`): before each step it asks the proposer for the running
requests' drafts, their lengths from the policy below; after the step it records what the target
accepted (the policy's estimates, the ``spec_decode_*`` counters).

Back-off (:class:`DraftLengthPolicy`): a request drafts ``k_r`` tokens with ``k_r`` the largest
``k <= num_speculative_tokens`` whose ``k``-th draft still pays, ``alpha_r ** k > lambda``:
``alpha_r`` is the request's estimated per-token acceptance rate and ``lambda`` the measured cost
of one extra query row in target-token units (step-time regression). When drafts keep being
rejected, ``alpha_r`` falls below ``lambda`` and the request stops drafting; its estimate decays
back toward the prior, so it probes again later.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import numpy as np

from engine.request import Request
from engine.scheduler import SchedulerOutput
from engine.stats import StepMetrics

logger = logging.getLogger("kvserve.engine")

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


class Speculator:
    """The engine's side of speculative decoding: :meth:`propose` before a step sets the
    running requests' drafts, :meth:`record` after it feeds what the target accepted back into
    :attr:`policy` and the counters. Nothing raises out of :meth:`propose`: a proposer or policy
    that raises on a request, or proposes ids outside the vocabulary, turns drafting off for that
    request alone (``Request.spec_disabled``), which goes on without drafts.

    Args:
        config: the speculative config.
        proposer: a :class:`NgramProposer` or an ``engine.draft_model.DraftModelProposer``.
        vocab_size: the target's vocabulary size (draft ids must be in ``[0, vocab_size)``).

    Attributes:
        proposer: as passed (may be replaced between steps).
        policy: the :class:`DraftLengthPolicy` (draft length per request).
        counts: totals ``num_drafts`` (requests that verified drafts), ``num_draft_tokens``
            (drafts verified), ``num_accepted_tokens`` (drafts accepted).
        accepted_per_position: accepted drafts by position in the draft (index 0 = first), totals.
    """

    def __init__(self, config: SpeculativeConfig, proposer, vocab_size: int):
        self.config, self.proposer, self.vocab_size = config, proposer, vocab_size
        self.policy = DraftLengthPolicy(config.num_speculative_tokens, config.adaptive)
        self.counts = dict(num_drafts=0, num_draft_tokens=0, num_accepted_tokens=0)
        self.accepted_per_position = [0] * config.num_speculative_tokens

    def propose(self, running: list[Request], clock: Callable[[], float]) -> None:
        """Set ``spec_token_ids`` of each request of ``running`` (the scheduler's running queue)
        for the next step. Only requests in decode (one token to compute) without a grammar, not
        ``spec_disabled``, and only while at least two output tokens remain get drafts; their
        length comes from :attr:`policy`. ``clock`` (seconds) times the draft model's forward,
        the policy's extra cost per draft token."""
        reqs = []
        for req in running:
            req.spec_token_ids = []
            if (req.num_tokens - req.num_computed_tokens == 1 and req.grammar is None and not req.spec_disabled
                    and req.max_output_tokens - req.num_output_tokens > 1):
                reqs.append(req)
        if not reqs:
            return
        k_max, batch, p = self.config.num_speculative_tokens, len(running), self.policy

        def room(req: Request) -> int:  # drafts + the step's own token stay within max_tokens
            return min(k_max, req.max_output_tokens - req.num_output_tokens - 1)

        if isinstance(self.proposer, NgramProposer):
            for req in reqs:
                try:
                    draft = self.proposer.propose(req.all_token_ids, room(req))
                    req.spec_token_ids = self._checked_drafts(draft[:p.draft_length(req.request_id, len(draft), batch)])
                except Exception as e:
                    self._stop_drafting(req, e)
            return
        want = []
        for req in reqs:
            try:
                if (k := p.draft_length(req.request_id, room(req), batch)) > 0:
                    want.append((req, k))
            except Exception as e:
                self._stop_drafting(req, e)
        if not want:
            return
        t0 = clock()
        try:
            drafts = self.proposer.propose(want)
        except Exception as e:  # which request? each alone, from a clean draft state
            logger.warning("draft model failed on a batch of %d (%s: %s); retrying each request alone",
                           len(want), type(e).__name__, e)
            for req, _ in want:
                self.proposer.forget(req.request_id)
            drafts = {}
            for req, k in want:
                try:
                    drafts.update(self.proposer.propose([(req, k)]))
                except Exception as e1:
                    self._stop_drafting(req, e1)
        rounds = max(k for _, k in want)
        per_token = (clock() - t0) / (rounds * len(want))
        if math.isfinite(per_token) and per_token >= 0:  # a clock that jumped back says nothing
            p.extra_cost_s = per_token if not p.extra_cost_s else 0.8 * p.extra_cost_s + 0.2 * per_token
        for req, _ in want:
            if req.spec_disabled:
                continue
            try:
                req.spec_token_ids = self._checked_drafts(drafts.get(req.request_id, []))
            except Exception as e:
                self._stop_drafting(req, e)

    def record(self, sched: SchedulerOutput, m: StepMetrics | None) -> None:
        """After a step (``sched`` updated: ``sched.num_accepted``): each request's acceptance
        goes to the policy and the counters, and into ``m`` (the step's metrics; None when the
        model call failed and was isolated); a decode-only step also gives the policy its time
        and rows (its cost model). May raise if the policy does (the engine logs and skips it)."""
        per_pos = [0] * self.config.num_speculative_tokens
        drafts = tokens = accepted = 0
        for sr in sched.requests:
            k = len(sr.spec_token_ids)
            if not k or sr.request_id not in sched.num_accepted:
                continue
            a = sched.num_accepted[sr.request_id]
            self.policy.record_acceptance(sr.request_id, k, a)
            drafts, tokens, accepted = drafts + 1, tokens + k, accepted + a
            for j in range(a):
                per_pos[j] += 1
        c = self.counts
        c["num_drafts"] += drafts
        c["num_draft_tokens"] += tokens
        c["num_accepted_tokens"] += accepted
        self.accepted_per_position = [x + y for x, y in zip(self.accepted_per_position, per_pos)]
        if m is not None:
            m.num_drafts, m.num_draft_tokens, m.num_accepted_tokens = drafts, tokens, accepted
            m.accepted_per_position = per_pos
            if m.num_prefill_tokens == 0:
                self.policy.record_step(m.end - m.start, sched.num_batched_tokens)

    def release(self, req: Request) -> None:
        """``req`` left the engine: drop its acceptance estimate and draft-model state."""
        self.policy.forget(req.request_id)
        if hasattr(self.proposer, "forget"):
            self.proposer.forget(req.request_id)

    def stats(self) -> dict[str, float | list[int]]:
        """The ``spec_decode_*`` totals of ``LLMEngine.get_stats`` (vLLM's names): the counters,
        the acceptance rate (accepted / verified drafts), the mean acceptance length (tokens per
        verifying step, the bonus token included) and the accepted drafts per position."""
        c = self.counts
        drafts, tokens, accepted = c["num_drafts"], c["num_draft_tokens"], c["num_accepted_tokens"]
        s = {f"spec_decode_{k}": v for k, v in c.items()}
        s["spec_decode_acceptance_rate"] = accepted / tokens if tokens else 0.0
        s["spec_decode_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
        s["spec_decode_num_accepted_tokens_per_pos"] = list(self.accepted_per_position)
        return s

    def _checked_drafts(self, draft: list[int]) -> list[int]:
        """``draft`` as a list of Python ints in the vocabulary.

        Raises:
            ValueError: a draft id that is not an integer in ``[0, vocab_size)``.
        """
        vocab = self.vocab_size
        out = [int(t) for t in draft]
        if any(t < 0 or t >= vocab or t != d for t, d in zip(out, draft)):
            raise ValueError(f"proposed draft ids outside the vocabulary [0, {vocab}): {draft}")
        return out

    def _stop_drafting(self, req: Request, error: BaseException) -> None:
        """The proposer or the draft-length policy failed on ``req``: it goes on without drafts
        (and its proposer state is dropped)."""
        logger.error("speculative decoding turned off for request %s: its proposer failed: %s: %s",
                     req.request_id, type(error).__name__, error, exc_info=error)
        req.spec_disabled, req.spec_token_ids = True, []
        try:
            self.release(req)
        except Exception:
            logger.exception("releasing the draft state of request %s failed", req.request_id)
