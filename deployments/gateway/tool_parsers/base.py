"""The tool-call parser interface: :class:`ToolParser` finds tool calls in a model's free text
(``tool_choice: auto``), as :class:`ParsedToolCall` records."""
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


# ---- parsers for tool_choice "auto" -----------------------------------------------------------
class ToolParser:
    """Finds tool calls in a model's free text. ``start`` is the marker that opens a call
    (text before it is content); streaming holds text back from the first marker on."""

    name = ""
    start = ""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """``(content, calls)``; no calls when the text has none that parse."""
        raise NotImplementedError


def call_of(obj: Any) -> ParsedToolCall | None:
    """``{"name": ..., "arguments" | "parameters": {...}}`` as a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        return ParsedToolCall(obj["name"], args)
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


