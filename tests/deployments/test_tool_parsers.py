"""Tool-call parsers per model family (kvserve/deployments/gateway/tool_parsers/): what each reads, and the
property that matters for streaming: fed the same output split anywhere (at every token boundary
of a real tokenizer through the engine's incremental detokenizer, at every character, at random
byte-level splits inside multi-byte characters), a stream assembles exactly the whole response's
content and calls; malformed or cut-off calls stay content."""

from __future__ import annotations

import codecs
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.deployments.gateway.tool_parsers import TOOL_PARSERS, get_tool_parser
from kvserve.deployments.gateway.tools import ToolCallStream, extract_calls
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.sampling_params import SamplingParams

W = {"city": "Zürich", "note": '東京 ☀️ "quoted" {braces} [x]'}  # multi-byte characters, JSON's specials
T = {}

#: parser -> [(output, expected content, expected [(name, arguments)])]: well-formed calls with
#: content around them, several calls, a cut-off or broken call (content), plain text.
CASES = {
    "hermes": [
        (
            f"Let me check.\n<tool_call>\n{json.dumps({'name': 'get_weather', 'arguments': W}, ensure_ascii=False)}\n"
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
            "Let me check.",
            [("get_weather", W), ("get_time", T)],
        ),
        (
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and then prose after it, < and <tool',
            "and then prose after it, < and <tool",
            [("get_time", T)],
        ),
        ('<tool_call>{"name": "get_time", "arguments": {}}', None, [("get_time", T)]),  # ended on EOS, no tag
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Zür',
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Zür',
            [],
        ),  # cut off by max_tokens
        (
            '<tool_call>{"nom": 1}</tool_call><tool_call>{"name": "get_time", "arguments": {}}</tool_call>',
            '<tool_call>{"nom": 1}</tool_call>',
            [("get_time", T)],
        ),  # a broken block stays content
        ("Plain text: 1 < 2, a <tag>, ünïcödé. ", "Plain text: 1 < 2, a <tag>, ünïcödé. ", []),
    ],
    "qwen3_coder": [
        (
            "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
            "</function>\n</tool_call>",
            "Checking.",
            [("get_weather", {"city": "Zürich", "days": 3}), ("get_time", T)],
        ),
        (
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京",
            "<tool_call>\n<function=get_weather>\n<parameter=city>\n東京",
            [],
        ),
        ("<tool_call>not a function</tool_call> ok", "<tool_call>not a function</tool_call> ok", []),
    ],
    "mistral": [
        (
            f"[TOOL_CALLS][{json.dumps({'name': 'get_weather', 'arguments': W}, ensure_ascii=False)}, "
            '{"name": "get_time", "arguments": {}}]',
            None,
            [("get_weather", W), ("get_time", T)],
        ),
        (
            f"Sure. [TOOL_CALLS]get_weather[ARGS]{json.dumps(W, ensure_ascii=False)}[TOOL_CALLS]get_time[ARGS]{{}}",
            "Sure.",
            [("get_weather", W), ("get_time", T)],
        ),
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Z',
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Z',
            [],
        ),
        ("[TOOL_CALLS] is a marker [but] not {a call}", "[TOOL_CALLS] is a marker [but] not {a call}", []),
    ],
    "llama3_json": [
        (
            f"<|python_tag|>{json.dumps({'name': 'get_weather', 'parameters': W}, ensure_ascii=False)}; "
            '{"name": "get_time", "parameters": {}}',
            None,
            [("get_weather", W), ("get_time", T)],
        ),
        (
            '{"answer": 42, "note": "a JSON answer is no call"}',
            '{"answer": 42, "note": "a JSON answer is no call"}',
            [],
        ),
        ('{"name": "get_time", "parameters": {}} and some words', "and some words", [("get_time", T)]),
        (
            'The answer: {"name": "get_time", "parameters": {}}',
            'The answer: {"name": "get_time", "parameters": {}}',
            [],
        ),
        (
            '{"name": "get_weather", "parameters": {"city": "Zü',
            '{"name": "get_weather", "parameters": {"city": "Zü',
            [],
        ),
    ],
    "pythonic": [
        (
            '[get_weather(city="Zürich", note=\'東京 ☀️ "quoted" {braces} [x]\'), get_time()]',
            None,
            [("get_weather", W), ("get_time", T)],
        ),
        (
            "<|python_start|>[get_weather(city='Zürich', days=3, units=None, flags=[True, 1.5])]<|python_end|>",
            None,
            [("get_weather", {"city": "Zürich", "days": 3, "units": None, "flags": [True, 1.5]})],
        ),
        ("[1, 2, 3] is a list", "[1, 2, 3] is a list", []),
        ("[get_weather(city=__import__('os'))]", "[get_weather(city=__import__('os'))]", []),  # never evaluated
        ('[get_weather(city="Zü', '[get_weather(city="Zü', []),
        ("Not a call: [x](y)", "Not a call: [x](y)", []),
    ],
}
CASES["qwen3_xml"] = CASES["qwen3_coder"]
OUTPUTS = [(name, *case) for name, cases in CASES.items() for case in cases]


def _stream(name: str, deltas) -> tuple[str, list[tuple[str, str]]]:
    """The content and calls a stream of ``deltas`` assembles to."""
    stream, content, calls = ToolCallStream(get_tool_parser(name)), [], []
    for d in deltas:
        c, k = stream.feed(d)
        content.append(c)
        calls += k
    c, k = stream.finish()
    return "".join(content) + c, [(x.name, x.arguments) for x in calls + k]


def _whole(name: str, text: str) -> tuple[str, list[tuple[str, str]]]:
    content, calls = extract_calls(get_tool_parser(name), text)
    return content or "", [(x.name, x.arguments) for x in calls]


def test_every_parser_has_cases():
    assert set(CASES) == set(TOOL_PARSERS)


@pytest.mark.parametrize("name,text,content,calls", OUTPUTS)
def test_whole_output(name, text, content, calls):
    got_content, got = extract_calls(get_tool_parser(name), text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert len({c.id for c in got}) == len(got)


@pytest.mark.parametrize("name,text,content,calls", OUTPUTS)
def test_stream_split_at_every_character_equals_whole(name, text, content, calls):
    whole = _whole(name, text)
    assert _stream(name, list(text)) == whole  # one character at a time
    for i in range(len(text) + 1):  # and every single cut
        assert _stream(name, [text[:i], text[i:]]) == whole, i


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path)


def _token_deltas(tokenizer, text: str) -> list[str]:
    """The deltas the engine streams for ``text``: its tokens through the engine's incremental
    detokenizer, one token a step ("" while a character is incomplete)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(max_tokens=len(ids), skip_special_tokens=False))
    deltas, seen = [], 0
    for tok in ids:
        detok.update([tok])
        deltas.append(detok.text[seen:])
        seen = len(detok.text)
    assert "".join(deltas) == text
    return deltas


def test_real_tokens_split_characters(tokenizer):
    """The cases hold characters that SmolLM2's byte-level BPE spreads over several tokens."""
    assert "" in _token_deltas(tokenizer, CASES["hermes"][0][0])


@pytest.mark.parametrize("name,text,content,calls", OUTPUTS)
def test_stream_of_real_tokens_equals_whole(name, text, content, calls, tokenizer):
    assert _stream(name, _token_deltas(tokenizer, text)) == _whole(name, text)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(case=st.sampled_from(OUTPUTS), cuts=st.lists(st.integers(min_value=0, max_value=4096), max_size=12))
def test_stream_of_random_byte_splits_equals_whole(case, cuts):
    """The output's UTF-8 bytes cut at random (inside multi-byte characters too), decoded as a
    stream decodes them: a character split over two pieces arrives whole in the second."""
    name, text = case[0], case[1]
    raw = text.encode()
    points = sorted({c % (len(raw) + 1) for c in cuts} | {0, len(raw)})
    decoder = codecs.getincrementaldecoder("utf-8")()
    deltas = [decoder.decode(raw[a:b]) for a, b in zip(points, points[1:])] + [decoder.decode(b"", final=True)]
    assert "".join(deltas) == text
    assert _stream(name, deltas) == _whole(name, text)


def test_unknown_parser_is_refused():
    with pytest.raises(ValueError, match="unknown tool_call_parser"):
        get_tool_parser("no-such-parser")


@pytest.mark.parametrize(
    "snippet,parser",
    [
        ("{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}", "qwen3_coder"),  # Qwen3-Coder
        ('{{- "<tool_call>\\n{\\"name\\": \\"" }}{{ tool_call.name }}', "hermes"),  # Qwen2.5 / Qwen3 / Hermes
        ("{{- '[TOOL_CALLS][' }}{% for tool in tool_calls %}", "mistral"),
        ("{{- '<|python_start|>' }}{%- if tool_call.function is defined %}", "pythonic"),  # Llama 4
        ("[func_name1(params_name1=params_value1, params_name2=params_value2...)]", "pythonic"),
        ("{{- '<|python_tag|>' + tool_call.name + '.call(' }}", "llama3_json"),  # Llama 3.1
        ("{{ messages[0]['content'] }}", "hermes"),  # no tools: the convention the gateway teaches
        (None, "hermes"),
    ],
)
def test_auto_picks_the_parser_the_template_writes_calls_for(snippet, parser):
    from kvserve.engine.chat_templates import tool_parser_for_template

    assert tool_parser_for_template(snippet) == parser
    assert parser in TOOL_PARSERS
