"""Verification of drafts in speculative decoding: the rejection sampler draws from the target's
distribution (chi-square, on the sampler and on a tiny model's next-token distribution against HF
transformers'), and greedy verification accepts only the argmax."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.layers.sampler import Sampler, SamplingRow
from tiny_models import make_tiny_model


def chi2_sf(stat: float, dof: int) -> float:
    """Chi-square survival function (p-value): the regularised upper incomplete gamma."""
    return float(
        torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    )


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
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_blocks=4096,
        speculative_config={
            "method": "draft_model",
            "model": str(path),
            "num_speculative_tokens": 1,
            "adaptive": False,
        },
    )
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
