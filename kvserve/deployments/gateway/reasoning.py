"""Reasoning output (``--reasoning-parser``): :class:`ReasoningStream` splits a reasoning model's
output into its reasoning and its content, for chat's ``reasoning_content``, the Responses
API's ``reasoning`` item and the Messages API's ``thinking`` block. The families' rules are in
:mod:`kvserve.deployments.contract.reasoning`; ``max_tokens`` and stop strings count the whole output,
reasoning included, as in vLLM."""

from __future__ import annotations

from kvserve.deployments.contract.reasoning import REASONING_PARSERS, reasons_first
from kvserve.deployments.gateway.tool_parsers.base import partial_marker_at


class ReasoningStream:
    """Splits one output, fed as a stream's deltas or whole, into ``(reasoning, content)``
    pieces; a stream assembles exactly what the whole output gives. Text that may still be
    the start of a marker is held back until the next delta decides it.

    Leading whitespace of the reasoning and of the content after ``</think>`` is dropped
    (``<think>\\n...</think>\\n\\nAnswer`` gives ``...`` and ``Answer``).

    Args:
        parser: a name of :data:`~kvserve.deployments.contract.reasoning.REASONING_PARSERS`.
        prompt_state: where the prompt left the model (the first chunk's ``prompt_reasoning``).
    """

    def __init__(self, parser: str, prompt_state: str = ""):
        self.start, self.end = REASONING_PARSERS[parser]
        if reasons_first(parser, prompt_state):
            self.state = "opening"  # reasoning; a <think> of the output's own may come first
        else:  # qwen3: reasoning only if the output opens <think>; deepseek_r1 after a closed block: none
            self.state = "undecided" if parser == "qwen3" and prompt_state != "closed" else "content"
        self.text, self.started = "", False  # started: the reasoning's first character was seen

    def feed(self, delta: str) -> tuple[str, str]:
        """Add output text: ``(reasoning, content)`` that can be sent now."""
        self.text += delta
        return self._split(final=False)

    def finish(self) -> tuple[str, str]:
        """At the end of the output: the ``(reasoning, content)`` held back."""
        return self._split(final=True)

    @property
    def reasoning_done(self) -> bool:
        """The reasoning is over (or never began): what comes now is content."""
        return self.state in ("after", "content")

    def _split(self, final: bool) -> tuple[str, str]:
        reasoning, content = "", ""
        while True:
            if self.state in ("opening", "undecided"):
                head = self.text.lstrip()
                if head.startswith(self.start):
                    self.text, self.state = head[len(self.start) :], "reasoning"
                    continue
                if not final and self.start.startswith(head):
                    break  # nothing yet, or maybe the start marker
                self.state = "reasoning" if self.state == "opening" else "content"
                continue
            if self.state == "reasoning":
                if not self.started:
                    self.text = self.text.lstrip()  # leading whitespace goes
                    if not self.text:
                        break
                    self.started = True
                at = self.text.find(self.end)
                if at >= 0:
                    reasoning += self.text[:at]
                    self.text, self.state = self.text[at + len(self.end) :], "after"
                    continue
                cut = len(self.text) if final else partial_marker_at(self.text, self.end)
                reasoning, self.text = reasoning + self.text[:cut], self.text[cut:]
                break
            if self.state == "after":
                rest = self.text.lstrip()
                if not rest:
                    self.text = ""
                    break
                self.text, self.state = rest, "content"
                continue
            content, self.text = self.text, ""
            break
        return reasoning, content
