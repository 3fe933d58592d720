"""``POST /v1/completions``: OpenAI's legacy completions (streamed or whole): a batch of
prompts, ``n`` and ``best_of`` choices per prompt, ``echo`` with prompt logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from openai.types import Completion, CompletionChoice
from openai.types.completion_choice import Logprobs

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.openai_requests import CompletionRequest
from kvserve.deployments.contract.types import GenerationChunk, TokenLogprob, finish_reason
from kvserve.deployments.gateway.call import Call, GenerateSpec
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.gateway.streams import SSE_HEADERS, sse, usage_of


def completion_logprobs(entries: list[TokenLogprob], offset: int) -> tuple[Logprobs, int]:
    """Legacy completions logprobs (parallel lists per token) from ``offset`` characters on;
    returns them and the offset after the last token. An entry without a log-probability
    (the first prompt token under ``echo``) gets null ones, as OpenAI writes it."""
    lp = Logprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
    for e in entries:
        lp.tokens.append(e.token)
        lp.token_logprobs.append(e.logprob)
        lp.top_logprobs.append(None if e.logprob is None else {t.token: t.logprob for t in e.top_logprobs})
        lp.text_offset.append(offset)
        offset += len(e.token)
    return lp, offset


def _join(a: Logprobs, b: Logprobs) -> Logprobs:
    """``a``'s tokens followed by ``b``'s."""
    return Logprobs.model_construct(
        tokens=a.tokens + b.tokens,
        token_logprobs=a.token_logprobs + b.token_logprobs,
        top_logprobs=a.top_logprobs + b.top_logprobs,
        text_offset=a.text_offset + b.text_offset,
    )


async def completions(gw: Gateway, body: CompletionRequest, request: Request, response: Response):
    """``POST /v1/completions``. A batch larger than a replica holds at once (its prompts times
    ``best_of`` or ``n``) is refused by the replica (400 ``too_large``), not here."""
    prompts = body.prompts()
    limit = gw.args.max_prompts_per_request
    if len(prompts) > limit:
        raise OpenAIError(
            f"{len(prompts)} prompts in one request; the limit is {limit}", 400, param="prompt", code="too_many_prompts"
        )
    n_gen = body.best_of or body.n  # sequences generated per prompt; the best n are returned
    ranking = n_gen > body.n
    extra = {"prompt_logprobs": body.logprobs} if body.echo and body.logprobs is not None else {}
    params = body.to_sampling_params(
        body.max_tokens, body.logprobs if body.logprobs is not None or not ranking else 0, **extra
    )
    call = await gw.run(
        GenerateSpec(request, body, "completion", "cmpl", params, n=n_gen, prompts=prompts, echo=body.echo)
    )
    if not isinstance(call, Call):  # every replica refused: the upstream's answer
        return call
    if body.stream:
        return StreamingResponse(
            gw.answers.sse(call, _events(gw, call, body)),
            media_type="text/event-stream",
            headers={**SSE_HEADERS, **call.headers},
        )
    wholes = await gw.answers.whole(call)
    response.headers.update(call.headers)
    choices = []
    for p in range(len(prompts)):
        group = [wholes[(p, i)] for i in range(n_gen)]
        prompt_lp = group[0].prompt_logprobs
        if ranking:  # best_of: the n sequences of highest cumulative log-probability
            group = sorted(group, key=lambda w: -sum(e.logprob for e in w.logprobs or []))[: body.n]
        for w in group:
            echo = (w.prompt_text or "") if body.echo else ""
            lp = None
            if body.logprobs is not None:
                lp, offset = completion_logprobs(prompt_lp or [], 0) if body.echo else (None, 0)
                gen, _ = completion_logprobs(w.logprobs or [], offset if body.echo else len(echo))
                lp = gen if lp is None else _join(lp, gen)
            choices.append(
                CompletionChoice(
                    index=len(choices), text=echo + w.text, logprobs=lp, finish_reason=finish_reason(w.finish_reason)
                )
            )
    return Completion(
        id=call.response_id,
        object="text_completion",
        created=call.created,
        model=call.served,
        choices=choices,
        usage=usage_of(wholes),
    )


async def _events(gw: Gateway, call: Call, body: CompletionRequest) -> AsyncIterator[bytes]:
    """The completion chunks' SSE events (OpenAI's ``text_completion``), the prompts' streams merged."""
    head = dict(id=call.response_id, object="text_completion", created=call.created, model=call.served)
    n = body.n
    want_lp = body.logprobs is not None
    include_usage, continuous = body.include_usage, body.continuous_usage
    offsets: dict[tuple[int, int], int] = {}
    prompt_lps: dict[int, list] = {}

    def event(p: int, chunk: GenerationChunk) -> bytes | None:
        key = (p, chunk.index)
        if chunk.prompt_logprobs is not None:
            prompt_lps[p] = chunk.prompt_logprobs
        text, lp = chunk.text, None
        if key not in offsets:  # the choice's first chunk: the echoed prompt goes first
            offsets[key] = 0
            if body.echo:
                text = (chunk.prompt_text or "") + text
                if want_lp:
                    lp, offsets[key] = completion_logprobs(prompt_lps.get(p) or [], 0)
                else:
                    offsets[key] = len(chunk.prompt_text or "")
        if want_lp and chunk.logprobs:
            gen, offsets[key] = completion_logprobs(chunk.logprobs, offsets[key])
            lp = gen if lp is None else _join(lp, gen)
        fr = finish_reason(chunk.finish_reason) if chunk.finished else None
        if not text and fr is None and lp is None:
            return None
        # OpenAI streams finish_reason null until the last chunk, which the SDK's type does
        # not admit (the SDK builds stream chunks unvalidated, as here)
        choice = CompletionChoice.model_construct(index=p * n + chunk.index, text=text, logprobs=lp, finish_reason=fr)
        out = Completion(**head, choices=[choice])
        if include_usage:
            out.usage = usage_of(call.lasts) if continuous else None
        return sse(out)

    async for p, chunk in gw.answers.chunks(call):
        b = event(p, chunk)
        if b is not None:
            yield b
    if include_usage:
        yield sse(Completion(**head, choices=[], usage=usage_of(call.lasts)))
