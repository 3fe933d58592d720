"""Speculative decoding (``engine/spec_decode.py``, ``engine/draft_model.py``): greedy output equals
HF transformers' greedy output (SmolLM2 and tiny models; batched, with prefix-cache hits,
chunked prefill and preemption), the rejection sampler draws from the target's distribution
(chi-square, on the sampler and on a tiny model's next-token distribution), rejected drafts'
blocks return to the pool, stop strings / stop tokens / max_tokens cut inside a verified run,
and the counters add up."""
from __future__ import annotations

import asyncio
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.kv_cache_manager import KVCacheManager
from engine.layers.sampler import Sampler, SamplingRow
from engine.request import Request
from engine.scheduler import Scheduler
from engine.spec_decode import DraftLengthPolicy, NgramProposer, SpeculativeConfig
from test_correctness import assert_same, hf_greedy, prompt_ids
from tiny_models import make_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
#: prompts whose continuations copy from the prompt (drafts hit) next to ones that do not
COPY_PROMPTS = [
    "Repeat this sentence exactly: The quick brown fox jumps over the lazy dog near the river bank.\n"
    "The quick brown fox",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef add(a, b):\n",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 2, 3, 4, 5,",
]


class StepCostClock:
    """A deterministic clock for the adaptive draft-length policy: each reading advances by
    ``a + b * rows`` seconds, ``rows`` being the query rows of the engine's running requests
    (their last token plus their drafts), so the step time the engine measures (two readings
    around the model call) follows a linear cost model whatever the host is doing. With real
    time, a test's draft counts depend on the machine and its load."""

    def __init__(self, engine, a: float = 0.010, b: float = 0.0005):
        self.engine, self.a, self.b, self.t = engine, a, b, 0.0

    def __call__(self) -> float:
        rows = sum(1 + len(r.spec_token_ids) for r in self.engine.scheduler.running)
        self.t += self.a + self.b * rows
        return self.t


def spec_greedy(path, ids, new_tokens, spec, **kw):
    """Greedy outputs of an engine with speculation ``spec``, in float32 unless ``kw`` says
    otherwise: they are compared token for token with float32 references (HF, or the engine
    without speculation), and verifying k drafted tokens in one step changes the matmul shapes,
    so bfloat16 (``dtype="auto"`` on a CPU with native bf16) may round a near tie either way."""
    kw.setdefault("dtype", "float32")
    llm = LLM(model=str(path), speculative_config=spec, **kw)
    llm.engine.clock = StepCostClock(llm.engine)
    outs = llm.generate(ids, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"], "blocks leaked"
    llm.engine.scheduler.kv.pool.check()
    return [o.outputs[0].token_ids for o in outs], stats, llm


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


@pytest.mark.parametrize("bad,match", [
    ({"method": "medusa", "num_speculative_tokens": 2}, "method"),
    ({"method": "ngram"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "exceeds"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs 'model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "typo": 1}, "unknown key"),
    ("ngram", "must be a dict"),
])
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


# ---------------------------------------------------------------- rejection sampling

def chi2_sf(stat: float, dof: int) -> float:
    """Chi-square survival function (p-value): the regularised upper incomplete gamma."""
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson chi-square of ``counts`` against ``probs`` (bins under ``min_expected`` merged)."""
    n = counts.sum().item()
    exp = probs.double() * n
    big = exp >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    e = torch.cat([exp[big], exp[~big].sum()[None]])
    keep = e > 0
    stat = float(((obs[keep] - e[keep]) ** 2 / e[keep]).sum())
    if (obs[~keep] > 0).any():
        return 0.0
    return chi2_sf(stat, int(keep.sum()) - 1)


@pytest.mark.parametrize("draft", ["likely", "unlikely"])
def test_rejection_sampler_draws_from_the_target_distribution(draft):
    """20,000 rows with one-hot drafts (the most likely token: mostly accepted; an unlikely one:
    mostly rejected, then the residual draw) under temperature, top-k and a penalty: the row
    tokens follow the target's final distribution."""
    g = torch.Generator().manual_seed(0)
    vocab, n = 12, 20000
    logits = torch.randn(vocab, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=8, presence_penalty=0.5)
    hist = [3]
    # the target: penalties, then temperature, then top-k
    ref = logits.clone()
    ref[3] -= 0.5
    ref = ref / 0.8
    ref[ref < ref.topk(8).values[-1]] = float("-inf")
    probs = ref.softmax(-1)
    d = int(probs.argmax()) if draft == "likely" else int(probs.argsort(descending=True)[3])
    rows = [SamplingRow(params, None, [1], hist, [], d) for _ in range(n)]
    torch.manual_seed(1)
    tokens, _, accepted = Sampler()(logits.expand(n, vocab).clone(), rows)
    counts = torch.bincount(torch.tensor(tokens), minlength=vocab)
    assert 0.05 < sum(accepted) / n < 0.95 or draft == "likely"
    assert all(t == d for t, a in zip(tokens, accepted) if a)
    assert _chi2_pvalue(counts, probs) > 1e-3, (counts, probs * n)
    # the residual matters: rejected rows never carry the draft
    assert all(t != d for t, a in zip(tokens, accepted) if not a)


def test_greedy_verification_accepts_only_the_argmax():
    logits = torch.tensor([[0.0, 2.0, 1.0], [3.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0)
    tokens, _, acc = Sampler()(logits, [SamplingRow(p, None, [], [], [], 1), SamplingRow(p, None, [], [], [], 2)])
    assert tokens == [1, 0] and acc == [True, False]


@pytest.mark.slow
def test_tiny_model_sampled_distribution_matches_hf(tmp_path):
    """3,000 sampled requests of 3 tokens with a draft model (the target itself, so drafts are
    its argmax: accepted with probability p(argmax), else the residual draw): the second token,
    whose draft was verified, follows HF's next-token distribution given the prompt and the
    first token (chi-square per first token, combined)."""
    path = make_tiny_model(tmp_path / "t", arch="llama", initializer_range=1.0, num_hidden_layers=2)
    prompt = [101, 2045, 7, 99, 3003]  # (weights this large give peaked next-token distributions)
    n = 3000
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=4096, speculative_config={
        "method": "draft_model", "model": str(path), "num_speculative_tokens": 1, "adaptive": False})
    outs = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True), use_tqdm=False)
    stats = llm.get_stats()
    assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
    assert stats["spec_decode_num_draft_tokens"] >= n  # every second token was a verified draft
    rate = stats["spec_decode_acceptance_rate"]
    assert 0.02 < rate < 0.98, rate  # both the accept and the reject paths ran
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    by_first: dict[int, list[int]] = {}
    for o in outs:
        t = o.outputs[0].token_ids
        by_first.setdefault(t[0], []).append(t[1])
    stat, dof = 0.0, 0
    groups = [(f, s) for f, s in by_first.items() if len(s) >= 150]
    assert sum(len(s) for _, s in groups) > n // 2
    for first, seconds in groups:
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + [first]])).logits[0, -1]
        probs = logits.softmax(-1)
        counts = torch.bincount(torch.tensor(seconds), minlength=probs.numel())
        exp = probs.double() * len(seconds)
        big = exp >= 5
        obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
        e = torch.cat([exp[big], exp[~big].sum()[None]])
        stat += float(((obs - e) ** 2 / e).sum())
        dof += int(big.sum())
    assert chi2_sf(stat, dof) > 1e-3, (stat, dof)


# ---------------------------------------------------------------- greedy equality with HF

@pytest.mark.slow
class TestSmolLM2:
    NEW = 48

    @pytest.fixture(scope="class")
    def case(self, smollm2_path):
        from engine.model_loader import load_tokenizer
        tok = load_tokenizer(smollm2_path)
        ids = prompt_ids(smollm2_path) + [tok.encode(p) for p in COPY_PROMPTS]
        return smollm2_path, ids, hf_greedy(smollm2_path, ids, self.NEW)

    @pytest.mark.parametrize("adaptive", [False, True])
    def test_ngram_batched_equals_hf(self, case, adaptive):
        path, ids, ref = case
        got, stats, llm = spec_greedy(path, ids, self.NEW, dict(NGRAM, adaptive=adaptive))
        assert_same(ref, got)
        assert stats["spec_decode_num_accepted_tokens"] > 50, stats
        assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
        # second round: every prompt is a prefix-cache hit now
        again = llm.generate(ids, SamplingParams(max_tokens=self.NEW, temperature=0, ignore_eos=True), use_tqdm=False)
        assert_same(ref, [o.outputs[0].token_ids for o in again])
        assert llm.get_stats()["prefix_cache_hit_rate"] > 0.3

    def test_ngram_chunked_and_preempted_equals_hf(self, case):
        path, ids, ref = case
        got, stats, _ = spec_greedy(path, ids, self.NEW, dict(NGRAM, adaptive=False), num_kv_blocks=40,
                                    max_num_batched_tokens=64)
        assert_same(ref, got)
        assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0

    def test_draft_model_equals_hf(self, case):
        """SmolLM2 drafting for itself: every draft is accepted (the bonus-token path), and the
        output still equals HF's."""
        path, ids, ref = case
        got, stats, llm = spec_greedy(path, ids[:6], self.NEW, {
            "method": "draft_model", "model": str(path), "num_speculative_tokens": 3, "adaptive": False})
        assert_same(ref[:6], got)
        assert stats["spec_decode_acceptance_rate"] == 1.0
        assert stats["spec_decode_mean_acceptance_length"] > 3.5
        proposer = llm.engine.speculator.proposer
        assert proposer.kv.pool.num_free_blocks == proposer.kv.num_blocks and not proposer.shadows


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_tiny_draft_model_equals_hf(tmp_path, arch):
    """A different random draft (same vocabulary): mostly rejected drafts, every rollback path,
    with chunked prefill and preemption; greedy output equals HF's for the target."""
    target = make_tiny_model(tmp_path / "target", arch=arch, initializer_range=0.2, num_hidden_layers=3)
    draft = make_tiny_model(tmp_path / "draft", arch="llama", seed=5, initializer_range=0.2)
    ids = [[1, 2, 3, 4, 5, 1, 2, 3], list(range(200, 290)), [7] * 20, [4000, 17, 4000, 17, 4000]]
    ref = hf_greedy(target, ids, 24)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    for kw in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 30, "block_size": 4}):
        got, stats, _ = spec_greedy(target, ids, 24, spec, **kw)
        assert_same(ref, got)
        assert stats["spec_decode_num_draft_tokens"] > 0


# ---------------------------------------------------------------- stops, streaming, seeds

@pytest.mark.slow
def test_stop_strings_tokens_and_max_tokens_cut_inside_a_verified_run(smollm2_path):
    base = LLM(model=str(smollm2_path), dtype="float32")  # token for token: see spec_greedy
    spec = LLM(model=str(smollm2_path), dtype="float32", speculative_config=dict(NGRAM, adaptive=False))
    prompt = COPY_PROMPTS[0]
    for params in (SamplingParams(max_tokens=40, temperature=0, stop=["lazy"]),
                   SamplingParams(max_tokens=40, temperature=0, stop=["river"], include_stop_str_in_output=True),
                   SamplingParams(max_tokens=5, temperature=0),
                   SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[base.engine.tokenizer.encode(" dog")[0]]),
                   SamplingParams(max_tokens=40, temperature=0, logprobs=2)):
        want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == \
            (want.token_ids, want.text, want.finish_reason, want.stop_reason), params
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)
    st = spec.get_stats()
    assert st["spec_decode_num_accepted_tokens"] > 0 and st["free_kv_blocks"] == st["num_kv_blocks"]


@pytest.mark.slow
def test_streaming_delivers_several_tokens_per_step_as_one_delta(smollm2_path):
    from engine.async_engine import AsyncLLMEngine
    from engine.config import EngineConfig

    async def run():
        eng = AsyncLLMEngine.from_config(EngineConfig(model=str(smollm2_path),
                                                      speculative_config=dict(NGRAM, adaptive=False)))
        try:
            deltas, text = [], ""
            async for out in eng.generate(COPY_PROMPTS[0], SamplingParams(max_tokens=30, temperature=0), "s1"):
                c = out.outputs[0]
                deltas.append(c.delta_token_ids)
                text += c.delta_text
            return deltas, text, c
        finally:
            await eng.shutdown()

    deltas, text, final = asyncio.run(run())
    assert max(len(d) for d in deltas) > 1  # a verified run arrived in one update
    assert sum(deltas, []) == final.token_ids and text == final.text


def test_seeded_sampling_is_reproducible_with_speculation(tmp_path):
    path = make_tiny_model(tmp_path / "t", arch="llama", initializer_range=0.3)
    llm = LLM(model=str(path), speculative_config={"method": "draft_model", "model": str(path),
                                                   "num_speculative_tokens": 2, "adaptive": False})
    p = SamplingParams(max_tokens=20, temperature=0.9, seed=123, ignore_eos=True)
    a = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate([[5, 6, 7]], p, use_tqdm=False)[0].outputs[0].token_ids
    assert a == b and len(a) == 20
    assert llm.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_no_hit_workload_does_not_draft(tmp_path):
    """Prompts with no repeated n-grams and a random model: the proposer finds nothing or the
    policy backs off, so almost no rows are spent on drafts."""
    path = make_tiny_model(tmp_path / "t", arch="llama", initializer_range=0.2)
    llm = LLM(model=str(path), speculative_config=NGRAM)
    llm.engine.clock = StepCostClock(llm.engine)
    ids = [list(range(1000 + 50 * i, 1030 + 50 * i)) for i in range(4)]
    llm.generate(ids, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)
    st = llm.get_stats()
    assert st["spec_decode_num_draft_tokens"] <= 0.25 * st["num_generated_tokens"], st
    assert math.isfinite(st["spec_decode_acceptance_rate"])


_METRICS = r"""
import json, os, sys, tempfile
os.environ["KVSERVE_METRICS_DIR"] = tempfile.mkdtemp(prefix="kvserve-metrics-")
from telemetry import metrics as M
from engine.stats import IterationStats
m = IterationStats(0.0, 0.1, 0, 3, 7, 3, 0, num_drafts=2, num_draft_tokens=6, num_accepted_tokens=4,
                accepted_per_position=[2, 1, 1])
e = M.PrometheusStatLogger("m", "r", speculative=True)
e.record_step(m)
e.record_step(m)
M.PrometheusStatLogger("plain", "r2").record_step(m)
print(M.render()[0].decode())
"""


def test_prometheus_spec_decode_series_use_vllm_names():
    """``kvserve:spec_decode_*`` (vLLM's names) count drafts, draft tokens, accepted tokens and
    accepted tokens per position, only for an engine that speculates."""
    import subprocess
    import sys
    from pathlib import Path
    root = Path(__file__).resolve().parents[2]
    r = subprocess.run([sys.executable, "-c", _METRICS], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in r.stdout.splitlines()
             if ln.startswith("kvserve:spec_decode")}
    lb = 'model_name="m",replica="r"'
    assert lines[f"kvserve:spec_decode_num_drafts_total{{{lb}}}"] == 4
    assert lines[f"kvserve:spec_decode_num_draft_tokens_total{{{lb}}}"] == 12
    assert lines[f"kvserve:spec_decode_num_accepted_tokens_total{{{lb}}}"] == 8
    per_pos = {k: v for k, v in lines.items() if k.startswith("kvserve:spec_decode_num_accepted_tokens_per_pos_total{")
               and 'model_name="m"' in k}
    assert sorted((k.split('position="')[1][0], v) for k, v in per_pos.items()) == [("0", 4), ("1", 2), ("2", 2)]
    assert not any('model_name="plain"' in k for k in lines)
