"""Embeddings from a decoder model: the final hidden states of a prompt pooled into one vector,
with no generation (vLLM's pooling runner for generative models; the "last token" pooling of
e5-mistral, Wang et al. 2023, "Improving Text Embeddings with Large Language Models", and the
mean pooling of Sentence-BERT, Reimers & Gurevych 2019).

A pooling request is an engine request with ``max_tokens=0`` and :class:`PoolingParams`: the
scheduler runs its prompt (chunked like any prefill, batched with other requests), the model
runner pools the rows of the final norm's output (``[tokens, hidden_size]``, what Hugging Face
calls ``last_hidden_state``) and the request finishes with the vector in
``RequestOutput.pooled``. Mean pooling needs every position's hidden state, so such requests
take no prefix-cache hits (as ``prompt_logprobs``); last-token pooling does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Pooling types a decoder model serves (vLLM's ``PoolerConfig.pooling_type`` names, lower case).
POOLING_TYPES = ("last", "mean")


@dataclass(frozen=True)
class PoolingParams:
    """How one request's hidden states become its embedding.

    Attributes:
        pooling_type: ``last`` (the hidden state of the prompt's last token) or ``mean`` (the
            average over every prompt token).
        normalize: scale the vector to unit L2 norm (OpenAI's embeddings are unit length).

    Raises:
        ValueError: an unknown pooling type.
    """

    pooling_type: str = "last"
    normalize: bool = True

    def __post_init__(self):
        if self.pooling_type not in POOLING_TYPES:
            raise ValueError(f"pooling_type must be one of {POOLING_TYPES}, got {self.pooling_type!r}")

    @property
    def needs_every_position(self) -> bool:
        """True for mean pooling: no prefix-cache hits (their hidden states are not computed)."""
        return self.pooling_type == "mean"


class PoolingState:
    """One running request's pooling in the model runner, across its prefill chunks.

    Args:
        params: the request's :class:`PoolingParams`.
        prompt_len: its prompt's tokens; the vector is ready when the slice that ends there ran.
    """

    __slots__ = ("params", "prompt_len", "total")

    def __init__(self, params: PoolingParams, prompt_len: int):
        self.params, self.prompt_len = params, prompt_len
        self.total: torch.Tensor | None = None  # mean: float32 [hidden_size] sum of the rows so far

    def add(self, rows: torch.Tensor, start: int) -> list[float] | None:
        """Take one slice's hidden states (``rows`` ``[n, hidden_size]``, any float dtype, for
        positions ``start .. start + n``); returns the finished embedding (float32 values as a
        list, picklable) when the slice ends the prompt, else None."""
        if self.params.pooling_type == "mean":
            part = rows.float().sum(0)
            self.total = part if self.total is None else self.total + part
        if start + rows.shape[0] < self.prompt_len:
            return None
        vec = rows[-1].float() if self.params.pooling_type == "last" else self.total / self.prompt_len
        if self.params.normalize:
            vec = torch.nn.functional.normalize(vec, dim=0)
        return vec.tolist()
