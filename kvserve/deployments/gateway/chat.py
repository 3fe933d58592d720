"""``POST /v1/chat/completions``: OpenAI's chat completions (streamed or whole), with tool
calls (``tool_choice`` auto by the model family's parser, ``required`` and named forced by a
grammar) and structured outputs."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs as ChatChoiceLogprobs
from openai.types.chat.chat_completion_chunk import Choice as ChunkChoice
from openai.types.chat.chat_completion_chunk import ChoiceDelta, ChoiceDeltaToolCall, ChoiceDeltaToolCallFunction
from openai.types.chat.chat_completion_chunk import ChoiceLogprobs as ChunkChoiceLogprobs
from openai.types.chat.chat_completion_message_tool_call import ChatCompletionMessageFunctionToolCall, Function
from openai.types.chat.chat_completion_token_logprob import TopLogprob as OpenAITopLogprob

from kvserve.deployments.contract.openai_messages import NamedToolChoice
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest
from kvserve.deployments.contract.types import GenerationChunk, TokenLogprob, finish_reason
from kvserve.deployments.gateway.call import Call, GenerateSpec
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.gateway.reasoning import ReasoningStream
from kvserve.deployments.gateway.streams import SSE_HEADERS, sse, usage_of
from kvserve.deployments.gateway.tool_parsers import get_tool_parser
from kvserve.deployments.gateway.tool_parsers.base import ToolParser
from kvserve.deployments.gateway.tools import ToolCallStream, extract_calls, parse_forced, tool_grammar


def chat_logprobs(entries: list[TokenLogprob]) -> list[ChatCompletionTokenLogprob]:
    """OpenAI's chat ``logprobs.content`` entries."""
    return [
        ChatCompletionTokenLogprob(
            token=e.token,
            logprob=e.logprob,
            bytes=e.bytes,
            top_logprobs=[OpenAITopLogprob(token=t.token, logprob=t.logprob, bytes=t.bytes) for t in e.top_logprobs],
        )
        for e in entries
    ]


class ChatChoiceRenderer:
    """How one chat choice's text becomes OpenAI's message: plain content, or tool calls
    (``mode``: ``text``, ``auto`` (parsed by the model family's parser), ``required`` (a
    grammar-forced JSON array of calls) or ``named`` (the output is the arguments of
    ``tool_choice``'s function)); streaming and whole. With ``reasoning`` (a reasoning
    model's :class:`ReasoningStream`) the reasoning goes to ``reasoning_content`` and only
    what follows it is read as content or calls."""

    def __init__(self, mode: str, parser: ToolParser | None, tool_choice, reasoning: ReasoningStream | None = None):
        self.mode, self.parser, self.tool_choice, self.reasoning = mode, parser, tool_choice, reasoning
        self.role_sent = False
        self.tool_text = ToolCallStream(parser) if mode == "auto" else None
        self.calls_sent = 0  # auto: the index of the next streamed call
        self.held = ""  # required: the whole output is parsed at the end
        self.call_id: str | None = None  # named: the call streamed so far
        self.called = False

    @staticmethod
    def mode_of(body: ChatCompletionRequest) -> str:
        choice = body.effective_tool_choice
        if choice == "none":
            return "text"
        return "named" if isinstance(choice, NamedToolChoice) else choice

    def _finish(self, engine_reason: str | None) -> str | None:
        fr = finish_reason(engine_reason)
        return "tool_calls" if self.called and fr == "stop" else fr

    def message(self, whole: GenerationChunk) -> tuple[ChatCompletionMessage, str | None]:
        """The whole choice: the assistant message and its finish reason."""
        text, calls, reasoning = whole.text, None, None
        if self.reasoning is not None:
            r1, t1 = self.reasoning.feed(text)
            r2, t2 = self.reasoning.finish()
            reasoning, text = (r1 + r2) or None, t1 + t2
        if self.mode in ("required", "named"):
            calls = parse_forced(text, self.tool_choice.model_dump() if self.mode == "named" else "required")
            if calls:
                text = None
        elif self.mode == "auto":
            content, calls = extract_calls(type(self.parser)(), text)
            if calls:
                text = content
        self.called = bool(calls)
        extra = {}
        if self.reasoning is not None:  # vLLM's field; a reply that is all reasoning has no content
            extra, text = {"reasoning_content": reasoning}, text or None
        msg = ChatCompletionMessage(
            role="assistant",
            content=text,
            **extra,
            tool_calls=[
                ChatCompletionMessageFunctionToolCall(
                    id=c.id, type="function", function=Function(name=c.name, arguments=c.arguments)
                )
                for c in calls
            ]
            if calls
            else None,
        )
        return msg, self._finish(whole.finish_reason)

    def deltas(self, chunk: GenerationChunk) -> tuple[list[ChoiceDelta], str | None]:
        """The stream deltas for one chunk of this choice, and its finish reason (on the last):
        its reasoning first (``reasoning_content``), then its content or calls."""
        text, calls, content, reasoning = chunk.text, [], "", ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if chunk.finished:
                r, t = self.reasoning.finish()
                reasoning, text = reasoning + r, text + t
        head = [ChoiceDelta(reasoning_content=reasoning)] if reasoning else []
        if self.mode == "text":
            content = text
        elif self.mode == "auto":
            content, calls = self.tool_text.feed(text)
            if chunk.finished:
                rest, more = self.tool_text.finish()
                content, calls = content + rest, calls + more
        elif self.mode == "required":
            self.held += text
            if chunk.finished:
                calls = parse_forced(self.held, "required") or []
                content = "" if calls else self.held
        else:  # named: the arguments stream as they are generated
            name = self.tool_choice.function.name
            out = []
            if self.call_id is None and (text or chunk.finished):
                self.call_id, self.called = f"call_{uuid.uuid4().hex[:24]}", True
                out.append(
                    ChoiceDeltaToolCall(
                        index=0,
                        id=self.call_id,
                        type="function",
                        function=ChoiceDeltaToolCallFunction(name=name, arguments=text),
                    )
                )
            elif text:
                out.append(ChoiceDeltaToolCall(index=0, function=ChoiceDeltaToolCallFunction(arguments=text)))
            deltas = head + ([ChoiceDelta(tool_calls=out)] if out else [])
            return self._role(deltas), self._finish(chunk.finish_reason) if chunk.finished else None
        deltas = head + ([ChoiceDelta(content=content)] if content else [])
        if calls:
            self.called = True
            deltas.append(
                ChoiceDelta(
                    tool_calls=[
                        ChoiceDeltaToolCall(
                            index=self.calls_sent + k,
                            id=c.id,
                            type="function",
                            function=ChoiceDeltaToolCallFunction(name=c.name, arguments=c.arguments),
                        )
                        for k, c in enumerate(calls)
                    ]
                )
            )
            self.calls_sent += len(calls)
        return self._role(deltas), self._finish(chunk.finish_reason) if chunk.finished else None

    def _role(self, deltas: list[ChoiceDelta]) -> list[ChoiceDelta]:
        """The first delta of a choice carries ``role`` (an empty one is sent if need be)."""
        if not self.role_sent:
            self.role_sent = True
            if deltas:
                deltas[0].role = "assistant"
            else:
                deltas = [ChoiceDelta(role="assistant", content="")]
        return deltas


def chat_spec(
    body: ChatCompletionRequest, request: Request, id_prefix: str = "chatcmpl", fallback: bool = True
) -> tuple[GenerateSpec, str]:
    """The pipeline's spec of a chat request, and its choices' rendering mode (``text``,
    ``auto``, ``required``, ``named``): the messages, the tools (a grammar forces ``required``
    and named calls), the sampling parameters. ``POST /v1/responses`` builds its requests here
    too, without the upstream fallback.

    Raises:
        OpenAIError: 400 for a value the engine cannot honour.
    """
    messages = [m.to_template() for m in body.messages]
    max_tokens = body.effective_max_tokens
    mode = ChatChoiceRenderer.mode_of(body)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools and mode != "text" else None
    grammar = None
    if tools:
        grammar = tool_grammar(
            tools, body.tool_choice.model_dump() if mode == "named" else mode, body.parallel_tool_calls
        )
    params = body.to_sampling_params(
        max_tokens, body.num_logprobs, **({"structured_outputs": grammar} if grammar is not None else {})
    )
    return GenerateSpec(
        request,
        body,
        "chat",
        id_prefix,
        params,
        n=body.n,
        messages=messages,
        tools=tools,
        chat_template_kwargs=body.chat_template_kwargs,
        fallback=fallback,
    ), mode


async def renderers(gw: Gateway, call: Call, body: ChatCompletionRequest, mode: str) -> list[ChatChoiceRenderer]:
    """One renderer per choice, each with its own tool parser of the model's family under
    ``tool_choice`` auto."""
    name = await gw.catalog.tool_call_parser(call.model) if mode == "auto" else None
    reasoning = gw.catalog.reasoning_parser(call.model)
    state = call.streams[0].first.prompt_reasoning if call.streams else ""
    return [
        ChatChoiceRenderer(
            mode,
            get_tool_parser(name) if name else None,
            body.tool_choice,
            ReasoningStream(reasoning, state) if reasoning else None,
        )
        for _ in range(body.n)
    ]


async def chat_completions(gw: Gateway, body: ChatCompletionRequest, request: Request, response: Response):
    """``POST /v1/chat/completions``."""
    spec, mode = chat_spec(body, request)
    call = await gw.run(spec)
    if not isinstance(call, Call):  # every replica refused: the upstream's answer
        return call
    choice_renderers = await renderers(gw, call, body, mode)
    if body.stream:
        return StreamingResponse(
            gw.answers.sse(call, _events(gw, call, body, choice_renderers)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **call.headers},
        )
    wholes = [w for _, w in sorted((await gw.answers.whole(call)).items())]
    response.headers.update(call.headers)
    choices = []
    for i, (whole, renderer) in enumerate(zip(wholes, choice_renderers)):
        msg, fr = renderer.message(whole)
        choices.append(
            ChatChoice(
                index=i,
                message=msg,
                finish_reason=fr,
                logprobs=ChatChoiceLogprobs(content=chat_logprobs(whole.logprobs or [])) if body.logprobs else None,
            )
        )
    return ChatCompletion(
        id=call.response_id,
        object="chat.completion",
        created=call.created,
        model=call.served,
        choices=choices,
        usage=usage_of({(0, w.index): w for w in wholes}),
    )


async def _events(
    gw: Gateway, call: Call, body: ChatCompletionRequest, renderers: list[ChatChoiceRenderer]
) -> AsyncIterator[bytes]:
    """The chat chunks' SSE events (OpenAI's ``chat.completion.chunk``)."""
    head = dict(id=call.response_id, object="chat.completion.chunk", created=call.created, model=call.served)
    include_usage, continuous = body.include_usage, body.continuous_usage
    async for _, chunk in gw.answers.chunks(call):
        deltas, fr = renderers[chunk.index].deltas(chunk)
        lp = chunk.logprobs if body.logprobs else None
        if not deltas and fr is None and not lp:
            continue  # nothing new for the client in this step (e.g. a held-back stop string prefix)
        deltas = deltas or [ChoiceDelta()]
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            choice = ChunkChoice(
                index=chunk.index,
                delta=delta,
                finish_reason=fr if last else None,
                logprobs=ChunkChoiceLogprobs(content=chat_logprobs(lp)) if lp and not k else None,
            )
            out = ChatCompletionChunk(**head, choices=[choice])
            if include_usage:  # OpenAI sends "usage": null on every chunk but the last
                out.usage = usage_of(call.lasts) if continuous else None
            yield sse(out)
    if include_usage:
        yield sse(ChatCompletionChunk(**head, choices=[], usage=usage_of(call.lasts)))
