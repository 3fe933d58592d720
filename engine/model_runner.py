"""Runs the model for one scheduler step: builds the flat batch, owns the KV cache tensors,
samples. One instance per tensor-parallel rank."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.kv_calibration import calibrate_kv_scales
from engine.layers.quantization import quantize_model
from engine.layers.sampler import Sampler, SamplingRow
from engine.model_loader import iter_safetensors, load_config
from engine.models.registry import model_class
from engine.pipeline import pipeline_forward
from engine.pooling import PoolingState
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.structured_output import bitmask_rows
from kernels.backend import AttentionMetadata
from kernels.selector import select_attention_backend

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
    #: embeddings of the pooling requests whose prompt this step finished (engine.pooling)
    pooled: dict[str, list[float]] | None = None


#: Prompt positions whose logits are computed at once for prompt_logprobs (rows x vocab fp32).
PROMPT_LOGPROBS_SLICE = 256


class _RequestState:
    __slots__ = ("prompt_len", "token_ids", "params", "generator", "prompt_token_ids", "lora", "pooling")

    def __init__(self, prompt_len: int, params: SamplingParams, generator: torch.Generator | None):
        self.prompt_len, self.params, self.generator = prompt_len, params, generator
        self.token_ids: list[int] = []
        self.prompt_token_ids: list[int] = []  # kept only with params.prompt_logprobs
        self.lora = None  # the request's engine.lora.LoRARequest
        self.pooling = None  # an embedding request's engine.pooling.PoolingState


class ModelRunner:
    """Loads the model (this rank's shard) and executes :class:`SchedulerOutput` batches.

    Args:
        config: engine configuration.
        model_path: local Hugging Face folder (see ``engine.model_loader.resolve_model``).

    Raises:
        ValueError: unsupported architecture, missing or unexpected weights, a quantization
            (``engine.layers.quantization.check_quantization``) or float8 KV cache this device
            or attention backend cannot run.
    """

    def __init__(self, config: EngineConfig, model_path: str | Path):
        self.config = config
        self.device = config.torch_device
        if config.dtype == "auto":
            self.dtype, why = config.auto_dtype()
            logger.info("dtype auto -> %s", why)
        else:
            self.dtype = config.torch_dtype
        self.hf_config = load_config(model_path)
        self.block_size = config.block_size
        head_dim = getattr(self.hf_config, "head_dim", None) or \
            self.hf_config.hidden_size // self.hf_config.num_attention_heads
        self.backend = select_attention_backend(self.device, self.dtype, self.block_size, head_dim,
                                                config.attention_backend)()
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        reason = config.kv_cache_dtype == "fp8" and self.backend.fp8_kv_unsupported_reason(self.device)
        if reason:
            raise ValueError(f"kv_cache_dtype='fp8' is not supported here: {reason} "
                             f"(float8 caches run on the torch, cpu and triton backends)")
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = model_class(self.hf_config)(self.hf_config, self.backend)
        finally:
            torch.set_default_dtype(default_dtype)
        self.model.load_weights(iter_safetensors(model_path))
        self.model.eval()
        if config.quantization is not None:
            quantize_model(self.model, config.quantization, self.device, self.dtype)
        if self.device.type == "cpu":
            self._prepack_linears()
        if config.kv_cache_dtype == "fp8":
            calibrate_kv_scales(model_path, self.model.layers, self.device, self._prefill_alone)
        self.eos_token_ids = load_eos_token_ids(model_path, self.hf_config)
        #: LoRA adapters' slots in the linear layers (engine.lora.LoRASlots), None without enable_lora
        self.lora = None
        if config.enable_lora:
            from engine.lora_slots import LoRASlots
            self.lora = LoRASlots(self.model, self.hf_config, config.max_loras, config.max_lora_rank,
                                  config.max_cpu_loras)
        self.sampler = Sampler()
        self.states: dict[str, _RequestState] = {}
        self.pooling: set[str] = set()  # running embedding requests (engine.pooling): most steps have none
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0

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
                "gpu_memory_utilization, free the GPU, or set kv_cache_memory_bytes")
        return int(budget // self.bytes_per_block)

    @torch.inference_mode()
    def _profile_run(self) -> None:
        n = self.config.max_num_batched_tokens
        h, _ = self._prefill_alone(torch.zeros(n, dtype=torch.long, device=self.device))
        if getattr(self.model, "last_stage", True):
            self.model.compute_logits(h[-min(n, self.config.max_num_seqs):])

    @torch.inference_mode()
    def _prefill_alone(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """One request of prompt ``ids`` (int64 ``[n]``) through the model in one chunk, with
        temporary K/V caches in the model dtype (never the engine's pool). Returns the hidden
        states ``[n, hidden]`` and the caches (K, V per layer; the first ``n`` slots hold them)."""
        n, dev = ids.numel(), self.device
        nblocks = -(-n // self.block_size)
        attn = self.model.layers[0].self_attn
        shape = (nblocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        caches = [(torch.zeros(shape, dtype=self.dtype, device=dev), torch.zeros(shape, dtype=self.dtype, device=dev))
                  for _ in self.model.layers]
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nblocks, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(n, dtype=torch.long, device=dev),
            query_lens_cpu=[n], seq_lens_cpu=[n], max_seqlen_q=n, max_seqlen_k=n)
        self._attach(caches)
        try:
            h = self.model(ids, torch.arange(n, device=dev) % self.hf_config.max_position_embeddings, meta)
        finally:
            self._attach([])
        return h, caches

    def _prepack_linears(self) -> None:
        """CPU: every linear layer and the LM head keep a oneDNN-layout copy of their weight for
        the matmuls (``engine.layers.linear.prepack_weight``; quantized layers keep theirs)."""
        from engine.layers.embedding import ParallelLMHead
        from engine.layers.linear import ColumnParallelLinear, RowParallelLinear

        for m in self.model.modules():
            if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ParallelLMHead)):
                m.prepack()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``[num_blocks, block_size, kv_heads, head_dim]`` K and V per layer.

        The memory is not cleared (on CPU, zeroing gigabytes costs seconds of page faults):
        attention backends never let a slot past a request's ``seq_len`` affect the output."""
        attn = self.model.layers[0].self_attn
        shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
        self.kv_caches = [(torch.empty(shape, dtype=self.kv_dtype, device=self.device),
                           torch.empty(shape, dtype=self.kv_dtype, device=self.device)) for _ in self.model.layers]
        self._attach(self.kv_caches)
        self.num_blocks = num_blocks
        if self.use_cuda_graphs:
            self.capture_cudagraphs()

    @property
    def use_cuda_graphs(self) -> bool:
        """Whether decode steps replay CUDA graphs: ``config.cuda_graphs``, with an attention
        backend whose kernels can be captured (``supports_cuda_graphs``)."""
        return self.config.cuda_graphs and self.backend.supports_cuda_graphs

    # ---- CUDA graphs for decode -----------------------------------------------
    def graph_batch_sizes(self) -> list[int]:
        """Decode batch sizes that get a graph: 1, 2, 4, 8, then steps of 8 up to max_num_seqs."""
        top = min(self.config.max_num_seqs, 512)
        return sorted({b for b in [1, 2, 4, 8, *range(16, top + 1, 8)] if b <= top} | {top})

    @torch.inference_mode()
    def capture_cudagraphs(self) -> None:
        """Capture one CUDA graph of the model's decode forward per batch size (largest first,
        sharing one memory pool). Inputs live in static buffers; padded rows have slot -1 (the
        store skips them) and seq_len 0 (attention writes zeros), so they touch no cache state.
        The split-K count is fixed at capture for ``max_model_len``-long contexts; the kernels
        derive each request's split bounds from its ``seq_len`` at replay time."""
        sizes = self.graph_batch_sizes()
        top, dev = sizes[-1], self.device
        max_len = min(self.hf_config.max_position_embeddings, self.num_blocks * self.block_size)
        width = -(-max_len // self.block_size)
        self.g_input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.g_positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.g_slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.g_seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.g_block_tables = torch.zeros(top, width, dtype=torch.int32, device=dev)
        self.g_cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for b in reversed(sizes):
            meta = AttentionMetadata(
                cu_seqlens_q=self.g_cu[:b + 1], seq_lens=self.g_seq_lens[:b], block_tables=self.g_block_tables[:b],
                slot_mapping=self.g_slots[:b], query_lens_cpu=[1] * b, seq_lens_cpu=[max_len] * b,
                max_seqlen_q=1, max_seqlen_k=max_len)
            self.model(self.g_input_ids[:b], self.g_positions[:b], meta)  # warm-up: JIT, allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(self.g_input_ids[:b], self.g_positions[:b], meta)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def _replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        b = input_ids.shape[0]
        gb = next(s for s in sorted(self.graphs) if s >= b)
        graph, out = self.graphs[gb]
        self.g_input_ids[:b].copy_(input_ids)
        self.g_positions[:b].copy_(positions)
        self.g_slots[:b].copy_(meta.slot_mapping)
        self.g_slots[b:gb].fill_(-1)
        self.g_seq_lens[:b].copy_(meta.seq_lens)
        self.g_seq_lens[b:gb].zero_()
        self.g_block_tables[:b, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        graph.replay()
        return out[:b]

    def _use_graph(self, meta: AttentionMetadata) -> bool:
        graphs = getattr(self, "graphs", None)
        return bool(graphs) and meta.decode_only and meta.num_reqs <= max(graphs)

    def _attach(self, caches) -> None:
        for layer, kv in zip(self.model.layers, caches or [(torch.empty(0), torch.empty(0))] * len(self.model.layers)):
            layer.self_attn.k_cache, layer.self_attn.v_cache = kv

    # ---- one step -----------------------------------------------------------
    def _prepare(self, requests: list):
        """The flat batch of ``requests`` (a step's ``ScheduledRequest`` list, or a micro-batch of
        it): input ids and positions (int64 ``[num_tokens]``), attention metadata, and the rows
        that sample (int64)."""
        bs = self.block_size
        input_ids, positions, slots, qlens, slens, sample_idx = [], [], [], [], [], []
        for sr in requests:
            n = len(sr.token_ids)
            input_ids.extend(sr.token_ids)
            pos = range(sr.start, sr.start + n)
            positions.extend(pos)
            bt = sr.block_table
            slots.extend(bt[p // bs] * bs + p % bs for p in pos)
            qlens.append(n)
            slens.append(sr.start + n)
            if sr.sample:  # the last row, or with drafts the last 1 + k rows (each verifies one)
                sample_idx.extend(range(len(input_ids) - 1 - len(sr.spec_token_ids), len(input_ids)))
        width = max(len(sr.block_table) for sr in requests)
        tables = [sr.block_table + [0] * (width - len(sr.block_table)) for sr in requests]
        cu = [0]
        for n in qlens:
            cu.append(cu[-1] + n)
        dev = self.device
        meta = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(slens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_lens_cpu=qlens, seq_lens_cpu=slens, max_seqlen_q=max(qlens), max_seqlen_k=max(slens))
        return (torch.tensor(input_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta,
                torch.tensor(sample_idx, dtype=torch.long, device=dev))

    def _update_states(self, sched: SchedulerOutput) -> list[SamplingRow]:
        for rid in sched.finished_req_ids:
            self.states.pop(rid, None)
            self.pooling.discard(rid)
        rows = []
        for sr in sched.requests:
            st = self.states.get(sr.request_id)
            if sr.new is not None:
                p = sr.new.params
                gen = st.generator if st is not None else None
                if gen is None and p.seed is not None:
                    gen = torch.Generator(device=self.device).manual_seed(p.seed)
                st = self.states[sr.request_id] = _RequestState(len(sr.new.prompt_token_ids), p, gen)
                st.token_ids = list(sr.new.computed_token_ids)  # history before a prefix-cache hit
                st.lora = sr.new.lora_request
                if sr.new.pooling is not None:
                    st.pooling = PoolingState(sr.new.pooling, len(sr.new.prompt_token_ids))
                    self.pooling.add(sr.request_id)
                if p.prompt_logprobs is not None:
                    st.prompt_token_ids = sr.new.prompt_token_ids
            del st.token_ids[sr.start:]
            st.token_ids.extend(sr.token_ids)
            if not sr.sample:
                continue
            k = len(sr.spec_token_ids)
            end = len(st.token_ids)
            p, need_hist = st.params, st.params.needs_penalties
            for j in range(k + 1):  # position end-1-k+j predicts the token after it
                n_out = end - k + j - st.prompt_len  # output tokens before this position
                masked = []
                if n_out < p.min_tokens:
                    masked = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))
                # the histories are copied only for penalties: a copy per row and step costs
                # O(length) of host time at every step of a long output
                rows.append(SamplingRow(p, st.generator,
                                        st.token_ids[:st.prompt_len] if need_hist else [],
                                        st.token_ids[st.prompt_len:st.prompt_len + n_out] if need_hist else [],
                                        masked, sr.spec_token_ids[j] if j < k else None))
        return rows

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run one step. Returns the sampled token of every request whose slice ends at its
        last known token (``sample``), and the prompt logprobs of the slices that ask for them;
        None on a pipeline stage other than the last (every stage runs every step)."""
        rows = self._update_states(sched)
        if sched.is_empty:
            return ModelRunnerOutput({})
        if self.config.pipeline_parallel_size > 1:  # this stage's layers, micro-batch by micro-batch
            hidden, sample_idx = pipeline_forward(self, sched.requests)
            if hidden is None:  # not the last stage: its activations went on to the next one
                return None
        else:
            input_ids, positions, meta, sample_idx = self._prepare(sched.requests)
            if self.lora is not None:  # each row's adapter (LoRA steps never replay graphs: cuda_graphs is off)
                self.lora.prepare([(self.states[sr.request_id].lora, len(sr.token_ids)) for sr in sched.requests],
                                  self.device)
            try:
                if self._use_graph(meta):
                    hidden = self._replay(input_ids, positions, meta)
                else:
                    hidden = self.model(input_ids, positions, meta)
            finally:
                if self.lora is not None:
                    self.lora.clear()
        prompt_lp = self._prompt_logprobs(hidden, sched)
        pooled = self._pool(hidden, sched)
        if not rows:
            return ModelRunnerOutput({}, None, prompt_lp, pooled)
        logits = self.model.compute_logits(hidden[sample_idx])
        ids = [sr.request_id for sr in sched.requests if sr.sample for _ in range(len(sr.spec_token_ids) + 1)]
        grammar = (None if sched.grammar_bitmask is None  # structured outputs: the engine's bitmask
                   else bitmask_rows(sched.grammar_bitmask, sched.grammar_req_ids, ids))
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
            sampled[rid] = tokens[i:j + 1]
            if logprobs[i] is not None:
                lp[rid] = logprobs[i:j + 1]
            i += k + 1
        return ModelRunnerOutput(sampled, lp or None, prompt_lp, pooled)

    def _pool(self, hidden: torch.Tensor, sched: SchedulerOutput) -> dict[str, list[float]] | None:
        """The embeddings of the step's pooling requests whose prompt ends in it (rows of
        ``hidden`` ``[num_tokens, hidden_size]`` fed to each one's
        :class:`~engine.pooling.PoolingState`); None when the step has none (no loop over the
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

    def _prompt_logprobs(self, hidden: torch.Tensor, sched: SchedulerOutput
                         ) -> dict[str, list[tuple[int, dict[int, float]]]] | None:
        """Prompt logprobs of the step's requests that ask for them (see
        :class:`ModelRunnerOutput`); None when none does (the common case costs one dict
        lookup per request).

        The hidden state at position ``p`` (a row of ``hidden`` ``[num_tokens, hidden_size]``)
        gives the logits of the prompt token at ``p + 1``, also when ``p + 1`` starts the next
        chunk of a chunked prefill (prompt tokens are known). Logits are computed
        :data:`PROMPT_LOGPROBS_SLICE` rows at a time (float32 ``[rows, vocab]``), and every
        tensor-parallel rank runs the same calls (the LM head all-gathers)."""
        out = {}
        offset = 0
        for sr in sched.requests:
            row0, offset = offset, offset + len(sr.token_ids)
            st = self.states[sr.request_id]
            k = st.params.prompt_logprobs
            end = min(sr.start + len(sr.token_ids), st.prompt_len - 1)  # last position + 1 that predicts a prompt token
            if k is None or end <= sr.start:
                continue
            prompt, entries = st.prompt_token_ids, []
            for a in range(sr.start, end, PROMPT_LOGPROBS_SLICE):
                b = min(a + PROMPT_LOGPROBS_SLICE, end)
                h = hidden[row0 + a - sr.start:row0 + b - sr.start]
                lp = self.model.compute_logits(h).float().log_softmax(dim=-1)
                targets = prompt[a + 1:b + 1]
                actual = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
                if k:
                    top_vals, top_ids = (t.tolist() for t in lp.topk(min(k, lp.shape[1]), dim=-1))
                for j, tok in enumerate(targets):
                    d = {tok: actual[j]}
                    if k:
                        d.update(zip(top_ids[j], top_vals[j]))
                    entries.append((a + 1 + j, d))
            out[sr.request_id] = entries
        return out or None
