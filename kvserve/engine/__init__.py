"""kvserve's engine: continuous batching over a paged KV cache (no Ray needed)."""

from kvserve.engine.config import EngineConfig
from kvserve.engine.request import CompletionOutput, RequestOutput
from kvserve.engine.sampling_params import SamplingParams


def __getattr__(name):  # heavy imports (torch, transformers) only when used
    if name == "LLM":
        from kvserve.engine.llm import LLM

        return LLM
    if name == "LLMEngine":
        from kvserve.engine.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from kvserve.engine.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
