"""A replica's bounded admission and per-request timeout, in-process (``LLMServer``'s class
without Serve) on a tiny random-weight model: what is admitted, what is refused (with a
``Retry-After`` estimate), and that every request leaves the engine with its KV blocks."""

import asyncio

import pytest

from kvserve.deployments.contract.config import ModelArgs
from kvserve.deployments.replica.admission import Admission, default_admission_bounds
from kvserve.deployments.replica.llm_server import LLMServer
from kvserve.deployments.contract.types import GenerateRequest
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny_admission"))


def _server(tiny, **kw):
    model = ModelArgs(
        model=str(tiny),
        served_model_name="tiny",
        torch_num_threads=1,
        max_num_seqs=kw.pop("max_num_seqs", 2),
        max_model_len=kw.pop("max_model_len", 256),
        num_kv_blocks=kw.pop("num_kv_blocks", 64),
        block_size=16,
        **kw,
    )
    return LLMServer.func_or_class(model)


async def _run(server, prompt, params, **kw):
    chunks = [c async for c in server.stream(GenerateRequest.of(prompt, params, **kw))]
    return chunks


def _assert_drained(server):
    s = server.engine.get_stats()
    assert s["num_running_requests"] == 0 and s["num_waiting_requests"] == 0
    assert s["free_kv_blocks"] == s["num_kv_blocks"]  # every block back in the pool
    assert server.admission.in_flight == 0 and server.admission.queued_requests == 0
    assert server.admission.queued_tokens == 0


def test_full_replica_refuses_at_once_and_admits_the_rest(tiny):
    server = _server(tiny, max_num_seqs=2, max_waiting_requests=2)  # 4 in flight at most

    async def main():
        try:
            return await asyncio.gather(
                *(_run(server, [1, 2, 3, 4 + i], {"max_tokens": 40, "ignore_eos": True}) for i in range(10))
            )
        finally:
            await server.engine.shutdown()

    results = asyncio.run(main())
    done = [r for r in results if r[-1].error is None]
    refused = [r for r in results if r[-1].error is not None]
    assert len(done) == 4 and len(refused) == 6, [r[-1].error for r in results]
    for r in done:
        assert r[-1].finished and r[-1].num_output_tokens == 40
    for r in refused:
        err = r[-1].error
        assert len(r) == 1 and err.code == "queue_full" and err.status == 429
        assert 1.0 <= err.retry_after_s <= 60.0
    assert server.engine.get_stats()["max_running_batch"] <= 2
    _assert_drained(server)


def test_prompt_over_the_token_bound_is_a_400_not_a_429(tiny):
    server = _server(tiny, max_queued_prompt_tokens=50)

    async def main():
        try:
            too_long = await _run(server, list(range(1, 101)), {"max_tokens": 2})
            fits = await _run(server, list(range(1, 41)), {"max_tokens": 2})
            return too_long, fits
        finally:
            await server.engine.shutdown()

    too_long, fits = asyncio.run(main())
    assert too_long[-1].error.code == "too_large" and too_long[-1].error.status == 400
    assert fits[-1].error is None and fits[-1].num_output_tokens == 2
    _assert_drained(server)


def test_request_timeout_ends_the_request_and_frees_its_blocks(tiny):
    # 2,000 tokens, one engine step each: far past the 0.3 s timeout on any CPU (240 tokens of the
    # tiny model once finished inside it where its bf16 decode runs in the C++ layer loop)
    server = _server(tiny, request_timeout_s=0.3, max_model_len=2048, num_kv_blocks=160)

    async def main():
        try:
            slow = await _run(server, [1, 2, 3], {"max_tokens": 2000, "ignore_eos": True})
            quick = await _run(server, [1, 2, 3], {"max_tokens": 2})
            return slow, quick
        finally:
            await server.engine.shutdown()

    slow, quick = asyncio.run(main())
    last = slow[-1]
    assert last.finished and last.error is not None and last.error.code == "timeout" and last.error.status == 504
    assert sum(len(c.token_ids) for c in slow) < 2000  # stopped early
    assert quick[-1].error is None  # the replica goes on
    _assert_drained(server)


def test_admission_bookkeeping_and_retry_after():
    adm = Admission(max_num_seqs=2, max_waiting_requests=1, max_prompt_tokens=100)
    assert adm.admit(60) is None and adm.admit(30) is None
    err = adm.admit(20)  # the queue holds 90 prompt tokens: 110 > 100
    assert err.code == "queue_full"
    adm.start(60)  # the first one got its first token: 30 tokens still queued
    assert adm.admit(20) is None  # 3 in flight = max_num_seqs + 1
    assert adm.admit(1).code == "queue_full"  # in-flight bound
    assert adm.admit(101).code == "too_large"
    adm.end(60, started=True)
    adm.end(30, started=False)
    adm.end(20, started=False)
    assert (adm.in_flight, adm.queued_requests, adm.queued_tokens) == (0, 0, 0)
    assert 1.0 <= adm.retry_after() <= 60.0
    with pytest.raises(ValueError):
        Admission(0, 1, 1)


def test_default_bounds_admit_a_full_batch_and_the_longest_prompt():
    req, tok = default_admission_bounds(64, 2048, 8192)
    assert (req, tok) == (1, 8192)
    assert default_admission_bounds(8, 512, 256) == (1, 2048)
    assert default_admission_bounds(256, 8192, 131072) == (4, 131072)


@pytest.mark.parametrize("interval,expected_chunks", [(1, 10), (4, 4), (0, 10)])
def test_replica_streams_every_interval_tokens_and_loses_none(tiny, interval, expected_chunks):
    """``stream_interval``: the first token at once, then a chunk every k outputs, the last at once;
    auto (0) sends every token while fewer than 16 requests are in flight. Text and ids are whole."""
    server = _server(tiny, stream_interval=interval)
    params = {"max_tokens": 10, "ignore_eos": True, "temperature": 0, "logprobs": 1}

    async def main():
        try:
            return await _run(server, [5, 6, 7], params)
        finally:
            await server.engine.shutdown()

    chunks = asyncio.run(main())
    assert len(chunks) == expected_chunks and len(chunks[0].token_ids) == 1
    ids = sum((c.token_ids for c in chunks), [])
    assert len(ids) == 10 and chunks[-1].finished and chunks[-1].num_output_tokens == 10
    assert [lp.token_id for c in chunks for lp in c.logprobs] == ids
    if interval > 1:  # greedy: the same tokens as a stream of every token
        reference = _server(tiny, stream_interval=1)

        async def ref():
            try:
                return await _run(reference, [5, 6, 7], params)
            finally:
                await reference.engine.shutdown()

        assert sum((c.token_ids for c in asyncio.run(ref())), []) == ids
    _assert_drained(server)


def test_the_replica_checks_a_batch_against_what_it_holds_in_flight(tiny):
    """The one size check of a request (the gateway has none): ``n`` choices times the prompts of
    the batch the request belongs to, against ``max_num_seqs + max_waiting_requests``, before the
    prompt is even tokenized; the error names the field for OpenAI's ``param``."""
    server = _server(tiny, max_num_seqs=2, max_waiting_requests=1)  # 3 in flight at most

    async def main():
        try:
            batch = await _run(server, [1, 2, 3], {"max_tokens": 2}, num_prompts=4)
            many = await _run(server, [1, 2, 3], {"max_tokens": 2, "n": 4})
            fits = await _run(server, [1, 2, 3], {"max_tokens": 2}, num_prompts=3)
            return batch, many, fits
        finally:
            await server.engine.shutdown()

    batch, many, fits = asyncio.run(main())
    (b,), (m,) = batch, many
    assert b.error.code == "too_large" and b.error.status == 400 and b.error.param == "prompt"
    assert b.error.message.startswith("4 prompts x 1 choices in one request; a replica of this model takes at most 3")
    assert m.error.code == "too_large" and m.error.param is None and "n=4" in m.error.message
    assert fits[-1].error is None and fits[-1].num_output_tokens == 2
    _assert_drained(server)


def test_the_replica_publishes_what_it_learned_at_load(tiny, monkeypatch):
    """Once loaded, a replica puts its ``max_model_len`` (here left to the KV pool) and its
    weights' revision on the facts board, under its configuration's digest; new weights on disk
    are published again at the next health check."""
    import os

    from kvserve.deployments.contract.facts import FactsBoard, LoadedFacts, ModelCard
    from kvserve.deployments.replica import llm_server

    published = []

    class Board:
        def put(self, model, facts):
            published.append((model, facts))

    monkeypatch.setattr(FactsBoard, "of_this_app", classmethod(lambda cls: Board()))
    model = ModelArgs(
        model=str(tiny), served_model_name="tiny", torch_num_threads=1, max_num_seqs=2, num_kv_blocks=8, block_size=16
    )
    server = LLMServer.func_or_class(model)

    async def touch_and_check():
        try:
            await server.check_health()  # nothing changed: nothing published
            config = tiny / "config.json"
            st = config.stat()
            os.utime(config, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
            await server.check_health()
        finally:
            await server.engine.shutdown()

    asyncio.run(touch_and_check())
    (name, first), (_, second) = published
    assert name == "tiny" and first.max_model_len == server.max_model_len <= 8 * 16  # the KV pool's 8 blocks
    assert first.digest == second.digest == ModelCard.of(model).digest
    # the dtype the engine runs: what "auto" became on this CPU, never "auto"
    assert first.dtype == server.engine.engine.config.dtype and first.dtype in ("float32", "bfloat16")
    assert second == LoadedFacts(
        first.max_model_len,
        llm_server.model_revision(tiny),
        first.digest,
        first.dtype,
        tool_call_parser="hermes",  # auto: the tiny model's template knows no tools
        max_token_bytes=server.engine.input_processor.max_token_bytes,
    )
    assert first.max_token_bytes is not None and first.max_prompt_bytes() == first.max_model_len * first.max_token_bytes
    assert second.revision != first.revision
