"""Tool calling for chat completions, the gateway's side: the grammar that enforces ``tool_choice: required`` or a named function,
and the parsers that turn a model's text into OpenAI ``tool_calls``.

How each ``tool_choice`` runs (the approach of vLLM's OpenAI server):

- ``none``: the tools are left out of the prompt (what vLLM's
  ``--exclude-tools-when-tool-choice-none`` does); the output is plain text.
- ``auto``: tools reach the template; the output is parsed by the model family's parser
  (:data:`TOOL_PARSERS`, named with vLLM's ``--tool-call-parser`` names).
- ``required``: a JSON schema grammar makes the model write a JSON array of
  ``{"name": <one of the tools>, "parameters": <that tool's schema>}`` (one item when
  ``parallel_tool_calls`` is false), so even a small model returns valid arguments.
- a named function: the grammar is that function's parameter schema; the output *is* the
  arguments.

Templates that know nothing of tools (no ``tools`` in their source, e.g. SmolLM2's) get the
Hermes convention written into the messages instead, by the replica
(:func:`engine.chat_templates.prepare_messages`): the tool
list in the system message, past calls as ``<tool_call>`` blocks, results as
``<tool_response>`` blocks, so the history is never silently dropped.
"""
from __future__ import annotations

import json
from typing import Any

from deployments.gateway.tool_parsers.base import ParsedToolCall, ToolParser

#: What the JSON schema of a tool without ``parameters`` is.
_ANY_OBJECT = {"type": "object"}




def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or _ANY_OBJECT


def tool_grammar(tools: list[dict], choice: str | dict, parallel: bool) -> dict | None:
    """The engine's ``structured_outputs`` spec that enforces ``choice`` (``required`` or
    ``{"type": "function", "function": {"name": ...}}``); None for ``auto`` / ``none``."""
    if isinstance(choice, dict):
        tool = next(t for t in tools if t["function"]["name"] == choice["function"]["name"])
        return {"json": _parameters(tool)}
    if choice != "required":
        return None
    item = {"anyOf": [{"type": "object", "properties": {
        "name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _parameters(t)},
        "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}
    schema: dict[str, Any] = {"type": "array", "items": item, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return {"json": schema}


def parse_forced(text: str, choice: str | dict) -> list[ParsedToolCall] | None:
    """The calls in the output of a grammar-forced request (``required``: a JSON array of
    ``{"name", "parameters"}``; a named function: the arguments object). None when the text
    does not parse (the output was cut off by ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    if isinstance(choice, dict):
        if not isinstance(value, dict):
            return None
        return [ParsedToolCall(choice["function"]["name"], json.dumps(value, ensure_ascii=False))]
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        calls.append(ParsedToolCall(item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False)))
    return calls


















class StreamingToolText:
    """Splits an ``auto`` stream into content to send now and text held back because it is
    (or may become) a tool call: everything from the parser's start marker on, and a tail
    that is a prefix of the marker. :meth:`finish` parses what was held back."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.sent, self.calling = parser, "", 0, False
        self.leading_only = parser.name == "llama3_json"  # a call is the whole output there
        self.decided = False

    def feed(self, delta: str) -> str:
        """Add new output text; returns the content that can be streamed now."""
        self.text += delta
        if self.calling:
            return ""
        if self.leading_only:
            if not self.decided:
                head = self.text.lstrip()
                if not head or "<|python_tag|>".startswith(head):
                    return ""  # undecided: nothing yet, or maybe the start of the tag
                self.decided = True
                self.calling = head.startswith(("{", "<|python_tag|>"))
                if self.calling:
                    return ""
            out, self.sent = self.text[self.sent:], len(self.text)
            return out
        marker = self.parser.start
        at = self.text.find(marker, self.sent)
        if at >= 0:
            self.calling = True
            out, self.sent = self.text[self.sent:at], at
            return out
        keep = 0  # the longest tail that could start the marker
        for k in range(min(len(marker) - 1, len(self.text) - self.sent), 0, -1):
            if marker.startswith(self.text[-k:]):
                keep = k
                break
        end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], end
        return out

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end of the output: ``(content not yet sent, calls)``."""
        rest = self.text[self.sent:]
        if not self.calling:
            return rest, []
        content, calls = self.parser.extract(rest)
        if not calls:
            return rest, []
        return content or "", calls


# ---- the prompt side --------------------------------------------------------------------------
