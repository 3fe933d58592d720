"""Calls written between an opening and a closing tag, anywhere in the text (the shape of
``hermes`` and ``qwen3_coder``): :class:`TaggedToolParser`."""

from __future__ import annotations

from kvserve.deployments.gateway.tool_parsers.base import ParsedToolCall, Scan, ToolParser, partial_marker_at


class TaggedToolParser(ToolParser):
    """Content, then ``<start>body<end>`` blocks, each a call when :meth:`parse_body` reads
    it, else left as content; text between blocks is content. A block the output ends inside
    (no closing tag: the model stopped on its end-of-turn token, or ``max_tokens`` cut it) is
    read as it is."""

    start = end = ""

    def parse_body(self, body: str) -> ParsedToolCall | None:
        """The call in a block's body (None: not a call)."""
        raise NotImplementedError

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.start)
        if at > 0:
            return [text[:at]], at
        if at < 0:
            cut = len(text) if final else partial_marker_at(text, self.start)
            return ([text[:cut]] if cut else []), cut
        close = text.find(self.end, len(self.start))
        if close < 0 and not final:
            return [], 0
        stop = len(text) if close < 0 else close + len(self.end)
        call = self.parse_body(text[len(self.start) : close if close >= 0 else len(text)])
        return [call if call is not None else text[:stop]], stop
