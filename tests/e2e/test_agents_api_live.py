"""The agents' API on the live Serve app (tests/e2e/conftest.py): Anthropic's Messages API through
the ``anthropic`` SDK (a forced tool call, its result sent back, a stream), and a batch job of the
Batch API through the openai SDK, whose requests the ingress replica runs through its own app and
Serve's handles (a LoRA adapter as one request's model)."""

import json
import time

import openai
import pytest

anthropic = pytest.importorskip("anthropic")

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}


def test_messages_on_serve_with_a_tool_round_trip_and_a_stream(serve_app):
    client = anthropic.Anthropic(base_url=serve_app.root, api_key="none", max_retries=0)
    tools = [{"name": "get_weather", "description": "Current weather of a city.", "input_schema": CITY}]
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    m = client.messages.create(
        model=serve_app.model,
        max_tokens=40,
        messages=ask,
        tools=tools,
        tool_choice={"type": "tool", "name": "get_weather"},
    )
    use = next(b for b in m.content if b.type == "tool_use")
    assert m.stop_reason == "tool_use" and use.name == "get_weather" and isinstance(use.input["city"], str)
    back = [
        *ask,
        {"role": "assistant", "content": [b.model_dump() for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C, sunny"}]},
    ]
    final = client.messages.create(
        model=serve_app.model, max_tokens=16, messages=back, tools=tools, extra_body={"temperature": 0}
    )
    assert final.stop_reason in ("end_turn", "max_tokens") and final.usage.input_tokens > m.usage.input_tokens
    with client.messages.stream(
        model=serve_app.model, max_tokens=12, messages=ask, extra_body={"temperature": 0}
    ) as stream:
        text = "".join(stream.text_stream)
        streamed = stream.get_final_message()
    whole = client.messages.create(model=serve_app.model, max_tokens=12, messages=ask, extra_body={"temperature": 0})
    assert text == streamed.content[0].text == whole.content[0].text  # greedy: the same answer either way


def test_batch_job_on_serve(serve_app):
    client = openai.OpenAI(base_url=serve_app.base_url, api_key="none", max_retries=0)
    lines = [
        {
            "custom_id": f"s{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": f"Count to {i + 2}."}],
                "max_tokens": 8,
                "temperature": 0,
            },
        }
        for i, model in enumerate([serve_app.model, "tiny", "tiny-lora", "no-such-model"])
    ]
    f = client.files.create(file=("jobs.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode()), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    deadline = time.monotonic() + 120
    while (b := client.batches.retrieve(b.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, b
        time.sleep(0.25)
    assert b.status == "completed" and b.request_counts.completed == 3 and b.request_counts.failed == 1
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"]["body"]["model"]) for x in out] == [
        ("s0", serve_app.model),
        ("s1", "tiny"),
        ("s2", "tiny-lora"),
    ]
    live = client.chat.completions.create(
        model=serve_app.model, messages=lines[0]["body"]["messages"], max_tokens=8, temperature=0
    )
    assert out[0]["response"]["body"]["choices"][0]["message"]["content"] == live.choices[0].message.content
    err = [json.loads(x) for x in client.files.content(b.error_file_id).text.splitlines()]
    assert [(x["custom_id"], x["response"]["status_code"]) for x in err] == [("s3", 404)]
