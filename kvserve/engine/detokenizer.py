"""Incremental detokenization with stop strings.

Text is produced by decoding a sliding window of token ids and emitting only the part
that grew since the last decode (the prefix/read-offset scheme of HF TGI and vLLM), so a
multi-byte character split over several byte-level BPE tokens is emitted only once it is
complete (no U+FFFD in the stream). Stop strings are matched on the text; the streamed
text holds back ``max(len(stop)) - 1`` characters so that a stop string is never emitted
before it is recognised.
"""
from __future__ import annotations

from kvserve.engine.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context (leading-space handling)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text, step by step.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: used only as decoding context.
        params: for ``stop``, ``skip_special_tokens``, ``include_stop_str_in_output``.
    """

    def __init__(self, tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        ctx = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.ids = ctx
        self.prefix_offset, self.read_offset = 0, len(ctx)
        self.text = ""
        self.emitted = 0
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def update(self, token_ids: list[int]) -> str | None:
        """Add new output tokens. Returns the stop string that matched (the text is cut
        before it, or after it with ``include_stop_str_in_output``), else None."""
        if self.stopped:
            return None
        before = len(self.text)
        for tok in token_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
            full = self._decode(self.ids[self.prefix_offset:])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix):]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if not self.stop or len(self.text) == before:
            return None
        start = max(0, before - self.hold_back)
        best = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s) if self.include_stop else i]
        self.stopped = True
        return s

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, the last ``hold_back`` characters
        wait (they may start a stop string)."""
        end = len(self.text) if finished or self.stopped else max(self.emitted, len(self.text) - self.hold_back)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
