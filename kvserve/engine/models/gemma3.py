"""Gemma 3 text decoder (Gemma Team, "Gemma 3 Technical Report", 2025), e.g. Gemma 3 270M.

Differences from the Llama family (:mod:`kvserve.engine.models.llama`), all following Hugging Face's
``Gemma3ForCausalLM`` (transformers 5):

* RMSNorm scales by ``1 + weight`` in float32 (:class:`kvserve.engine.layers.layernorm.GemmaRMSNorm`),
  and every layer has four of them: before and after attention, before and after the MLP
  (the residual is added after the post-norms).
* Token embeddings are multiplied by ``sqrt(hidden_size)``, that factor rounded to the
  embedding dtype first (as HF's ``Gemma3TextScaledWordEmbedding``). The LM head is tied
  (``tie_word_embeddings``, true in every released Gemma 3).
* q and k get their own RMSNorm over ``head_dim`` before RoPE; scores are scaled by
  ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``).
* Interleaved local and global layers (``config.layer_types``, 5 local : 1 global in Gemma 3):
  local (``sliding_attention``) layers attend to the last ``sliding_window`` tokens only and use
  RoPE base ``rope_parameters["sliding_attention"]["rope_theta"]`` (the older
  ``rope_local_base_freq``, 10k); global layers see the whole context with their own base
  (1M) and optional scaling (linear in the larger Gemma 3 models).
* GeLU (tanh approximation) gated MLP; final-logit soft-capping ``c * tanh(x / c)`` when
  ``final_logit_softcapping`` is set (None in the released Gemma 3 models).
* ``attn_logit_softcapping`` is read but, as in HF's ``Gemma3Attention`` (transformers 5.23,
  which never passes it to the attention function), not applied: Gemma 3 replaced Gemma 2's
  attention soft-capping by the q/k norms (Gemma 3 report, sec. 2, "Model Architecture"). The attention backends
  can cap (``softcap=``, for Gemma 2); a Gemma 3 config that sets it runs exactly as HF runs
  it, which ``tests/engine/test_gemma3.py`` checks.

The sliding window is applied by the attention backend per layer (``window=``, see
:mod:`kvserve.kernels.backend`). The paged KV cache keeps every block of a request for all layers,
also those that have slid out of the local layers' window (they are not freed early), so a
local layer's memory is that of a global one; in exchange prefix caching and preemption work
unchanged (a cached block is valid for every layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.distributed import pp_size, split_range, tp_rank, tp_size
from kvserve.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from kvserve.engine.layers.layernorm import GemmaRMSNorm
from kvserve.engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from kvserve.engine.layers.rotary import RotaryEmbedding
from kvserve.engine.models.weights import load_hf_weights
from kvserve.kernels.backend import AttentionBackend, AttentionMetadata

SUPPORTED_ARCHITECTURES = ("Gemma3ForCausalLM",)
_LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(cfg) -> list[str]:
    """``sliding_attention`` / ``full_attention`` per layer: ``cfg.layer_types``, else every
    ``sliding_window_pattern``-th layer global (default 6, Gemma 3's 5:1)."""
    types = getattr(cfg, "layer_types", None)
    if types is None:
        pattern = getattr(cfg, "sliding_window_pattern", None) or getattr(cfg, "_sliding_window_pattern", 6)
        types = [
            "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(cfg.num_hidden_layers)
        ]
    if len(types) != cfg.num_hidden_layers or set(types) - set(_LAYER_TYPES):
        raise ValueError(f"layer_types must list {_LAYER_TYPES} once per layer, got {types!r}")
    return list(types)


def _rotary(cfg, layer_type: str, head_dim: int) -> RotaryEmbedding:
    """RoPE of one layer type from ``cfg.rope_parameters[layer_type]`` (transformers 5 layout)."""
    params = (getattr(cfg, "rope_parameters", None) or {}).get(layer_type)
    if params is None:  # a config object from before rope_parameters
        local = layer_type == "sliding_attention"
        params = (
            {"rope_theta": getattr(cfg, "rope_local_base_freq", 10000.0)}
            if local
            else {"rope_theta": getattr(cfg, "rope_theta", 1e6), **(getattr(cfg, "rope_scaling", None) or {})}
        )
    scaling = params if params.get("rope_type", "default") != "default" else None
    return RotaryEmbedding(head_dim, cfg.max_position_embeddings, params["rope_theta"], scaling)


class Gemma3Attention(nn.Module):
    """Self-attention of one layer (local or global); ``k_cache``/``v_cache`` ``[num_blocks,
    block_size, kv_heads_on_this_rank, head_dim]`` are attached by the model runner.

    ``window``: ``cfg.sliding_window`` for local layers, None for global ones."""

    def __init__(self, cfg, layer_type: str, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        total_heads, total_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if total_kv < tp_size():
            raise ValueError(f"tensor_parallel_size {tp_size()} exceeds num_key_value_heads {total_kv}")
        self.head_dim = hd = cfg.head_dim
        group = total_heads // total_kv
        kv0, kv1 = split_range(total_kv, tp_size(), tp_rank())
        self.num_kv_heads = kv1 - kv0
        self.num_heads = self.num_kv_heads * group
        q_range = (kv0 * group * hd, kv1 * group * hd)
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [q_range, (kv0 * hd, kv1 * hd), (kv0 * hd, kv1 * hd)])
        self.o_proj = RowParallelLinear(q_range, cfg.hidden_size)
        self.q_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(hd, cfg.rms_norm_eps)
        self.rotary = rotary
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.window = cfg.sliding_window if layer_type == "sliding_attention" else None
        self.softcap = None  # attn_logit_softcapping: ignored, as HF's Gemma 3 (module docstring)
        self.backend = backend
        self.k_cache = self.v_cache = torch.empty(0)
        self.k_scale = self.v_scale = 1.0  # float8 KV cache scales (set by the model runner)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``positions`` int64 ``[n]``, ``h`` ``[n, hidden]`` -> ``[n, hidden]``."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(h).split([q_size, kv_size, kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(-1, self.num_kv_heads, self.head_dim))
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        self.backend.store_kv(k, v, self.k_cache, self.v_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        o = self.backend.forward(
            q,
            self.k_cache,
            self.v_cache,
            meta,
            self.scale,
            window=self.window,
            softcap=self.softcap,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
            key=k,
            value=v,
        )
        return self.o_proj(o.reshape(-1, q_size))


class Gemma3MLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))``, gate and up fused into one matmul."""

    def __init__(self, cfg):
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation {act!r} is not supported (gelu_pytorch_tanh)")
        r = split_range(cfg.intermediate_size, tp_size(), tp_rank())
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, [r, r])
        self.down_proj = RowParallelLinear(r, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Attention and MLP, each between a pre- and a post-norm; the residual stream is carried
    un-normed between layers and added by the next norm (fused add, as in Llama's layers)."""

    def __init__(self, cfg, layer_type: str, rotary: RotaryEmbedding, backend: AttentionBackend):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = Gemma3Attention(cfg, layer_type, rotary, backend)
        self.mlp = Gemma3MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, positions, h, residual, meta):
        """Returns ``(mlp_out, residual)``: the layer's output is their sum."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(positions, h, meta))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h)), residual


class Gemma3ForCausalLM(nn.Module):
    """The whole Gemma 3 text decoder plus the tied LM head.

    Args:
        cfg: a Hugging Face ``Gemma3TextConfig`` (``architectures == ["Gemma3ForCausalLM"]``).
        backend: attention backend shared by all layers (each passes its own window).

    Raises:
        ValueError: another architecture, bidirectional attention (Gemma embedding models),
            attention biases, an unsupported activation or RoPE scaling, or more
            tensor-parallel ranks than KV heads, or pipeline parallelism.
    """

    def __init__(self, cfg, backend: AttentionBackend):
        super().__init__()
        arch = (getattr(cfg, "architectures", None) or ["Gemma3ForCausalLM"])[0]
        if pp_size() > 1:
            raise ValueError(
                "pipeline_parallel_size > 1 runs Llama-family models; Gemma 3 runs with tensor parallelism only"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"architecture {arch!r} is not supported by the Gemma 3 model "
                f"(text-only {SUPPORTED_ARCHITECTURES}; a multimodal "
                "Gemma3ForConditionalGeneration checkpoint is not)"
            )
        if getattr(cfg, "use_bidirectional_attention", False):
            raise ValueError(
                "use_bidirectional_attention (Gemma embedding models) is not supported: kvserve generates causally"
            )
        if getattr(cfg, "attention_bias", False):
            raise ValueError("attention_bias is not supported for Gemma 3")
        self.cfg = cfg
        self.final_softcap = getattr(cfg, "final_logit_softcapping", None)
        types = layer_types(cfg)
        rotary = {t: _rotary(cfg, t, cfg.head_dim) for t in sorted(set(types))}  # shared per type
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, t, rotary[t], backend) for t in types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size)
        self.tied = getattr(cfg, "tie_word_embeddings", True)
        if self.tied:  # every released Gemma 3
            self.lm_head.weight = self.embed_tokens.weight
        # sqrt(hidden_size) rounded to the embedding dtype first, as HF's scaled embedding
        self.embed_scale = float(torch.tensor(cfg.hidden_size**0.5, dtype=self.embed_tokens.weight.dtype))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``/``positions`` int64 ``[num_tokens]`` -> hidden ``[num_tokens, hidden]``."""
        h = self.embed_tokens(input_ids) * self.embed_scale
        residual = None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        h, _ = self.norm(h, residual)
        return h

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits ``[n, vocab_size]`` for the ``n`` positions that sample (soft-capped
        when ``final_logit_softcapping`` is set)."""
        logits = self.lm_head(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def load_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs in Hugging Face naming, each cut to this rank's shard
        (with tied embeddings a stored ``lm_head.weight`` is ignored: the head is the embedding).

        Raises:
            ValueError: a tensor name the model does not know, or weights left unloaded.
        """
        load_hf_weights(self, weights, tied=self.tied)
