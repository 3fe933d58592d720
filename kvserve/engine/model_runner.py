"""Runs the model for one scheduler step: loads it, owns the KV cache tensors, runs and samples.

One instance per tensor-parallel rank. The step's inputs are built by :mod:`kvserve.engine.input_batch`,
decode steps on a GPU replay :mod:`kvserve.engine.cuda_graphs`, prompt logprobs come from
:mod:`kvserve.engine.prompt_logprobs`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from kvserve.engine import dtype_probe, huge_pages, kv_offload
from kvserve.engine.config import EngineConfig
from kvserve.engine.cuda_graphs import DecodeCudaGraphs, graph_batch_sizes
from kvserve.engine.grammar_bitmask import bitmask_rows
from kvserve.engine.input_batch import RequestState, build_batch, update_states
from kvserve.engine.kv_calibration import calibrate_kv_scales
from kvserve.engine.kv_offload import HostKVStore
from kvserve.engine.layers.embedding import ParallelLMHead
from kvserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvserve.engine.layers.quantization import check_quantization, quantize_model
from kvserve.engine.layers.w4a16 import W4_METHODS, prepare_w4a16, resolve_quantization, w4a16_config
from kvserve.engine.layers.sampler import Sampler, SamplingRow
from kvserve.engine.lora_slots import LoRASlots
from kvserve.engine.model_loader import iter_safetensors, load_config
from kvserve.engine.models.registry import model_class
from kvserve.engine.pipeline import pipeline_forward
from kvserve.engine.prompt_logprobs import PROMPT_LOGPROBS_SLICE, prompt_logprobs
from kvserve.engine.sched_output import SchedulerOutput
from kvserve.kernels.backend import AttentionMetadata
from kvserve.kernels.selector import select_attention_backend

logger = logging.getLogger("kvserve.engine")


def load_eos_token_ids(model_path: str | Path, hf_config=None) -> set[int]:
    """EOS ids from ``generation_config.json`` and ``config.json`` (either may be a list)."""
    ids: set[int] = set()
    cfg = hf_config or load_config(model_path)
    gen = Path(model_path) / "generation_config.json"
    sources = [getattr(cfg, "eos_token_id", None)]
    if gen.exists():
        sources.append(json.loads(gen.read_text()).get("eos_token_id"))
    for s in sources:
        if isinstance(s, int):
            ids.add(s)
        elif isinstance(s, list):
            ids.update(int(x) for x in s)
    return ids


@dataclass
class ModelRunnerOutput:
    """Sampled token id per sampling request, and optional logprobs dicts.

    ``prompt_logprobs``: for requests with ``params.prompt_logprobs`` whose slice covered prompt
    positions, ``{request_id: [(position, {token_id: logprob}), ...]}``: the log-probability of
    the prompt token at ``position`` given the tokens before it, plus the top-k (plain Python
    values: picklable for a distributed executor).

    A request that verified drafts (speculative decoding) gets a list in ``sampled``: its
    accepted drafts then the target's own token (1 to ``k + 1`` ids), and a list of logprobs
    dicts, one per token."""

    sampled: dict[str, int | list[int]]
    logprobs: dict[str, dict[int, float] | list[dict[int, float]]] | None = None
    prompt_logprobs: dict[str, list[tuple[int, dict[int, float]]]] | None = None
    #: embeddings of the pooling requests whose prompt this step finished (kvserve.engine.pooling)
    pooled: dict[str, list[float]] | None = None
    #: seconds this rank spent loading blocks back from the host tier before the forward
    kv_load_seconds: float = 0.0


class ModelRunner:
    """Loads the model (this rank's shard) and executes :class:`SchedulerOutput` batches.

    Args:
        config: engine configuration.
        model_path: local Hugging Face folder (see ``kvserve.engine.model_loader.resolve_model``).

    Raises:
        ValueError: unsupported architecture, missing or unexpected weights, a quantization
            (``kvserve.engine.layers.quantization.check_quantization``) or float8 KV cache this device
            or attention backend cannot run.
    """

    def __init__(self, config: EngineConfig, model_path: str | Path):
        self.config = config
        self.device = config.torch_device
        self.hf_config = load_config(model_path)
        if config.dtype == "auto":  # (an LLMEngine decides before its executor starts: ranks get a dtype)
            self.dtype, why = dtype_probe.auto_dtype(config, self.hf_config)
            logger.info("dtype auto -> %s", why)
        else:
            self.dtype = config.torch_dtype
        self.block_size = config.block_size
        head_dim = (
            getattr(self.hf_config, "head_dim", None)
            or self.hf_config.hidden_size // self.hf_config.num_attention_heads
        )
        self.backend = select_attention_backend(
            self.device, self.dtype, self.block_size, head_dim, config.attention_backend
        )()
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        reason = config.kv_cache_dtype == "fp8" and self.backend.fp8_kv_unsupported_reason(self.device)
        if reason:
            raise ValueError(
                f"kv_cache_dtype='fp8' is not supported here: {reason} "
                f"(float8 caches run on the torch, cpu and triton backends)"
            )
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(self.hf_config)(self.hf_config, self.backend)
        finally:
            torch.set_default_dtype(default_dtype)
        self.quantization = resolve_quantization(config.quantization, self.hf_config)
        if self.quantization in W4_METHODS:  # a 4-bit checkpoint: its layers take the packed tensors
            check_quantization(self.quantization, self.device, self.dtype)
            prepare_w4a16(self.model, w4a16_config(self.hf_config), self.dtype)
        # CPU: the weights a decode step streams go on huge pages (kvserve/engine/huge_pages.py); a model
        # loaded as it is moves its (not yet written) weights first and loads into them, a quantized
        # one moves the weights its quantization made
        moved = 0
        if self.device.type == "cpu" and self.quantization is None:
            moved = huge_pages.move_to_huge_pages(self.model)
        self.model.load_weights(iter_safetensors(model_path))
        self.model.eval()
        if self.quantization in ("int8", "fp8"):
            quantize_model(self.model, self.quantization, self.device, self.dtype)
        if self.device.type == "cpu":
            self._prepack_linears()
            if self.quantization is not None:
                moved = huge_pages.move_to_huge_pages(self.model)
            if moved:
                logger.info("%.0f MiB of weights on transparent huge pages", moved / 2**20)
        if config.kv_cache_dtype == "fp8":
            calibrate_kv_scales(model_path, self.model.layers, self.device, self._prefill_alone)
        self.eos_token_ids = load_eos_token_ids(model_path, self.hf_config)
        #: LoRA adapters' slots in the linear layers (kvserve.engine.lora.LoRASlots), None without enable_lora
        self.lora = None
        if config.enable_lora:
            self.lora = LoRASlots(
                self.model, self.hf_config, config.max_loras, config.max_lora_rank, config.max_cpu_loras
            )
        self.sampler = Sampler()
        self.states: dict[str, RequestState] = {}
        self.pooling: set[str] = set()  # running embedding requests (kvserve.engine.pooling): most steps have none
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        #: this rank's bytes of the host tier below the pool (kvserve.engine.kv_offload), None without one
        self.host_store: HostKVStore | None = None
        #: the captured decode graphs (None: eager; see :meth:`capture_cudagraphs`)
        self.graphs: DecodeCudaGraphs | None = None

    # ---- KV cache -----------------------------------------------------------
    @property
    def bytes_per_block(self) -> int:
        """K+V bytes of one block over all layers on this rank."""
        attn = self.model.layers[0].self_attn
        per_token = 2 * attn.num_kv_heads * attn.head_dim * torch.tensor([], dtype=self.kv_dtype).element_size()
        return per_token * self.block_size * len(self.model.layers)

    def determine_num_blocks(self) -> int:
        """Blocks that fit: ``num_kv_blocks`` if set, else ``kv_cache_memory_bytes``, else
        ``cpu_kv_cache_bytes`` on CPU or free memory under ``gpu_memory_utilization`` on CUDA
        after a profiling forward pass of ``max_num_batched_tokens`` tokens.

        Raises:
            ValueError: on CUDA, the memory under ``gpu_memory_utilization`` holds less than one
                block once this process's weights, activations (and any other engine in it)
                and other processes' memory are taken out (vLLM raises the same; never a
                one-block engine that refuses every prompt).
        """
        c = self.config
        if c.num_kv_blocks:
            return c.num_kv_blocks
        if c.kv_cache_memory_bytes:
            return max(1, c.kv_cache_memory_bytes // self.bytes_per_block)
        if self.device.type != "cuda":
            return max(1, c.cpu_kv_cache_bytes // self.bytes_per_block)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        self._profile_run()
        free, total = torch.cuda.mem_get_info()
        peak = torch.cuda.max_memory_allocated()
        used_elsewhere = total - free - torch.cuda.memory_reserved()
        budget = total * c.gpu_memory_utilization - peak - max(used_elsewhere, 0)
        if budget < self.bytes_per_block:
            gib = 1 << 30
            raise ValueError(
                f"no GPU memory left for the KV cache: gpu_memory_utilization {c.gpu_memory_utilization} of "
                f"{total / gib:.1f} GiB, minus {peak / gib:.2f} GiB for weights and activations (this process, "
                f"other engines in it included) and {max(used_elsewhere, 0) / gib:.2f} GiB used by other "
                f"processes, leaves less than one block ({self.bytes_per_block} bytes); raise "
                "gpu_memory_utilization, free the GPU, or set kv_cache_memory_bytes"
            )
        return int(budget // self.bytes_per_block)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        n = self.config.max_num_batched_tokens
        h, _ = self._prefill_alone(torch.zeros(n, dtype=torch.long, device=self.device))
        if getattr(self.model, "last_stage", True):
            self.model.compute_logits(h[-min(n, self.config.max_num_seqs) :])

    @torch.inference_mode()
    def _prefill_alone(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One request of prompt ``ids`` (int64 ``[n]``) through the model in one chunk, with
        temporary K/V caches in the model dtype (never the engine's pool). Returns the hidden
        states ``[n, hidden]`` and the caches (K, V per layer; the first ``n`` slots hold them)."""
        n, dev = ids.numel(), self.device
        nblocks = -(-n // self.block_size)
        attn = self.model.layers[0].self_attn
        shape = (nblocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        caches = [
            (torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
            for _ in self.model.layers
        ]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nblocks, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            query_lens_cpu=[n],
            seq_lens_cpu=[n],
            max_seqlen_q=n,
            max_seqlen_k=n,
        )
        self._attach(caches)
        try:
            h = self.model(ids, torch.arange(n, device=dev) % self.hf_config.max_position_embeddings, meta)
        finally:
            self._attach([])
        return h, caches

    def _prepack_linears(self) -> None:
        """CPU: every linear layer and the LM head keep a oneDNN-layout copy of their weight for
        the matmuls (``kvserve.engine.layers.linear.prepack_weight``; quantized layers keep theirs)."""
        for m in self.model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
                m.prepack()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``[num_blocks, block_size, kv_heads, head_dim]`` K and V per layer.

        The memory is not cleared (on CPU, zeroing gigabytes costs seconds of page faults):
        attention backends never let a slot past a request's ``seq_len`` affect the output."""
        attn = self.model.layers[0].self_attn
        shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [
            (
                torch.empty(shape, dtype=self.kv_dtype, device=self.device),
                torch.empty(shape, dtype=self.kv_dtype, device=self.device),
            )
            for _ in self.model.layers
        ]
        self._attach(self.kv_caches)
        self.num_blocks = num_blocks
        c = self.config
        block_bytes = kv_offload.bytes_per_block(self.hf_config, self.block_size, self.kv_dtype.itemsize)
        slots = kv_offload.num_slots(c.kv_offloading_size, block_bytes)
        if slots:
            self.host_store = HostKVStore(self.kv_caches, slots, c.kv_offloading_backend, c.kv_offloading_path)
        if self.use_cuda_graphs:
            self.capture_cudagraphs()

    def read_kv_blocks(self, block_ids: list[int]):
        """This rank's K and V of pool blocks ``block_ids`` as bytes (:func:`kvserve.engine.kv_offload.read_blocks`:
        ``uint8 [len(block_ids), block bytes]``), for a tier outside the engine."""
        return kv_offload.read_blocks(self.kv_caches, block_ids)

    def write_kv_slots(self, slots: list[int], rows) -> None:
        """Write blocks from outside the engine into host-tier ``slots``
        (:meth:`kvserve.engine.kv_offload.HostKVStore.write_slots`).

        Raises:
            ValueError: no host tier here, or rows of another layout.
        """
        if self.host_store is None:
            raise ValueError("blocks from outside the engine go to the host tier: set kv_offloading_size")
        self.host_store.write_slots(slots, rows)

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs: ``config.cuda_graphs``, with an attention
        backend whose kernels can be captured (``supports_cuda_graphs``)."""
        return self.config.cuda_graphs and self.backend.supports_cuda_graphs

    # ---- CUDA graphs for decode -----------------------------------------------
    def graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes that get a graph (:func:`kvserve.engine.cuda_graphs.graph_batch_sizes`)."""
        return graph_batch_sizes(self.config.max_num_seqs)

    def capture_cudagraphs(self) -> None:
        """Capture the decode forward's CUDA graphs (:class:`kvserve.engine.cuda_graphs.DecodeCudaGraphs`)
        for contexts up to the model's ``max_position_embeddings`` or the KV pool's tokens."""
        max_len = min(self.hf_config.max_position_embeddings, self.num_blocks * self.block_size)
        self.graphs = DecodeCudaGraphs(self.model, self.graph_batch_sizes(), max_len, self.block_size, self.device)

    def _attach(self, caches) -> None:
        for layer, kv in zip(self.model.layers, caches or [(torch.empty(0), torch.empty(0))] * len(self.model.layers)):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv

    # ---- one step -----------------------------------------------------------
    def _prepare(self, requests: list) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The flat batch of ``requests`` (:func:`kvserve.engine.input_batch.build_batch`)."""
        return build_batch(requests, self.block_size, self.device)

    def _update_states(self, sched: SchedulerOutput) -> list[SamplingRow]:
        """:attr:`states` brought up to date with ``sched``; the step's sampling rows
        (:func:`kvserve.engine.input_batch.update_states`)."""
        return update_states(self.states, self.pooling, sched, self.device, self.eos_token_ids)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled token of every request whose slice ends at its
        last known token (``sample``), and the prompt logprobs of the slices that ask for them;
        None on a pipeline stage other than the last (every stage runs every step)."""
        load_s = 0.0
        if sched.kv_transfer:  # before the forward: saves read blocks it may overwrite, loads fill blocks it reads
            t0 = self.host_store.load_seconds
            self.host_store.apply(sched.kv_transfer)
            load_s = self.host_store.load_seconds - t0
        rows = self._update_states(sched)
        if sched.is_empty or not sched.requests:
            return ModelRunnerOutput({}, kv_load_seconds=load_s)
        if self.config.pipeline_parallel_size > 1:  # this stage's layers, micro-batch by micro-batch
            hidden, sample_idx = pipeline_forward(self, sched.requests)
            if hidden is None:  # not the last stage: its activations went on to the next one
                return None
        else:
            input_ids, positions, meta, sample_idx = self._prepare(sched.requests)
            if self.lora is not None:  # each row's adapter (LoRA steps never replay graphs: cuda_graphs is off)
                self.lora.prepare(
                    [(self.states[sr.request_id].lora, len(sr.token_ids)) for sr in sched.requests], self.device
                )
            try:
                if self.graphs is not None and self.graphs.can_replay(meta):
                    hidden = self.graphs.replay(input_ids, positions, meta)
                else:
                    hidden = self.model(input_ids, positions, meta)
            finally:
                if self.lora is not None:
                    self.lora.clear()
        prompt_lp = prompt_logprobs(self.model, hidden, sched, self.states)
        pooled = self._pool(hidden, sched)
        if not rows:
            return ModelRunnerOutput({}, None, prompt_lp, pooled, load_s)
        logits = self.model.compute_logits(hidden[sample_idx])
        ids = [sr.request_id for sr in sched.requests if sr.sample for _ in range(len(sr.spec_token_ids) + 1)]
        grammar = (
            None
            if sched.grammar_bitmask is None  # structured outputs: the engine's bitmask
            else bitmask_rows(sched.grammar_bitmask, sched.grammar_req_ids, ids)
        )
        tokens, logprobs, accepted = self.sampler(logits, rows, grammar)
        sampled, lp, i = {}, {}, 0
        for sr in sched.requests:
            if not sr.sample:
                continue
            rid = sr.request_id
            if not sr.spec_token_ids:
                sampled[rid] = tokens[i]
                if logprobs[i] is not None:
                    lp[rid] = logprobs[i]
                i += 1
                continue
            # verified drafts: keep accepted ones, then the first rejection's (or the bonus) token
            j, k = i, len(sr.spec_token_ids)
            while j < i + k and accepted[j]:
                j += 1
            sampled[rid] = tokens[i : j + 1]
            if logprobs[i] is not None:
                lp[rid] = logprobs[i : j + 1]
            i += k + 1
        return ModelRunnerOutput(sampled, lp or None, prompt_lp, pooled, load_s)

    def _pool(self, hidden: torch.Tensor, sched: SchedulerOutput) -> dict[str, list[float]] | None:
        """The embeddings of the step's pooling requests whose prompt ends in it (rows of
        ``hidden`` ``[num_tokens, hidden_size]`` fed to each one's
        :class:`~kvserve.engine.pooling.PoolingState`); None when the step has none (no loop over the
        batch then: the step loop of generation pays nothing for embeddings)."""
        if not self.pooling:
            return None
        out, offset = {}, 0
        for sr in sched.requests:
            row0, offset = offset, offset + len(sr.token_ids)
            pool = self.states[sr.request_id].pooling
            if pool is not None and (vec := pool.add(hidden[row0:offset], sr.start)) is not None:
                out[sr.request_id] = vec
        return out or None


__all__ = ["PROMPT_LOGPROBS_SLICE", "ModelRunner", "ModelRunnerOutput", "load_eos_token_ids"]
