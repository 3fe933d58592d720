"""Reasoning models' output markers (vLLM's ``--reasoning-parser`` names), shared by the replica
(where a prompt leaves the model: in its reasoning or not) and the gateway (which splits the
output into reasoning and content, :mod:`kvserve.deployments.gateway.reasoning`).

The two ``<think>`` families differ in one thing, as in vLLM:

- ``deepseek_r1`` (DeepSeek-R1 and its distills): the output *is* reasoning from its first token
  (the template usually opens ``<think>`` in the prompt; a leading ``<think>`` in the output is
  dropped) until ``</think>``; an output that never closes it is all reasoning.
- ``qwen3`` (Qwen3, QwQ): the output reasons only when it opens with ``<think>``, or when the
  prompt left a ``<think>`` open (Qwen3-Thinking-2507's template); otherwise (thinking off,
  ``enable_thinking: false`` closes an empty block in the prompt) it is all content.
"""

from __future__ import annotations

#: reasoning parser name -> (start marker, end marker).
REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "deepseek_r1": ("<think>", "</think>"),
    "qwen3": ("<think>", "</think>"),
}


def prompt_reasoning(prompt_tail: str, parser: str) -> str:
    """Where the prompt leaves the model (``prompt_tail``: the prompt's last tokens as text):
    ``"open"`` inside a reasoning block the template opened, ``"closed"`` right after one it
    closed (thinking turned off), ``""`` neither."""
    start, end = REASONING_PARSERS[parser]
    s, e = prompt_tail.rfind(start), prompt_tail.rfind(end)
    if s < 0 and e < 0:
        return ""
    return "open" if s > e else "closed"


def reasons_first(parser: str, prompt_state: str) -> bool:
    """Whether the output starts inside the reasoning (before any ``<think>`` of its own)."""
    if parser == "deepseek_r1":
        return prompt_state != "closed"
    return prompt_state == "open"
