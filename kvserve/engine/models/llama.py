"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm).

Pre-norm transformer (Touvron et al. 2023) with grouped-query attention (Ainslie et al.
2023), SwiGLU MLP (Shazeer 2020) and RoPE. Tokens of all requests in a step are flattened
into one ``[num_tokens, hidden]`` batch; attention reads and writes the paged KV cache
through ``kvserve.kernels.backend``. Tensor parallelism splits attention by KV-head groups (as
evenly as possible, so e.g. 3 KV heads over 2 ranks is 2 + 1) and the MLP by columns. Pipeline
parallelism gives each stage a consecutive run of layers: the first embeds the tokens, the last
owns the final norm and the LM head, and the ones between pass ``(hidden, residual)`` on. On CPU a
decode step of up to 8 requests runs all of this stage's layers in one C++ call
(``kvserve.kernels.cpu_backend.decode_layers``: the same kernels in the same order, so the same bits) where
the layers' weights and caches allow (:meth:`LlamaForCausalLM._decode_layer_weights`).
"""

from __future__ import annotations

import torch
from torch import nn

from kvserve.engine.distributed import pp_rank, pp_size, split_range, tp_rank, tp_size
from kvserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.engine.layers.layernorm import RMSNorm
from kvserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear, decode_gemv_weight
from kvserve.engine.layers.rotary import RotaryEmbedding
from kvserve.engine.models.weights import load_hf_weights, stage_weights
from kvserve.kernels import cpu_backend, gpu_ops
from kvserve.kernels.backend import AttentionBackend, AttentionMetadata

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class Attention(nn.Module):
    """Self-attention of one layer; ``k_cache``/``v_cache`` ``[num_blocks, block_size,
    kv_heads_on_this_rank, head_dim]`` are attached by the model runner."""

    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if total_kv < tp_size():
            raise ValueError(f"tensor_parallel_size {tp_size()} exceeds num_key_value_heads {total_kv}")
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // total_heads
        group = total_heads // total_kv
        kv0, kv1 = split_range(total_kv, tp_size(), tp_rank())
        self.num_kv_heads = kv1 - kv0
        self.num_heads = self.num_kv_heads * group
        hd = self.head_dim
        q_range = (kv0 * group * hd, kv1 * group * hd)
        self.qkv_proj = ColumnParallelLinear(
            cfg.hidden_size,
            [q_range, (kv0 * hd, kv1 * hd), (kv0 * hd, kv1 * hd)],
            bias=getattr(cfg, "attention_bias", False) or cfg.model_type == "qwen2",
        )
        self.o_proj = RowParallelLinear(q_range, cfg.hidden_size)
        self.qk_norm = cfg.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps)
        rope_scaling = getattr(cfg, "rope_scaling", None)
        rope_theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get(
            "rope_theta", 10000.0
        )
        if rope_scaling is None and isinstance(getattr(cfg, "rope_parameters", None), dict):
            rp = cfg.rope_parameters
            rope_scaling = rp if rp.get("rope_type", "default") != "default" else None
        self.rotary = RotaryEmbedding(hd, cfg.max_position_embeddings, rope_theta, rope_scaling)
        self.scale = hd**-0.5
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0  # float8 KV cache scales (set by the model runner)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(-1, self.num_heads, self.head_dim)
        k = k.reshape(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self._norm_heads(self.q_norm, q), self._norm_heads(self.k_norm, k)
        q, k = self.rotary(positions, q, k)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        o = self.backend.forward(
            q, self.k_cache, self.v_cache, meta, self.scale, k_scale=self.k_scale, v_scale=self.v_scale, key=k, value=v
        )
        return self.o_proj(o.reshape(-1, q_size))

    @staticmethod
    def _norm_heads(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm of each head of ``x`` ``[N, heads, head_dim]``; on CPU the fused
        kernel over a ``[N * heads, head_dim]`` copy (as ``kvserve.kernels.cpu_backend.decode_layers``
        runs it), else the norm's own dispatch (on CUDA the Triton kernel reads the strided heads
        in place)."""
        if cpu_backend.use_fused_ops(x):
            return norm(x.reshape(-1, x.shape[-1])).view(x.shape)
        return norm(x)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))``, gate and up fused into one matmul."""

    def __init__(self, cfg):
        super().__init__()
        r = split_range(cfg.intermediate_size, tp_size(), tp_rank())
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [r, r])
        self.down_proj = RowParallelLinear(r, cfg.hidden_size)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (silu)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        if h.dim() == 2 and cpu_backend.use_fused_ops(h):
            return self.down_proj(cpu_backend.silu_and_mul(h))
        if h.dim() == 2 and gpu_ops.use_fused_ops(h):
            return self.down_proj(gpu_ops.ops().silu_and_mul(h))
        gate, up = h.chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        self.self_attn = Attention(cfg, backend)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, positions, h, residual, meta):
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """The decoder plus LM head, or this pipeline stage's part of it.

    Args:
        cfg: a Hugging Face config of one of ``SUPPORTED_ARCHITECTURES``.
        backend: attention backend shared by all layers.

    Attributes:
        start_layer, end_layer: the layers ``[start, end)`` of the checkpoint this stage holds
            (``layers[i]`` is checkpoint layer ``start_layer + i``); all of them without a pipeline.
        first_stage, last_stage: whether it embeds tokens / owns the norm and LM head
            (``embed_tokens`` or ``norm`` and ``lm_head`` are None on the other stages).

    Raises:
        ValueError: unsupported architecture or activation.
    """

    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        arch = (getattr(cfg, "architectures", None) or ["LlamaForCausalLM"])[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"architecture {arch!r} is not supported; kvserve runs {SUPPORTED_ARCHITECTURES}")
        self.cfg = cfg
        self.start_layer, self.end_layer = split_range(cfg.num_hidden_layers, pp_size(), pp_rank())
        self.first_stage, self.last_stage = pp_rank() == 0, pp_rank() == pp_size() - 1
        self.tied = bool(getattr(cfg, "tie_word_embeddings", False))
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size) if self.first_stage else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend) for _ in range(self.end_layer - self.start_layer))
        self.norm = self.lm_head = None
        if self.last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
            if self.tied and self.first_stage:
                self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        """``input_ids``/``positions`` int64 ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``
        after the final norm (the last stage), else this stage's ``(hidden, residual)`` for the
        next one. A later stage starts from ``intermediate``, the previous stage's pair (zeros
        when None: a profiling pass)."""
        if self.first_stage:
            h, residual = self.embed_tokens(input_ids), None
        elif intermediate is not None:
            h, residual = intermediate
        else:
            h = torch.zeros(
                input_ids.shape[0],
                self.cfg.hidden_size,
                device=input_ids.device,
                dtype=self.layers[0].input_layernorm.weight.dtype,
            )
            residual = torch.zeros_like(h)
        plan = self._decode_plan(h) if meta.decode_only else None
        if plan is not None:  # one C++ call for all layers, the same kernels and bits
            a = self.layers[0].self_attn
            h, residual = cpu_backend.decode_layers(
                h,
                residual,
                positions,
                plan[0],
                plan[1],
                plan[2],
                meta,
                a.rotary.cos,
                a.rotary.sin,
                a.num_heads,
                a.num_kv_heads,
                a.head_dim,
                self.layers[0].input_layernorm.eps,
                a.scale,
            )
        else:
            for layer in self.layers:
                h, residual = layer(positions, h, residual, meta)
        if not self.last_stage:
            return h, residual
        h, _ = self.norm(h, residual)
        return h

    def _decode_plan(self, h: torch.Tensor) -> tuple[list, list, list] | None:
        """``(weights, k_caches, v_caches)`` for :func:`kvserve.kernels.cpu_backend.decode_layers` when
        this decode step can run there (:meth:`_decode_layer_weights`), else None. Built once and
        reused while the first and last layers' weights and caches are the same tensors (a reload,
        a quantization or new caches build it again): walking 30 layers' modules per step cost
        ~1.8 ms, as much as the LM head's tenth of the weights."""
        if not self.layers or not cpu_backend.use_decode_layers(h):
            return None
        first, last = self.layers[0], self.layers[-1]
        key = (
            h.dtype,
            id(first.self_attn.qkv_proj.weight),
            id(last.mlp.down_proj.weight),
            id(first.self_attn.k_cache),
            id(last.self_attn.v_cache),
            first.self_attn.qkv_proj.lora is None,
        )
        cached = getattr(self, "_decode_plan_cache", None)
        if cached is None or cached[0] != key:
            weights = self._decode_layer_weights(h)
            plan = (
                None
                if weights is None
                else (
                    weights,
                    [lay.self_attn.k_cache for lay in self.layers],
                    [lay.self_attn.v_cache for lay in self.layers],
                )
            )
            cached = self._decode_plan_cache = (key, plan)
        return cached[1]

    def _decode_layer_weights(self, h: torch.Tensor) -> list[torch.Tensor] | None:
        """The layers' tensors in :func:`kvserve.kernels.cpu_backend.decode_layers`' order when this decode
        step can run there: CPU float32 (or bfloat16 where its matmuls take the bf16 GEMV), one
        rank, plain weights every matmul of which :func:`kvserve.engine.layers.linear.linear` would run in
        the C++ GEMV, no LoRA, the C++ attention kernel, a cache of ``h``'s dtype; else None (the
        layers then run op by op; called by :meth:`_decode_plan`, which checked ``self.layers``)."""
        if tp_size() != 1:
            return None
        a0 = self.layers[0].self_attn
        if a0.backend.name != "cpu" or not getattr(a0.backend, "kernel", False):
            return None
        no_bias = torch.empty(0, dtype=h.dtype)
        out = []
        for layer in self.layers:
            a, mlp = layer.self_attn, layer.mlp
            if a.k_cache.dtype != h.dtype or a.v_cache.dtype != h.dtype:
                return None
            ws = [decode_gemv_weight(m, h.dtype) for m in (a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj)]
            norms = (
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                *((a.q_norm.weight, a.k_norm.weight) if a.qk_norm else ()),
            )
            if any(w is None for w in ws) or any(n.dtype != h.dtype for n in norms):
                return None
            bias = a.qkv_proj.bias
            if bias is not None and (bias.dtype != h.dtype or not bias.is_contiguous()):
                return None
            out += [
                norms[0],
                ws[0],
                no_bias if bias is None else bias,
                ws[1],
                norms[1],
                ws[2],
                ws[3],
                *(norms[2:] if a.qk_norm else (no_bias, no_bias)),
            ]
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, vocab_size]`` for the ``n`` positions that sample (last stage)."""
        return self.lm_head(hidden)

    def load_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs in Hugging Face naming, each cut to this rank's shard
        (:func:`kvserve.engine.models.weights.load_hf_weights`), keeping this stage's layers only.

        Raises:
            ValueError: a tensor name the model does not know, or weights left unloaded.
        """
        weights = stage_weights(weights, self.start_layer, self.end_layer, self.first_stage, self.last_stage, self.tied)
        load_hf_weights(self, weights, self.tied and self.first_stage and self.last_stage)
