"""What ``POST /v1/responses`` takes: OpenAI's Responses request (:class:`ResponsesRequest`),
turned into the chat request the gateway's pipeline runs (:meth:`ResponsesRequest.to_chat`),
and the stored responses behind ``store`` / ``previous_response_id`` (:class:`ResponseStore`).

Supported: ``input`` (a string, or message / ``function_call`` / ``function_call_output``
items with text content), ``instructions``, ``max_output_tokens``, ``temperature``, ``top_p``,
``text.format`` (``text``, ``json_object``, ``json_schema``), function ``tools`` with
``tool_choice`` and ``parallel_tool_calls``, ``stream``, ``store``, ``previous_response_id``,
``metadata``, ``reasoning`` (a reasoning model's output gives a ``reasoning`` item; ``effort``
``none`` or ``minimal`` turns thinking off through the template's ``enable_thinking``, other
efforts and ``summary`` are not honoured). Anything that would change the answer and is not supported (hosted tools,
``background``, ``truncation: auto``, images and files, ``conversation``,
prompt templates, ``top_logprobs``) is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvserve.deployments.cache import CacheSettings
from kvserve.deployments.cache.owner_stores import OwnerStores
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest

#: Seconds a stored response lives (OpenAI keeps them 30 days).
RESPONSE_TTL_S = 30 * 24 * 3600.0
_TEXT_PARTS = ("input_text", "output_text", "text", "refusal")


def _bad(message: str, param: str) -> OpenAIError:
    return OpenAIError(message, 400, param=param, code="invalid_value")


class TextFormat(BaseModel):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (``name``, ``schema``,
    ``strict``, ``description`` flat in the object, as the Responses API writes them)."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(BaseModel):
    """OpenAI's ``POST /v1/responses`` body (see the module docstring for what is supported)."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] = Field(...)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: TextConfig | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    # kvserve's (and vLLM's) extensions
    seed: int | None = None
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, max_length=512)  # vLLM's: see the chat request's
    # refused when set (they change the answer and are not supported)
    background: bool | None = None
    truncation: str | None = None
    reasoning: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: int | None = None
    max_tool_calls: int | None = None

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        if self.background:
            raise ValueError("background: background responses are not supported; send background false")
        if self.truncation not in (None, "disabled"):
            raise ValueError("truncation: only 'disabled' is supported (a too long input is a 400)")
        if self.conversation is not None:
            raise ValueError("conversation: conversations are not supported; use previous_response_id")
        if self.prompt is not None:
            raise ValueError("prompt: prompt templates are not supported; send input and instructions")
        if self.top_logprobs:
            raise ValueError("top_logprobs: logprobs are not supported in the Responses API here")
        if self.max_tool_calls is not None:
            raise ValueError("max_tool_calls: not supported (hosted tools are not supported)")
        if isinstance(self.input, list) and not self.input:
            raise ValueError("input must not be empty")
        for i, t in enumerate(self.tools or []):
            if t.get("type") != "function":
                raise ValueError(
                    f"tools[{i}].type: only function tools are supported, got {t.get('type')!r} "
                    "(hosted tools such as web_search or file_search are not)"
                )
        return self

    # ---- to the chat pipeline ---------------------------------------------------------------
    def input_messages(self) -> list[dict[str, Any]]:
        """This request's input items as chat messages (OpenAI's chat format).

        Raises:
            OpenAIError: 400 naming the item or part that is not supported.
        """
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict[str, Any]] = []
        for i, item in enumerate(self.input):
            kind = item.get("type", "message")
            if kind == "message" or ("role" in item and "type" not in item):
                out.append({"role": item.get("role"), "content": _text(item.get("content"), f"input[{i}].content")})
            elif kind == "function_call":
                call = {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
                }
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                out.append(
                    {
                        "role": "tool",
                        "tool_call_id": item.get("call_id"),
                        "content": output if isinstance(output, str) else _text(output, f"input[{i}].output"),
                    }
                )
            elif kind == "reasoning":
                continue  # no reasoning model here: an earlier turn's reasoning summary adds nothing
            else:
                raise _bad(
                    f"input[{i}].type: items of type {kind!r} are not supported (message, function_call, "
                    "function_call_output)",
                    f"input[{i}].type",
                )
        return out

    def to_chat(self, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request of this response: ``instructions`` as the system message, then
        ``conversation`` (the stored turns of ``previous_response_id`` and :meth:`input_messages`).

        Raises:
            OpenAIError: 400 for what the chat request does not accept (the message names the field).
        """
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + conversation
        chat: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls,
            "priority": self.priority,
        }
        for k in ("temperature", "top_p", "seed", "user"):
            if getattr(self, k) is not None:
                chat[k] = getattr(self, k)
        if self.max_output_tokens is not None:
            chat["max_completion_tokens"] = self.max_output_tokens
        if (self.reasoning or {}).get("effort") in ("none", "minimal"):
            chat["chat_template_kwargs"] = {"enable_thinking": False}
        if self.tools:
            chat["tools"] = [
                {
                    "type": "function",
                    "function": {
                        k: t[k] for k in ("name", "description", "parameters", "strict") if t.get(k) is not None
                    },
                }
                for t in self.tools
            ]
        if isinstance(self.tool_choice, dict):
            if self.tool_choice.get("type") != "function":
                raise _bad(
                    f"tool_choice: type {self.tool_choice.get('type')!r} is not supported (function)", "tool_choice"
                )
            chat["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.get("name")}}
        elif self.tool_choice is not None:
            chat["tool_choice"] = self.tool_choice
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        elif fmt is not None and fmt.type == "json_schema":
            chat["response_format"] = {
                "type": "json_schema",
                "json_schema": {
                    "name": fmt.name or "response",
                    "schema": fmt.schema_,
                    "strict": fmt.strict,
                    "description": fmt.description,
                },
            }
        try:
            return ChatCompletionRequest.model_validate(chat)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(p) for p in err.get("loc", ()))
            msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
            raise _bad(f"{where}: {msg}" if where else msg, where or None) from None


def _text(content: Any, where: str) -> str:
    """Text content (a string, or text parts joined).

    Raises:
        OpenAIError: 400 for a part that is not text (images, files, audio).
    """
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise _bad(f"{where}: must be a string or a list of content parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise _bad(f"{where}[{j}].type: only text parts are supported, got {kind!r}", f"{where}[{j}].type")
        texts.append(part.get("text") or part.get("refusal") or "")
    return "".join(texts)


class ResponseStore:
    """Stored responses (``store: true``): the response object, the conversation so far (for
    ``previous_response_id``) and its owner, the stable id of the API key that made it
    (:func:`kvserve.deployments.gateway.gate.owner_id`: derived from the key, not its name; another
    key's reads are 404s).

    Kept where the response cache's backend is: in this ingress replica's memory, or in Redis
    (``cache_backend: redis``) so that every ingress replica sees them. Each owner has its own
    least-recently-used store, bounded by the cache's entry and byte bounds on its own (so
    one tenant's traffic never evicts another's responses; owners are the configured keys,
    and ``anonymous`` without keys); each response lives :data:`RESPONSE_TTL_S` seconds.
    """

    MODEL = "responses"  # the stores' model tag of every stored response
    PREFIX = "kvserve:resp:"  # Redis: each owner's keys under kvserve:resp:<owner>:

    def __init__(self, settings: CacheSettings, owners: int = 1):
        self.settings = settings
        self.owners = OwnerStores(settings, self.PREFIX, owners=owners)  # each owner: 1/owners of the bytes

    def store_of(self, owner: str):
        """The store of ``owner``'s responses (made on first use)."""
        return self.owners.store_of(owner)

    async def put(self, response: dict[str, Any], messages: list[dict[str, Any]], owner: str) -> bool:
        """Keep ``response`` (its ``id``) with the conversation ``messages`` it ends, in
        ``owner``'s store (its least recently used go past the owner's bounds); False when it
        was not kept (larger than the owner's bytes, or the backend failed)."""
        data = json.dumps(
            {"response": response, "messages": messages, "owner": owner}, separators=(",", ":"), ensure_ascii=False
        ).encode()
        try:
            return await self.store_of(owner).put(self.MODEL, response["id"], data, RESPONSE_TTL_S)
        except OpenAIError:  # StoreUnavailable: the caller says so in the response
            return False

    async def get(self, response_id: str, owner: str, param: str | None = None) -> dict[str, Any]:
        """The stored record of ``response_id`` (``response``, ``messages``) of ``owner``.

        Raises:
            OpenAIError: 404 when there is none for this key (never stored, expired, evicted,
                another key's).
        """
        data = await self.store_of(owner).get(self.MODEL, response_id)
        record = json.loads(data) if data else None
        if record is None or record.get("owner") != owner:
            raise OpenAIError(
                f"no response with id '{response_id}' was found", 404, param=param, code="response_not_found"
            )
        return record

    async def delete(self, response_id: str, owner: str) -> None:
        """Forget a stored response.

        Raises:
            OpenAIError: 404 as :meth:`get`.
        """
        await self.get(response_id, owner)
        await self.store_of(owner).delete(self.MODEL, response_id)
