"""Llama 3 JSON tool calls (vLLM's ``llama3_json`` parser): :class:`Llama3JsonToolParser`."""
from __future__ import annotations

import json

from deployments.gateway.tool_parsers.base import ToolParser, call_of


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: the output is ``{"name": ..., "parameters": {...}}``
    (several separated by ``;``), maybe after ``<|python_tag|>`` (vLLM: ``llama3_json``)."""

    name, start = "llama3_json", "{"

    def extract(self, text):
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, end = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = call_of(obj)
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls


