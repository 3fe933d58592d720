"""Speculative decoding's greedy output equals HF transformers' greedy output token for token:
SmolLM2 with n-gram drafts (adaptive or not; batched, with prefix-cache hits, chunked prefill and
preemption) and drafting for itself, and tiny models with a different random draft model (every
rollback path). SmolLM2's HF references are the session cache of ``test_correctness.py``
(``hf_greedy``): both files run in one pytest-xdist worker (``SHARED_GROUPS``, tests/conftest.py)."""

from __future__ import annotations

import pytest

from _spec_decode_helpers import COPY_PROMPTS, NGRAM, spec_greedy
from kvserve.engine import SamplingParams
from helpers import sized
from test_correctness import SMOLLM2_REF_TOKENS, assert_same, hf_greedy, smollm2_prompt_ids
from tiny_models import make_tiny_model


@pytest.mark.slow
class TestSmolLM2:
    #: Tokens compared (48 in the thorough profile, 24 in the fast one: HF's references, most of
    #: this class's time, are per token).
    NEW = SMOLLM2_REF_TOKENS

    @pytest.fixture(scope="class")
    def case(self, smollm2_path):
        from kvserve.engine.model_loader import load_tokenizer

        tok = load_tokenizer(smollm2_path)
        ids = smollm2_prompt_ids(smollm2_path) + [tok.encode(p) for p in COPY_PROMPTS]  # the profile's size
        return smollm2_path, ids, hf_greedy(smollm2_path, ids, self.NEW)

    @pytest.mark.parametrize("adaptive", [False, True])
    def test_ngram_batched_equals_hf(self, case, adaptive):
        path, ids, ref = case
        got, stats, llm = spec_greedy(path, ids, self.NEW, dict(NGRAM, adaptive=adaptive))
        assert_same(ref, got)
        assert stats["spec_decode_num_accepted_tokens"] > sized(16, 50), stats  # drafts were accepted, many
        assert stats["spec_decode_num_draft_tokens"] >= stats["spec_decode_num_accepted_tokens"]
        # second round: every prompt is a prefix-cache hit now
        again = llm.generate(ids, SamplingParams(max_tokens=self.NEW, temperature=0, ignore_eos=True), use_tqdm=False)
        assert_same(ref, [o.outputs[0].token_ids for o in again])
        assert llm.get_stats()["prefix_cache_hit_rate"] > 0.3

    def test_ngram_chunked_and_preempted_equals_hf(self, case):
        path, ids, ref = case
        # too few blocks for the profile's prompts at once (9 of them in the fast profile, 15 in the thorough)
        got, stats, _ = spec_greedy(
            path, ids, self.NEW, dict(NGRAM, adaptive=False), num_kv_blocks=sized(16, 40), max_num_batched_tokens=64
        )
        assert_same(ref, got)
        assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0

    def test_draft_model_equals_hf(self, case):
        """SmolLM2 drafting for itself: every draft is accepted (the bonus-token path), and the
        output still equals HF's."""
        path, ids, ref = case
        got, stats, llm = spec_greedy(
            path,
            ids[:6],
            self.NEW,
            {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3, "adaptive": False},
        )
        assert_same(ref[:6], got)
        assert stats["spec_decode_acceptance_rate"] == 1.0
        assert stats["spec_decode_mean_acceptance_length"] > 3.5
        proposer = llm.engine.speculator.proposer
        assert proposer.kv.pool.num_free_blocks == proposer.kv.num_blocks and not proposer.shadows


@pytest.mark.parametrize("arch", [pytest.param("llama", marks=pytest.mark.thorough), "qwen3"])
def test_tiny_draft_model_equals_hf(tmp_path, arch):
    """A different random draft (same vocabulary): mostly rejected drafts, every rollback path,
    with chunked prefill and preemption; greedy output equals HF's for the target. The Llama
    target is the thorough profile's: the fast one takes every rollback path with the Qwen3
    target (q/k norms too), and its draft is a Llama."""
    target = make_tiny_model(tmp_path / "target", arch=arch, initializer_range=0.2, num_hidden_layers=3)
    draft = make_tiny_model(tmp_path / "draft", arch="llama", seed=5, initializer_range=0.2)
    ids = [[1, 2, 3, 4, 5, 1, 2, 3], list(range(200, 290)), [7] * 20, [4000, 17, 4000, 17, 4000]]
    ref = hf_greedy(target, ids, 24)
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "adaptive": False}
    for kw in ({}, {"max_num_batched_tokens": 16, "num_kv_blocks": 30, "block_size": 4}):
        got, stats, _ = spec_greedy(target, ids, 24, spec, **kw)
        assert_same(ref, got)
        assert stats["spec_decode_num_draft_tokens"] > 0
