"""Tiny random-weight model folders for tests (moved here from ``kvserve/engine/model_loader.py``:
only tests use them).

Import as ``from tiny_models import make_tiny_model`` (pytest puts ``tests/`` on
``sys.path`` for ``tests/conftest.py``).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from kvserve.engine.model_loader import resolve_model

# Tokenizer files copied from the default model into tiny test models.
_TOKENIZER_FILES = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
]


#: SmolLM2's attention layout at tiny size (``make_tiny_model`` overrides): 3 KV heads of 3
#: query heads each (9 heads of 16), which split unevenly over 2 tensor ranks (2 and 1).
SMOLLM2_HEADS = dict(hidden_size=144, num_attention_heads=9, num_key_value_heads=3, head_dim=16)


def make_tiny_model(
    path: str | os.PathLike,
    arch: str = "llama",
    seed: int = 0,
    **overrides,
) -> Path:
    """Build a tiny random-weight model folder for tests and save it as float32 safetensors.

    Default shape: hidden 64, 2 layers, 4 query heads and 2 KV heads (GQA, head_dim 16),
    intermediate 128, vocab 49152 (SmolLM2's, so its tokenizer fits),
    max_position_embeddings 2048, untied lm_head.  ``qwen3`` adds q/k RMSNorm, ``qwen2``
    adds q/k/v biases.  ``gemma3`` is a Gemma 3 text model (``Gemma3ForCausalLM``; lm_head
    untied like the others: a tied random tiny Gemma just repeats its input token, which
    would test little), local layers with ``sliding_window`` 16 and RoPE base 10k
    alternating with global layers (base 1M; ``sliding_window_pattern=2``: every 2nd global),
    ``query_pre_attn_scalar`` 32 (not head_dim, so the score scale is checked), and its
    RMSNorm offsets (0 at HF's init, which would hide a missing ``1 +``) drawn from N(0, 0.1).
    Weights use transformers' default init (normal, std ``initializer_range`` = 0.02) under
    ``torch.manual_seed(seed)``, so the same arguments give the same weights.  SmolLM2's
    tokenizer files (with its chat template) are copied from the default model folder, which
    is converted first if needed.

    Args:
        path: output folder (created; existing files are overwritten).
        arch: ``"llama"``, ``"qwen3"``, ``"qwen2"`` or ``"gemma3"``.
        seed: torch seed for the weights.
        **overrides: config fields, e.g. ``num_hidden_layers=4``,
            ``tie_word_embeddings=True``, or for llama
            ``rope_scaling={"rope_type": "llama3", "factor": 8.0, ...}``; for gemma3
            ``sliding_window``, ``layer_types``, ``attn_logit_softcapping``,
            ``final_logit_softcapping``.

    Returns:
        The folder path.

    Raises:
        ValueError: unknown ``arch``.
        ModelNotFoundError: the default model (tokenizer source) is unavailable.
    """
    from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    classes = {"llama": LlamaConfig, "qwen3": Qwen3Config, "qwen2": Qwen2Config, "gemma3": Gemma3TextConfig}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; expected one of {sorted(classes)}")
    fields = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=49152,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "qwen2":
        fields["use_sliding_window"] = False
    if arch == "qwen3":
        fields["use_sliding_window"] = False
        fields["attention_bias"] = False
    if arch == "gemma3":
        del fields["rope_theta"]
        fields.update(
            sliding_window=16,
            sliding_window_pattern=2,
            query_pre_attn_scalar=32,
            rms_norm_eps=1e-6,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        )
    fields.update(overrides)
    if "rope_scaling" in fields and fields["rope_scaling"] is not None:
        # transformers 5 folds rope_theta and rope scaling into rope_parameters.
        rope = dict(fields.pop("rope_scaling"))
        rope.setdefault("rope_theta", fields.pop("rope_theta"))
        fields["rope_parameters"] = rope
    config = classes[arch](**fields)

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    if arch == "gemma3":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("norm.weight"):
                    p.normal_(0.0, 0.1)
    model.save_pretrained(os.fspath(out), safe_serialization=True)
    del model

    src = resolve_model(None)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, out / name)
    return out


def run_async_engine(coro_fn, engine, timeout_s: float = 60.0):
    """Run ``coro_fn(AsyncLLMEngine(engine))`` in a fresh event loop (at most ``timeout_s``
    seconds), then shut the engine down; returns what ``coro_fn`` returns."""
    import asyncio

    from kvserve.engine.async_engine import AsyncLLMEngine

    async def main():
        eng = AsyncLLMEngine(engine)
        try:
            return await asyncio.wait_for(coro_fn(eng), timeout_s)
        finally:
            await eng.shutdown()

    return asyncio.run(main())
