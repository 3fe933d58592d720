"""The float8 (e4m3) KV cache through the engine: capacity, calibration, HF agreement, every
request's blocks returned. The kernels' float8 paths against the float64 reference are in
``test_kernels.py`` (``test_fp8_kv_cache``, ``test_fp8_store_rounds_to_e4m3``); SmolLM2 with it
in ``test_int8_weights.py::test_smollm2_quantized_answers_paris``."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.model_loader import load_tokenizer
from engine.model_runner import ModelRunner
from kernels.flash_attn_backend import FlashAttnBackend
from kernels.torch_backend import TorchBackend
from kernels.triton_backend import TritonBackend
from tiny_models import make_tiny_model


def fp8_round(x: torch.Tensor, scale: float) -> torch.Tensor:
    """What a float8 cache gives back for ``x``: e4m3 rounding of ``x / scale``, times ``scale``."""
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float().mul(scale).to(x.dtype)


def hf_greedy_fp8(path, ids, new_tokens, scales):
    """HF transformers (float32) with every layer's post-RoPE keys and values rounded as our float8
    cache stores them (``scales``: the engine's per-layer ``(k_scale, v_scale)``): the reference
    the float8 engine must equal."""
    import itertools

    from transformers.models.llama import modeling_llama
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for layer, (_, vs) in zip(model.model.layers, scales):
        layer.self_attn.v_proj.register_forward_hook(lambda m, i, o, vs=vs: fp8_round(o, vs))
    order = itertools.cycle(range(len(scales)))  # RoPE is applied layer by layer, in order
    rope = modeling_llama.apply_rotary_pos_emb

    def rope_then_round(q, k, *a, **kw):
        q, k = rope(q, k, *a, **kw)
        return q, fp8_round(k, scales[next(order)][0])

    out = []
    modeling_llama.apply_rotary_pos_emb = rope_then_round
    try:
        with torch.inference_mode():
            for x in ids:
                t = torch.tensor([x])
                y = model.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=new_tokens,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)
                out.append(y[0, len(x):].tolist())
    finally:
        modeling_llama.apply_rotary_pos_emb = rope
    return out


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_tiny_model_fp8_equals_hf_with_fp8_rounding(tmp_path, backend):
    """Greedy output equals HF float32 whose K/V are rounded as the float8 cache rounds them
    (same per-layer scales), also chunked and under preemption; every block comes back."""
    path = make_tiny_model(tmp_path / "llama", arch="llama", initializer_range=0.2, num_hidden_layers=3)
    tok = load_tokenizer(path)
    ids = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "List three colors:")]
    ids.append(list(range(100, 180)))
    ref = None
    for kw in ({}, {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
               {"num_kv_blocks": 40, "block_size": 4}):
        llm = LLM(model=str(path), kv_cache_dtype="fp8", attention_backend=backend, **kw)
        if ref is None:
            scales = [(m.self_attn.k_scale, m.self_attn.v_scale) for m in llm.engine.executor.runner.model.layers]
            ref = hf_greedy_fp8(path, ids, 24, scales)
        outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, kw
        stats = llm.get_stats()
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]
        if "num_kv_blocks" in kw:
            assert stats["num_preemptions"] > 0


def test_fp8_cache_holds_four_times_the_tokens_and_calibrates(tiny_llama_path):
    """Same kv_cache_memory_bytes: 4x the blocks of float32; per-layer scales from the
    calibration text (not the 1.0 default), float32 caches keep 1.0."""
    fp32 = ModelRunner(EngineConfig(device="cpu", kv_cache_memory_bytes=8 << 20), tiny_llama_path)
    fp8 = ModelRunner(EngineConfig(device="cpu", kv_cache_memory_bytes=8 << 20, kv_cache_dtype="fp8"),
                      tiny_llama_path)
    assert fp8.bytes_per_block * 4 == fp32.bytes_per_block
    assert fp8.determine_num_blocks() == 4 * fp32.determine_num_blocks()
    fp8.init_kv_cache(8)
    assert all(c.dtype == torch.float8_e4m3fn for kv in fp8.kv_caches for c in kv)
    scales = [(layer.self_attn.k_scale, layer.self_attn.v_scale) for layer in fp8.model.layers]
    assert all(0 < s != 1.0 for pair in scales for s in pair)
    assert all(layer.self_attn.k_scale == 1.0 for layer in fp32.model.layers)


def test_backends_without_fp8_are_refused(tiny_llama_path, monkeypatch):
    assert not TritonBackend.supports_fp8_kv and not FlashAttnBackend.supports_fp8_kv
    monkeypatch.setattr(TorchBackend, "supports_fp8_kv", False)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported by the torch attention backend"):
        ModelRunner(EngineConfig(device="cpu", attention_backend="torch", kv_cache_dtype="fp8"), tiny_llama_path)
