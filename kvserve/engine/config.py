"""Engine configuration (the knobs of ``LLM(...)`` and ``kvserve serve``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal, get_type_hints

from kvserve.engine.grammar_spec import GrammarLimits  # standard library only
from kvserve.engine.spec_config import SpeculativeConfig  # no torch

if TYPE_CHECKING:  # torch loads only when a device or dtype is asked for (front ends never do)
    import torch


def _knob(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass
class EngineConfig:
    """Everything that shapes one engine instance.

    This dataclass is the one source of the engine's settings: ``LLM(...)`` takes them as
    keyword arguments, and the Serve application's args (``kvserve.deployments.app.ModelArgs``) and
    ``kvserve serve``'s flags are generated from its fields, types, defaults and help
    (:func:`engine_fields`), as vLLM's ``EngineArgs`` does. Each field's ``help`` says what it
    means and its unit.

    Raises:
        ValueError: an out-of-range value (the message names the field).
    """

    model: str | None = _knob(None, "local Hugging Face folder, hub id, or None for SmolLM2-135M-Instruct")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _knob(
        "auto",
        "weights and KV cache dtype; auto: bfloat16 on CUDA; on a CPU with native bf16 dot products "
        "(avx512_bf16 or AMX) the faster of float32 and bfloat16 for this model, measured once and cached "
        "(float32 with quantization='int8'); else float32",
    )
    device: Literal["auto", "cpu", "cuda"] = _knob(
        "auto", "auto: CUDA if available; 'cuda' gives each replica (or tensor-parallel rank) one GPU"
    )
    block_size: int = _knob(16, "tokens per KV block")
    max_num_seqs: int = _knob(256, "most requests running at once")
    max_num_batched_tokens: int = _knob(2048, "token budget of one step (longer prompts are prefilled in chunks)")
    max_model_len: int | None = _knob(
        None, "longest prompt + output, tokens (default: the model's max_position_embeddings, capped by the KV pool)"
    )
    enable_prefix_caching: bool = _knob(True, "share full KV blocks between requests with equal prefixes")
    prefix_caching_hash_seed: str | None = _knob(
        None,
        "seed of the prefix cache's SHA-256 block hashes (the root of every chain); replicas that share "
        "blocks or routers share it (the Serve app gives its replicas one); None: "
        "$KVSERVE_PREFIX_CACHING_HASH_SEED, else random per engine",
    )
    num_kv_blocks: int | None = _knob(None, "KV pool size in blocks (overrides the memory-based sizes)")
    kv_cache_memory_bytes: int | None = _knob(None, "KV pool size in bytes per rank")
    cpu_kv_cache_bytes: int = _knob(2 << 30, "KV pool size in bytes on CPU when neither of the above is set")
    gpu_memory_utilization: float = _knob(
        0.90, "fraction of GPU memory for weights, activations and the KV pool (CUDA, when the pool is not sized)"
    )
    tensor_parallel_size: int = _knob(
        1, "ranks the model is split over (> 1: a distributed executor, see distributed_executor_backend)"
    )
    pipeline_parallel_size: int = _knob(
        1,
        "stages the model's layers are split into, each of tensor_parallel_size ranks (> 1: a distributed "
        "executor, see distributed_executor_backend; Llama-family models; a step's batch runs as this many "
        "micro-batches)",
    )
    distributed_executor_backend: Literal["ray", "mp", "uni"] | None = _knob(
        None,
        "how the ranks of tensor_parallel_size x pipeline_parallel_size > 1 run (vLLM's knob): ray: one Ray "
        "actor per rank (a local Ray is started when none is connected); mp: one local process per rank, "
        "no Ray; uni: the engine's own process (one rank only); None: uni for one rank, else ray where Ray "
        "is installed, else mp",
    )
    seed: int = _knob(0, "seed of the sampler's global RNG")
    scheduling_policy: Literal["fcfs", "priority"] = _knob(
        "fcfs",
        "fcfs: arrival order; priority: lower first, and a waiting request of strictly lower priority "
        "preempts the worst running one (by recompute) when max_num_seqs run",
    )
    attention_backend: Literal["torch", "cpu", "triton", "flash_attn"] | None = _knob(
        None, "attention kernels (default: the best that supports the device, dtype and block size)"
    )
    enforce_eager: bool = _knob(False, "disable CUDA graphs")
    quantization: Literal["int8", "fp8", "awq", "gptq", "compressed-tensors"] | None = _knob(
        None,
        "int8: weight-only int8 (one scale per output row) for every linear layer and the LM head, "
        "float32 activations (CPU, float32 models); fp8: float8 e4m3 weights (one scale per output row) "
        "and per-token float8 activations through torch._scaled_mm (CUDA, bfloat16, compute capability "
        ">= 8.9; the LM head stays bfloat16); awq, gptq, compressed-tensors: a 4-bit (W4A16) checkpoint "
        "of that format, kept 4-bit in memory (kvserve/engine/layers/w4a16.py; detected from the checkpoint's "
        "quantization_config when unset); None: the checkpoint's own quantization, else weights in the "
        "model dtype",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = _knob(
        "auto",
        "auto: the KV cache in the model dtype; fp8: float8 e4m3 with a per-layer scale for K and one for "
        "V (calibrated at start-up), a quarter of float32's bytes per block (torch and cpu attention "
        "backends)",
    )
    speculative_config: dict | None = _knob(
        None,
        'speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": k, '
        '"prompt_lookup_max": n, "prompt_lookup_min": m} or {"method": "draft_model", "model": '
        'PATH_OR_ID, "num_speculative_tokens": k}; "adaptive": false drafts k whenever it can '
        "(default: each request's draft length follows its measured acceptance and the step cost)",
    )
    enable_lora: bool = _knob(
        False, "serve LoRA adapters (kvserve/engine/lora.py): requests may name one (lora_request)"
    )
    max_loras: int = _knob(1, "most adapters in one step (device slots per adapted layer)")
    max_lora_rank: int = _knob(16, "largest adapter rank accepted (slots are sized for it)")
    max_cpu_loras: int | None = _knob(None, "adapters kept loaded in host memory (default: max_loras)")
    mixed_step_prefill_tokens: int | None = _knob(
        None,
        "in a step that also carries decodes, the largest chunk of a long prompt (one longer than this; "
        "one such prompt per step, short prompts go whole), so a long prompt cannot stall running streams: "
        "None sizes it from measured step times to keep such a step within mixed_step_slowdown x a "
        "decode-only step (on CUDA with CUDA graphs: no cap, as decode steps replay graphs and mixed "
        "steps run eagerly); 0: no cap; k: at most k tokens. Steps without decodes get "
        "max_num_batched_tokens",
    )
    kv_offloading_size: float | None = _knob(
        None,
        "GiB of the host tier below the KV pool (vLLM's --kv-offloading-size; the whole model's K and V, "
        "summed over tensor/pipeline-parallel ranks): cached prefix blocks the pool evicts are copied there "
        "and loaded back on a later hit instead of recomputed (kvserve/engine/kv_offload.py); None or 0: no tier",
    )
    kv_offloading_backend: Literal["native", "mmap"] = _knob(
        "native",
        "where the host tier keeps its blocks: native: host memory (pinned on CUDA); mmap: a "
        "memory-mapped file in kv_offloading_path (it can exceed RAM)",
    )
    kv_offloading_path: str | None = _knob(None, "folder of the mmap backend's file (default: the temp dir)")
    enable_kv_cache_events: bool = _knob(
        False,
        "record KV cache events (vLLM's BlockStored / BlockRemoved / AllBlocksCleared, kvserve/engine/kv_events.py) "
        "every step, for a KV-aware router",
    )
    structured_outputs_config: dict | None = _knob(
        None,
        "bounds on structured outputs (kvserve/engine/grammar_spec.py GrammarLimits; keys max_choices, "
        "max_choice_bytes, max_regex_bytes, max_grammar_bytes, max_json_schema_bytes, compile_timeout_s, "
        "compile_workers, max_queued_compiles); None: the defaults",
    )
    mixed_step_slowdown: float = _knob(
        2.5,
        "the automatic cap's target ratio (> 1): a step with decodes and prefill takes at most about this "
        "many times a decode-only step, bounding running streams' inter-token latency during a long prefill",
    )

    def __post_init__(self) -> None:
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name, least in (("max_model_len", 2), ("num_kv_blocks", 1), ("kv_cache_memory_bytes", 1)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < least):
                raise ValueError(f"{name} must be None or an integer >= {least}, got {v!r}")
        if self.mixed_step_prefill_tokens is not None and (
            not isinstance(self.mixed_step_prefill_tokens, int) or self.mixed_step_prefill_tokens < 0
        ):
            raise ValueError(
                f"mixed_step_prefill_tokens must be None, 0 or a positive integer, "
                f"got {self.mixed_step_prefill_tokens!r}"
            )
        if not self.mixed_step_slowdown > 1.0 or self.mixed_step_slowdown == float("inf"):
            raise ValueError(f"mixed_step_slowdown must be a finite number > 1, got {self.mixed_step_slowdown!r}")
        SpeculativeConfig.from_dict(self.speculative_config)  # raises ValueError naming the key
        GrammarLimits.from_dict(self.structured_outputs_config)  # raises ValueError naming the key
        if self.enable_lora:
            if (
                not isinstance(self.max_loras, int)
                or not isinstance(self.max_lora_rank, int)
                or min(self.max_loras, self.max_lora_rank) < 1
            ):
                raise ValueError(
                    f"max_loras and max_lora_rank must be positive integers, got {self.max_loras!r}, "
                    f"{self.max_lora_rank!r}"
                )
            if self.max_cpu_loras is not None and (
                not isinstance(self.max_cpu_loras, int) or self.max_cpu_loras < self.max_loras
            ):
                raise ValueError(f"max_cpu_loras must be None or an integer >= max_loras, got {self.max_cpu_loras!r}")
            if self.speculative_config:
                raise ValueError(
                    "enable_lora with speculative_config is not supported (the drafts would come from the base model)"
                )
        if self.pipeline_parallel_size > 1:
            for name, on in (
                ("enable_lora", self.enable_lora),
                ("speculative_config", self.speculative_config),
                ("kv_cache_dtype='fp8'", self.kv_cache_dtype == "fp8"),
            ):
                if on:
                    raise ValueError(f"pipeline_parallel_size > 1 does not run with {name} yet")
        if self.kv_offloading_size is not None:
            if not isinstance(self.kv_offloading_size, (int, float)) or not 0 <= self.kv_offloading_size < float("inf"):
                raise ValueError(
                    f"kv_offloading_size must be None or a finite number of GiB >= 0, got {self.kv_offloading_size!r}"
                )
            if self.kv_offloading_size and not self.enable_prefix_caching:
                raise ValueError("kv_offloading_size needs enable_prefix_caching (the tier keeps cached prefix blocks)")
        if self.kv_offloading_backend not in ("native", "mmap"):
            raise ValueError(f"kv_offloading_backend must be 'native' or 'mmap', got {self.kv_offloading_backend!r}")
        if self.distributed_executor_backend not in (None, "ray", "mp", "uni"):
            raise ValueError(
                f"distributed_executor_backend must be 'ray', 'mp', 'uni' or None, "
                f"got {self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend == "uni" and self.tensor_parallel_size * self.pipeline_parallel_size > 1:
            raise ValueError(
                f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size "
                f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} "
                f"needs 'mp' (local processes) or 'ray' (Ray actors)"
            )
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")

    @property
    def torch_device(self) -> "torch.device":
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def cuda_graphs(self) -> bool:
        """CUDA graphs asked for: a CUDA device and ``enforce_eager`` off (the model runner also
        needs an attention backend whose kernels can be captured). LoRA steps and pipeline stages run
        eagerly."""
        return (
            self.torch_device.type == "cuda"
            and not self.enforce_eager
            and not self.enable_lora
            and self.pipeline_parallel_size == 1
        )

    @property
    def torch_dtype(self) -> "torch.dtype":
        """The dtype of weights and activations: ``dtype``, or for ``"auto"`` the one
        :meth:`auto_dtype` picks."""
        import torch

        if self.dtype == "auto":
            return self.auto_dtype()[0]
        return getattr(torch, self.dtype)

    def auto_dtype(self) -> tuple["torch.dtype", str]:
        """What ``dtype="auto"`` means by the device and the CPU's flags, and why (a sentence for
        the log, as vLLM logs its choice): bfloat16 on CUDA; float32 with ``quantization="int8"``
        (its kernels take float32 activations) and on a CPU without native bf16 dot products
        (:func:`cpu_native_bf16`: bf16 weights would cost a float32 widening per step); bfloat16
        on a CPU with them. An engine refines the last case by measuring this model's matmuls
        in both dtypes (:func:`kvserve.engine.dtype_probe.auto_dtype`); ``benchmarks/throughput.py
        --dtype`` measures both end to end."""
        import torch

        if self.torch_device.type == "cuda":
            return torch.bfloat16, "bfloat16 on CUDA"
        if self.quantization == "int8":
            return torch.float32, "float32: quantization='int8' runs float32 activations"
        native, flags = cpu_native_bf16()
        if native:
            return torch.bfloat16, f"bfloat16: this CPU has native bf16 dot products ({flags})"
        return torch.float32, f"float32: this CPU has no native bf16 dot products ({flags}), bf16 would be slower"


def cpu_native_bf16() -> tuple[bool, str]:
    """Whether this CPU computes bfloat16 dot products natively (AVX512_BF16's ``vdpbf16ps``
    or AMX tiles), and which of those flags it has (e.g. ``"avx512_bf16, amx_bf16"``;
    ``"no avx512_bf16 or amx_bf16"``). Read from torch's CPU probes, else ``/proc/cpuinfo``."""
    import torch

    found = []
    try:
        if torch.cpu._is_avx512_bf16_supported():
            found.append("avx512_bf16")
        if torch.cpu._is_amx_tile_supported():
            found.append("amx_bf16")
    except AttributeError:  # an older torch: the kernel's view of the flags
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
        except OSError:
            flags = []
        found = [x for x in ("avx512_bf16", "amx_bf16") if x in flags]
    return bool(found), ", ".join(found) or "no avx512_bf16 or amx_bf16"


def engine_fields() -> list[tuple[str, Any, Any, str]]:
    """``(name, type, default, help)`` of every :class:`EngineConfig` field, in order: what
    the Serve args and the CLI flags are generated from."""
    hints = get_type_hints(EngineConfig)
    return [(f.name, hints[f.name], f.default, f.metadata["help"]) for f in fields(EngineConfig)]
