"""What a speculating engine returns: stop strings, stop tokens and ``max_tokens`` cut inside a
verified run as without speculation, a verified run streams as one delta, seeded sampling is
reproducible, a workload without n-gram hits barely drafts, and the Prometheus series use vLLM's
``spec_decode`` names."""

from __future__ import annotations

import asyncio
import math

import pytest

from _spec_decode_helpers import COPY_PROMPTS, NGRAM, StepCostClock
from kvserve.engine import LLM, SamplingParams
from tiny_models import make_tiny_model


# ---------------------------------------------------------------- stops, streaming, seeds


@pytest.mark.slow
def test_stop_strings_tokens_and_max_tokens_cut_inside_a_verified_run(smollm2_path):
    base = LLM(model=str(smollm2_path), dtype="float32")  # token for token: see spec_greedy
    spec = LLM(model=str(smollm2_path), dtype="float32", speculative_config=dict(NGRAM, adaptive=False))
    prompt = COPY_PROMPTS[0]
    for params in (
        SamplingParams(max_tokens=40, temperature=0, stop=["lazy"]),
        SamplingParams(max_tokens=40, temperature=0, stop=["river"], include_stop_str_in_output=True),
        SamplingParams(max_tokens=5, temperature=0),
        SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[base.engine.tokenizer.encode(" dog")[0]]),
        SamplingParams(max_tokens=40, temperature=0, logprobs=2),
    ):
        want = base.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        got = spec.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason, got.stop_reason) == (
            want.token_ids,
            want.text,
            want.finish_reason,
            want.stop_reason,
        ), params
        if params.logprobs:
            assert len(got.logprobs) == len(got.token_ids)
            for a, b in zip(got.logprobs, want.logprobs):
                assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-3 for t in a)
    st = spec.get_stats()
    assert st["spec_decode_num_accepted_tokens"] > 0 and st["free_kv_blocks"] == st["num_kv_blocks"]


@pytest.mark.slow
def test_streaming_delivers_several_tokens_per_step_as_one_delta(smollm2_path):
    from kvserve.engine.async_engine import AsyncLLMEngine
    from kvserve.engine.config import EngineConfig

    async def run():
        eng = AsyncLLMEngine.from_config(
            EngineConfig(model=str(smollm2_path), speculative_config=dict(NGRAM, adaptive=False))
        )
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
    llm = LLM(
        model=str(path),
        speculative_config={
            "method": "draft_model",
            "model": str(path),
            "num_speculative_tokens": 2,
            "adaptive": False,
        },
    )
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
from kvserve.telemetry import metrics as M
from kvserve.engine.stats import IterationStats
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
    lines = {
        ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1])
        for ln in r.stdout.splitlines()
        if ln.startswith("kvserve:spec_decode")
    }
    lb = 'model_name="m",replica="r",variant=""'  # variant: the A/B test label, empty outside one
    assert lines[f"kvserve:spec_decode_num_drafts_total{{{lb}}}"] == 4
    assert lines[f"kvserve:spec_decode_num_draft_tokens_total{{{lb}}}"] == 12
    assert lines[f"kvserve:spec_decode_num_accepted_tokens_total{{{lb}}}"] == 8
    per_pos = {
        k: v
        for k, v in lines.items()
        if k.startswith("kvserve:spec_decode_num_accepted_tokens_per_pos_total{") and 'model_name="m"' in k
    }
    assert sorted((k.split('position="')[1][0], v) for k, v in per_pos.items()) == [("0", 4), ("1", 2), ("2", 2)]
    assert not any('model_name="plain"' in k for k in lines)
