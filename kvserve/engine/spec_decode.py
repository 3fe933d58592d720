"""Speculative decoding: cheap draft tokens, verified by the target model in one step.

Algorithm: Leviathan, Kalman, Matias 2023, "Fast Inference from Transformers via Speculative
Decoding" (sec. 2.3), and Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling". A proposer guesses up to ``k`` next tokens of a request; the scheduler
puts the request's last token plus the drafts into one step as query rows; the target's
logits at those ``k + 1`` positions decide how many drafts stand:

* greedy requests keep the longest run of drafts equal to the target's argmax, then the
  target's own token at the first mismatch (or the bonus token after ``k`` accepted drafts);
* sampled requests use rejection sampling (``Sampler._verify_drafts`` of
  :mod:`kvserve.engine.layers.sampler`): draft ``d`` at a position where the target's distribution
  (after penalties, temperature, top-k/top-p/min-p) is ``p`` is accepted with probability
  ``min(1, p(d) / q(d))``; on rejection the token is drawn from ``norm(max(0, p - q))``. Our
  drafts are deterministic (``q`` is one-hot at ``d``: n-gram lookup, and the draft model's
  argmax), so acceptance is ``p(d)`` and the residual is ``p`` without ``d``, renormalised.
  Each output token is then distributed exactly as the target's (Leviathan et al., appendix A.1).

Proposers: :class:`NgramProposer` (prompt lookup decoding, Saxena 2023: the continuation of the
latest earlier occurrence of the request's last ``n`` tokens) and
:class:`kvserve.engine.draft_model.DraftModelProposer` (a smaller model of the same tokenizer with its own
paged KV cache).

The engine's side (:class:`Speculator`): before each step it asks the proposer for the running
requests' drafts, their lengths from the policy below; after the step it records what the target
accepted (the policy's estimates, the ``spec_decode_*`` counters).

Back-off (:class:`DraftLengthPolicy`): a request drafts only as many tokens as its estimated
acceptance pays for against the measured cost of a query row, and none while drafts keep being
rejected (probing again later).

Modules: :mod:`kvserve.engine.spec_config` (:class:`SpeculativeConfig`), :mod:`kvserve.engine.ngram_proposer`
(:class:`NgramProposer`), :mod:`kvserve.engine.draft_length` (:class:`DraftLengthPolicy`), and this one
(:class:`Speculator`; it re-exports the others' names).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from kvserve.engine.draft_length import DraftLengthPolicy
from kvserve.engine.ngram_proposer import NgramProposer
from kvserve.engine.request import Request
from kvserve.engine.sched_output import SchedulerOutput
from kvserve.engine.spec_config import METHODS, SpeculativeConfig
from kvserve.engine.stats import IterationStats

__all__ = ["METHODS", "DraftLengthPolicy", "NgramProposer", "SpeculativeConfig", "Speculator"]

logger = logging.getLogger("kvserve.engine")


class Speculator:
    """The engine's side of speculative decoding: :meth:`propose` before a step sets the
    running requests' drafts, :meth:`record` after it feeds what the target accepted back into
    :attr:`policy` and the counters. Nothing raises out of :meth:`propose`: a proposer or policy
    that raises on a request, or proposes ids outside the vocabulary, turns drafting off for that
    request alone (``Request.spec_disabled``), which goes on without drafts.

    Args:
        config: the speculative config.
        proposer: a :class:`NgramProposer` or an ``kvserve.engine.draft_model.DraftModelProposer``.
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
            if (
                req.num_tokens - req.num_computed_tokens == 1
                and req.grammar is None
                and not req.spec_disabled
                and req.max_output_tokens - req.num_output_tokens > 1
            ):
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
                    req.spec_token_ids = self._checked_drafts(
                        draft[: p.draft_length(req.request_id, len(draft), batch)]
                    )
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
            logger.warning(
                "draft model failed on a batch of %d (%s: %s); retrying each request alone",
                len(want),
                type(e).__name__,
                e,
            )
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

    def record(self, sched: SchedulerOutput, m: IterationStats | None) -> None:
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
        logger.error(
            "speculative decoding turned off for request %s: its proposer failed: %s: %s",
            req.request_id,
            type(error).__name__,
            error,
            exc_info=error,
        )
        req.spec_disabled, req.spec_token_ids = True, []
        try:
            self.release(req)
        except Exception:
            logger.exception("releasing the draft state of request %s failed", req.request_id)
