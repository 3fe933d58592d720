"""Hermes-style tool calls (vLLM's ``hermes`` parser): :class:`HermesToolParser`."""

from __future__ import annotations

import json

from kvserve.deployments.gateway.tool_parsers.base import call_of
from kvserve.deployments.gateway.tool_parsers.tagged import TaggedToolParser


class HermesToolParser(TaggedToolParser):
    """Hermes / Qwen2.5 / Qwen3 style: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    blocks (vLLM: ``hermes``); also what :func:`kvserve.engine.chat_templates.prepare_messages` teaches
    template-less models."""

    name, start, end = "hermes", "<tool_call>", "</tool_call>"

    def parse_body(self, body):
        try:
            return call_of(json.loads(body))
        except ValueError:
            return None
