"""The output processor finds stop strings and returns them; the scheduler acts on them
(``Scheduler.finish_stopped``: drops the step's tokens after the stop, finishes the request and
frees its blocks). A real tokenizer and scheduler, tokens appended through the scheduler's own
update (several per step, as with speculative decoding)."""

import pytest

from kvserve.engine.kv_cache_manager import KVCacheManager
from kvserve.engine.model_loader import load_tokenizer
from kvserve.engine.output_processor import OutputProcessor, StopStringMatch
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling_params import SamplingParams
from kvserve.engine.scheduler import Scheduler

NUM_BLOCKS, BLOCK_SIZE = 16, 4


@pytest.fixture(scope="module")
def tok(tiny_llama_path):
    return load_tokenizer(tiny_llama_path)


def running(tok, params, rid="r"):
    """A scheduler with one request whose prompt is computed (its first token sampled), and the
    output processor that knows it."""
    sched = Scheduler(KVCacheManager(NUM_BLOCKS, BLOCK_SIZE, True), 4, 64)
    req = Request(rid, tok.encode("Say:"), params, {tok.eos_token_id})
    finished = []
    out = OutputProcessor(tok, finished.append)
    sched.add_request(req)
    out.add_request(req)
    first = tok.encode(" one", add_special_tokens=False)[0]
    sched.update_from_output(sched.schedule(), {rid: first}, {rid: {first: -0.1}})
    out.detokenize([req])
    return sched, out, req, finished


def step(sched, req, tokens):
    """One decode step that verifies ``len(tokens) - 1`` drafts and accepts them all: the
    scheduler appends ``tokens``."""
    req.spec_token_ids = list(tokens[:-1])
    so = sched.schedule()
    assert so.requests[0].spec_token_ids == tokens[:-1]
    return sched.update_from_output(so, {req.request_id: list(tokens)}, {req.request_id: [{t: -0.5} for t in tokens]})


def test_stop_string_mid_step_is_returned_then_the_scheduler_acts(tok):
    words = tok.encode(" alpha beta gamma delta", add_special_tokens=False)
    stop_at = next(i for i in range(len(words)) if "beta" in tok.decode(words[: i + 1]))
    sched, out, req, finished = running(tok, SamplingParams(max_tokens=20, stop=["beta"], logprobs=1))
    tokens_before = list(req.all_token_ids)
    updated = step(sched, req, words)
    assert updated == [req] and req.new_token_ids == words
    found = out.detokenize(updated)
    assert found.failed == [] and found.stops == [StopStringMatch(req, "beta", len(words) - 1 - stop_at)]
    # the output processor changed nothing: the request still runs, with all its tokens and blocks
    assert req.status is RequestStatus.RUNNING and req.all_token_ids == tokens_before + words
    assert sched.kv.pool.num_free_blocks < NUM_BLOCKS and "r" in sched.requests
    stop = found.stops[0]
    sched.finish_stopped(stop.request, stop.stop, stop.num_dropped_tokens)
    assert req.status is RequestStatus.FINISHED_STOPPED and req.stop_reason == "beta"
    assert req.all_token_ids == tokens_before + words[: stop_at + 1] and req.new_token_ids == words[: stop_at + 1]
    assert len(req.logprobs) == req.num_output_tokens
    assert "r" not in sched.requests and sched.kv.pool.num_free_blocks == NUM_BLOCKS
    outputs, failed = out.make_outputs(updated)
    assert failed == [] and finished == [req]
    c = outputs[0].outputs[0]
    assert outputs[0].finished and (c.finish_reason, c.stop_reason) == ("stop", "beta")
    assert c.token_ids == req.output_token_ids and c.delta_token_ids == words[: stop_at + 1]
    assert c.text == tok.decode(req.output_token_ids).split("beta")[0] and out.detokenizers == {}


def test_a_stop_string_before_the_length_limit_makes_it_a_stop(tok):
    """The step's last allowed token finished the request by length (freed in the update); a stop
    string earlier in the step turns it into a stop and drops the tokens after it."""
    words = tok.encode(" alpha beta gamma delta", add_special_tokens=False)
    stop_at = next(i for i in range(len(words)) if "beta" in tok.decode(words[: i + 1]))
    sched, out, req, _ = running(tok, SamplingParams(max_tokens=1 + len(words), stop=["beta"]))
    step(sched, req, words)
    assert req.status is RequestStatus.FINISHED_LENGTH and sched.kv.pool.num_free_blocks == NUM_BLOCKS
    (stop,) = out.detokenize([req]).stops
    sched.finish_stopped(stop.request, stop.stop, stop.num_dropped_tokens)
    assert (req.status, req.stop_reason, req.new_token_ids) == (
        RequestStatus.FINISHED_STOPPED,
        "beta",
        words[: stop_at + 1],
    )


def test_finish_stopped_keeps_failed_requests_and_checks_its_count(tok):
    sched, out, req, _ = running(tok, SamplingParams(max_tokens=20))
    step(sched, req, [5, 6])
    with pytest.raises(ValueError, match=r"num_dropped_tokens must be in \[0, 2\]"):
        sched.finish_stopped(req, "x", 3)
    sched.finish(req, RequestStatus.FINISHED_ERROR)
    sched.finish_stopped(req, "x", 1)
    assert req.status is RequestStatus.FINISHED_ERROR and req.stop_reason is None
    # no stop string, no detokenizer (detokenize=False): nothing to return
    sched, out, req, _ = running(tok, SamplingParams(max_tokens=20, detokenize=False), rid="ids")
    step(sched, req, [5, 6])
    assert out.detokenize([req]).stops == [] and req.status is RequestStatus.RUNNING


def test_a_detokenizer_that_raises_is_returned_as_failed(tok):
    sched, out, req, _ = running(tok, SamplingParams(max_tokens=20, stop=["zz"]))
    step(sched, req, [5])

    class Broken:
        def update(self, ids):
            raise RuntimeError("boom")

    out.detokenizers["r"] = Broken()
    found = out.detokenize([req])
    assert found.stops == [] and [(r, str(e)) for r, e in found.failed] == [(req, "boom")]
    assert req.status is RequestStatus.RUNNING  # the engine fails it, not the output processor
