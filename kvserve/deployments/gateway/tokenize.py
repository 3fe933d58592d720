"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's): count a prompt's or a conversation's
tokens against ``max_model_len`` before sending it, with the model's own tokenizer and chat
template (the replica's; see :mod:`kvserve.deployments.replica.pooling`)."""

from __future__ import annotations

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from kvserve.deployments.contract.openai_messages import ChatMessage, ToolDef, reject_lone_surrogates
from kvserve.deployments.gateway.call import UnarySpec
from kvserve.deployments.gateway.core import Gateway


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize`` body: ``prompt`` (a completion prompt) or ``messages`` (a chat,
    with ``tools``), not both.

    ``add_special_tokens`` defaults as vLLM's: true for a prompt (e.g. BOS), false for chat
    messages (the template writes them). ``add_generation_prompt`` (chat, default true) appends
    the assistant's turn header; ``continue_final_message`` leaves the last message open.
    """

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """A lone surrogate in the body is a 400 naming the field (see ``reject_lone_surrogates``)."""
        return reject_lone_surrogates(data)

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    tokens: list[int] = Field(..., max_length=1 << 20)


class DetokenizeResponse(BaseModel):
    prompt: str


async def tokenize(gw: Gateway, body: TokenizeRequest, request: Request) -> TokenizeResponse:
    """``POST /tokenize``: counts as a request of the key, with no tokens."""
    messages = [m.to_template() for m in body.messages] if body.messages is not None else None
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    _, out = await gw.run_unary(
        UnarySpec(
            request,
            body.model,
            "tok",
            "tokenize",
            (body.prompt, messages),
            body=body,
            kwargs=dict(
                tools=tools,
                add_special_tokens=body.add_special_tokens,
                add_generation_prompt=body.add_generation_prompt,
                continue_final_message=body.continue_final_message,
                return_token_strs=body.return_token_strs,
            ),
        )
    )
    return TokenizeResponse(
        count=out.count, max_model_len=out.max_model_len, tokens=out.tokens, token_strs=out.token_strs
    )


async def detokenize(gw: Gateway, body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    """``POST /detokenize``."""
    _, out = await gw.run_unary(UnarySpec(request, body.model, "tok", "detokenize", (body.tokens,), body=body))
    return DetokenizeResponse(prompt=out.prompt)
