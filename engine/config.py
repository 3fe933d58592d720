"""Engine configuration (the knobs of ``LLM(...)`` and ``kvserve serve``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    Attributes:
        model: local Hugging Face folder, hub id, or None for the default SmolLM2-135M-Instruct.
        dtype: "auto" (float32 on CPU, bfloat16 on CUDA), "float32", "bfloat16" or "float16".
        device: "auto" (CUDA if available), "cpu" or "cuda".
        block_size: tokens per KV block.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: token budget per step (chunked prefill beyond it).
        max_model_len: longest prompt + output in tokens (default: the model's
            ``max_position_embeddings``, capped by the KV pool).
        enable_prefix_caching: share full KV blocks between requests with equal prefixes.
        num_kv_blocks / kv_cache_memory_bytes: size the KV pool explicitly (blocks / bytes);
            otherwise ``cpu_kv_cache_bytes`` on CPU, ``gpu_memory_utilization`` on CUDA.
        tensor_parallel_size: ranks the model is split over (needs an injected executor > 1).
        seed: seed of the global sampler RNG.
        scheduling_policy: "fcfs" or "priority".
        attention_backend: None (auto), "torch", "triton" or "flash_attn".
        enforce_eager: disable CUDA graphs.
        mixed_step_prefill_tokens: prefill tokens (summed over requests) that a step which
            also carries decodes may compute, so that a long prompt cannot stall running
            streams: ``None`` (default) sizes it from the engine's own step times to keep such
            a step within ``mixed_step_slowdown`` x a decode-only step; ``0`` = no cap (prefill
            chunks fill ``max_num_batched_tokens``, the behaviour before this knob); ``k > 0``
            = at most ``k`` tokens. Steps with no decodes always get the full
            ``max_num_batched_tokens``.
        mixed_step_slowdown: the automatic cap's target, a ratio (> 1): a step with decodes
            and prefill should take at most this many times a decode-only step, which bounds
            running streams' inter-token latency while a long prompt is prefilled.
    """

    model: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    cpu_kv_cache_bytes: int = 2 << 30
    gpu_memory_utilization: float = 0.90
    tensor_parallel_size: int = 1
    seed: int = 0
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    enforce_eager: bool = False
    mixed_step_prefill_tokens: int | None = None
    mixed_step_slowdown: float = 2.5

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        if self.mixed_step_prefill_tokens is not None and (
                not isinstance(self.mixed_step_prefill_tokens, int) or self.mixed_step_prefill_tokens < 0):
            raise ValueError(f"mixed_step_prefill_tokens must be None, 0 or a positive integer, "
                             f"got {self.mixed_step_prefill_tokens!r}")
        if not self.mixed_step_slowdown > 1.0 or self.mixed_step_slowdown == float("inf"):
            raise ValueError(f"mixed_step_slowdown must be a finite number > 1, got {self.mixed_step_slowdown!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return getattr(torch, self.dtype)
