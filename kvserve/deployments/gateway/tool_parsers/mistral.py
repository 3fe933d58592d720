"""Mistral tool calls (vLLM's ``mistral`` parser): :class:`MistralToolParser`."""

from __future__ import annotations

import json
import re

from kvserve.deployments.gateway.tool_parsers.base import (
    ParsedToolCall,
    Scan,
    ToolParser,
    bracket_end,
    json_calls,
    partial_marker_at,
)

_NAME = re.compile(r"[A-Za-z0-9_.\-]+")


class MistralToolParser(ToolParser):
    """Mistral's ``[TOOL_CALLS]`` marker (vLLM: ``mistral``), then either a JSON array of
    ``{"name", "arguments"}`` (tokenizers before v11) or ``NAME[ARGS]{...}`` (v11 on:
    Mistral Small 3.2, Magistral, Devstral; one marker per call). Content may come before a
    marker; a marker followed by neither form stays content."""

    name, start, args_tag = "mistral", "[TOOL_CALLS]", "[ARGS]"

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(self.start)
        if at != 0:
            cut = at if at > 0 else len(text) if final else partial_marker_at(text, self.start)
            return ([text[:cut]] if cut else []), cut
        i = len(self.start)
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return ([text], len(text)) if final else ([], 0)
        if text[i] == "[":  # [TOOL_CALLS][{...}, ...]
            end = bracket_end(text, i)
            if end is None:
                return ([text], len(text)) if final else ([], 0)
            calls = json_calls(text[i:end])
            return (calls if calls else [text[:end]]), end
        name = _NAME.match(text, i)
        if name is None:
            return [text[:i]], i
        j = name.end()
        rest = text[j:]
        if self.args_tag.startswith(rest) and not final:
            return [], 0  # the name so far, maybe the start of [ARGS]
        if rest.startswith(self.args_tag):
            j += len(self.args_tag)
        while j < len(text) and text[j].isspace():
            j += 1
        if j == len(text):
            return ([text], len(text)) if final else ([], 0)
        if text[j] != "{":
            return [text[:j]], j
        end = bracket_end(text, j)
        if end is None:
            return ([text], len(text)) if final else ([], 0)
        try:
            args = json.loads(text[j:end])
        except ValueError:
            args = None
        if not isinstance(args, dict):
            return [text[:end]], end
        return [ParsedToolCall(name.group(0), json.dumps(args, ensure_ascii=False))], end
