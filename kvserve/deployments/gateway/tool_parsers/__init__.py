"""Tool-call parsers per model family, by vLLM's ``--tool-call-parser`` names: :data:`TOOL_PARSERS`
and :func:`get_tool_parser`; one module per family, the interface in :mod:`~kvserve.deployments.gateway.tool_parsers.base`."""

from __future__ import annotations

from kvserve.deployments.gateway.tool_parsers.base import ToolParser
from kvserve.deployments.gateway.tool_parsers.hermes import HermesToolParser
from kvserve.deployments.gateway.tool_parsers.llama3_json import Llama3JsonToolParser
from kvserve.deployments.gateway.tool_parsers.mistral import MistralToolParser
from kvserve.deployments.gateway.tool_parsers.pythonic import PythonicToolParser
from kvserve.deployments.gateway.tool_parsers.qwen3_coder import Qwen3CoderToolParser

#: ``tool_call_parser`` name -> parser (vLLM's names; ``qwen3_xml`` is vLLM's other parser of
#: Qwen3-Coder's format).
TOOL_PARSERS: dict[str, type[ToolParser]] = {
    **{
        p.name: p
        for p in (HermesToolParser, Llama3JsonToolParser, MistralToolParser, PythonicToolParser, Qwen3CoderToolParser)
    },
    "qwen3_xml": Qwen3CoderToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    """A fresh parser (one per output: parsers keep state) of vLLM name ``name``.

    Raises:
        ValueError: a name not in :data:`TOOL_PARSERS`.
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool_call_parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]()
