"""kvserve's engine: continuous batching over a paged KV cache (no Ray needed)."""
import os

# OpenMP threads that spin while waiting burn the time slices of everything else on a busy
# CPU host (Ray's proxy, the ingress, other replicas): measured on 2 cores at load 5, a
# 2048-token prefill step took 49 s spinning and 5 s passive. Must be set before torch loads.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
from engine.config import EngineConfig
from engine.request import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


def __getattr__(name):  # heavy imports (torch, transformers) only when used
    if name == "LLM":
        from engine.llm import LLM
        return LLM
    if name == "LLMEngine":
        from engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "AsyncLLMEngine":
        from engine.async_engine import AsyncLLMEngine
        return AsyncLLMEngine
    raise AttributeError(name)


__all__ = ["LLM", "LLMEngine", "AsyncLLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput"]
