"""Python-list tool calls (vLLM's ``pythonic`` parser): :class:`PythonicToolParser`."""

from __future__ import annotations

import ast
import json

from kvserve.deployments.gateway.tool_parsers.base import ParsedToolCall, Scan, ToolParser, bracket_end


class PythonicToolParser(ToolParser):
    """Calls as a Python list of calls with keyword arguments, the whole output (vLLM:
    ``pythonic``; Llama 3.2 / 4 and Gemma 3 prompt guides): ``[get_weather(city="Paris"),
    get_time()]``, maybe between Llama 4's ``<|python_start|>`` and ``<|python_end|>``.
    Argument values are Python literals (strings, numbers, ``True``/``False``/``None``, lists,
    dicts), read with :func:`ast.literal_eval` (never evaluated). Anything else, or a list
    that is not all such calls, is content."""

    name, start_tag, end_tag = "pythonic", "<|python_start|>", "<|python_end|>"

    def __init__(self):
        self.state = "start"  # start -> after (the calls were read) -> content

    def scan(self, text: str, final: bool) -> Scan:
        if self.state == "content":
            return [text], len(text)
        if self.state == "after":  # only the closing tag and whitespace may follow the list
            rest = text.lstrip()
            if rest.startswith(self.end_tag):
                return [], len(text) - len(rest) + len(self.end_tag)
            if (not rest or self.end_tag.startswith(rest)) and not final:
                return [], 0
            self.state = "content"
            return ([text] if text.strip() else []), len(text)
        i = len(text) - len(text.lstrip())
        if text.startswith(self.start_tag, i):
            i += len(self.start_tag)
            i += len(text) - i - len(text[i:].lstrip())
        elif i < len(text) and self.start_tag.startswith(text[i:]) and not final:
            return [], 0
        if i < len(text) and text[i] == "[":
            end = bracket_end(text, i, quotes="\"'")
            if end is None and not final:
                return [], 0
            calls = self._calls(text[i:end]) if end is not None else None
            if calls is not None:
                self.state = "after"
                return calls, end
        elif i == len(text) and not final:
            return [], 0
        self.state = "content"
        return ([text] if text else []), len(text)

    @staticmethod
    def _calls(source: str) -> list[ParsedToolCall] | None:
        try:
            tree = ast.parse(source, mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg is not None}
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            if len(args) != len(node.keywords):
                return None  # **kwargs
            try:
                arguments = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError):  # a set, bytes, a complex number: no JSON for it
                return None
            calls.append(ParsedToolCall(node.func.id, arguments))
        return calls
