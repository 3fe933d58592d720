"""The Responses API, embeddings and tokenize endpoints in-process: the gateway over fake
replicas (no Ray, no engine), driven by the openai SDK itself through httpx's ASGI transport,
so the SDK's own parsing (its stream accumulator, ``responses.parse``, base64 embeddings)
checks what the gateway sends."""
import asyncio
import base64

import httpx
import numpy as np
import openai
import pytest
from pydantic import BaseModel
from test_gateway import FakeGen, _Remote, make_gateway

from deployments.gateway.api import build_api
from deployments.contract.types import EmbedResult, GenerationChunk, GenerationError, ServerInfo, TokenizeResult

TOOL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


class ScriptedReplica:
    """An LLMServer stand-in whose answer is ``pieces`` (one chunk each) ending with
    ``finish_reason``; it records the typed requests, and answers embed / tokenize calls."""

    def __init__(self, pieces=("Hello", " there"), finish_reason="stop"):
        self.pieces, self.finish = list(pieces), finish_reason
        self.requests, self.embed_calls = [], []
        self.stream = _Remote(self._stream)
        self.server_info = _Remote(self._info)
        self.embed = _Remote(self._embed)
        self.tokenize = _Remote(self._tokenize)
        self.detokenize = _Remote(self._detokenize)

    def options(self, **_):
        return self

    async def _info(self):
        return ServerInfo(name="fake", max_model_len=128, max_in_flight_requests=8, revision="r1",
                          tool_call_parser="hermes")

    def _stream(self, request):
        self.requests.append(request)
        return FakeGen(self._chunks())

    async def _chunks(self):
        for i, p in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield GenerationChunk(text=p, token_ids=[i], num_prompt_tokens=7, num_output_tokens=i + 1,
                                  finished=last, finish_reason=self.finish if last else None)
            await asyncio.sleep(0)

    async def _embed(self, inputs, dimensions=None, lora_name=None, priority=0, request_id=None):
        self.embed_calls.append((inputs, dimensions))
        if dimensions is not None:
            return EmbedResult(error=GenerationError("invalid_value", "dimensions: not a matryoshka model"))
        return EmbedResult(data=[[float(len(x)), 0.5, -0.25] for x in inputs], prompt_tokens=3 * len(inputs))

    async def _tokenize(self, prompt=None, messages=None, **kw):
        if prompt == "BAD":
            return TokenizeResult(error=GenerationError("invalid_value", "cannot tokenize"))
        text = prompt if prompt is not None else "".join(m["content"] for m in messages)
        ids = [ord(c) for c in text]
        return TokenizeResult(tokens=ids, count=len(ids), max_model_len=128,
                              token_strs=list(text) if kw.get("return_token_strs") else None)

    async def _detokenize(self, tokens):
        return TokenizeResult(tokens=tokens, count=len(tokens), prompt="".join(chr(t) for t in tokens))


def _sdk(replica, api_key="sk-a", **settings):
    gw = make_gateway(replica, **settings)
    app = build_api(gw)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")
    return openai.AsyncOpenAI(api_key=api_key, base_url="http://gw/v1", http_client=http, max_retries=0), app


def _run(coro):
    return asyncio.run(coro)


def test_create_maps_to_one_chat_request_and_renders_a_response():
    replica = ScriptedReplica()

    async def main():
        client, _ = _sdk(replica)
        return await client.responses.create(model="fake", input="Say hi", instructions="Be brief.",
                                             max_output_tokens=20, temperature=0, store=False)

    r = _run(main())
    assert r.output_text == "Hello there" and r.status == "completed" and r.id.startswith("resp_")
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == 7 and r.usage.output_tokens == 2 and r.usage.total_tokens == 9
    assert r.instructions == "Be brief." and r.max_output_tokens == 20
    [req] = replica.requests
    assert req.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi"}]
    assert req.sampling_params.max_tokens == 20 and req.sampling_params.temperature == 0.0


def test_stream_events_build_the_same_response_in_the_sdk_accumulator():
    replica = ScriptedReplica(pieces=("One", ", two", ", three"))

    async def main():
        client, _ = _sdk(replica)
        kinds, seqs = [], []
        async with client.responses.stream(model="fake", input="count", store=False) as s:
            async for event in s:
                kinds.append(event.type)
                seqs.append(event.sequence_number)
            final = await s.get_final_response()
        return kinds, seqs, final

    kinds, seqs, final = _run(main())
    assert final.output_text == "One, two, three" and final.status == "completed"
    assert seqs == list(range(len(seqs)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds.count("response.output_text.delta") == 3
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert final.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_give_function_call_items(stream):
    replica = ScriptedReplica(pieces=(TOOL_TEXT[:20], TOOL_TEXT[20:]))
    tools = [{"type": "function", "name": "get_weather", "description": "weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]

    async def main():
        client, _ = _sdk(replica)
        if not stream:
            return await client.responses.create(model="fake", input="Weather in Paris?", tools=tools, store=False)
        async with client.responses.stream(model="fake", input="Weather in Paris?", tools=tools, store=False) as s:
            async for _ in s:
                pass
            return await s.get_final_response()

    r = _run(main())
    [item] = r.output
    assert item.type == "function_call" and item.name == "get_weather"
    assert item.arguments.replace(" ", "") == '{"city":"Paris"}' and item.call_id
    [req] = replica.requests
    assert req.tools[0]["function"]["name"] == "get_weather"


def test_forced_function_streams_its_arguments_as_deltas():
    replica = ScriptedReplica(pieces=('{"city": ', '"Oslo"}'))
    tools = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]

    async def main():
        client, _ = _sdk(replica)
        deltas = []
        async with client.responses.stream(model="fake", input="x", tools=tools, store=False,
                                           tool_choice={"type": "function", "name": "get_weather"}) as s:
            async for e in s:
                if e.type == "response.function_call_arguments.delta":
                    deltas.append(e.delta)
            return deltas, await s.get_final_response()

    deltas, r = _run(main())
    assert deltas == ['{"city": ', '"Oslo"}']
    assert r.output[0].arguments == '{"city": "Oslo"}'
    assert replica.requests[0].sampling_params.structured_outputs is not None  # the grammar forces the call


def test_parse_with_a_pydantic_model_sends_the_schema_and_parses_the_text():
    class City(BaseModel):
        name: str
        population: int

    replica = ScriptedReplica(pieces=('{"name": "Oslo", ', '"population": 700000}'))

    async def main():
        client, _ = _sdk(replica)
        return await client.responses.parse(model="fake", input="A city", text_format=City, store=False)

    r = _run(main())
    assert r.output_parsed == City(name="Oslo", population=700000)
    spec = replica.requests[0].sampling_params.structured_outputs
    assert spec["json"]["properties"]["population"]["type"] == "integer"


def test_store_previous_response_id_get_and_delete_are_per_key():
    replica = ScriptedReplica()

    async def main():
        client, app = _sdk(replica, api_keys=["sk-a name=alice", "sk-b name=bob"])
        first = await client.responses.create(model="fake", input="My name is Ada.", instructions="Be kind.")
        second = await client.responses.create(model="fake", input="What is my name?",
                                               previous_response_id=first.id)
        got = await client.responses.retrieve(first.id)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")
        other = await http.get(f"/v1/responses/{first.id}", headers={"Authorization": "Bearer sk-b"})
        other_prev = await http.post("/v1/responses", headers={"Authorization": "Bearer sk-b"},
                                     json={"model": "fake", "input": "hi", "previous_response_id": first.id})
        await client.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        return first, second, got, other, other_prev

    first, second, got, other, other_prev = _run(main())
    assert got.id == first.id and got.output_text == "Hello there"
    assert other.status_code == 404 and other.json()["error"]["code"] == "response_not_found"
    assert other_prev.status_code == 404 and other_prev.json()["error"]["param"] == "previous_response_id"
    assert second.previous_response_id == first.id
    # the second turn carries the first turn's input and output, not its instructions
    assert replica.requests[1].messages == [{"role": "user", "content": "My name is Ada."},
                                            {"role": "assistant", "content": "Hello there"},
                                            {"role": "user", "content": "What is my name?"}]


def test_function_call_output_items_become_tool_turns():
    replica = ScriptedReplica()
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
             {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "c1", "output": "sunny, 21 C"}]

    async def main():
        client, _ = _sdk(replica)
        return await client.responses.create(model="fake", input=items, store=False)

    _run(main())
    msgs = replica.requests[0].messages
    assert msgs[0] == {"role": "user", "content": "Weather?"}
    assert msgs[1]["role"] == "assistant" and msgs[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert msgs[2]["role"] == "tool" and msgs[2]["tool_call_id"] == "c1" and msgs[2]["content"] == "sunny, 21 C"


def test_max_output_tokens_cut_is_incomplete():
    replica = ScriptedReplica(finish_reason="length")

    async def main():
        client, _ = _sdk(replica)
        created = await client.responses.create(model="fake", input="x", max_output_tokens=2, store=False)
        kinds = []
        async with client.responses.stream(model="fake", input="x", max_output_tokens=2, store=False) as s:
            async for e in s:
                kinds.append(e.type)
        return created, kinds

    r, kinds = _run(main())
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert kinds[-1] == "response.incomplete"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
     "input[0].content[0].type"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
])
def test_unsupported_fields_are_400s_naming_the_field(body, param):
    replica = ScriptedReplica()

    async def main():
        _, app = _sdk(replica)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return await c.post("/v1/responses", json={"model": "fake", **body})

    r = _run(main())
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert param in err["message"] or err.get("param") == param, err
    assert replica.requests == []


def test_embeddings_float_and_base64_and_errors():
    replica = ScriptedReplica()

    async def main():
        client, app = _sdk(replica)
        floats = await client.embeddings.create(model="fake", input=["ab", "abcd"], encoding_format="float")
        b64 = await client.embeddings.create(model="fake", input="abc")  # the SDK asks base64 and decodes it
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            raw = await c.post("/v1/embeddings", json={"model": "fake", "input": [1, 2], "encoding_format": "base64"})
            empty = await c.post("/v1/embeddings", json={"model": "fake", "input": ["ok", ""]})
            dims = await c.post("/v1/embeddings", json={"model": "fake", "input": "x", "dimensions": 2})
            unknown = await c.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        return floats, b64, raw, empty, dims, unknown

    floats, b64, raw, empty, dims, unknown = _run(main())
    assert [d.embedding for d in floats.data] == [[2.0, 0.5, -0.25], [4.0, 0.5, -0.25]]
    assert [d.index for d in floats.data] == [0, 1] and floats.usage.prompt_tokens == 6
    assert b64.data[0].embedding == [3.0, 0.5, -0.25]
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == [2.0, 0.5, -0.25]  # token ids went to the replica as a list of ids
    assert replica.embed_calls[2][0] == [[1, 2]]
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    assert dims.status_code == 400 and "dimensions" in dims.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_embedding_tokens_count_against_the_keys_token_budget():
    replica = ScriptedReplica()

    async def main():
        _, app = _sdk(replica, api_keys=["sk-a tpm=40"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw",
                                     headers={"Authorization": "Bearer sk-a"}) as c:
            codes = []
            for _ in range(6):  # each: 4 inputs estimated at 2 tokens, settled at 12 used
                r = await c.post("/v1/embeddings", json={"model": "fake", "input": ["abcd"] * 4})
                codes.append(r.status_code)
            return codes

    codes = _run(main())
    assert codes[0] == 200 and 429 in codes  # 40 tokens a minute: the settled 12-token requests run out


def test_tokenize_and_detokenize():
    replica = ScriptedReplica()

    async def main():
        _, app = _sdk(replica)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            t = await c.post("/tokenize", json={"model": "fake", "prompt": "hey", "return_token_strs": True})
            m = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}]})
            d = await c.post("/detokenize", json={"model": "fake", "tokens": [104, 105]})
            both = await c.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
            bad = await c.post("/tokenize", json={"prompt": "BAD"})
        return t, m, d, both, bad

    t, m, d, both, bad = _run(main())
    assert t.json() == {"count": 3, "max_model_len": 128, "tokens": [104, 101, 121], "token_strs": ["h", "e", "y"]}
    assert m.json()["count"] == 2
    assert d.json() == {"prompt": "hi"}
    assert both.status_code == 400 and bad.status_code == 400 and bad.json()["error"]["message"] == "cannot tokenize"


def test_one_answer_calls_are_sent_again_when_their_replica_is_lost():
    """An embeddings or tokenize call whose replica died under it (a lost node: ActorDiedError)
    is idempotent, so it goes again, as a stream lost before its first token does; a replica that
    stays lost is a 503 after the retries."""
    from ray.exceptions import ActorDiedError

    class Flaky(ScriptedReplica):
        def __init__(self, losses):
            super().__init__()
            self.losses, self.calls = losses, 0
            embed, tokenize = self.embed.remote, self.tokenize.remote

            def lossy(fn):
                async def call(*a, **kw):
                    self.calls += 1
                    if self.losses > 0:
                        self.losses -= 1
                        raise ActorDiedError()
                    return await fn(*a, **kw)
                return _Remote(call)
            self.embed, self.tokenize = lossy(embed), lossy(tokenize)

    async def main(replica):
        _, app = _sdk(replica)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            e = await c.post("/v1/embeddings", json={"model": "fake", "input": "ab"})
            t = await c.post("/tokenize", json={"model": "fake", "prompt": "hey"})
        return e, t

    once = Flaky(losses=1)
    e, t = _run(main(once))
    assert e.status_code == 200 and e.json()["data"][0]["embedding"] == [2.0, 0.5, -0.25]
    assert t.status_code == 200 and t.json()["count"] == 3 and once.calls == 3
    gone = Flaky(losses=100)
    e, t = _run(main(gone))
    assert e.status_code == 503 and e.json()["error"]["code"] == "model_unavailable"
    assert t.status_code == 503 and gone.calls == 6  # 1 + UNAVAILABLE_RETRIES each


def test_every_endpoint_is_counted_by_route_template():
    from telemetry.metrics import http_requests

    replica = ScriptedReplica()

    async def main():
        client, _ = _sdk(replica)
        r = await client.responses.create(model="fake", input="x")
        await client.responses.retrieve(r.id)
        await client.embeddings.create(model="fake", input="x")

    before = http_requests().prom.labels(handler="/v1/responses/{response_id}", method="GET", status="200")._value.get()
    _run(main())
    after = http_requests().prom.labels(handler="/v1/responses/{response_id}", method="GET", status="200")._value.get()
    assert after == before + 1
    assert http_requests().prom.labels(handler="/v1/embeddings", method="POST", status="200")._value.get() >= 1


def test_stored_responses_in_redis_are_seen_by_every_ingress_replica(redis_server):
    """Two gateways (two ingress replicas) on one Redis: a response stored through one is read,
    continued and deleted through the other."""
    replica = ScriptedReplica()
    settings = dict(redis_url=redis_server, cache_backend="redis")

    async def main():
        a, _ = _sdk(replica, **settings)
        b, _ = _sdk(replica, **settings)
        first = await a.responses.create(model="fake", input="Remember 42.")
        seen = await b.responses.retrieve(first.id)
        await b.responses.create(model="fake", input="What number?", previous_response_id=first.id, store=False)
        await b.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(first.id)
        return first, seen

    first, seen = _run(main())
    assert seen.id == first.id and seen.output_text == "Hello there"
    assert replica.requests[1].messages[:2] == [{"role": "user", "content": "Remember 42."},
                                                {"role": "assistant", "content": "Hello there"}]


# ---- owners: the key itself, each with its own bound ------------------------------------------
@pytest.fixture(params=["memory", "redis"])
def store_backend(request):
    """The stored responses' backend (``cache`` settings): this replica's memory, or a real
    Redis (skips without redis-server)."""
    if request.param == "memory":
        return {}
    return {"redis_url": request.getfixturevalue("redis_server"), "cache_backend": "redis"}


def _as(gw, key):
    """The openai SDK on ``gw``'s app with API key ``key``."""
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw/v1")
    return openai.AsyncOpenAI(api_key=key, base_url="http://gw/v1", http_client=http, max_retries=0)


def test_a_key_reissued_under_an_old_name_does_not_inherit_its_responses(store_backend):
    """Stored responses belong to the key, not its display name: after ``alice``'s key is
    replaced (a new configuration, the same store), the new key gets 404 for the old key's
    response, as a read and as ``previous_response_id``."""
    replica = ScriptedReplica()
    old = make_gateway(replica, api_keys=["sk-old-alice-1 name=alice"], **store_backend)
    new = make_gateway(replica, api_keys=["sk-new-alice-1 name=alice"], **store_backend)
    if not store_backend:
        new.responses = old.responses  # memory: the one replica's store, across the key change (Redis: shared)

    async def main():
        first = await _as(old, "sk-old-alice-1").responses.create(model="fake", input="My secret is 7.")
        kept = await _as(old, "sk-old-alice-1").responses.retrieve(first.id)
        client = _as(new, "sk-new-alice-1")
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(first.id)
        with pytest.raises(openai.NotFoundError) as prev:
            await client.responses.create(model="fake", input="What is my secret?", previous_response_id=first.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.delete(first.id)
        return first, kept, prev.value

    first, kept, prev = _run(main())
    assert kept.id == first.id and prev.body["param"] == "previous_response_id"
    assert len(replica.requests) == 1  # the refused continuation never reached the replica


def test_one_owners_responses_never_evict_anothers(store_backend):
    """Each owner has its own bound (the cache's ``max_entries``, 3 here): key A storing six
    responses evicts only A's oldest, never B's one."""
    replica = ScriptedReplica()
    gw = make_gateway(replica, api_keys=["sk-tenant-a-2 name=a", "sk-tenant-b-2 name=b"], cache_max_entries=3,
                      **store_backend)

    async def main():
        a, b = _as(gw, "sk-tenant-a-2"), _as(gw, "sk-tenant-b-2")
        mine = await b.responses.create(model="fake", input="B's only turn")
        flood = [await a.responses.create(model="fake", input=f"A's turn {i}") for i in range(6)]
        b_kept = await b.responses.retrieve(mine.id)
        a_kept = [(await a.responses.retrieve(r.id)).id for r in flood[-3:]]
        with pytest.raises(openai.NotFoundError):
            await a.responses.retrieve(flood[0].id)  # A's own oldest: A's bound is real
        return mine, b_kept, flood, a_kept

    mine, b_kept, flood, a_kept = _run(main())
    assert b_kept.id == mine.id
    assert a_kept == [r.id for r in flood[-3:]]


def test_owner_ids_follow_the_key_never_show_it():
    from deployments.limits import KeyPolicy

    old, new = KeyPolicy("sk-old-alice-1", name="alice"), KeyPolicy("sk-new-alice-1", name="alice")
    assert old.owner_id != new.owner_id and old.owner_id == KeyPolicy("sk-old-alice-1", name="bob").owner_id
    assert old.owner_id.startswith("owner-") and "sk-old" not in old.owner_id and "alice" not in old.owner_id
