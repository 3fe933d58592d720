"""The replica's view of the engine's outputs: each ``RequestOutput`` of a request as the
:class:`~kvserve.deployments.contract.types.GenerationChunk` callers get (:class:`ChunkBuilder`), and the
timings of recently finished requests (:class:`RecentRequests`); and the merge of several
chunk streams as they come (:func:`merge_streams`: a replica's ``n`` choices, the gateway's
prompts of one completions request)."""

from __future__ import annotations

from kvserve.deployments.contract.types import GenerationChunk, TokenLogprob, TopLogprob


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
    return TokenLogprob(
        token_id=token_id,
        token=s,
        bytes=b,
        logprob=d.get(token_id, float("-inf")),
        top_logprobs=[TopLogprob(t, *_token_str(tokenizer, t), lp) for t, lp in top],
    )


#: ``stream_interval=0`` (auto): a replica sends about this many stream messages per engine step.
STREAMS_PER_STEP = 16


def stream_interval(setting: int, in_flight: int) -> int:
    """Engine outputs per streamed chunk (vLLM's ``--stream-interval``): ``setting`` when >= 1;
    0 (auto) gives ``1 + in_flight // STREAMS_PER_STEP``: every token while fewer than
    :data:`STREAMS_PER_STEP` requests are in flight on the replica, then about that many messages
    per engine step however many run. Each message costs CPU in the replica, the gateway and
    Serve's proxy while the next step computes, and on a small CPU such work stretches the
    forward pass (docs/known-limits.md, "The serving path")."""
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
            text=c.delta_text,
            token_ids=list(c.delta_token_ids),
            finished=out.finished,  # a copy: add() extends it
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason if out.finished else None,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(c.token_ids),
            num_cached_tokens=out.num_cached_tokens,
            index=self.index,
        )
        if self.first:
            chunk.prompt_text, self.first = self.prompt_text, False
        if p.logprobs is not None:
            entries = (c.logprobs or [])[self.num_logprobs : self.num_logprobs + len(c.delta_token_ids)]
            self.num_logprobs += len(entries)
            chunk.logprobs = [
                logprob_entry(self.tokenizer, tid, d, p.logprobs) for tid, d in zip(c.delta_token_ids, entries)
            ]
        if self.prompt_logprobs_due and out.prompt_logprobs is not None:
            self.prompt_logprobs_due = False  # sent once
            chunk.prompt_logprobs = [
                logprob_entry(self.tokenizer, tid, d, p.prompt_logprobs)
                for tid, d in zip(out.prompt_token_ids, out.prompt_logprobs)
            ]
        return chunk
