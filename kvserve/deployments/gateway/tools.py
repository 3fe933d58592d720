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
(:func:`kvserve.engine.chat_templates.prepare_messages`): the tool
list in the system message, past calls as ``<tool_call>`` blocks, results as
``<tool_response>`` blocks, so the history is never silently dropped.
"""

from __future__ import annotations

import json
from typing import Any

from kvserve.deployments.gateway.tool_parsers.base import ParsedToolCall, ToolParser

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
    item = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for t in tools
        ]
    }
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


class ToolCallStream:
    """Cuts one output (``tool_choice: auto``) into content to send and tool calls, with the
    model family's parser (:class:`~kvserve.deployments.gateway.tool_parsers.base.ToolParser`), fed a
    stream's deltas or a whole text alike, so a stream gives exactly the whole response's
    content and calls (:func:`extract_calls`): each call goes out whole once its text is
    complete; content goes out as soon as no later text can make it part of a call.

    Whitespace around calls is dropped (a run of content that follows a call loses its leading
    whitespace; one that a call follows, its trailing whitespace); content with no call next to
    it passes through as the model wrote it."""

    def __init__(self, parser: ToolParser):
        self.parser, self.text, self.after_call, self.held = parser, "", False, ""

    def feed(self, delta: str) -> tuple[str, list[ParsedToolCall]]:
        """Add new output text: ``(content to send now, calls completed now)``."""
        self.text += delta
        return self._scan(final=False)

    def finish(self) -> tuple[str, list[ParsedToolCall]]:
        """At the end of the output: ``(content not yet sent, the last calls)``."""
        content, calls = self._scan(final=True)
        content, self.held = content + self.held, ""
        return content, calls

    def _scan(self, final: bool) -> tuple[str, list[ParsedToolCall]]:
        out, calls = [], []
        while self.text:
            pieces, used = self.parser.scan(self.text, final)
            if not used:
                break
            self.text = self.text[used:]
            for piece in pieces:
                if isinstance(piece, ParsedToolCall):
                    calls.append(piece)
                    self.after_call, self.held = True, ""  # the whitespace before a call goes
                    continue
                if self.after_call:
                    piece = piece.lstrip()
                    if not piece:
                        continue
                    self.after_call = False
                body = piece.rstrip()
                if body:  # send what was held, and this piece up to its trailing whitespace
                    out.append(self.held + body)
                    self.held = piece[len(body) :]
                else:
                    self.held += piece
        return "".join(out), calls


def extract_calls(parser: ToolParser, text: str) -> tuple[str | None, list[ParsedToolCall]]:
    """A whole output's ``(content or None, calls)``, cut as a stream of it would be."""
    stream = ToolCallStream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return (content + rest) or None, calls + more
