"""Priority preemption on a real engine (the tiny Llama, float32, greedy): a request of better
priority that arrives while ``max_num_seqs`` requests of worse priority run enters the very next
step, and the request it preempted (by recompute) still ends with the tokens it gives alone.
The scheduler's rule itself, without a model: ``test_scheduler.py``."""

from __future__ import annotations

import pytest

from _features_helpers import assert_engine_empty, greedy
from kvserve.engine import LLM
from kvserve.engine.request import RequestStatus

BLOCK = 4
LOW, HIGH = 5, 0  # priorities: lower runs first


@pytest.fixture(scope="module")
def llm(tiny_llama_path):
    engine = LLM(
        model=str(tiny_llama_path),
        dtype="float32",
        block_size=BLOCK,
        num_kv_blocks=96,
        max_num_seqs=2,
        max_model_len=128,
        scheduling_policy="priority",
        enable_prefix_caching=True,
    )
    try:
        yield engine
    finally:
        engine.engine.shutdown()


def test_a_better_request_preempts_a_full_batch_and_the_victim_keeps_its_tokens(llm):
    tok = llm.tokenizer
    prompts = {
        "low0": tok.encode("The history of the river valley begins"),
        "low1": tok.encode("A recipe for bread needs flour, water and"),
        "high": tok.encode("Quick answer:"),
    }
    lengths = {"low0": 32, "low1": 32, "high": 6}
    alone = {}  # each request run alone: the reference
    for rid, ids in prompts.items():
        out = llm.generate([ids], greedy(max_tokens=lengths[rid], ignore_eos=True), use_tqdm=False)[0]
        alone[rid] = out.outputs[0].token_ids
        assert len(alone[rid]) == lengths[rid]
    eng, sched = llm.engine, llm.engine.scheduler
    assert eng.reset_prefix_cache()  # the prompts start uncached: a hit below is the victim's own blocks

    final = {}

    def step():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o.outputs[0].token_ids

    for rid in ("low0", "low1"):
        eng.add_request(rid, prompts[rid], greedy(max_tokens=lengths[rid], ignore_eos=True), priority=LOW)
    victim = sched.requests["low1"]  # the lower priority's latest arrival
    while victim.num_output_tokens < 10:
        step()
    assert [r.request_id for r in sched.running] == ["low0", "low1"]  # max_num_seqs = 2: the batch is full
    made = victim.num_output_tokens
    tokens_before = list(victim.all_token_ids)

    eng.add_request("high", prompts["high"], greedy(max_tokens=lengths["high"], ignore_eos=True), priority=HIGH)
    high = sched.requests["high"]
    step()  # the next step takes the better request in place of the victim
    assert high.status is RequestStatus.RUNNING and high.num_output_tokens == 1
    assert victim.status is RequestStatus.PREEMPTED and victim.metrics.num_preemptions == 1
    assert victim.all_token_ids == tokens_before and victim.num_output_tokens == made  # nothing discarded
    assert sched.requests["low0"].status is RequestStatus.RUNNING  # only the worst one gave way

    while eng.has_unfinished_requests():
        step()
    assert final == alone  # every request, the victim too, with exactly its tokens alone
    # the victim resumed from its own cached blocks: at least its full blocks but the last
    assert victim.metrics.num_cached_tokens >= (len(tokens_before) - 1) // BLOCK * BLOCK - BLOCK
    assert eng.get_stats()["num_preemptions"] >= 1
    assert_engine_empty(llm)
