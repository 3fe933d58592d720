"""Gateway channels (issue 41 item 2): a replica sends each gateway replica one message per engine
step with every chunk of that gateway's requests (kvserve/deployments/replica/channels.py), and the
gateway's ChunkStream reads a request's chunks from its channel queue, with the request's own
stream pumped beside it (kvserve/deployments/gateway/streams.py). The Serve path is in
tests/e2e/test_serve_http.py (test_streams_share_one_channel_message_per_step)."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.types import GenerationChunk, GenerationError
from kvserve.deployments.gateway.streams import ChunkStream
from kvserve.deployments.replica.channels import GatewayChannels


def chunk(text, finished=False, index=0, seq=0):
    return GenerationChunk(
        text=text,
        token_ids=[len(text)],
        finished=finished,
        finish_reason="length" if finished else None,
        index=index,
        seq=seq,
    )


class Step:
    """Engine steps as the replica sees them: every request's generator waits for the same step."""

    def __init__(self):
        self.cond = asyncio.Condition()
        self.n = 0

    async def next(self):
        async with self.cond:
            self.n += 1
            self.cond.notify_all()

    async def wait(self, k):
        async with self.cond:
            await self.cond.wait_for(lambda: self.n >= k)


async def engine_stream(step: Step, name: str, n_tokens: int):
    for k in range(n_tokens):
        await step.wait(k)
        yield chunk(f"{name}{k}", finished=k == n_tokens - 1)


async def collect(agen):
    return [x async for x in agen]


def run(coro, timeout=10):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_requests_of_one_gateway_share_one_message_per_step():
    async def body():
        ch = GatewayChannels(idle_s=0.2)
        step = Step()
        reader = ch.serve("gw")
        assert await reader.__anext__() == {"replica": None}  # hello (the replica's id when given)
        outs = {name: ch.route(engine_stream(step, name, 3), ("gw", name), "replica-1") for name in "abc"}
        firsts = {}

        async def first_of(name):
            firsts[name] = await outs[name].__anext__()
            rest = [c async for c in outs[name]]  # nothing more on the own stream
            return rest

        rests = asyncio.gather(*(first_of(n) for n in outs))
        await asyncio.sleep(0.01)
        batches = []
        for k in (1, 2):
            await step.next()
            batches.append(await reader.__anext__())
        assert await rests == [[], [], []]
        return firsts, batches, ch.stats()

    firsts, batches, stats = run(body())
    assert all(f.via_channel and f.replica == "replica-1" and f.text == f"{n}0" for n, f in firsts.items())
    # one message per step, each with the step's chunk of every request
    assert [sorted((k, [c.text for c in v]) for k, v in b.items()) for b in batches] == [
        [("a", ["a1"]), ("b", ["b1"]), ("c", ["c1"])],
        [("a", ["a2"]), ("b", ["b2"]), ("c", ["c2"])],
    ]
    assert batches[1]["a"][0].finished
    assert stats == {"gateway_channels": 1, "channel_messages": 2, "channel_chunks": 6}


def test_without_the_gateways_channel_every_chunk_goes_on_the_own_stream():
    async def body():
        ch = GatewayChannels(idle_s=0.2)
        step = Step()
        other = ch.serve("other-gateway")
        await other.__anext__()
        got = []

        async def consume():
            async for c in ch.route(engine_stream(step, "x", 3), ("gw", "k"), "r"):
                got.append(c)

        t = asyncio.create_task(consume())
        for _ in range(3):
            await asyncio.sleep(0.01)
            await step.next()
        await t
        direct = [c async for c in ch.route(engine_stream(Step(), "y", 1), None, "r")]  # a Python-handle caller
        return got, direct

    got, direct = run(body())
    assert [c.text for c in got] == ["x0", "x1", "x2"] and not any(c.via_channel for c in got)
    assert got[0].replica == "r" and direct[0].finished and not direct[0].via_channel


def test_an_idle_channel_ends_and_a_running_request_goes_on_on_its_own_stream():
    async def body():
        ch = GatewayChannels(idle_s=0.05)
        step = Step()
        reader = ch.serve("gw")
        await reader.__anext__()
        out = ch.route(engine_stream(step, "slow", 4), ("gw", "k"), "r")
        first = await out.__anext__()
        rest = asyncio.create_task(collect(out))
        await step.next()
        batch = await reader.__anext__()
        with pytest.raises(StopAsyncIteration):  # nothing for idle_s: the channel ends
            await reader.__anext__()
        closed = ch.stats()["gateway_channels"]
        await step.next()
        await step.next()
        return first, batch, closed, await rest

    first, batch, closed, rest = run(body())
    assert first.via_channel and [c.text for c in batch["k"]] == ["slow1"] and closed == 0
    assert [c.text for c in rest] == ["slow2", "slow3"] and rest[-1].finished  # nothing lost, nothing twice


def test_a_second_channel_of_a_gateway_takes_over_what_is_waiting():
    async def body():
        ch = GatewayChannels(idle_s=5)
        step = Step()
        old = ch.serve("gw")
        await old.__anext__()
        out = ch.route(engine_stream(step, "r", 3), ("gw", "k"), "r")
        await out.__anext__()
        drain = asyncio.create_task(out.__anext__())
        new = ch.serve("gw")
        await new.__anext__()
        with pytest.raises(StopAsyncIteration):
            await old.__anext__()
        await step.next()
        await step.next()
        got = []
        while len(got) < 2:
            got += (await new.__anext__())["k"]
        with pytest.raises(StopAsyncIteration):
            await drain
        return got

    assert [c.text for c in run(body())] == ["r1", "r2"]


async def _gen(items, delay=0.0):
    for it in items:
        await asyncio.sleep(delay)
        if isinstance(it, Exception):
            raise it
        yield it


def test_chunk_stream_reads_the_channel_queue_and_the_own_stream():
    async def body():
        q: asyncio.Queue = asyncio.Queue()
        closed = []
        s = ChunkStream(_gen([], delay=0.05), chunk("a"), 1, channel=(q, lambda: closed.append(1)))
        for c in (chunk("b", seq=1), chunk("c", finished=True, seq=2)):
            q.put_nowait(c)
        texts = [c.text async for c in s.chunks()]
        return texts, closed, s.done

    texts, closed, done = run(body())
    assert texts == ["a", "b", "c"] and closed == [1] and done


def test_chunk_stream_on_a_channel_raises_the_own_streams_error_chunk():
    async def body():
        q: asyncio.Queue = asyncio.Queue()
        err = GenerationChunk.failed(GenerationError("timeout", "too slow"))
        s = ChunkStream(_gen([err], delay=0.05), chunk("a"), 1, channel=(q, lambda: None))
        q.put_nowait(chunk("b", seq=1))
        got = []
        with pytest.raises(Exception, match="too slow"):
            async for c in s.chunks():
                got.append(c.text)
        return got

    assert run(body()) == ["a", "b"]


def test_chunk_stream_waits_a_grace_period_for_the_channel_after_the_own_stream_ends(monkeypatch):
    import kvserve.deployments.gateway.streams as streams

    monkeypatch.setattr(streams, "CHANNEL_GRACE_S", 0.1)

    async def body():
        q: asyncio.Queue = asyncio.Queue()
        s = ChunkStream(_gen([]), chunk("a"), 1, channel=(q, lambda: None))

        async def late():
            await asyncio.sleep(0.05)
            q.put_nowait(chunk("b", finished=True, seq=1))

        t = asyncio.create_task(late())
        texts = [c.text async for c in s.chunks()]
        await t
        lost = ChunkStream(_gen([]), chunk("x"), 1, channel=(asyncio.Queue(), lambda: None))
        got = []
        with pytest.raises(OpenAIError) as e:
            async for c in lost.chunks():
                got.append(c.text)
        return texts, got, lost.done, e.value

    texts, lost, done, err = run(body())
    assert texts == ["a", "b"]
    # nothing came: the stream ends with an error (never as an answer that looks whole)
    assert lost == ["x"] and done and err.code == "stream_incomplete"


# ---- issue 63: no chunk is ever dropped by the replica's channel ------------------------------
def test_chunks_waiting_when_the_channel_ends_go_back_to_their_own_stream_in_order():
    """The channel ends (its reader goes away) while the outbox holds two chunks of a request:
    they come on the request's own stream, before the rest, every seq once (they were lost)."""

    async def body():
        ch = GatewayChannels(idle_s=60)
        step = Step()
        reader = ch.serve("gw")
        await reader.__anext__()
        out = ch.route(engine_stream(step, "q", 4), ("gw", "k"), "r")
        first = await out.__anext__()
        rest = asyncio.create_task(collect(out))
        await step.next()
        await step.next()  # q1 and q2 wait in the outbox: nobody reads the channel
        await step.next()  # q3 (finished) too: the own stream waits until the channel took them
        for _ in range(20):
            await asyncio.sleep(0)
        waiting = not rest.done()
        await reader.aclose()  # the channel is gone with them
        return first, waiting, await rest

    first, waiting, rest = run(body())
    assert first.via_channel and first.seq == 0 and waiting
    assert [(c.seq, c.text) for c in rest] == [(1, "q1"), (2, "q2"), (3, "q3")] and rest[-1].finished


def test_a_full_outbox_holds_the_request_back_instead_of_dropping_chunks():
    async def body():
        ch = GatewayChannels(idle_s=60, max_pending=2)
        reader = ch.serve("gw")
        await reader.__anext__()
        produced = []

        async def engine():
            for k in range(6):
                produced.append(k)
                yield chunk(f"c{k}", finished=k == 5)

        out = ch.route(engine(), ("gw", "k"), "r")
        await out.__anext__()
        rest = asyncio.create_task(collect(out))
        for _ in range(20):
            await asyncio.sleep(0)
        held = len(produced)  # c1, c2 in the outbox, c3 made and waiting for room
        got = []
        while not got or not got[-1].finished:
            got += (await reader.__anext__())["k"]
        assert await rest == []  # everything went on the channel
        return held, got

    held, got = run(body())
    assert held == 4
    assert [(c.seq, c.text) for c in got] == [(k, f"c{k}") for k in range(1, 6)]
