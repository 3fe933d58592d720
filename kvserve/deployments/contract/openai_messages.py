"""Chat messages and tools as the OpenAI API sends them (pydantic): :class:`ChatMessage` with its
content parts and tool calls, :class:`ToolDef` and :class:`NamedToolChoice`."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: A UTF-16 surrogate code point. JSON's ``"\\ud83d\\ude00"`` (a pair) decodes to one astral
#: character, so a surrogate left in a decoded string is a lone one: not Unicode text, which no
#: tokenizer encodes and no UTF-8 writer writes.
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate_error(value: Any, where: str = "body") -> str | None:
    """Where the first lone surrogate sits in a decoded JSON value (dicts, lists, strings, keys
    included), as an error message naming the field (``messages.0.content: ...``); None when
    there is none. Iterative (no recursion limit), one regex search per string.
    """
    stack = [(where, value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            m = _SURROGATE.search(v)
            if m is not None:
                return (
                    f"{path} holds a lone surrogate (U+{ord(m.group()):04X} at character {m.start()}), "
                    "which is not valid Unicode; a JSON \\uD800-\\uDFFF escape must be half of a surrogate pair"
                )
        elif isinstance(v, dict):
            for k, item in reversed(list(v.items())):
                if isinstance(k, str) and _SURROGATE.search(k):
                    return f"a key of {path} holds a lone surrogate, which is not valid Unicode"
                stack.append((f"{path}.{k}" if path != "body" else str(k), item))
        elif isinstance(v, (list, tuple)):
            stack.extend((f"{path}.{i}", item) for i, item in reversed(list(enumerate(v))))
    return None


def reject_lone_surrogates(data: Any) -> Any:
    """A ``model_validator(mode="before")`` body: ``data`` unchanged, or ``ValueError`` naming
    the first field whose text holds a lone surrogate (:func:`lone_surrogate_error`), so such a
    request is a 400 before anything encodes its text."""
    err = lone_surrogate_error(data)
    if err is not None:
        raise ValueError(err)
    return data


# ---- chat completions ---------------------------------------------------------------------
class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """An assistant message's tool call (history sent back by the client)."""

    model_config = ConfigDict(extra="allow")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str = Field(..., min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    class _Name(BaseModel):
        name: str

    type: Literal["function"] = "function"
    function: _Name


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, v):
        if isinstance(v, list):
            for p in v:
                if p.type != "text" or p.text is None:
                    raise ValueError(f"only text content parts are supported, got type {p.type!r}")
        return v

    def to_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention): text content,
        and tool calls with ``arguments`` as a dict (OpenAI sends a JSON string)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text or "" for p in content)
        d: dict[str, Any] = {"role": self.role, "content": content or ""}
        if self.name:
            d["name"] = self.name
        if self.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments_dict(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            d["tool_call_id"] = self.tool_call_id
        return d


def _arguments_dict(arguments: str | dict) -> dict:
    """A tool call's arguments as a dict (a JSON string that is not an object is kept under
    ``"value"``, so the history still reaches the model)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        v = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"value": arguments}
    return v if isinstance(v, dict) else {"value": v}
