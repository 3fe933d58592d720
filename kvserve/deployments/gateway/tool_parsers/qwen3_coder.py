"""Qwen3-Coder XML tool calls (vLLM's ``qwen3_coder`` and ``qwen3_xml`` parsers): :class:`Qwen3CoderToolParser`."""

from __future__ import annotations

import json
import re

from kvserve.deployments.gateway.tool_parsers.base import ParsedToolCall
from kvserve.deployments.gateway.tool_parsers.tagged import TaggedToolParser


class Qwen3CoderToolParser(TaggedToolParser):
    """Qwen3-Coder's XML calls (vLLM: ``qwen3_coder``; ``qwen3_xml`` reads the same format):
    ``<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call>``;
    a value that parses as JSON (a number, a list, ``true``) is taken as such, else as a
    string (one leading and one trailing newline around it dropped)."""

    name, start, end = "qwen3_coder", "<tool_call>", "</tool_call>"
    _FUNCTION = re.compile(r"\s*<function=([^>\s]+)>(.*?)</function>\s*", re.DOTALL)
    _PARAM = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)

    def parse_body(self, body):
        m = self._FUNCTION.fullmatch(body)
        if m is None or self._PARAM.sub("", m.group(2)).strip():
            return None  # not one function, or text outside its parameters
        args = {}
        for key, raw in self._PARAM.findall(m.group(2)):
            try:
                args[key] = json.loads(raw)
            except ValueError:
                args[key] = raw
        return ParsedToolCall(m.group(1), json.dumps(args, ensure_ascii=False))
