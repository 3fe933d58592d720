"""Incremental detokenization with stop strings.

Text is produced by decoding a sliding window of token ids and emitting only the part
that grew since the last decode (the prefix/read-offset scheme of HF TGI and vLLM), so a
multi-byte character split over several byte-level BPE tokens is emitted only once it is
complete (no U+FFFD in the stream). Stop strings are matched on the text; the streamed
text holds back ``max(len(stop)) - 1`` characters so that a stop string is never emitted
before it is recognised.

Stop strings are found in one pass per step (:class:`StopMatcher`): one compiled regular
expression, the escaped strings as one alternation, searched over the step's new text plus
the ``max(len(stop)) - 1`` characters before it, so a step's work grows with that window,
not with the number of stop strings (``SamplingParams`` bounds both: ``MAX_STOP_STRINGS``,
``MAX_STOP_STRING_CHARS``).
"""

from __future__ import annotations

import re

from kvserve.engine.sampling_params import SamplingParams

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context (leading-space handling)


class StopMatcher:
    """The earliest stop string in a text, found by one regex search.

    The strings are escaped and joined into one alternation in their given order. Python's
    ``re`` reports the leftmost match and, at that position, the first alternative that
    matches, so :meth:`search` returns the stop string that starts first and, of those that
    start at the same character, the first in ``stops``: exactly what a ``str.find`` per stop
    string with the smallest index kept (ties to the earlier string) returns, in one call.

    Args:
        stops: non-empty strings, at least one.

    Attributes:
        pattern: the compiled alternation.
        max_len: the longest stop string, characters.
    """

    def __init__(self, stops: list[str]):
        if not stops:
            raise ValueError("a StopMatcher needs at least one stop string")
        self.pattern = re.compile("|".join(re.escape(s) for s in stops))
        self.max_len = max(len(s) for s in stops)

    def search(self, text: str, start: int) -> tuple[int, str] | None:
        """``(index, stop string)`` of the earliest stop string in ``text`` at or after
        ``start`` (ties: the first in ``stops``), or None."""
        m = self.pattern.search(text, start)
        return None if m is None else (m.start(), m.group())


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
        #: one pattern for all the stop strings (None: no stop strings)
        self.matcher = StopMatcher(self.stop) if self.stop else None
        self.hold_back = self.matcher.max_len - 1 if self.matcher else 0
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
        before it, or after it with ``include_stop_str_in_output``), else None.

        The stop strings are searched once per call (one :meth:`StopMatcher.search`), over
        the new text and the ``hold_back`` characters before it (where a stop string that
        spans the previous text and the new one starts)."""
        if self.stopped:
            return None
        before = len(self.text)
        for tok in token_ids:
            self.ids.append(tok)
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.matcher is None or len(self.text) == before:
            return None
        found = self.matcher.search(self.text, max(0, before - self.hold_back))
        if found is None:
            return None
        i, s = found
        self.text = self.text[: i + len(s) if self.include_stop else i]
        self.stopped = True
        return s

    def delta(self, finished: bool) -> str:
        """Text not yet handed out; while unfinished, the last ``hold_back`` characters
        wait (they may start a stop string)."""
        end = len(self.text) if finished or self.stopped else max(self.emitted, len(self.text) - self.hold_back)
        out = self.text[self.emitted : end]
        self.emitted = end
        return out
