"""Qwen3-Coder XML tool calls (vLLM's ``qwen3_coder`` parser): :class:`Qwen3CoderToolParser`."""
from __future__ import annotations

import json
import re

from deployments.gateway.tool_parsers.base import ParsedToolCall, ToolParser


class Qwen3CoderToolParser(ToolParser):
    """Qwen3-Coder's XML calls (vLLM: ``qwen3_coder``): ``<tool_call><function=NAME>
    <parameter=KEY>VALUE</parameter>...</function></tool_call>``; a value that parses as JSON
    (a number, a list, ``true``) is taken as such, else as a string."""

    name, start = "qwen3_coder", "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\s]+)>(.*?)</function>\s*</tool_call>", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def extract(self, text):
        if self.start not in text:
            return text, []
        calls = []
        for name, body in self._CALL.findall(text):
            args = {}
            for key, raw in self._PARAM.findall(body):
                try:
                    args[key] = json.loads(raw)
                except ValueError:
                    args[key] = raw
            calls.append(ParsedToolCall(name, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        content = text[:text.index(self.start)].strip()
        return content or None, calls


