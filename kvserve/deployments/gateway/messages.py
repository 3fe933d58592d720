"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API.

A message request runs as a chat request through the same pipeline (model, LoRA adapter as the
model, response cache, key and limits, A/B variant, replica; no upstream fallback: the upstream
speaks OpenAI's API), so tools behave as in chat (``tool_choice`` ``any`` / ``tool`` forced by a
grammar, ``auto`` by the model family's parser). What differs is the shape: content blocks
(``thinking`` from a model served with a reasoning parser, with an empty ``signature``: kvserve
does not sign; ``text``; ``tool_use`` with its ``input`` as an object), ``stop_reason`` (``end_turn``,
``max_tokens``, ``stop_sequence`` with the ``stop_sequence`` that matched, ``tool_use``),
``usage`` in input / output tokens (prefix-cached prompt tokens as ``cache_read_input_tokens``),
errors as ``{"type": "error", "error": {"type", "message"}}``, and the stream's events:
``message_start``, ``ping``, per block ``content_block_start``, ``content_block_delta``
(``thinking_delta``, ``text_delta`` or ``input_json_delta``) ..., ``content_block_stop``, then ``message_delta``
(stop reason, output tokens) and ``message_stop``; a failure midway is an ``error`` event. The
request translation: :mod:`kvserve.deployments.gateway.messages_input`."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from kvserve.deployments.contract.openai_errors import anthropic_error_body
from kvserve.deployments.contract.types import GenerationChunk, finish_reason
from kvserve.deployments.gateway.call import Call, UnarySpec
from kvserve.deployments.gateway.chat import ChatChoiceRenderer, chat_spec, renderers
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.gateway.errors import failed
from kvserve.deployments.gateway.messages_input import CountTokensRequest, MessagesRequest
from kvserve.deployments.gateway.streams import SSE_HEADERS, usage_of


def _event(kind: str, data: dict[str, Any]) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, separators=(',', ':'), ensure_ascii=False)}\n\n".encode()


def _error_event(request_id: str, exc: BaseException) -> bytes:
    err = failed(request_id, exc)
    return _event("error", {k: v for k, v in anthropic_error_body(err.status_code, err.message).items() if k != "type"})


def _usage(lasts: dict) -> dict[str, int]:
    u = usage_of(lasts)
    cached = (u.prompt_tokens_details.cached_tokens if u.prompt_tokens_details else 0) or 0
    return {
        "input_tokens": u.prompt_tokens,
        "output_tokens": u.completion_tokens,
        "cache_read_input_tokens": cached,
        "cache_creation_input_tokens": 0,
    }


def _stop(last: GenerationChunk, tool_use: bool, stops: list[str] | None) -> tuple[str, str | None]:
    """``(stop_reason, stop_sequence)`` of a finished answer."""
    fr = finish_reason(last.finish_reason)
    if tool_use:
        return "tool_use", None
    if fr == "length":
        return "max_tokens", None
    if isinstance(last.stop_reason, str) and stops and last.stop_reason in stops:
        return "stop_sequence", last.stop_reason
    return "end_turn", None


def _input_of(arguments: str) -> dict[str, Any]:
    try:
        v = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return v if isinstance(v, dict) else {"value": v}


async def create_message(gw: Gateway, body: MessagesRequest, request: Request, response: Response):
    """``POST /v1/messages``."""
    gw.warn_unknown(body)
    chat = body.to_chat()
    spec, mode = chat_spec(chat, request, "msg", fallback=False)
    call = await gw.run(spec)
    renderer = (await renderers(gw, call, chat, mode))[0]
    msg_id = "msg_" + call.response_id.split("-", 1)[1]
    if body.stream:
        return StreamingResponse(
            gw.answers.sse(call, _events(gw, call, body, renderer, msg_id), done=False, error=_error_event),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **call.headers},
        )
    whole = (await gw.answers.whole(call))[(0, 0)]
    msg, _ = renderer.message(whole)
    thinking = getattr(msg, "reasoning_content", None)
    content: list[dict[str, Any]] = [{"type": "thinking", "thinking": thinking, "signature": ""}] if thinking else []
    content += [{"type": "text", "text": msg.content}] if msg.content else []
    content += [
        {"type": "tool_use", "id": c.id, "name": c.function.name, "input": _input_of(c.function.arguments)}
        for c in msg.tool_calls or []
    ]
    stop_reason, stop_sequence = _stop(whole, bool(msg.tool_calls), body.stop_sequences)
    response.headers.update(call.headers)
    return {
        "id": msg_id,
        "type": "message",
        "role": "assistant",
        "model": call.served,
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": stop_sequence,
        "usage": _usage({(0, 0): whole}),
    }


async def _events(
    gw: Gateway, call: Call, body: MessagesRequest, renderer: ChatChoiceRenderer, msg_id: str
) -> AsyncIterator[bytes]:
    """The stream's events (see the module docstring)."""
    first = call.lasts[(0, 0)]
    yield _event(
        "message_start",
        {
            "message": {
                "id": msg_id,
                "type": "message",
                "role": "assistant",
                "model": call.served,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": first.num_prompt_tokens,
                    "output_tokens": 0,
                    "cache_read_input_tokens": first.num_cached_tokens,
                    "cache_creation_input_tokens": 0,
                },
            }
        },
    )
    yield _event("ping", {})
    index, open_kind, tool_use = -1, None, False
    async for _, chunk in gw.answers.chunks(call):
        deltas, _ = renderer.deltas(chunk)
        for d in deltas:
            thinking = getattr(d, "reasoning_content", None)
            if thinking:
                if open_kind != "thinking":
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, "thinking"
                    yield _event(
                        "content_block_start",
                        {"index": index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
                    )
                yield _event(
                    "content_block_delta", {"index": index, "delta": {"type": "thinking_delta", "thinking": thinking}}
                )
            if d.content:
                if open_kind != "text":
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind = index + 1, "text"
                    yield _event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
                yield _event(
                    "content_block_delta", {"index": index, "delta": {"type": "text_delta", "text": d.content}}
                )
            for tc in d.tool_calls or []:
                if tc.id is not None:  # a new call: a block of its own
                    if open_kind is not None:
                        yield _event("content_block_stop", {"index": index})
                    index, open_kind, tool_use = index + 1, "tool_use", True
                    yield _event(
                        "content_block_start",
                        {
                            "index": index,
                            "content_block": {"type": "tool_use", "id": tc.id, "name": tc.function.name, "input": {}},
                        },
                    )
                args = tc.function.arguments if tc.function is not None else None
                if args:
                    yield _event(
                        "content_block_delta",
                        {"index": index, "delta": {"type": "input_json_delta", "partial_json": args}},
                    )
    if open_kind is not None:
        yield _event("content_block_stop", {"index": index})
    last = call.lasts[(0, 0)]
    stop_reason, stop_sequence = _stop(last, tool_use, body.stop_sequences)
    yield _event(
        "message_delta",
        {
            "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
            "usage": {"output_tokens": usage_of(call.lasts).completion_tokens},
        },
    )
    yield _event("message_stop", {})


async def count_tokens(gw: Gateway, body: CountTokensRequest, request: Request) -> dict[str, int]:
    """``POST /v1/messages/count_tokens``: ``{"input_tokens": n}``, the prompt's tokens with the
    model's chat template (and its tools) applied, as the replica would run it."""
    gw.warn_unknown(body)
    body.check_thinking()
    _, out = await gw.run_unary(
        UnarySpec(
            request,
            body.model,
            "msg",
            "tokenize",
            (None, body.chat_messages()),
            body=body,
            kwargs=dict(
                tools=body.chat_tools(),
                add_special_tokens=False,
                add_generation_prompt=True,
                continue_final_message=False,
                return_token_strs=False,
            ),
        )
    )
    return {"input_tokens": out.count}
