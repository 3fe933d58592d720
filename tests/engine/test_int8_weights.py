"""Weight-only int8 (``quantization="int8"``): the kernels against a float64 reference, and the
engine against HF transformers running the same int8-rounded weights."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.config import EngineConfig
from kvserve.engine.model_loader import load_tokenizer
from kvserve.engine.model_runner import ModelRunner
from tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def kernels():
    from kvserve.kernels import cpu_backend

    if not cpu_backend.load_kernel():
        pytest.skip(f"CPU kernels cannot be built here: {cpu_backend.kernel_error()}")
    return cpu_backend


@pytest.mark.parametrize("rows", [0, 1, 3, 8, 9, 70])
def test_int8_linear_matches_float64(kernels, rows):
    """Both paths (GEMV up to 8 rows, dequantize + oneDNN above), strided rows, bias, K not a
    multiple of 16: equal to float64 over the dequantized weight."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 200, generator=g) / 10
    b = torch.randn(300, generator=g)
    q, s = kernels.quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert ((q.float() * s[:, None] - w).abs() <= s[:, None] / 2 + 1e-7).all()  # half a step at most
    x = torch.randn(rows, 400, generator=g)[:, :200]
    y = kernels.int8_linear(x, q, s, b)
    ref = x.double() @ (q.double() * s.double()[:, None]).T + b.double()
    assert y.shape == (rows, 300)
    if rows:
        assert ((y.double() - ref).abs().max() / ref.abs().max()) < 1e-5


def _hf_with_int8_weights(path):
    """HF transformers (float32) whose linear layers and LM head hold int8-rounded weights: the
    reference the int8 engine must equal."""
    from kvserve.kernels.cpu_backend import quantize_int8

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, m in model.named_modules():
            if isinstance(m, torch.nn.Linear):
                q, s = quantize_int8(m.weight)
                if name == "lm_head" and m.weight is model.model.embed_tokens.weight:  # tied: embedding stays float
                    m.weight = torch.nn.Parameter(q.float() * s[:, None], requires_grad=False)
                else:
                    m.weight.copy_(q.float() * s[:, None])
    return model


def test_tiny_model_int8_equals_hf_with_int8_weights(tmp_path, kernels):
    """Greedy output equals HF float32 with the same int8-rounded weights (batch of 4: the GEMV
    path in decode, the dequantize path in prefill), also chunked and under preemption."""
    path = make_tiny_model(
        tmp_path / "llama", arch="llama", initializer_range=0.2, num_hidden_layers=3, tie_word_embeddings=True
    )
    tok = load_tokenizer(path)
    ids = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "List three colors:")]
    ids.append(list(range(100, 180)))
    hf = _hf_with_int8_weights(path)
    ref = []
    with torch.inference_mode():
        for x in ids:
            t = torch.tensor([x])
            y = hf.generate(
                t,
                attention_mask=torch.ones_like(t),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            ref.append(y[0, len(x) :].tolist())
    for kw in (
        {},
        {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
        {"num_kv_blocks": 40, "block_size": 4},
    ):
        llm = LLM(model=str(path), quantization="int8", **kw)
        outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref, kw
        stats = llm.get_stats()
        assert stats["free_kv_blocks"] == stats["num_kv_blocks"]


def test_int8_replaces_the_float_weights(tiny_llama_path):
    runner = ModelRunner(EngineConfig(device="cpu", quantization="int8"), tiny_llama_path)
    layer = runner.model.layers[0]
    for lin in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj):
        assert lin.weight is None and lin.qweight.dtype == torch.int8 and lin.wscale.dtype == torch.float32
    assert runner.model.lm_head.qweight.dtype == torch.int8
    with pytest.raises(ValueError, match="quantization='int8' runs on CPU in float32"):
        ModelRunner(EngineConfig(device="cpu", dtype="bfloat16", quantization="int8"), tiny_llama_path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kw", [{"quantization": "int8"}, {"kv_cache_dtype": "fp8"}, {"quantization": "int8", "kv_cache_dtype": "fp8"}]
)
def test_smollm2_quantized_answers_paris(smollm2_path, kw):
    llm = LLM(model=str(smollm2_path), **kw)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(max_tokens=16, temperature=0),
        use_tqdm=False,
    )
    assert "Paris" in out[0].outputs[0].text
