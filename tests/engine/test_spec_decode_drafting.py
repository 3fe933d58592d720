"""Drafting in speculative decoding (``kvserve/engine/spec_decode.py``), without a model: the n-gram proposer,
refused configurations, the adaptive draft-length policy (backs off, probes again, is defined for
any step times) and the scheduler's handling of drafts (rejected drafts' blocks return to the pool
and never enter the prefix cache; drafts never push past ``max_tokens`` or the token budget)."""

from __future__ import annotations

import math

import pytest

from kvserve.engine import SamplingParams
from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.scheduler import Scheduler
from kvserve.engine.spec_decode import DraftLengthPolicy, NgramProposer, SpeculativeConfig


# ---------------------------------------------------------------- proposer, config, policy


def test_ngram_proposer_takes_the_latest_longest_match():
    p = NgramProposer(min_n=2, max_n=3)
    #            0  1  2  3  4  5  6  7  8  9
    toks = [5, 6, 7, 1, 5, 6, 8, 2, 5, 6]
    assert p.propose(toks, 3) == [8, 2, 5]  # "5 6" occurs at 0 and 4: the latest (4) wins
    assert p.propose(toks + [7], 2) == [1, 5]  # n=3 first: "5 6 7" occurs only at 0
    assert p.propose([1, 2, 3, 4], 3) == []  # no earlier occurrence
    assert p.propose([9, 9], 3) == []  # too short for n >= 2 plus a continuation
    assert p.propose([4, 4, 4, 4, 4], 2) == [4]  # continuation clipped at the end
    assert NgramProposer(1, 1).propose([3, 1, 3], 2) == [1, 3]


@pytest.mark.parametrize(
    "bad,match",
    [
        ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
        ("ngram", "must be a dict"),
    ],
)
def test_bad_speculative_config_is_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig.from_dict(bad)


def test_draft_length_policy_backs_off_and_probes_again():
    pol = DraftLengthPolicy(max_k=5)
    assert pol.draft_length("r", 5, batch=1) > 0  # the prior drafts
    ks = []
    for _ in range(200):  # every draft rejected
        k = pol.draft_length("r", 5, batch=1)
        ks.append(k)
        pol.record_acceptance("r", k, 0)
    assert ks[20:].count(0) > 150 and sum(ks[100:]) <= 3  # backed off, probes ever rarer
    probes = [i for i, k in enumerate(ks) if k and i > 25]
    assert probes and all(b - a >= 2 for a, b in zip(probes, probes[1:]))
    good = DraftLengthPolicy(max_k=5)
    for _ in range(10):
        good.record_acceptance("g", 5, 5)
    assert good.draft_length("g", 5, batch=1) == 5
    # measured cost: rows cost 50 % of a step's fixed part -> lambda high -> fewer drafts
    for n in (1, 2, 4, 6) * 10:
        good.record_step(0.010 + 0.005 * n, n)
    a, b = good.step_cost()
    assert abs(a - 0.010) < 1e-6 and abs(b - 0.005) < 1e-6
    assert good.cost_lambda(1) == pytest.approx(0.005 / 0.015)


ADVERSARIAL_TIMES = {
    "decreasing": lambda i, n: 1.0 / (1 + i) - 0.001 * n,  # more rows, less time: a negative slope
    "rows_cheaper": lambda i, n: 0.05 - 0.004 * n,  # the crash on main: b < 0 clamped to 0, lam = 0
    "constant": lambda i, n: 0.02,
    "zero": lambda i, n: 0.0,
    "huge": lambda i, n: 1e300 * n,
    "nan": lambda i, n: math.nan,
    "inf": lambda i, n: math.inf if i % 2 else 0.01,
    "negative": lambda i, n: -0.5 * n,
    "mixed": lambda i, n: [0.01 * n, math.nan, -1.0, 1e9, 0.0, 1e-320][i % 6],
}


@pytest.mark.parametrize("times", sorted(ADVERSARIAL_TIMES))
@pytest.mark.parametrize("acceptance", ["all", "none", "half"])
def test_draft_length_policy_is_defined_for_any_step_times(times, acceptance):
    """Step times from a busy host, a jumping clock or a broken timer: the policy returns a
    length in [0, available] and never raises (on main, a negative fitted slope gave
    ``math.log(0)``: a ValueError out of ``LLMEngine.step`` for every stream of a replica)."""
    f = ADVERSARIAL_TIMES[times]
    for extra in (0.0, math.nan, -1.0, 1e300):
        pol = DraftLengthPolicy(max_k=4)
        pol.extra_cost_s = extra
        for i in range(60):
            n = 1 + i % 5
            pol.record_step(f(i, n), n)
            for rid in ("a", "b"):
                avail = i % 6
                k = pol.draft_length(rid, avail, batch=1 + i % 8)
                assert isinstance(k, int) and 0 <= k <= min(avail, 4)
                acc = {"all": k, "none": 0, "half": k // 2}[acceptance]
                pol.record_acceptance(rid, k, acc)
            lam = pol.cost_lambda(1 + i % 8)
            assert 0.0 < lam <= 1.0 and 0.0 <= pol.alpha("a") <= 1.0
            ab = pol.step_cost()
            assert ab is None or (ab[0] >= 0 and ab[1] >= 0 and all(map(math.isfinite, ab)))


def test_draft_length_policy_ignores_an_incredible_fit():
    """A negative slope is noise, not a cost: the prior lambda rules, and one that turns
    credible again is used."""
    pol = DraftLengthPolicy(max_k=4)
    for n in (1, 2, 3, 4) * 5:
        pol.record_step(0.05 - 0.004 * n, n)
    assert pol.step_cost() is None and pol.cost_lambda(4) == pol.prior_lambda
    pol.record_acceptance("r", 4, 4)
    assert 1 <= pol.draft_length("r", 4, batch=4) <= 4
    for n in (1, 2, 3, 4) * 200:  # the decayed sums forget the noise
        pol.record_step(0.010 + 0.002 * n, n)
    a, b = pol.step_cost()
    assert a == pytest.approx(0.010, rel=1e-3) and b == pytest.approx(0.002, rel=1e-3)


# ---------------------------------------------------------------- scheduler rollback


def test_rejected_drafts_return_their_blocks_and_never_enter_the_prefix_cache():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = Request("a", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=20, temperature=0))
    s.add_request(req)
    s.update_from_output(s.schedule(), {"a": 7})  # prefill + first token
    assert req.num_tokens == 7 and len(req.block_table) == 2
    req.spec_token_ids = [8, 9, 10, 11, 12, 13]  # positions 7..12 -> blocks 2 and 3
    out = s.schedule()
    (sr,) = out.requests
    assert sr.token_ids == [7, 8, 9, 10, 11, 12, 13] and sr.spec_token_ids == [8, 9, 10, 11, 12, 13]
    assert len(req.block_table) == 4 and kv.pool.num_free_blocks == 4
    s.update_from_output(out, {"a": [8, 42]})  # one draft accepted, then the target's 42
    assert req.all_token_ids[6:] == [7, 8, 42] and req.num_computed_tokens == 8
    assert len(req.block_table) == 3 and kv.pool.num_free_blocks == 5  # block 3 went back
    assert out.num_accepted == {"a": 1}
    cached = {kv.pool.block_hash[b] for b in req.block_table}
    assert len(kv.pool.cached) == 2 and None in cached  # blocks 0,1 computed; 2 holds 8, 42: not full
    kv.pool.check()


def test_drafts_never_push_past_max_tokens_or_the_budget():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=64)
    req = Request("a", [1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    s.add_request(req)
    s.update_from_output(s.schedule(), {"a": 7})
    req.spec_token_ids = [1, 2, 3, 4, 5]
    (sr,) = s.schedule().requests
    assert sr.spec_token_ids == [1, 2]  # 1 token out, 3 left: 2 drafts + the step's own token
    s2 = Scheduler(KVCacheManager(16, 4), max_num_seqs=4, max_num_batched_tokens=3)
    r2 = Request("b", [1], SamplingParams(max_tokens=50, temperature=0))
    s2.add_request(r2)
    s2.update_from_output(s2.schedule(), {"b": 5})
    r2.spec_token_ids = [1, 2, 3, 4]
    (sr,) = s2.schedule().requests
    assert len(sr.token_ids) == 3 and sr.spec_token_ids == [1, 2]
