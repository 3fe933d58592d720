"""What the tiny-model generation tests share (``test_generation_features.py``,
``test_penalties_and_eos.py``): greedy parameters, one request's output, the empty-engine check,
a repeat check and a 40-token prompt whose first two blocks a later request can reuse."""

from __future__ import annotations

from kvserve.engine import SamplingParams


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def gen1(llm, prompt, params):
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]


def assert_engine_empty(llm):
    eng = llm.engine
    assert not eng.has_unfinished_requests()
    assert eng.scheduler.requests == {} and eng.output_processor.detokenizers == {}
    assert eng.scheduler.kv.pool.num_free_blocks == eng.scheduler.kv.num_blocks
    eng.scheduler.kv.pool.check()


def _has_repeat(ids):
    return len(set(ids)) < len(ids)


PREFIX = list(range(1000, 1040))  # 40 tokens: a later request can reuse 2 full blocks
