"""What the engine hardening tests share (``test_bad_requests.py``, ``test_engine_failures.py``,
``test_mixed_step_budget.py``, ``test_tokenization_off_loop.py``): prompts, a tiny-model engine
factory, running requests to their end, the idle-engine check and a fresh async engine per test."""

from __future__ import annotations

from kvserve.engine import EngineConfig
from kvserve.engine.llm_engine import LLMEngine
from tiny_models import run_async_engine

TIMEOUT = 60
PROMPTS = [
    "The quick brown fox",
    "Once upon a time",
    "In the beginning was",
    "1, 2, 3,",
    "Hello there, how are",
    "A B C D E",
    "import torch\nimport",
    "The capital of France",
]


def make_engine(path, **kw) -> LLMEngine:
    cfg = dict(
        model=str(path), block_size=16, max_num_seqs=8, max_num_batched_tokens=256, num_kv_blocks=64, max_model_len=512
    )
    cfg.update(kw)
    return LLMEngine(EngineConfig(**cfg))


def assert_idle(engine: LLMEngine):
    assert engine.scheduler.requests == {} and not engine.has_unfinished_requests()
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_blocks
    kv.pool.check()


def run_all(engine: LLMEngine, reqs) -> dict:
    """Enqueue (request, ...) and step until all finish; returns {request_id: final output}."""
    for r in reqs:
        engine.enqueue(r)
    done = {}
    for _ in range(10_000):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("requests never finished")


def arun(coro_fn, path, **kw):
    """Run ``coro_fn(async_engine)`` on a fresh engine over ``path``, then shut it down."""
    return run_async_engine(coro_fn, make_engine(path, **kw), TIMEOUT)


async def collect(agen):
    return [o async for o in agen]
