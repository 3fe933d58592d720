"""Issue 63, the response caches: each API key's answers are its own (exact and semantic levels,
the ``x-kvserve-cache`` header, the saved-token count), sharing them across keys is the operator's
explicit setting (``cache_shared_across_keys``); an identical request sent right after its first
answer is an exact hit (the entry is stored before the response ends, whatever the backend); and
a stream that lost chunks on the replica's channel ends with an error event and is never cached.

Through the real gateway app (``build_api`` over a :class:`Gateway`, httpx's ASGI transport) in
front of fake replicas (tests/deployments/gateway_fakes.py); the channel test runs the real
replica-side channels (:class:`kvserve.deployments.replica.channels.GatewayChannels`) behind its
fake, and loses one batch on the way as a gateway end that went away would."""

import asyncio

import httpx
import pytest
from gateway_fakes import FakeReplica, _Remote, _run, make_gateway
from helpers import DONE, iter_sse

from kvserve.deployments.contract.types import GenerationChunk, ServerInfo
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.replica.channels import GatewayChannels

KEY_A, KEY_B = "sk-tenant-a-0001", "sk-tenant-b-0002"
CACHE = "x-kvserve-cache"


def _auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def _chat(text: str, **kw) -> dict:
    return {
        "model": "fake",
        "messages": [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": text}],
        "max_tokens": 4,
        "temperature": 0,
        **kw,
    }


@pytest.fixture(scope="module")
def encoder():
    """The real all-MiniLM-L6-v2 (the semantic level's encoder); skips without it."""
    from kvserve.deployments.contract.encoder import SentenceEncoder, bundled_encoder_path

    try:
        bundled_encoder_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return SentenceEncoder()


def _gateway(replica, encoder, **settings):
    """The gateway with two keys and the semantic level opt-in, its encoder the real one given
    (the ingress's own loader would pin this process's BLAS threads)."""
    from kvserve.deployments.cache import ResponseCache

    gw = make_gateway(replica, api_keys=[KEY_A, KEY_B], semantic_cache="opt-in", **settings)
    gw.cache = gw.answers.cache = ResponseCache(gw.cache.settings, embedder_factory=lambda: encoder, metrics=False)
    return gw


def _ask_all(gw, steps):
    """Send ``(key, body)`` steps one after the other; their cache headers."""

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            out = []
            for key, body in steps:
                r = await c.post("/v1/chat/completions", json=body, headers=_auth(key))
                assert r.status_code == 200, r.text
                out.append(r.headers.get(CACHE))
            return out

    return _run(main())


SEMANTIC = {"cache": {"semantic": True}}
QUESTION, PARAPHRASE = "How many days are there in a leap year?", "How many days does a leap year have?"


def test_another_keys_identical_and_similar_requests_never_get_its_answer(encoder):
    replica = FakeReplica()
    gw = _gateway(replica, encoder)
    statuses = _ask_all(
        gw,
        [
            (KEY_A, _chat(QUESTION, **SEMANTIC)),  # A asks: stored as A's
            (KEY_A, _chat(QUESTION, **SEMANTIC)),  # A again: its own answer
            (KEY_B, _chat(QUESTION, **SEMANTIC)),  # B, the same text: not A's answer
            (KEY_B, _chat(PARAPHRASE, **SEMANTIC)),  # B, a paraphrase: B's own (just stored), never A's
            (KEY_A, _chat(PARAPHRASE, **SEMANTIC)),  # A's paraphrase: A's own answer
        ],
    )
    assert statuses == ["miss", "exact", "miss", "semantic", "semantic"]
    assert len(replica.requests) == 2  # A's first and B's first reached the replica
    assert gw.cache.counts["exact"]["hits"] == 1 and gw.cache.counts["semantic"]["hits"] == 2

    # B's paraphrase before B ever asked: a miss, though A's answer to the question is cached
    replica = FakeReplica()
    gw = _gateway(replica, encoder)
    assert _ask_all(gw, [(KEY_A, _chat(QUESTION, **SEMANTIC)), (KEY_B, _chat(PARAPHRASE, **SEMANTIC))]) == [
        "miss",
        "miss",
    ]
    assert len(replica.requests) == 2


def test_sharing_across_keys_is_an_explicit_setting(encoder):
    replica = FakeReplica()
    gw = _gateway(replica, encoder, cache_shared_across_keys=True)
    statuses = _ask_all(
        gw,
        [
            (KEY_A, _chat(QUESTION, **SEMANTIC)),
            (KEY_B, _chat(QUESTION, **SEMANTIC)),
            (KEY_B, _chat(PARAPHRASE, **SEMANTIC)),
        ],
    )
    assert statuses == ["miss", "exact", "semantic"]
    assert len(replica.requests) == 1


def test_an_identical_request_right_after_the_first_answer_hits_and_counts_its_savings(redis_server):
    """No keys, greedy, the shared Redis backend (a real redis-server): the second request is
    sent the moment the first response has ended, with nothing in between, and is an exact hit;
    the tokens it saved are counted once, streamed and not."""
    replica = FakeReplica()
    gw = make_gateway(replica, cache_backend="redis", redis_url=redis_server)

    def tokens() -> float:  # kvserve:cache_saved_tokens_total of the model's exact level
        return gw.savings.tokens.prom.labels(model_name="fake", level="exact", variant="")._value.get()

    async def main():
        before = tokens()
        out = []
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            for stream in (False, True):
                body = {
                    "model": "fake",
                    "prompt": f"same words {stream}",
                    "max_tokens": 2,
                    "temperature": 0,
                    "stream": stream,
                }
                for _ in range(2):
                    r = await c.post("/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    out.append(r.headers.get(CACHE))
        for _ in range(100):  # the savings are counted in a task after the hit's answer
            if tokens() - before >= 4:
                break
            await asyncio.sleep(0)
        return out, tokens() - before

    statuses, saved_tokens = _run(main())
    assert statuses == ["miss", "exact", "miss", "exact"]
    assert len(replica.requests) == 2
    assert saved_tokens == 4  # two output tokens per hit


# ---- a channel that loses chunks ----------------------------------------------------------
class _Gen:
    """A Serve streaming response: an async iterator with ``cancel()``."""

    def __init__(self, agen):
        self.agen = agen

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self):
        pass


class ChannelReplica:
    """An ``LLMServer`` stand-in whose streams and channel are the real replica-side
    :class:`GatewayChannels`; each request's engine gives four chunks. ``lose_next``: the next
    batch the channel takes never reaches the gateway, and the channel ends (its gateway end
    went away under it)."""

    def __init__(self):
        self.channels = GatewayChannels(idle_s=60)
        self.requests = []
        self.lose_next = False
        self.opened: asyncio.Event | None = None
        self.stream = _Remote(self._stream)
        self.channel = _Remote(self._channel)
        self.server_info = _Remote(self._info)

    def options(self, **_):
        return self

    async def _info(self):
        return ServerInfo(name="fake", max_model_len=128, max_in_flight_requests=8, revision="r1")

    def _stream(self, request):
        self.requests.append(request)
        return _Gen(self.channels.route(self._engine(), request.channel, "replica-1"))

    async def _engine(self):
        for k in range(4):
            yield GenerationChunk(
                text=f"t{k} ",
                token_ids=[k],
                num_prompt_tokens=3,
                num_output_tokens=k + 1,
                finished=k == 3,
                finish_reason="length" if k == 3 else None,
            )
            await asyncio.sleep(0)

    def _channel(self, gateway_id, replica_id):
        return _Gen(self._serve(gateway_id, replica_id))

    async def _serve(self, gateway_id, replica_id):
        channel = self.channels.serve(gateway_id, replica_id)
        yield await channel.__anext__()
        self.opened.set()
        async for batch in channel:
            if self.lose_next:
                self.lose_next = False
                await channel.aclose()
                return
            yield batch


def test_a_stream_that_lost_chunks_on_the_channel_ends_with_an_error_and_is_not_cached(monkeypatch):
    import kvserve.deployments.gateway.streams as streams

    monkeypatch.setattr(streams, "CHANNEL_GRACE_S", 0.2)  # the missing chunk never comes: no need to wait 10 s
    replica = ChannelReplica()
    gw = make_gateway(replica)
    body = {"model": "fake", "prompt": "count", "max_tokens": 4, "temperature": 0}

    async def main():
        replica.opened = asyncio.Event()
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            warm = await c.post("/v1/completions", json={**body, "temperature": 0.5})  # opens the channel
            await replica.opened.wait()
            replica.lose_next = True
            holed = await c.post("/v1/completions", json={**body, "stream": True})
            whole = await c.post("/v1/completions", json=body)  # the channel again, nothing lost
            again = await c.post("/v1/completions", json=body)
        return warm, holed, whole, again

    warm, holed, whole, again = _run(main())
    assert warm.status_code == 200 and warm.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
    events = list(iter_sse(holed.text))
    assert events[-1] == DONE
    error = events[-2]["error"]
    assert error["code"] == "stream_incomplete" and error["type"] == "server_error"
    text = "".join(c["text"] for e in events[:-2] for c in e["choices"])
    assert text == "t0 "  # what came after the lost chunk is never shown as if it followed it
    assert holed.headers[CACHE] == "miss"
    # nothing was stored: the same request is a miss, runs whole, and is stored then
    assert whole.headers[CACHE] == "miss" and whole.json()["choices"][0]["text"] == "t0 t1 t2 t3 "
    assert again.headers[CACHE] == "exact"
    assert len(replica.requests) == 3
