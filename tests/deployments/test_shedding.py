"""Cheap refusals (``kvserve/deployments/gateway/shedding.py``): once a replica said "full", the gateway
refuses what it would refuse without a trip to it, fills a freed slot at once, probes again
after the hold, reports what it refused as demand, and still sends refusals upstream when a
fallback is configured. The gateway runs in-process over a fake replica with a fixed capacity."""

import asyncio
import time

import httpx
from fastapi.responses import JSONResponse

from kvserve.deployments.replica.admission import Admission
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.gateway.shedding import LoadShedder
from kvserve.deployments.contract.types import GenerateRequest, GenerationChunk, GenerationError, ServerInfo
from tests.deployments.gateway_fakes import FakeGen, _Remote, make_gateway

CAP = 4


class CappedReplica:
    """A replica that admits ``CAP`` requests at once (each holds its slot until ``release``
    is set) and refuses the rest with a typed ``queue_full`` chunk, as ``Admission`` does."""

    def __init__(self):
        self.requests: list[GenerateRequest] = []
        self.running = 0
        self.release = asyncio.Event()
        self.stream = _Remote(self._stream)
        self.server_info = _Remote(self._info)

    def options(self, **_):
        return self

    async def _info(self):
        return ServerInfo(name="fake", max_model_len=128, max_in_flight_requests=CAP, revision="r1")

    def _stream(self, request: GenerateRequest) -> FakeGen:
        self.requests.append(request)
        return FakeGen(self._chunks())

    async def _chunks(self):
        if self.running >= CAP:
            yield GenerationChunk.failed(GenerationError("queue_full", "the model is at capacity", 7.0))
            return
        self.running += 1
        try:
            yield GenerationChunk(text="hello", token_ids=[1], num_prompt_tokens=4, num_output_tokens=1)
            await self.release.wait()
            yield GenerationChunk(
                text=" world",
                token_ids=[2],
                finished=True,
                finish_reason="length",
                num_prompt_tokens=4,
                num_output_tokens=2,
            )
        finally:
            self.running -= 1


def _gateway(replica, hold_s: float = 60.0) -> tuple[Gateway, httpx.AsyncClient]:
    gw = make_gateway(replica, response_cache=False)
    gw.shedder = LoadShedder(hold_s=hold_s)
    return gw, httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw")


async def _fill(c: httpx.AsyncClient, replica: CappedReplica) -> list[asyncio.Task]:
    """``CAP + 1`` streams at once: ``CAP`` hold the replica's slots (until ``release``), one is
    refused (the model is marked full). Returns the streams' tasks."""
    held = [asyncio.create_task(_chat(c)) for _ in range(CAP + 1)]
    while sum(t.done() for t in held) < 1 or replica.running < CAP:
        await asyncio.sleep(0.01)
    return held


async def _chat(c: httpx.AsyncClient, stream: bool = True) -> httpx.Response:
    return await c.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": stream},
    )


def test_after_a_full_refusal_the_gateway_refuses_without_a_trip_and_refills_freed_slots():
    replica = CappedReplica()

    async def main():
        gw, c = _gateway(replica)
        async with c:
            first = [asyncio.create_task(_chat(c)) for _ in range(CAP + 1)]
            while sum(t.done() for t in first) < 1 or replica.running < CAP:
                await asyncio.sleep(0.01)  # CAP streams hold their slots; one was refused by the replica
            sent = len(replica.requests)
            shed = await asyncio.gather(*(_chat(c, stream=False) for _ in range(40)))
            reached = len(replica.requests) - sent
            replica.release.set()
            done = await asyncio.gather(*first)
            replica.release = asyncio.Event()
            replica.release.set()
            after = await _chat(c, stream=False)
            return done, shed, reached, after, gw

    done, shed, reached, after, gw = asyncio.run(main())
    assert sorted(r.status_code for r in done) == [200] * CAP + [429]
    assert reached == 0  # none of the 40 crossed to the replica
    for r in shed:
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full", r.text
        assert r.headers["Retry-After"] == "7"  # the replica's own estimate
    # the slots freed: the next request goes through, carrying the count refused meanwhile
    assert after.status_code == 200, after.text
    assert replica.requests[-1].shed_requests == 40
    assert gw.shedder.open["fake"] == 0  # every stream's slot came back


def test_a_freed_slot_is_taken_at_once_and_the_mark_expires_into_a_probe():
    replica = CappedReplica()

    async def main():
        gw, c = _gateway(replica, hold_s=0.2)
        async with c:
            held = await _fill(c, replica)
            n = len(replica.requests)
            assert (await _chat(c, stream=False)).status_code == 429 and len(replica.requests) == n
            time.sleep(0.25)  # past the hold: the next request is a probe that reaches the replica
            probe = await _chat(c, stream=False)
            probed = len(replica.requests) - n
            replica.release.set()
            await asyncio.gather(*held)
            return probe, probed

    probe, probed = asyncio.run(main())
    assert probed == 1 and probe.status_code == 429  # the replica itself refused the probe


def test_shed_requests_still_go_upstream_when_a_fallback_is_configured():
    replica = CappedReplica()

    class FakeUpstream:
        def __init__(self):
            self.paths = []

        async def forward(self, path, body, model, http_id):
            self.paths.append(path)
            return JSONResponse({"upstream": True})

    async def main():
        gw, c = _gateway(replica)
        gw.upstream = FakeUpstream()
        async with c:
            held = await _fill(c, replica)
            n = len(replica.requests)
            r = await _chat(c, stream=False)
            reached = len(replica.requests) - n
            replica.release.set()
            await asyncio.gather(*held)
            return r, reached, gw.upstream.paths

    r, reached, paths = asyncio.run(main())
    assert r.status_code == 200 and r.json() == {"upstream": True}
    assert reached == 0 and paths[-1] == "/chat/completions"


def test_the_replica_counts_the_gateways_refusals_as_demand():
    a = Admission(max_num_seqs=2, max_waiting_requests=1, max_prompt_tokens=100)
    a.note_refused(5)
    a.note_refused(-3)  # nonsense from a caller counts nothing
    assert a.recently_refused(10.0) == 5


def test_shedder_bookkeeping():
    s = LoadShedder(hold_s=60.0)
    assert s.check("m") is None  # no mark: everything goes
    for _ in range(3):
        assert s.opened("m") == 0
    s.closed("m")
    s.refused("m", 2.5)  # two open when the replica said full
    assert s.check("m") is not None and s.check("m", needed=1).retry_after_s == 2.5
    s.closed("m")  # one finished: its slot is free
    assert s.check("m") is None
    assert s.check("m", needed=2) is not None  # a two-prompt request does not fit
    assert s.opened("m") == 4  # the refusals above (1 + 1 + 2 prompts), reported once
    assert s.opened("m") == 0
    s.opened("m")
    s.refused("m", None)  # Serve's handle queue refused later, with more open: the smaller count holds
    assert s.marks["m"].limit == 2 and s.marks["m"].retry_after_s == 1.0


def test_past_the_hold_one_probe_goes_at_a_time_and_an_admitted_probe_ends_the_mark(monkeypatch):
    """Under a flood, a hold that runs out lets one request through, not all of them: the rest
    are refused here until the probe's answer is known (the next probe waits a hold again)."""
    import kvserve.deployments.gateway.shedding as shedding

    now = [100.0]
    monkeypatch.setattr(shedding.time, "monotonic", lambda: now[0])
    s = LoadShedder(hold_s=1.0)
    for _ in range(2):
        s.opened("m")
    s.refused("m", None)  # two open when the replica said full
    assert s.check("m") is not None
    now[0] += 1.5  # past the hold
    assert s.check("m") is None  # the probe
    s.opened("m")
    assert [s.check("m") is None for _ in range(50)] == [False] * 50  # a flood behind it: refused here
    s.closed("m")
    s.refused("m", None)  # the replica refused the probe: the mark is renewed
    assert s.marks["m"].limit == 2 and s.check("m") is not None
    now[0] += 1.5
    assert s.check("m") is None  # the next probe ...
    s.opened("m")
    s.admitted("m")  # ... got in: three fit now, the mark ends
    assert "m" not in s.marks and s.check("m") is None
    s.admitted("m")  # without a mark: nothing to do


def test_a_flood_past_the_hold_sends_one_probe_to_the_replica(monkeypatch):
    """Past the hold, a flood sends one probe, not one per request. The shedder's clock is held
    still during the flood (it moves only past the hold): on a loaded box the 30 requests can take
    longer than a hold, and then a second probe would rightly go."""
    import types

    import kvserve.deployments.gateway.shedding as shedding

    replica = CappedReplica()
    now = [1000.0]
    # the shedder's clock only (the event loop keeps the real one)
    monkeypatch.setattr(shedding, "time", types.SimpleNamespace(monotonic=lambda: now[0]))

    async def main():
        gw, c = _gateway(replica, hold_s=0.2)
        async with c:
            held = await _fill(c, replica)
            now[0] += 0.25  # past the hold
            n = len(replica.requests)
            flood = await asyncio.gather(*(_chat(c, stream=False) for _ in range(30)))
            reached = len(replica.requests) - n
            replica.release.set()
            await asyncio.gather(*held)
            return flood, reached

    flood, reached = asyncio.run(main())
    assert reached == 1 and [r.status_code for r in flood] == [429] * 30
