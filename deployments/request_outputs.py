"""The replica's view of the engine's outputs: each ``RequestOutput`` of a request as the
:class:`~deployments.server_types.GenerationChunk` callers get (:class:`ChunkBuilder`), and the
timings of recently finished requests (:class:`RecentRequests`); and the merge of several
chunk streams as they come (:func:`merge_streams`: a replica's ``n`` choices, the gateway's
prompts of one completions request)."""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from deployments.server_types import GenerationChunk, TokenLogprob, TopLogprob


def _token_str(tokenizer, token_id: int) -> tuple[str, list[int]]:
    s = tokenizer.decode([token_id], skip_special_tokens=False)
    return s, list(s.encode("utf-8"))


def logprob_entry(tokenizer, token_id: int, d: dict[int, float] | None, k: int) -> TokenLogprob:
    """A token's logprob entry from the engine's ``{token id: logprob}`` (the token and the top
    ``k``); ``d`` None (the first prompt token: no context) gives ``logprob`` None."""
    s, b = _token_str(tokenizer, token_id)
    if d is None:
        return TokenLogprob(token_id=token_id, token=s, bytes=b, logprob=None)
    top = sorted(d.items(), key=lambda kv: -kv[1])[:k] if k else []
    return TokenLogprob(token_id=token_id, token=s, bytes=b, logprob=d.get(token_id, float("-inf")),
                        top_logprobs=[TopLogprob(t, *_token_str(tokenizer, t), lp) for t, lp in top])


#: ``stream_interval=0`` (auto): a replica sends about this many stream messages per engine step.
STREAMS_PER_STEP = 16


def stream_interval(setting: int, in_flight: int) -> int:
    """Engine outputs per streamed chunk (vLLM's ``--stream-interval``): ``setting`` when >= 1;
    0 (auto) gives ``1 + in_flight // STREAMS_PER_STEP``: every token while fewer than
    :data:`STREAMS_PER_STEP` requests are in flight on the replica, then about that many messages
    per engine step however many run. Each message costs CPU in the replica, the gateway and
    Serve's proxy while the next step computes; on the 2-core box such work stretched the forward
    pass (docs/known-limits.md, "The serving path")."""
    return setting if setting >= 1 else 1 + in_flight // STREAMS_PER_STEP


class ChunkBuilder:
    """One engine request's outputs as chunks of choice ``index``: the new text and token ids,
    the logprobs of the new tokens (``params.logprobs``), the prompt logprobs once
    (``params.prompt_logprobs``) and ``prompt_text`` on the first chunk."""

    def __init__(self, tokenizer, params, index: int = 0, prompt_text: str | None = None):
        self.tokenizer, self.params, self.index, self.prompt_text = tokenizer, params, index, prompt_text
        self.num_logprobs = 0  # logprob entries sent so far
        self.prompt_logprobs_due = params.prompt_logprobs is not None
        self.first = True
        self.pending: GenerationChunk | None = None  # outputs folded in, not yet sent (:meth:`add`)
        self.held = 0

    def add(self, out, interval: int = 1) -> GenerationChunk | None:
        """Fold ``out`` into the chunk being built and return it when it should be sent: the
        first, the last (``out.finished``), and otherwise every ``interval`` outputs (vLLM's
        ``--stream-interval``); None while it is held. Text, token ids and logprobs of held
        outputs are concatenated (:meth:`GenerationChunk.extend`), so nothing is lost."""
        first, chunk = self.first, self.chunk(out)
        if self.pending is None:
            self.pending = chunk
        else:
            self.pending.extend(chunk)
        self.held += 1
        if out.finished or first or self.held >= interval:
            chunk, self.pending, self.held = self.pending, None, 0
            return chunk
        return None

    def chunk(self, out) -> GenerationChunk:
        """The chunk of one ``engine.RequestOutput`` (delta mode)."""
        c, p = out.outputs[0], self.params
        chunk = GenerationChunk(
            text=c.delta_text, token_ids=list(c.delta_token_ids), finished=out.finished,  # a copy: add() extends it
            finish_reason=c.finish_reason, stop_reason=c.stop_reason if out.finished else None,
            num_prompt_tokens=len(out.prompt_token_ids), num_output_tokens=len(c.token_ids),
            num_cached_tokens=out.num_cached_tokens, index=self.index)
        if self.first:
            chunk.prompt_text, self.first = self.prompt_text, False
        if p.logprobs is not None:
            entries = (c.logprobs or [])[self.num_logprobs:self.num_logprobs + len(c.delta_token_ids)]
            self.num_logprobs += len(entries)
            chunk.logprobs = [logprob_entry(self.tokenizer, tid, d, p.logprobs)
                              for tid, d in zip(c.delta_token_ids, entries)]
        if self.prompt_logprobs_due and out.prompt_logprobs is not None:
            self.prompt_logprobs_due = False  # sent once
            chunk.prompt_logprobs = [logprob_entry(self.tokenizer, tid, d, p.prompt_logprobs)
                                     for tid, d in zip(out.prompt_token_ids, out.prompt_logprobs)]
        return chunk


class RecentRequests:
    """Engine-side timings (``time.time()`` seconds) and token counts of the last ``limit``
    finished requests, by request id."""

    def __init__(self, limit: int = 4096):
        self.limit = limit
        self.by_id: OrderedDict[str, dict[str, float | None]] = OrderedDict()

    def add(self, out) -> None:
        """Record a finished ``engine.RequestOutput``."""
        m = out.metrics
        self.by_id[out.request_id] = {
            "arrival_time": m.arrival_time, "first_scheduled_time": m.first_scheduled_time,
            "first_token_time": m.first_token_time, "finished_time": m.finished_time,
            "engine_ttft_s": m.ttft, "num_prompt_tokens": len(out.prompt_token_ids),
            "num_output_tokens": len(out.outputs[0].token_ids), "num_cached_tokens": m.num_cached_tokens}
        while len(self.by_id) > self.limit:
            self.by_id.popitem(last=False)

    def get(self, request_ids: list[str] | None = None) -> dict[str, dict]:
        """Those of ``request_ids`` still held (all when None)."""
        if request_ids is None:
            return dict(self.by_id)
        return {r: self.by_id[r] for r in request_ids if r in self.by_id}


async def merge_streams(gens: list) -> AsyncIterator[tuple[int, Any]]:
    """``(index in gens, item)`` of several async generators, as the items come; the first
    exception one of them raises is raised here. Leaving early (or an error) cancels the
    others, each closed, so a generator's cleanup (an engine abort) runs before this returns."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen):
        try:
            async for item in gen:
                await queue.put((i, item, None))
        except Exception as e:  # raised to the reader below
            await queue.put((i, None, e))
        finally:
            await gen.aclose()
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is None:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def next_before(stream, deadline: float | None):
    """The stream's next item, or ``TimeoutError`` once ``time.monotonic()`` passes ``deadline``."""
    if deadline is None:
        return await anext(stream)
    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
        return await anext(stream)
