"""Anthropic's Messages API request (``POST /v1/messages``, ``/v1/messages/count_tokens``) and its
translation into the chat request the pipeline runs (:class:`MessagesRequest`).

Supported: ``system`` (text or text blocks), ``messages`` whose content is text or blocks of
``text``, ``tool_use`` (an assistant's calls) and ``tool_result`` (a user's answers to them),
``tools`` (custom tools: ``name``, ``description``, ``input_schema``), ``tool_choice`` (``auto``,
``any``, ``tool``, ``none``; ``disable_parallel_tool_use``), ``max_tokens``, ``stop_sequences``,
``temperature``, ``top_p``, ``top_k``, ``metadata.user_id`` (the chat's ``user``), ``stream``.
``output_config.format`` (``json_schema``: structured outputs by the grammar, as chat's
``response_format``; ``output_config.effort`` is not honoured), ``thinking`` (``enabled`` /
``disabled``: the template's ``enable_thinking``; ``budget_tokens`` is
not enforced; a model served with a reasoning parser answers with a ``thinking`` block).
Refused with a 400 naming the field: images and documents, server tools (``web_search`` ...).
kvserve's ``priority`` and ``seed`` pass through."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, 400, "invalid_request_error", param=param, code="invalid_value")


class AnthropicMessage(BaseModel):
    """One turn: ``role`` and ``content`` (a string, or a list of content blocks)."""

    model_config = ConfigDict(extra="forbid")

    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``: what the prompt of a message request holds."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[AnthropicMessage] = Field(..., min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    def chat_messages(self) -> list[dict[str, Any]]:
        """The conversation as OpenAI chat messages (system first).

        Raises:
            OpenAIError: 400 for a block kvserve does not take (the message names it).
        """
        out: list[dict[str, Any]] = []
        system = _text_of(self.system, "system")
        if system:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            out += _turn(m, f"messages.{i}.content")
        return out

    def chat_tools(self) -> list[dict[str, Any]] | None:
        """The tools as OpenAI function tools.

        Raises:
            OpenAIError: 400 for a server tool or a tool without a name.
        """
        if not self.tools:
            return None
        out = []
        for i, t in enumerate(self.tools):
            if t.get("type") not in (None, "custom") or not t.get("name"):
                raise _bad(
                    f"tools.{i}: only custom tools (name, description, input_schema) are supported, got "
                    f"type {t.get('type')!r}",
                    f"tools.{i}",
                )
            fn = {"name": t["name"], "parameters": t.get("input_schema") or {"type": "object", "properties": {}}}
            if t.get("description"):
                fn["description"] = t["description"]
            out.append({"type": "function", "function": fn})
        return out

    def check_thinking(self) -> dict[str, bool] | None:
        """The chat template's variables for ``thinking``: ``enable_thinking`` (the variable
        Qwen3's and DeepSeek's templates read; others ignore it), None when not given.

        Raises:
            OpenAIError: 400 for a ``thinking.type`` other than ``enabled`` or ``disabled``.
        """
        kind = (self.thinking or {}).get("type")
        if kind is None:
            return None
        if kind not in ("enabled", "disabled"):
            raise _bad(f"thinking.type must be enabled or disabled, got {kind!r}", "thinking.type")
        return {"enable_thinking": kind == "enabled"}


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages`` (see the module docstring)."""

    max_tokens: int = Field(..., ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    metadata: dict[str, Any] | None = None
    output_config: dict[str, Any] | None = None
    stream: bool = False
    # kvserve's (and vLLM's) extensions
    seed: int | None = None
    priority: int = 0

    def to_chat(self) -> ChatCompletionRequest:
        """The chat request that runs this message request.

        Raises:
            OpenAIError: 400 for what the chat request does not take (the message names the field).
        """
        template_kwargs = self.check_thinking()
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": self.chat_messages(),
            "max_tokens": self.max_tokens,
            "stream": self.stream,
            "priority": self.priority,
        }
        if template_kwargs:
            chat["chat_template_kwargs"] = template_kwargs
        for k in ("temperature", "top_p", "seed"):
            if getattr(self, k) is not None:
                chat[k] = getattr(self, k)
        if self.top_k:  # Anthropic's 0 means off, as vLLM's -1 / None
            chat["top_k"] = self.top_k
        if self.stop_sequences:
            chat["stop"] = self.stop_sequences
        fmt = (self.output_config or {}).get("format")
        if fmt is not None:  # Anthropic's structured outputs: the grammar path of response_format
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise _bad(
                    'output_config.format must be {"type": "json_schema", "schema": {...}}', "output_config.format"
                )
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": fmt["schema"], "strict": True},
            }
        user = (self.metadata or {}).get("user_id")
        if user:
            chat["user"] = str(user)
        tools = self.chat_tools()
        if tools:
            chat["tools"] = tools
        tc = self.tool_choice or {}
        kind = tc.get("type")
        if kind is not None:
            if kind not in ("auto", "any", "tool", "none"):
                raise _bad(f"tool_choice.type must be auto, any, tool or none, got {kind!r}", "tool_choice.type")
            if kind == "tool":
                if not tc.get("name"):
                    raise _bad("tool_choice: type tool needs a name", "tool_choice.name")
                chat["tool_choice"] = {"type": "function", "function": {"name": tc["name"]}}
            else:
                chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[kind]
            if tc.get("disable_parallel_tool_use"):
                chat["parallel_tool_calls"] = False
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValueError as e:
            raise _bad(f"the request cannot be run: {e}", "messages") from None


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """The text of a string or a list of ``text`` blocks.

    Raises:
        OpenAIError: 400 for a block that is not text.
    """
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for i, b in enumerate(content):
        if not isinstance(b, dict) or b.get("type") != "text":
            raise _bad(
                f"{where}.{i}: only text blocks are supported here, got "
                f"{b.get('type') if isinstance(b, dict) else type(b).__name__!r}",
                f"{where}.{i}",
            )
        parts.append(str(b.get("text", "")))
    return "".join(parts)


def _turn(m: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    """One Anthropic turn as chat messages: a user turn's ``tool_result`` blocks become ``tool``
    messages (first: they answer the previous turn's calls), its text a user message; an
    assistant turn's ``tool_use`` blocks become its ``tool_calls``."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for i, b in enumerate(m.content):
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(str(b.get("text", "")))
        elif kind == "tool_use" and m.role == "assistant":
            if not b.get("id") or not b.get("name"):
                raise _bad(f"{where}.{i}: a tool_use block needs an id and a name", f"{where}.{i}")
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input") or {}, ensure_ascii=False)},
                }
            )
        elif kind in ("thinking", "redacted_thinking") and m.role == "assistant":
            continue  # an earlier turn's reasoning: not sent back to the model (as the templates drop it)
        elif kind == "tool_result" and m.role == "user":
            if not b.get("tool_use_id"):
                raise _bad(f"{where}.{i}: a tool_result block needs a tool_use_id", f"{where}.{i}")
            text = _text_of(b.get("content"), f"{where}.{i}.content")
            if b.get("is_error"):
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": b["tool_use_id"], "content": text})
        else:
            raise _bad(
                f"{where}.{i}: content blocks of type {kind!r} are not supported in a {m.role} turn "
                "(text, tool_use in assistant turns, tool_result in user turns)",
                f"{where}.{i}",
            )
    out = list(results)
    if m.role == "assistant":
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    elif texts:
        out.append({"role": "user", "content": "".join(texts)})
    return out
