"""Reasoning output (``reasoning_parser``; kvserve/deployments/contract/reasoning.py,
kvserve/deployments/gateway/reasoning.py): the split of a ``<think>`` model's output into reasoning and
content per family and prompt, the same whole and streamed at any split; then through the
gateway with the real SDKs: chat's ``reasoning_content`` (tool calls read after the reasoning
only), the Responses API's ``reasoning`` item, the Messages API's ``thinking`` block, whole and
streamed; and the replica's side: the prompt's state from a thinking template, structured outputs
held until the reasoning ends (the engine's side: tests/engine/test_structured_output.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

from kvserve.deployments.contract.openai_requests import ChatCompletionRequest
from kvserve.deployments.contract.reasoning import prompt_reasoning, reasons_first
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.reasoning import ReasoningStream
from gateway_fakes import ScriptedReplica, _sdk, make_gateway

anthropic = pytest.importorskip("anthropic")

#: (parser, prompt state, output, expected reasoning, expected content)
CASES = [
    ("qwen3", "", "<think>\nLet me think: 2 + 2.\n</think>\n\nIt is 4.", "Let me think: 2 + 2.\n", "It is 4."),
    ("qwen3", "", "It is 4, no thinking.", "", "It is 4, no thinking."),
    ("qwen3", "", "  <thin", "", "  <thin"),  # a start marker's prefix that never completes
    (
        "qwen3",
        "open",
        "Reasoning from the prompt's <think>.</think>Answer ☀️",
        "Reasoning from the prompt's <think>.",
        "Answer ☀️",
    ),
    (
        "qwen3",
        "closed",
        "<think>not a block: thinking is off</think> x",
        "",
        "<think>not a block: thinking is off</think> x",
    ),
    ("qwen3", "", "<think>cut off by max_tokens, 東京 and </thi", "cut off by max_tokens, 東京 and </thi", ""),
    ("deepseek_r1", "", "Hmm, the user wants 4.</think>\n4", "Hmm, the user wants 4.", "4"),
    ("deepseek_r1", "open", "<think>Own tag dropped.</think>Done.", "Own tag dropped.", "Done."),
    ("deepseek_r1", "open", "never closes", "never closes", ""),
    ("deepseek_r1", "closed", "Plain answer </think> literal", "", "Plain answer </think> literal"),
    ("deepseek_r1", "", "</think>empty reasoning", "", "empty reasoning"),
]


def _split(parser, state, deltas) -> tuple[str, str]:
    s, reasoning, content = ReasoningStream(parser, state), "", ""
    for d in deltas:
        r, c = s.feed(d)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("parser,state,text,reasoning,content", CASES)
def test_split_whole_and_at_every_cut(parser, state, text, reasoning, content):
    assert _split(parser, state, [text]) == (reasoning, content)
    assert _split(parser, state, list(text)) == (reasoning, content)
    for i in range(len(text) + 1):
        assert _split(parser, state, [text[:i], "", text[i:]]) == (reasoning, content), i


def test_prompt_state_from_the_prompt_tail():
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n", "qwen3") == "open"
    assert prompt_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", "qwen3") == "closed"
    assert prompt_reasoning("<|im_start|>assistant\n", "deepseek_r1") == ""
    assert reasons_first("deepseek_r1", "") and reasons_first("deepseek_r1", "open")
    assert not reasons_first("deepseek_r1", "closed")
    assert reasons_first("qwen3", "open") and not reasons_first("qwen3", "")


# ---- through the gateway ----------------------------------------------------------------------
OUTPUT = (
    "<think>\nThe user asks for the weather. Should I write <tool_call> now? Not inside the reasoning: "
    '{"name": "fake_call"}.\n</think>\n\nLet me look it up.\n<tool_call>\n{"name": "get_weather", '
    '"arguments": {"city": "Zürich"}}\n</tool_call>'
)
REASONING = (
    'The user asks for the weather. Should I write <tool_call> now? Not inside the reasoning: {"name": "fake_call"}.\n'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QWEN3 = {"reasoning_parser": "qwen3", "tool_call_parser": "hermes"}


def _pieces(text: str, step: int = 3) -> list[str]:
    return [text[i : i + step] for i in range(0, len(text), step)]


def test_chat_reasoning_content_whole_and_streamed_with_tools_after_it():
    async def run():
        client, _ = _sdk(ScriptedReplica(_pieces(OUTPUT)), model=QWEN3)
        msgs = [{"role": "user", "content": "Weather in Zürich?"}]
        r = await client.chat.completions.create(model="fake", messages=msgs, tools=[WEATHER])
        m = r.choices[0].message
        assert m.reasoning_content == REASONING and m.content == "Let me look it up."
        assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [
            ("get_weather", {"city": "Zürich"})
        ]
        assert r.choices[0].finish_reason == "tool_calls"
        stream = await client.chat.completions.create(model="fake", messages=msgs, tools=[WEATHER], stream=True)
        reasoning, content, calls, seen_content = "", "", [], False
        async for chunk in stream:
            d = chunk.choices[0].delta
            if getattr(d, "reasoning_content", None):
                assert not seen_content  # reasoning streams first
                reasoning += d.reasoning_content
            if d.content:
                seen_content = True
                content += d.content
            calls += [(c.function.name, json.loads(c.function.arguments)) for c in d.tool_calls or []]
        assert (reasoning, content, calls) == (REASONING, "Let me look it up.", [("get_weather", {"city": "Zürich"})])
        # a model without a reasoning parser: the same text is all content
        plain, _ = _sdk(ScriptedReplica(_pieces("<think>x</think>y")))
        r = await plain.chat.completions.create(model="fake", messages=msgs)
        assert r.choices[0].message.content == "<think>x</think>y"
        assert getattr(r.choices[0].message, "reasoning_content", None) is None

    asyncio.run(run())


def test_prompt_opened_reasoning_and_thinking_switched_off():
    async def run():
        replica = ScriptedReplica(_pieces("Still thinking.</think>The answer."), prompt_reasoning="open")
        client, _ = _sdk(replica, model=QWEN3)
        msgs = [{"role": "user", "content": "Q"}]
        m = (await client.chat.completions.create(model="fake", messages=msgs)).choices[0].message
        assert (m.reasoning_content, m.content) == ("Still thinking.", "The answer.")
        # chat_template_kwargs reach the replica (Qwen3's enable_thinking)
        await client.chat.completions.create(
            model="fake", messages=msgs, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
        )
        assert replica.requests[-1].chat_template_kwargs == {"enable_thinking": False}

    asyncio.run(run())
    with pytest.raises(ValueError, match="chat_template_kwargs cannot set messages"):
        ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "q"}], "chat_template_kwargs": {"messages": []}}
        )


def test_responses_reasoning_item_whole_and_streamed():
    async def run():
        client, _ = _sdk(ScriptedReplica(_pieces(OUTPUT)), model=QWEN3)
        r = await client.responses.create(
            model="fake",
            input="Weather in Zürich?",
            tools=[{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}],
        )
        kinds = [it.type for it in r.output]
        assert kinds == ["reasoning", "message", "function_call"]
        assert r.output[0].content[0].text == REASONING and r.output[1].content[0].text == "Let me look it up."
        async with client.responses.stream(model="fake", input="Weather?") as stream:
            deltas = [e.delta async for e in stream if e.type == "response.reasoning_text.delta"]
            final = await stream.get_final_response()
        assert "".join(deltas) == REASONING
        assert [it.type for it in final.output] == ["reasoning", "message"]
        assert final.output[0].content[0].text == REASONING
        # effort none turns thinking off through the template
        replica = ScriptedReplica(["ok"])
        client, _ = _sdk(replica, model=QWEN3)
        await client.responses.create(model="fake", input="q", reasoning={"effort": "none"})
        assert replica.requests[-1].chat_template_kwargs == {"enable_thinking": False}

    asyncio.run(run())


def test_messages_thinking_block_whole_and_streamed():
    async def run():
        replica = ScriptedReplica(_pieces(OUTPUT))
        gw = make_gateway(replica, model=QWEN3)
        httpx2 = pytest.importorskip("httpx2")  # the anthropic SDK's own httpx
        http = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=build_api(gw)), base_url="http://gw")
        client = anthropic.AsyncAnthropic(base_url="http://gw", api_key="x", http_client=http, max_retries=0)
        tools = [{"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}]
        msgs = [{"role": "user", "content": "Weather in Zürich?"}]
        m = await client.messages.create(
            model="fake", max_tokens=64, messages=msgs, tools=tools, thinking={"type": "enabled", "budget_tokens": 1024}
        )
        assert [b.type for b in m.content] == ["thinking", "text", "tool_use"]
        assert m.content[0].thinking == REASONING and m.content[1].text == "Let me look it up."
        assert m.content[2].input == {"city": "Zürich"} and m.stop_reason == "tool_use"
        assert replica.requests[-1].chat_template_kwargs == {"enable_thinking": True}
        async with client.messages.stream(model="fake", max_tokens=64, messages=msgs, tools=tools) as stream:
            thinking = "".join(
                [
                    e.delta.thinking
                    async for e in stream
                    if e.type == "content_block_delta" and e.delta.type == "thinking_delta"
                ]
            )
            final = await stream.get_final_message()
        assert thinking == REASONING
        assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[0].thinking == REASONING and final.content[2].input == {"city": "Zürich"}
        # the thinking block sent back in the next turn is accepted (and not shown to the model)
        back = [
            *msgs,
            {"role": "assistant", "content": [b.model_dump() for b in final.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": final.content[2].id, "content": "21 C"}],
            },
        ]
        await client.messages.create(
            model="fake", max_tokens=8, messages=back, tools=tools, thinking={"type": "disabled"}
        )
        sent = replica.requests[-1]
        assert sent.chat_template_kwargs == {"enable_thinking": False}
        assert all(REASONING not in json.dumps(msg) for msg in sent.messages)

    asyncio.run(run())


# ---- the replica: where the prompt leaves the model, and structured outputs after the reasoning --
THINKING_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}"
    "{% else %}{{ '<think>\\n' }}{% endif %}{% endif %}"
)


def test_replica_reports_the_prompt_state_and_holds_the_grammar_until_the_reasoning_ends(tmp_path_factory):
    """A DeepSeek-R1-like template (the generation prompt opens ``<think>``; Qwen3's
    ``enable_thinking: false`` closes an empty block) on the tiny random model, whose free text
    never writes ``</think>``: with the block open a grammar waits (the output runs free to
    ``max_tokens``, all reasoning); with it closed the grammar holds from the first token."""
    from kvserve.deployments.contract.config import ModelArgs
    from kvserve.deployments.contract.types import GenerateRequest
    from kvserve.deployments.replica.llm_server import LLMServer
    from tiny_models import make_tiny_model

    tiny = make_tiny_model(tmp_path_factory.mktemp("tiny_thinking"))
    (tiny / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    server = LLMServer.func_or_class(
        ModelArgs(
            model=str(tiny),
            served_model_name="tiny",
            torch_num_threads=1,
            max_model_len=256,
            num_kv_blocks=64,
            block_size=16,
            reasoning_parser="deepseek_r1",
        )
    )
    choice = {"temperature": 0, "max_tokens": 6, "structured_outputs": {"choice": ["yes", "no"]}}
    msgs = [{"role": "user", "content": "Is water wet?"}]

    async def run(**kw):
        req = GenerateRequest.of(None, choice, messages=msgs, **kw)
        return [c async for c in server.stream(req)]

    async def main():
        try:
            return await run(), await run(chat_template_kwargs={"enable_thinking": False})
        finally:
            await server.engine.shutdown()

    thinking, off = asyncio.run(main())
    assert thinking[0].prompt_reasoning == "open" and off[0].prompt_reasoning == "closed"
    text = "".join(c.text for c in thinking)
    assert thinking[-1].finish_reason == "length" and text not in ("yes", "no")  # free: still reasoning
    assert _split("deepseek_r1", "open", [text]) == (text.lstrip(), "")
    assert "".join(c.text for c in off) in ("yes", "no") and off[-1].finish_reason == "stop"
    assert server.tool_call_parser == "hermes"  # auto: the template writes no tool calls
