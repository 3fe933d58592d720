"""The tool-call parser interface: :class:`ToolParser` cuts a model's free text
(``tool_choice: auto``) into content and :class:`ParsedToolCall` records, one decided piece at
a time, so that a stream and a whole response are cut the same way
(:class:`kvserve.deployments.gateway.tools.ToolCallStream` drives it for both)."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ParsedToolCall:
    """One call the model made: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"


#: What :meth:`ToolParser.scan` returns: the pieces it decided (content text or a call) and how
#: many characters of its input they took.
Scan = tuple[list["str | ParsedToolCall"], int]


class ToolParser:
    """Cuts a model's output into content and tool calls, left to right, deciding a piece only
    when no later text can change it: a stream fed in any split is cut exactly as the whole
    text is (the property ``tests/deployments/test_tool_parsers.py`` checks at every token
    and byte boundary). A call that does not parse (bad JSON, no ``name``, cut off by
    ``max_tokens``) is left as content, never an error.

    A parser keeps state between :meth:`scan` calls (whether calls may still start, as in
    ``llama3_json`` where only the output's start may be one): one instance per output, as
    :func:`kvserve.deployments.gateway.tool_parsers.get_tool_parser` gives.
    """

    #: vLLM's ``--tool-call-parser`` name.
    name = ""

    def scan(self, text: str, final: bool) -> Scan:
        """Decide a prefix of ``text`` (the output not yet decided): ``(pieces, consumed)``.
        Not ``final``: a piece is decided only when the text after it cannot change it (a
        call's closing marker has arrived; content cannot be the start of a marker); 0
        consumed means "wait for more". ``final`` (the output ended): everything is decided."""
        raise NotImplementedError


def call_of(obj: Any) -> ParsedToolCall | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a call (None: not a call). The
    arguments as a JSON string: an object's re-serialised, a string taken as it is."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ParsedToolCall(obj["name"], args)
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def json_calls(body: str) -> list[ParsedToolCall] | None:
    """The calls in ``body``: a JSON call object or an array of them (None: not that)."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [call_of(v) for v in items]
    return calls if calls and all(c is not None for c in calls) else None


def partial_marker_at(text: str, marker: str) -> int:
    """Where the longest tail of ``text`` that could begin ``marker`` starts (``len(text)``: no
    such tail): content before it is decided, the tail must wait."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


_OPEN, _CLOSE = "[{(", "]})"


def bracket_end(text: str, start: int, quotes: str = '"') -> int | None:
    """The index just past the bracketed value opening at ``text[start]`` (one of ``[{(``),
    skipping brackets inside string literals (``quotes``: their delimiters, backslash escapes);
    None while it is not closed in ``text``. Brackets are matched by depth, not kind: a
    mismatched value is found malformed when it is parsed."""
    depth, quote, i = 0, None, start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = None
        elif ch in quotes:
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None
