"""Hermes-style tool calls (vLLM's ``hermes`` parser): :class:`HermesToolParser`."""
from __future__ import annotations

import json
import re

from deployments.gateway.tool_parsers.base import ToolParser, call_of


class HermesToolParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3 style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (vLLM: ``hermes``); also what :func:`prepare_messages` teaches template-less models."""

    name, start = "hermes", "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text):
        if self.start not in text:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = call_of(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[:text.index(self.start)].strip()
        return content or None, calls


