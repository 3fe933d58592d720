"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API.

A Responses request runs as a chat request through the same pipeline (model, cache, key and
limits, replica; :func:`~kvserve.deployments.gateway.chat.chat_spec`, with no upstream fallback), so
structured outputs (``text.format``) and function tools behave as in chat. What differs is
the shape: output *items* (a ``message`` with ``output_text``, one ``function_call`` per tool
call), ``usage`` as input/output tokens, ``status`` ``incomplete`` when ``max_output_tokens``
cut the answer, and a stream of typed events, each with a ``sequence_number``:
``response.created``, ``response.in_progress``, then per item ``response.output_item.added``,
(``response.content_part.added``, ``response.output_text.delta``..., ``response.output_text.done``,
``response.content_part.done``) or (``response.function_call_arguments.delta``...,
``response.function_call_arguments.done``), ``response.output_item.done``, and last
``response.completed`` (or ``response.incomplete``). With ``store`` (the default, as OpenAI's)
the response and its conversation are kept (:class:`~kvserve.deployments.gateway.responses_input.ResponseStore`)
for ``GET`` and for a later request's ``previous_response_id``; ``instructions`` are not carried
over (as OpenAI's). A response that asked to be stored and was not (the store failed, or it is
larger than the key's share of the store) says so: its ``store`` is ``false``, and a whole
answer carries the header :data:`STORE_HEADER` ``failed``."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from kvserve.deployments.contract.types import GenerationChunk, finish_reason
from kvserve.deployments.gateway.call import Call
from kvserve.deployments.gateway.chat import ChatChoiceRenderer, chat_spec, renderers
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.gateway.gate import owner_id
from kvserve.deployments.gateway.responses_input import ResponsesRequest, ResponseStore
from kvserve.deployments.gateway.streams import SSE_HEADERS, usage_of


#: Response header of a ``store: true`` response that was not stored: ``failed``.
STORE_HEADER = "x-kvserve-store"


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "reasoning",
        "summary": [],
        "status": status,
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponseBuilder:
    """One response object: the request's echoed settings, then its output, status and usage;
    :meth:`final` also stores it (``store``) with the conversation it ends."""

    def __init__(
        self,
        call: Call,
        body: ResponsesRequest,
        store: ResponseStore | None,
        conversation: list[dict[str, Any]],
        owner: str,
    ):
        self.call, self.body, self.store, self.conversation, self.owner = call, body, store, conversation, owner
        self.id = "resp_" + call.response_id.split("-", 1)[1]
        self.created = time.time()
        self.store_failed = False  # asked to be stored, and the store did not take it

    def response(self, status: str, output: list[dict[str, Any]], lasts: dict | None = None) -> dict[str, Any]:
        """The response object (``status`` ``in_progress``, ``completed`` or ``incomplete``)."""
        b = self.body
        fmt = (
            b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else {"type": "text"}
        )
        out = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.call.served,
            "output": output,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "tools": b.tools or [],
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto",
            "parallel_tool_calls": b.parallel_tool_calls,
            "text": {"format": fmt},
            "previous_response_id": b.previous_response_id,
            "store": b.store,
            "metadata": b.metadata or {},
            "user": b.user,
            "truncation": "disabled",
            "background": False,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": None,
        }
        if status != "in_progress":
            out["completed_at"] = time.time() if status == "completed" else None
        if lasts is not None:
            u = usage_of(lasts)
            cached = u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0
            out["usage"] = {
                "input_tokens": u.prompt_tokens,
                "output_tokens": u.completion_tokens,
                "total_tokens": u.total_tokens,
                "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
                "output_tokens_details": {"reasoning_tokens": 0},
            }
        return out

    async def final(self, output: list[dict[str, Any]], last: GenerationChunk) -> dict[str, Any]:
        """The finished response (``incomplete`` when ``max_output_tokens`` cut it; ``last`` is
        the generation's final chunk), stored when the request asked."""
        status = "incomplete" if finish_reason(last.finish_reason) == "length" else "completed"
        resp = self.response(status, output, {(0, 0): last})
        if self.store is not None and not await self.store.put(
            resp, self.conversation + conversation_of(output), self.owner
        ):
            self.store_failed = True
            resp["store"] = False  # not kept: a later GET or previous_response_id would not find it
        return resp


def conversation_of(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages a later turn sends back."""
    text = "".join(c["text"] for it in output if it["type"] == "message" for c in it["content"])
    calls = [
        {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
        for it in output
        if it["type"] == "function_call"
    ]
    msg: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        msg["tool_calls"] = calls
    return [msg]


async def create_response(gw: Gateway, store: ResponseStore, body: ResponsesRequest, request: Request):
    """``POST /v1/responses``."""
    owner = owner_id(request.scope)
    conversation = []
    if body.previous_response_id is not None:
        conversation = (await store.get(body.previous_response_id, owner, "previous_response_id"))["messages"]
    conversation += body.input_messages()
    gw.warn_unknown(body)
    chat = body.to_chat(conversation)
    spec, mode = chat_spec(chat, request, "resp", fallback=False)
    call = await gw.run(spec)
    renderer = (await renderers(gw, call, chat, mode))[0]
    builder = ResponseBuilder(call, body, store if body.store else None, conversation, owner)
    if body.stream:
        return StreamingResponse(
            gw.answers.sse(call, _events(gw, call, builder, renderer), done=False),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **call.headers},
        )
    whole = (await gw.answers.whole(call))[(0, 0)]
    msg, _ = renderer.message(whole)
    reasoning = getattr(msg, "reasoning_content", None)
    output = [_reasoning_item(_item_id("rs"), reasoning, "completed")] if reasoning else []
    output += [_message_item(_item_id("msg"), msg.content, "completed")] if msg.content else []
    output += [
        _call_item(_item_id("fc"), c.id, c.function.name, c.function.arguments, "completed")
        for c in msg.tool_calls or []
    ]
    resp = await builder.final(output, whole)
    if builder.store_failed:
        return JSONResponse(resp, headers={STORE_HEADER: "failed"})
    return resp


async def _events(
    gw: Gateway, call: Call, builder: ResponseBuilder, renderer: ChatChoiceRenderer
) -> AsyncIterator[bytes]:
    """The stream's typed events (see the module docstring)."""
    seq = itertools.count()
    output: list[dict[str, Any]] = []  # finished items
    open_item: dict[str, Any] | None = None  # the item being streamed (its events are serialized as sent)

    def ev(kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": next(seq), **fields}
        return f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()

    def close() -> list[bytes]:
        nonlocal open_item
        if open_item is None:
            return []
        item, idx, open_item = open_item, len(output), None
        item["status"] = "completed"
        output.append(item)
        if item["type"] == "reasoning":
            return [
                ev(
                    "response.reasoning_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=item["content"][0]["text"],
                ),
                ev("response.output_item.done", output_index=idx, item=item),
            ]
        if item["type"] == "message":
            part = item["content"][0]
            return [
                ev(
                    "response.output_text.done",
                    item_id=item["id"],
                    output_index=idx,
                    content_index=0,
                    text=part["text"],
                    logprobs=[],
                ),
                ev("response.content_part.done", item_id=item["id"], output_index=idx, content_index=0, part=part),
                ev("response.output_item.done", output_index=idx, item=item),
            ]
        return [
            ev(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=idx,
                name=item["name"],
                arguments=item["arguments"],
            ),
            ev("response.output_item.done", output_index=idx, item=item),
        ]

    yield ev("response.created", response=builder.response("in_progress", []))
    yield ev("response.in_progress", response=builder.response("in_progress", []))
    async for _, chunk in gw.answers.chunks(call):
        deltas, _ = renderer.deltas(chunk)
        for d in deltas:
            reasoning = getattr(d, "reasoning_content", None)
            if reasoning:
                if open_item is None or open_item["type"] != "reasoning":
                    for e in close():
                        yield e
                    open_item = _reasoning_item(_item_id("rs"), "", "in_progress")
                    yield ev("response.output_item.added", output_index=len(output), item={**open_item, "content": []})
                open_item["content"][0]["text"] += reasoning
                yield ev(
                    "response.reasoning_text.delta",
                    item_id=open_item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=reasoning,
                )
            if d.content:
                if open_item is None or open_item["type"] != "message":
                    for e in close():
                        yield e
                    open_item = _message_item(_item_id("msg"), "", "in_progress")
                    yield ev("response.output_item.added", output_index=len(output), item={**open_item, "content": []})
                    yield ev(
                        "response.content_part.added",
                        item_id=open_item["id"],
                        output_index=len(output),
                        content_index=0,
                        part=open_item["content"][0],
                    )
                open_item["content"][0]["text"] += d.content
                yield ev(
                    "response.output_text.delta",
                    item_id=open_item["id"],
                    output_index=len(output),
                    content_index=0,
                    delta=d.content,
                    logprobs=[],
                )
            for tc in d.tool_calls or []:
                if tc.id is not None:  # a new call
                    for e in close():
                        yield e
                    open_item = _call_item(_item_id("fc"), tc.id, tc.function.name, "", "in_progress")
                    yield ev("response.output_item.added", output_index=len(output), item=open_item)
                args = tc.function.arguments if tc.function is not None else None
                if args:
                    open_item["arguments"] += args
                    yield ev(
                        "response.function_call_arguments.delta",
                        item_id=open_item["id"],
                        output_index=len(output),
                        delta=args,
                    )
    for e in close():
        yield e
    resp = await builder.final(output, call.lasts[(0, 0)])
    yield ev(f"response.{resp['status']}", response=resp)


async def get_response(store: ResponseStore, response_id: str, request: Request) -> dict[str, Any]:
    """``GET /v1/responses/{id}``: a stored response of this API key (404 otherwise)."""
    return (await store.get(response_id, owner_id(request.scope)))["response"]


async def delete_response(store: ResponseStore, response_id: str, request: Request) -> dict[str, Any]:
    """``DELETE /v1/responses/{id}``."""
    await store.delete(response_id, owner_id(request.scope))
    return {"id": response_id, "object": "response", "deleted": True}
