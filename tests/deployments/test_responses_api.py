"""The Responses API in-process: the gateway over a fake replica (no Ray, no engine), driven by the
openai SDK itself through httpx's ASGI transport, so the SDK's own parsing (its stream accumulator,
``responses.parse``) checks what the gateway sends: a response and its stream, function tools,
structured output, tool turns, a cut answer, the fields refused, and the route metrics. Stored
responses: test_responses_store.py; embeddings and tokenize: test_embeddings_tokenize.py."""

import httpx
import pytest
from gateway_fakes import ScriptedReplica, _run, _sdk
from pydantic import BaseModel

TOOL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_create_maps_to_one_chat_request_and_renders_a_response():
    replica = ScriptedReplica()

    async def main():
        client, _ = _sdk(replica)
        return await client.responses.create(
            model="fake", input="Say hi", instructions="Be brief.", max_output_tokens=20, temperature=0, store=False
        )

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
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 3
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert final.usage.output_tokens == 3


@pytest.mark.parametrize("stream", [False, True])
def test_function_tools_give_function_call_items(stream):
    replica = ScriptedReplica(pieces=(TOOL_TEXT[:20], TOOL_TEXT[20:]))
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]

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
        async with client.responses.stream(
            model="fake", input="x", tools=tools, store=False, tool_choice={"type": "function", "name": "get_weather"}
        ) as s:
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


def test_function_call_output_items_become_tool_turns():
    replica = ScriptedReplica()
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny, 21 C"},
    ]

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


@pytest.mark.parametrize(
    "body,param",
    [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"input": "x", "background": True}, "background"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/a.png"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": "x", "truncation": "auto"}, "truncation"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
        ({"input": "x", "previous_response_id": "resp_nope"}, "previous_response_id"),
    ],
)
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


def test_every_endpoint_is_counted_by_route_template():
    from kvserve.telemetry.metrics import http_requests

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
