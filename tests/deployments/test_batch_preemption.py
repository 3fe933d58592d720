"""Batch work beside live traffic on one replica, in-process (``LLMServer``'s class without Serve,
the tiny Llama in float32, greedy): a Batch-API request (``GenerateRequest.batch``) is never
stopped for live requests, only preempted by the engine when they need its slot, and ends with
the tokens it gives alone, however many live requests come and go while it runs; it gets a
bounded share of the replica's admission; cache warming (``sheddable``) still gives way to live
requests at once (``warming_deferred``)."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.deployments.contract.config import ModelArgs
from kvserve.deployments.contract.types import GenerateRequest
from kvserve.deployments.gateway.core import WARM_PRIORITY
from kvserve.deployments.replica.admission import Admission
from kvserve.deployments.replica.llm_server import LLMServer

BATCH = {"max_tokens": 48, "ignore_eos": True, "temperature": 0}
LIVE = {"max_tokens": 4, "ignore_eos": True, "temperature": 0}
LIVE_PROMPTS = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]


def _server(path, **kw):
    model = ModelArgs(
        model=str(path),
        served_model_name="tiny",
        dtype="float32",
        torch_num_threads=1,
        max_num_seqs=2,
        max_model_len=256,
        num_kv_blocks=64,
        block_size=16,
        **kw,
    )
    return LLMServer.func_or_class(model)


def _batch(prompt, rid):
    return GenerateRequest.of(prompt, BATCH, request_id=rid, priority=WARM_PRIORITY, batch=True)


async def _collect(server, request):
    return [c async for c in server.stream(request)]


def _ids(chunks):
    return sum((c.token_ids for c in chunks), [])


async def _first_then_rest(server, request, started: asyncio.Event):
    chunks = []
    async for c in server.stream(request):
        chunks.append(c)
        started.set()
    started.set()
    return chunks


async def _trickle(server, until: list[asyncio.Task]):
    """Live requests one after another (the next as soon as one ends) while any of ``until``
    runs; returns ``[(prompt, chunks)]``."""
    done = []
    while not all(t.done() for t in until):
        prompt = LIVE_PROMPTS[len(done) % len(LIVE_PROMPTS)]
        done.append((prompt, await _collect(server, GenerateRequest.of(prompt, LIVE, request_id=f"live-{len(done)}"))))
    return done


def _assert_live_answered(live, alone):
    for prompt, chunks in live:
        last = chunks[-1]
        assert last.error is None and last.finished and last.finish_reason == "length", last.error
        assert last.num_output_tokens == 4 and _ids(chunks) == alone[tuple(prompt)]


def _assert_drained(server):
    s = server.engine.get_stats()
    assert s["num_running_requests"] == 0 and s["num_waiting_requests"] == 0
    assert s["free_kv_blocks"] == s["num_kv_blocks"]
    a = server.admission
    assert (
        a.in_flight,
        a.queued_requests,
        a.queued_tokens,
        a.batch_in_flight,
        a.batch_queued_requests,
        a.batch_queued_tokens,
    ) == (0, 0, 0, 0, 0, 0)
    assert server.runner.live == 0 and server.runner.warm == {}


def test_a_batch_request_finishes_under_a_steady_trickle_of_live_requests(tiny_llama_path):
    """One batch request of 48 tokens while live requests arrive one after another for its whole
    life: before, every arrival stopped it (``warming_deferred``) and its progress was lost; now
    it runs beside them and ends with all 48 tokens, the ids it gives alone; each live request is
    answered as it is alone. Its share: a second batch request is refused (``queue_full``, with
    ``Retry-After``) while the first holds the share (``max_batch_requests``, default 1 of
    ``max_num_seqs`` 2), and no live request is."""
    server = _server(tiny_llama_path)
    prompt = [5, 6, 7, 8, 9]

    async def main():
        try:
            alone = _ids(await _collect(server, _batch(prompt, "alone")))
            live_alone = {tuple(p): _ids(await _collect(server, GenerateRequest.of(p, LIVE))) for p in LIVE_PROMPTS}
            started = asyncio.Event()
            batch = asyncio.create_task(_first_then_rest(server, _batch(prompt, "batch"), started))
            await started.wait()  # it is in the engine, making tokens
            second = await _collect(
                server,
                GenerateRequest.of(
                    [40, 41], {**BATCH, "max_tokens": 2}, request_id="second", priority=WARM_PRIORITY, batch=True
                ),
            )
            stats = server.get_stats()
            live = await _trickle(server, [batch])
            return alone, live_alone, await batch, second, stats, live
        finally:
            await server.engine.shutdown()

    alone, live_alone, chunks, second, stats, live = asyncio.run(main())
    assert len(alone) == 48
    last = chunks[-1]
    assert all(c.error is None for c in chunks), last.error  # never warming_deferred, never stopped
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 48
    assert _ids(chunks) == alone  # the same work as alone
    assert len(live) >= 2  # live requests came and went while it ran
    _assert_live_answered(live, live_alone)
    (refused,) = second
    assert refused.error.code == "queue_full" and refused.error.status == 429 and refused.error.retry_after_s >= 1
    assert "max_batch_requests 1" in refused.error.message  # the setting that bounds it
    assert stats["num_batch_requests"] == 1 and stats["num_warm_requests"] == 0
    assert server.admission.recently_refused(60) == 0  # batch work's share is not demand turned away
    _assert_drained(server)


def test_live_requests_preempt_a_full_batch_of_batch_work_which_keeps_its_tokens(tiny_llama_path):
    """Two batch requests fill the batch (``max_batch_requests=2`` of ``max_num_seqs`` 2); a live
    request arriving then is admitted at once and the engine preempts one batch request for it
    (by recompute): a steady trickle of live requests for as long as the batch requests run, and
    both still end with the tokens they give alone."""
    server = _server(tiny_llama_path, max_batch_requests=2)
    prompts = {"b0": [5, 6, 7, 8, 9], "b1": [50, 51, 52, 53, 54, 55]}

    async def main():
        try:
            alone = {rid: _ids(await _collect(server, _batch(p, f"{rid}-alone"))) for rid, p in prompts.items()}
            live_alone = {tuple(p): _ids(await _collect(server, GenerateRequest.of(p, LIVE))) for p in LIVE_PROMPTS}
            before = server.engine.get_stats()["num_preemptions"]
            events = {rid: asyncio.Event() for rid in prompts}
            tasks = {
                rid: asyncio.create_task(_first_then_rest(server, _batch(p, rid), events[rid]))
                for rid, p in prompts.items()
            }
            for e in events.values():
                await e.wait()  # both run: the batch is full of batch work
            full = server.engine.get_stats()["num_running_requests"]
            live = await _trickle(server, list(tasks.values()))
            preempted = server.engine.get_stats()["num_preemptions"] - before
            return alone, live_alone, {rid: await t for rid, t in tasks.items()}, full, live, preempted
        finally:
            await server.engine.shutdown()

    alone, live_alone, got, full, live, preempted = asyncio.run(main())
    assert full == 2
    for rid, chunks in got.items():
        last = chunks[-1]
        assert all(c.error is None for c in chunks), (rid, last.error)
        assert last.finished and last.num_output_tokens == 48 and _ids(chunks) == alone[rid]
    assert preempted >= 1  # the first live request took a batch request's slot
    assert len(live) >= 2
    _assert_live_answered(live, live_alone)
    _assert_drained(server)


def test_warming_still_gives_way_to_a_live_request(tiny_llama_path):
    """A cache-warming request (``sheddable``, not batch work) is stopped when a live request
    arrives (``warming_deferred``) and refused at once while one is in flight, as before; batch
    work is not live traffic for it: a warming request is admitted while a batch request runs."""
    server = _server(tiny_llama_path, max_batch_requests=1)
    long = {"max_tokens": 200, "ignore_eos": True, "temperature": 0}

    def warm(rid, prompt=(1, 2, 3)):
        return GenerateRequest.of(list(prompt), long, request_id=rid, priority=WARM_PRIORITY, sheddable=True)

    async def main():
        try:
            started = asyncio.Event()
            stopped = asyncio.create_task(_first_then_rest(server, warm("warm-0"), started))
            await started.wait()
            live_started = asyncio.Event()
            live = asyncio.create_task(
                _first_then_rest(
                    server, GenerateRequest.of([9, 9, 9], {**LIVE, "max_tokens": 40}, request_id="live"), live_started
                )
            )
            await live_started.wait()
            refused = await _collect(server, warm("warm-1"))  # a live request is in flight
            live, stopped = await live, await stopped
            batch_started = asyncio.Event()
            batch = asyncio.create_task(_first_then_rest(server, _batch([5, 6, 7], "batch"), batch_started))
            await batch_started.wait()
            beside = await _collect(server, warm("warm-2", (4, 5)))  # only batch work in flight
            return stopped, refused, live, await batch, beside
        finally:
            await server.engine.shutdown()

    stopped, refused, live, batch, beside = asyncio.run(main())
    assert stopped[-1].error is not None and stopped[-1].error.code == "warming_deferred"
    assert _ids(stopped) and len(_ids(stopped)) < 200  # it had started, and was stopped
    (r,) = refused
    assert r.error.code == "warming_deferred" and r.error.status == 429 and r.error.retry_after_s > 0
    assert live[-1].error is None and live[-1].num_output_tokens == 40
    assert batch[-1].error is None and batch[-1].num_output_tokens == 48
    assert beside[-1].error is None and beside[-1].num_output_tokens == 200
    _assert_drained(server)


@pytest.mark.parametrize("share, expect", [(None, 2), (3, 3), (8, 4)])
def test_the_batch_share_defaults_to_half_the_batch_and_never_exceeds_it(share, expect):
    adm = Admission(max_num_seqs=4, max_waiting_requests=1, max_prompt_tokens=100, max_batch_requests=share)
    assert adm.max_batch_requests == expect
    with pytest.raises(ValueError, match="max_batch_requests"):
        Admission(4, 1, 100, max_batch_requests=0)


def test_batch_work_gets_a_share_and_live_requests_do_not_see_it():
    """Batch requests: at most ``max_batch_requests`` in flight, and only while fewer than
    ``max_num_seqs`` requests are; live requests are admitted (and bounded) as if no batch work
    were there; the counts of both kinds go back to zero. A batch job's request that could never
    fit the share is a 400, not a 429 to retry forever."""
    adm = Admission(max_num_seqs=2, max_waiting_requests=1, max_prompt_tokens=100, max_batch_requests=2)
    assert adm.admit(10, batch=True) is None and adm.admit(10, batch=True) is None
    assert adm.admit(10, batch=True).code == "queue_full"  # the share is full
    adm.start(10, batch=True)
    for _ in range(3):  # max_num_seqs + max_waiting_requests live ones, beside two batch requests
        assert adm.admit(20) is None
    assert adm.admit(20).code == "queue_full"  # the live bound, counting live requests only
    assert adm.recently_refused(60) == 1  # only the live refusal is demand turned away
    assert adm.in_flight == 5 and adm.batch_in_flight == 2
    for _ in range(3):
        adm.end(20, started=False)
    adm.end(10, started=True, batch=True)
    assert adm.admit(10, batch=True) is None  # one batch request in flight, one slot of the batch free
    assert adm.admit(30) is None
    assert adm.admit(10, batch=True).code == "queue_full"  # max_num_seqs requests in flight: no waiting
    adm.end(30, started=False)
    adm.end(10, started=False, batch=True)
    adm.end(10, started=False, batch=True)
    assert (adm.in_flight, adm.queued_requests, adm.queued_tokens) == (0, 0, 0)
    assert (adm.batch_in_flight, adm.batch_queued_requests, adm.batch_queued_tokens) == (0, 0, 0)
    too_big = adm.never_fits(3, batch=True)
    assert too_big.code == "too_large" and "max_batch_requests" in too_big.message
    assert adm.never_fits(3) is None  # a live request of 3 choices fits max_num_seqs + max_waiting_requests
