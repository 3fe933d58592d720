"""Tool calling's text side (kvserve/deployments/gateway/tools.py): the grammar for ``required`` / a named
function, and the Hermes rendering for chat templates that know no tools (with SmolLM2's real
template). The parsers per model family: tests/deployments/test_tool_parsers.py."""

import json

import jsonschema
import pytest

from kvserve.deployments.gateway.tools import parse_forced, tool_grammar
from kvserve.engine.chat_templates import prepare_messages, template_knows_tools

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_required_and_named_grammars():
    spec = tool_grammar([WEATHER, TIME], "required", parallel=False)["json"]
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, spec)
    for bad in (
        [],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_weather", "parameters": {}}],
        good + [{"name": "get_time", "parameters": {}}],
    ):  # two calls, parallel off
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, spec)
    calls = parse_forced(json.dumps(good), "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Rome"})]
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_grammar([WEATHER, TIME], named, True) == {"json": WEATHER["function"]["parameters"]}
    assert parse_forced('{"city": "Rome"}', named)[0].name == "get_weather"
    assert parse_forced('{"city": "Ro', named) is None and parse_forced("[]", "required") is None
    assert tool_grammar([WEATHER], "auto", True) is None


def test_history_rendered_for_a_template_without_tools(smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert not template_knows_tools(tok.chat_template)
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"},
    ]
    out, tools = prepare_messages(messages, [WEATHER], tok.chat_template)
    assert tools is None
    text = tok.apply_chat_template(out, tokenize=False, add_generation_prompt=True)
    assert '"name": "get_weather"' in text and "<tools>" in text  # the tool list
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in text
    # a template that renders tools itself gets them untouched
    assert prepare_messages(messages, [WEATHER], "{{ tools }}") == (messages, [WEATHER])
    plain = [{"role": "user", "content": "hi"}]
    assert prepare_messages(plain, None, tok.chat_template) == (plain, None)
