"""Anthropic's Messages API (kvserve/deployments/gateway/messages.py) through the real ``anthropic`` SDK
against a live gateway over a real engine in this process (tests/local_app.py): create and
stream, text and tool use, stop sequences, count_tokens, the key as ``x-api-key``, and errors in
Anthropic's shape; the answer is the chat endpoint's answer to the same conversation."""

from __future__ import annotations

import httpx
import pytest

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.messages_input import MessagesRequest

anthropic = pytest.importorskip("anthropic")

KEY = "sk-kvserve-messages-test"
#: (An enum keeps the random-weight model's forced arguments short enough to close within max_tokens.)
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city.",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def msg_app(tiny_llama_path):
    """The tiny model behind a gateway with an API key."""
    from local_app import LocalApp

    app = LocalApp(
        {
            "/": {
                "model": str(tiny_llama_path),
                "served_model_name": "tiny",
                "max_model_len": 512,
                "torch_num_threads": 1,
                "api_keys": [KEY],
            }
        }
    ).start()
    try:
        yield app.namespace()
    finally:
        app.stop()


@pytest.fixture
def client(msg_app):
    return anthropic.Anthropic(base_url=msg_app.root, api_key=KEY, max_retries=0)


def _chat_text(msg_app, messages: list[dict], **kw) -> dict:
    r = httpx.post(
        f"{msg_app.base_url}/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        timeout=120,
        json={"model": "tiny", "messages": messages, "temperature": 0, **kw},
    )
    assert r.status_code == 200, r.text
    return r.json()


# ---- the translation -------------------------------------------------------------------------
def test_a_tool_round_trip_becomes_the_chat_conversation():
    body = MessagesRequest.model_validate(
        {
            "model": "tiny",
            "max_tokens": 5,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "top_k": 5,
            "metadata": {"user_id": "u1"},
        }
    )
    chat = body.to_chat()
    assert [m.to_template() for m in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.stop == ["END"] and chat.top_k == 5 and chat.user == "u1" and chat.max_tokens == 5
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]


@pytest.mark.parametrize(
    "bad, param",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages.0.content.0"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0"),
        ({"thinking": {"type": "sometimes"}}, "thinking.type"),
        ({"tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ],
)
def test_what_is_not_supported_is_a_400_naming_the_field(bad, param):
    body = MessagesRequest.model_validate(
        {"model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **bad}
    )
    with pytest.raises(OpenAIError) as e:
        body.to_chat()
    assert e.value.status_code == 400 and e.value.param == param


# ---- through the SDK ------------------------------------------------------------------------
def test_create_answers_as_chat_does_with_usage_and_count_tokens(client, msg_app):
    msgs = [{"role": "user", "content": "Say something about rivers."}]
    m = client.messages.create(
        model="tiny", max_tokens=8, extra_body={"temperature": 0}, system="You are terse.", messages=msgs
    )
    chat = _chat_text(msg_app, [{"role": "system", "content": "You are terse."}, *msgs], max_tokens=8)
    assert m.type == "message" and m.role == "assistant" and m.model == "tiny" and m.id.startswith("msg_")
    assert [b.type for b in m.content] == ["text"] and m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]
    expected = {"length": "max_tokens", "stop": "end_turn"}[chat["choices"][0]["finish_reason"]]
    assert m.stop_reason == expected and m.stop_sequence is None
    n = client.messages.count_tokens(model="tiny", system="You are terse.", messages=msgs)
    assert n.input_tokens == m.usage.input_tokens


def test_stop_sequences_end_the_turn_with_the_sequence(client):
    msgs = [{"role": "user", "content": "Tell me a story."}]
    full = (
        client.messages.create(model="tiny", max_tokens=24, extra_body={"temperature": 0}, messages=msgs)
        .content[0]
        .text
    )
    stop = full.strip()[len(full.strip()) // 2 :][:3]  # a piece from the middle of the answer
    assert stop.strip()
    m = client.messages.create(
        model="tiny", max_tokens=24, extra_body={"temperature": 0}, messages=msgs, stop_sequences=[stop]
    )
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert full.startswith(m.content[0].text) and stop not in m.content[0].text


def test_stream_gives_anthropics_events_and_the_same_message(client):
    msgs = [{"role": "user", "content": "Count a little."}]
    whole = client.messages.create(model="tiny", max_tokens=10, extra_body={"temperature": 0}, messages=msgs)
    with client.messages.stream(model="tiny", max_tokens=10, extra_body={"temperature": 0}, messages=msgs) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.count("content_block_start") == kinds.count("content_block_stop") == 1
    assert final.content[0].text == whole.content[0].text and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_tool_use_forced_by_name_whole_and_streamed(client):
    kw = dict(
        model="tiny",
        max_tokens=40,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
    )
    m = client.messages.create(**kw)
    (use,) = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict)
    assert use.input["city"] in ("Paris", "Rome") and use.id.startswith("call_")
    with client.messages.stream(**kw) as s:
        events = list(s)
        final = s.get_final_message()
    assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)
    (suse,) = [b for b in final.content if b.type == "tool_use"]
    assert suse.input == use.input and final.stop_reason == "tool_use"
    # the answer goes back as a tool_result
    r = client.messages.create(
        model="tiny",
        max_tokens=5,
        extra_body={"temperature": 0},
        tools=[WEATHER],
        messages=[
            *kw["messages"],
            {"role": "assistant", "content": [b.model_dump() for b in m.content]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]},
        ],
    )
    assert r.type == "message"


def test_keys_and_errors_take_anthropics_shape(msg_app):
    bad = anthropic.Anthropic(base_url=msg_app.root, api_key="sk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model="tiny", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    good = anthropic.Anthropic(base_url=msg_app.root, api_key=KEY, max_retries=0)
    with pytest.raises(anthropic.NotFoundError) as e:
        good.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["error"]["type"] == "not_found_error" and "nope" in e.value.body["error"]["message"]
    assert e.value.body["request_id"]
    with pytest.raises(anthropic.BadRequestError) as e:  # max_tokens is required by Anthropic's API
        good.post(
            "/v1/messages", body={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}, cast_to=object
        )
    assert e.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in e.value.body["error"]["message"]
    # OpenAI's endpoints keep OpenAI's shape, and accept the key as x-api-key too
    r = httpx.post(
        f"{msg_app.base_url}/chat/completions",
        headers={"x-api-key": "sk-wrong"},
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(
        f"{msg_app.base_url}/chat/completions",
        headers={"x-api-key": KEY},
        timeout=120,
        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    )
    assert r.status_code == 200


def test_structured_output_through_output_config(client):
    """Anthropic's structured outputs (``output_config.format``; the SDK's ``messages.parse``
    with a pydantic model): the grammar makes even the random-weight model's text valid."""
    from typing import Literal

    from pydantic import BaseModel

    class Answer(BaseModel):  # short by its schema: the SDK moves maxLength into a description
        city: Literal["Paris", "Rome"]
        sunny: bool

    m = client.messages.parse(
        model="tiny",
        max_tokens=60,
        output_format=Answer,
        extra_body={"temperature": 0},
        messages=[{"role": "user", "content": "Weather in Paris, as JSON."}],
    )
    assert isinstance(m.parsed_output, Answer) and m.stop_reason == "end_turn", m
    with pytest.raises(anthropic.BadRequestError, match="output_config.format"):
        client.messages.create(
            model="tiny",
            max_tokens=5,
            messages=[{"role": "user", "content": "x"}],
            output_config={"format": {"type": "xml"}},
        )
