"""Stream coalescing (``stream_interval``): held engine outputs are folded into the next chunk
with nothing lost; the first token and the last chunk go out at once."""

import pytest

from kvserve.deployments.replica.request_outputs import STREAMS_PER_STEP, ChunkBuilder, stream_interval
from kvserve.engine import LLMEngine, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_loader import load_tokenizer


def test_auto_interval_is_one_until_streams_per_step_then_grows():
    assert [stream_interval(0, n) for n in (0, 1, STREAMS_PER_STEP - 1)] == [1, 1, 1]
    assert stream_interval(0, STREAMS_PER_STEP) == 2
    assert stream_interval(0, 4 * STREAMS_PER_STEP) == 5
    assert stream_interval(3, 1000) == 3 and stream_interval(1, 1000) == 1  # a fixed setting wins


@pytest.fixture(scope="module")
def outputs(tiny_llama_path):
    """The engine's delta outputs of one request: 11 tokens with top-2 logprobs."""
    eng = LLMEngine(EngineConfig(model=str(tiny_llama_path), num_kv_blocks=64))
    params = SamplingParams(max_tokens=11, ignore_eos=True, temperature=0, logprobs=2)
    eng.add_request("r", list(range(1000, 1020)), params)
    outs = []
    while eng.has_unfinished_requests():
        outs += [o for o in eng.step() if o.request_id == "r"]
    eng.shutdown()
    return outs, params, load_tokenizer(str(tiny_llama_path))


@pytest.mark.parametrize("interval", [1, 3, 4, 11, 50])
def test_held_outputs_fold_into_the_next_chunk(outputs, interval):
    outs, params, tok = outputs
    assert len(outs) == 11 and outs[-1].finished
    reference = [ChunkBuilder(tok, params).chunk(o) for o in outs]  # one chunk per output
    builder = ChunkBuilder(tok, params)
    sent = [c for c in (builder.add(o, interval) for o in outs) if c is not None]
    # the first token alone, then every `interval` outputs, and the last at once
    assert len(sent[0].token_ids) == 1
    assert len(sent) == 1 + -(-(len(outs) - 1) // interval)
    assert sum((c.token_ids for c in sent), []) == outs[-1].outputs[0].token_ids
    assert "".join(c.text for c in sent) == "".join(c.text for c in reference)
    assert [lp.token for c in sent for lp in c.logprobs] == [lp.token for c in reference for lp in c.logprobs]
    assert [c.finished for c in sent] == [False] * (len(sent) - 1) + [True]
    last = sent[-1]
    assert (last.finish_reason, last.num_output_tokens) == ("length", 11)
