"""``POST /v1/embeddings``: OpenAI's embeddings, from an embedding model's deployment
(:class:`~kvserve.deployments.replica.embedding_server.EmbeddingServer`) or from a served decoder model's
pooled hidden states (:mod:`kvserve.engine.pooling`); through the same key, per-key limits (the
inputs' tokens count) and error shape as chat."""

from __future__ import annotations

import base64
from typing import Literal, Union

import numpy as np
from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.openai_messages import reject_lone_surrogates
from kvserve.deployments.contract.types import MAX_EMBEDDING_INPUTS
from kvserve.deployments.gateway.call import UnarySpec, estimate_prompt_tokens
from kvserve.deployments.gateway.core import Gateway

TokenIds = list[int]


def _as_list(v) -> list:
    """``input`` as a list of inputs: a single string or token id list is one input."""
    return [v] if isinstance(v, str) or (v and isinstance(v[0], int)) else list(v)


class EmbeddingRequest(BaseModel):
    """OpenAI's ``POST /v1/embeddings`` body. ``input``: a string, a list of strings, a list of
    token ids, or a list of token id lists (at most 2048 inputs, none empty)."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(..., description="an embedding model or a served generating model (pooled hidden states)")
    input: Union[str, list[str], TokenIds, list[TokenIds]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="only for models trained for shorter embeddings")
    user: str | None = None
    priority: int = 0

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        """A lone surrogate in an input is a 400 naming it (``reject_lone_surrogates``)."""
        return reject_lone_surrogates(data)

    @field_validator("input")
    @classmethod
    def _check_input(cls, v):
        items = _as_list(v)
        if not items:
            raise ValueError("input must not be empty")
        if len(items) > MAX_EMBEDDING_INPUTS:
            raise ValueError(f"at most {MAX_EMBEDDING_INPUTS} inputs per request, got {len(items)}")
        if any(len(x) == 0 for x in items):
            raise ValueError("an input is empty (an empty string or token list has no embedding)")
        return v

    def inputs(self) -> list[str | list[int]]:
        """The inputs as a list (a single string or token list becomes one input)."""
        return _as_list(self.input)


def encode(vector: list[float], fmt: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or base64 of little-endian float32 bytes (what
    the openai SDK decodes with ``np.frombuffer(..., dtype="float32")``)."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def embeddings(gw: Gateway, body: EmbeddingRequest, request: Request) -> dict:
    """``POST /v1/embeddings``: OpenAI's ``CreateEmbeddingResponse`` (a plain dict: a base64
    embedding is a string where the SDK's type says a list of floats)."""
    inputs = body.inputs()
    call, out = await gw.run_unary(
        UnarySpec(
            request,
            body.model,
            "embd",
            "embed",
            (inputs, body.dimensions),
            body=body,
            prompt_tokens=sum(estimate_prompt_tokens(x) for x in inputs),
            priority=body.priority,
            call_context=True,
            tokens_used=lambda out: out.prompt_tokens,
        )
    )
    if len(out.data) != len(inputs):  # a replica bug: never answer with vectors out of order
        raise OpenAIError(f"internal server error (request id {call.http_id})", 500, "server_error")
    data = [
        {"object": "embedding", "index": i, "embedding": encode(v, body.encoding_format)}
        for i, v in enumerate(out.data)
    ]
    return {
        "object": "list",
        "data": data,
        "model": call.served,
        "usage": {"prompt_tokens": out.prompt_tokens, "total_tokens": out.prompt_tokens},
    }
