"""Mistral tool calls (vLLM's ``mistral`` parser): :class:`MistralToolParser`."""
from __future__ import annotations

import json

from deployments.gateway.tool_parsers.base import ToolParser, call_of


class MistralToolParser(ToolParser):
    """Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (vLLM: ``mistral``)."""

    name, start = "mistral", "[TOOL_CALLS]"

    def extract(self, text):
        if self.start not in text:
            return text, []
        head, _, body = text.partition(self.start)
        try:
            value = json.loads(body.strip())
        except ValueError:
            return text, []
        items = value if isinstance(value, list) else [value]
        calls = [call_of(v) for v in items]
        if not calls or any(c is None for c in calls):
            return text, []
        return head.strip() or None, calls


