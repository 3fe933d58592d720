"""Llama 3 JSON tool calls (vLLM's ``llama3_json`` parser): :class:`Llama3JsonToolParser`."""

from __future__ import annotations

import json

from kvserve.deployments.gateway.tool_parsers.base import Scan, ToolParser, bracket_end, call_of


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls (vLLM: ``llama3_json``): the output *begins* with
    ``{"name": ..., "parameters": {...}}`` (several separated by ``;``, which are dropped),
    maybe after ``<|python_tag|>``. Only the output's start can be a call: once a piece is
    content (prose, or a JSON object that is no call, like a JSON answer), the rest is content."""

    name, tag = "llama3_json", "<|python_tag|>"

    def __init__(self):
        self.state = "start"  # start -> after (a call was read) -> content

    def scan(self, text: str, final: bool) -> Scan:
        if self.state == "content":
            return [text], len(text)
        if self.state == "after":
            seps = len(text) - len(text.lstrip(" \t\r\n;"))
            if seps:
                return [], seps
            i = 0
        else:
            i = len(text) - len(text.lstrip())
            if text.startswith(self.tag, i):
                i += len(self.tag)
                i += len(text) - i - len(text[i:].lstrip())
            elif i < len(text) and self.tag.startswith(text[i:]) and not final:
                return [], 0  # maybe the tag
        if i == len(text) and not final:
            return [], 0
        end = bracket_end(text, i) if i < len(text) and text[i] == "{" else None
        if end is None:
            if i < len(text) and text[i] == "{" and not final:
                return [], 0  # a call being written
            self.state = "content"
            return ([text] if text else []), len(text)
        try:
            call = call_of(json.loads(text[i:end]))
        except ValueError:
            call = None
        if call is None:
            self.state = "content"
            return [text], len(text)
        self.state = "after"
        return [call], end
