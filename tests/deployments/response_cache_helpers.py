"""Helpers of the response cache tests (test_response_cache_*.py): ``run`` (``asyncio.run``), a clock
the test sets (``helpers.FakeClock``), a chat request and a replica's answer to it."""

from asyncio import run  # noqa: F401  (the cache tests take both from here)

from kvserve.deployments.contract.openai_requests import ChatCompletionRequest
from kvserve.deployments.contract.types import GenerationChunk
from helpers import FakeClock  # noqa: F401


def chat(**kw) -> ChatCompletionRequest:
    body = {
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 8,
    }
    return ChatCompletionRequest.model_validate({**body, **kw})


def answer(text="Paris.", n=1, reason="stop") -> list[GenerationChunk]:
    """A replica's chunks for one prompt, ``n`` choices of two steps each, numbered (``seq``) as
    the replica numbers them."""
    out = []
    for i in range(n):
        out.append(GenerationChunk(text=text[:3], token_ids=[11], num_prompt_tokens=9, num_output_tokens=1, index=i))
        out.append(
            GenerationChunk(
                text=text[3:],
                token_ids=[12],
                finished=True,
                finish_reason=reason,
                num_prompt_tokens=9,
                num_output_tokens=2,
                num_cached_tokens=4,
                index=i,
            )
        )
    for k, c in enumerate(out):
        c.seq = k
    return out
