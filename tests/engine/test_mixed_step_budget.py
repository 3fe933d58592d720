"""Mixed steps (decodes + prefill) get a prefill cap sized from measured step times
(``kvserve/engine/mixed_step_budget.py``): the budget's arithmetic, and a long prompt that arrives while
two streams decode on the tiny Llama is chunked at the cap with the uncapped engine's outputs. The
engine's default budget is checked in ``test_bad_requests.py`` (it uses that file's engine)."""

from __future__ import annotations

import math

from _hardening_helpers import PROMPTS, make_engine, run_all
from kvserve.engine import SamplingParams
from kvserve.engine.mixed_step_budget import MixedStepBudget


def test_mixed_step_budget_from_step_times():
    b = MixedStepBudget(slowdown=3.0, max_tokens=2048)
    assert b.tokens == 256  # nothing measured yet
    b.record(2048 * 1.6e-3, 2048, 0)  # a prefill-only step: 1.6 ms per token
    assert b.tokens == 256  # no decode-only step yet
    for _ in range(20):
        b.record(0.05, 0, 8)  # decode-only steps of 50 ms
    assert math.isclose(b.decode_s, 0.05)
    assert b.tokens == int(2 * 0.05 / 1.6e-3)  # 62 tokens take 2 x 50 ms more than a decode step
    # mixed steps with a fixed overhead E of 30 ms: the budget converges to steps of 3 x D
    for _ in range(60):
        n = b.tokens
        b.record(0.05 + 0.03 + n * 1.6e-3, n, 8)
    assert abs((0.05 + 0.03 + b.tokens * 1.6e-3) / 0.05 - 3.0) < 0.1
    fast = MixedStepBudget(slowdown=3.0, max_tokens=512)
    fast.record(0.001, 2048, 0)
    fast.record(0.005, 0, 8)
    assert fast.tokens == 512  # clamped to the step budget
    slow = MixedStepBudget(slowdown=1.5, max_tokens=512)
    slow.record(20.0, 100, 0)
    slow.record(0.005, 0, 8)
    assert slow.tokens == slow.min_tokens == 8  # at least min_tokens, so prefills progress


def test_mixed_step_cap_keeps_outputs_and_bounds_prefill(tiny_llama_path):
    """A long prompt arriving while two streams decode is chunked at the cap in steps that
    carry decodes; greedy outputs equal those of the uncapped engine."""
    long_prompt = list(range(1000, 1300))
    outs = {}
    for cap in (0, 16):
        eng = make_engine(tiny_llama_path, mixed_step_prefill_tokens=cap, enable_prefix_caching=False)
        try:
            steps = []
            schedule = eng.scheduler.schedule

            def recording(schedule=schedule, steps=steps):
                out = schedule()
                steps.append([(len(sr.token_ids), sr.new is None and len(sr.token_ids) == 1) for sr in out.requests])
                return out

            eng.scheduler.schedule = recording
            for i in range(2):
                eng.add_request(f"s{i}", PROMPTS[i], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
            eng.step()
            eng.step()
            got = run_all(eng, [eng.make_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=4))])
            outs[cap] = {k: v.outputs[0].token_ids for k, v in got.items()}
            mixed = [s for s in steps if any(d for _, d in s)]
            prefill = [sum(n for n, d in s if not d) for s in mixed]
            if cap:
                assert max(prefill) == 16 and sum(prefill) == 300
            else:
                assert max(prefill) == 254  # the whole budget after the two decodes
        finally:
            eng.shutdown()
    assert outs[0] == outs[16]
