"""Tool calling's text side (deployments/gateway/tools.py): the parsers per model family, the
streaming split of content and calls, the grammar for ``required`` / a named function, and
the Hermes rendering for chat templates that know no tools (with SmolLM2's real template)."""
import json

import jsonschema
import pytest

from deployments.gateway.tool_parsers import get_tool_parser
from deployments.gateway.tools import StreamingToolText, parse_forced, tool_grammar
from engine.chat_templates import prepare_messages, template_knows_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}

OUTPUTS = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', "Let me check."),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {}}', None),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {}}]', None),
    "qwen3_coder": ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                    "</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
                    "Checking."),
}


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_parsers_find_both_calls(name):
    text, content = OUTPUTS[name]
    got_content, calls = get_tool_parser(name).extract(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2


@pytest.mark.parametrize("name", list(OUTPUTS))
@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_streaming_split_sends_content_and_holds_calls(name, step):
    text, content = OUTPUTS[name]
    split = StreamingToolText(get_tool_parser(name))
    sent = "".join(split.feed(text[i:i + step]) for i in range(0, len(text), step))
    rest, calls = split.finish()
    assert (sent + rest).strip() == (content or "")
    assert [c.name for c in calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("name", list(OUTPUTS))
def test_plain_text_passes_through(name):
    text = "The weather is nice < today > [maybe] {not json"
    if name == "llama3_json":
        text = "The weather is nice {not json"
    split = StreamingToolText(get_tool_parser(name))
    sent = "".join(split.feed(text[i:i + 3]) for i in range(0, len(text), 3))
    rest, calls = split.finish()
    assert sent + rest == text and calls == []
    assert get_tool_parser(name).extract(text) == (text, [])


def test_broken_call_is_left_as_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    assert get_tool_parser("hermes").extract(text) == (text, [])
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        get_tool_parser("no-such-parser")


def test_required_and_named_grammars():
    spec = tool_grammar([WEATHER, TIME], "required", parallel=False)["json"]
    good = [{"name": "get_weather", "parameters": {"city": "Rome"}}]
    jsonschema.validate(good, spec)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {}}],
                good + [{"name": "get_time", "parameters": {}}]):  # two calls, parallel off
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
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "21 C, sunny"}]
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
