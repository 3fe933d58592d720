"""float8 e4m3 weights (``quantization="fp8"``, W8A8 through ``torch._scaled_mm``): the layer's
numerics against a float64 reference of the same quantized operands (on CPU, where torch has the
op, and on CUDA), the engine on a GPU, and the refusal elsewhere."""

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.layers.quantization import FP8, FP8_MAX, fp8_linear, quantize_fp8

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(
                not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                reason="needs an Ada/Hopper GPU",
            ),
        ],
    ),
]


def test_quantize_fp8_rows():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 64, generator=g) * torch.logspace(-3, 1, 32)[:, None]  # rows of very different scales
    q, s = quantize_fp8(w)
    assert q.dtype == FP8 and s.shape == (32,)
    deq = q.float() * s[:, None]
    assert torch.allclose(q.float().abs().amax(1), torch.full((32,), FP8_MAX))  # each row's max maps to 448
    rel = ((deq - w).abs() / w.abs().clamp_min(2**-6 * s[:, None])).max()
    assert rel <= 2**-4 + 1e-6  # e4m3's half-ulp


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_fp8_linear_equals_the_quantized_product(device, rows):
    """fp8_linear == (per-token e4m3 activations * scale) @ (e4m3 weight * scale).T + bias in
    float64, up to the bfloat16 output's rounding; and far from a wrong scaling."""
    g = torch.Generator().manual_seed(rows)
    x = (torch.randn(rows, 96, generator=g) * torch.logspace(-2, 1, rows)[:, None]).bfloat16()
    w = torch.randn(48, 96, generator=g) * 0.1
    bias = torch.randn(48, generator=g).bfloat16()
    q, s = quantize_fp8(w)
    out = fp8_linear(x.to(device), q.to(device), s.to(device), bias.to(device)).cpu()
    a_scale = x.float().abs().amax(1, keepdim=True) / FP8_MAX
    a8 = (x.float() / a_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    ref = (a8.double() * a_scale.double()) @ (q.double() * s.double()[:, None]).T + bias.double()
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 48)
    err = (out.double() - ref).abs().max() / ref.abs().max()
    assert err < 8e-3, err
    plain = x.double() @ w.double().T + bias.double()  # unquantized: differs by e4m3's rounding
    assert (out.double() - plain).abs().max() / plain.abs().max() < 0.1


def test_fp8_weights_are_refused_off_a_capable_gpu(tiny_llama_path):
    with pytest.raises(ValueError, match="quantization='fp8' runs on CUDA in bfloat16"):
        LLM(model=str(tiny_llama_path), device="cpu", quantization="fp8")


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9), reason="needs an Ada/Hopper GPU"
)
def test_engine_with_fp8_weights_on_cuda(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from gpu import build_random_model  # SmolLM2's shape, random weights, synthetic tokenizer (no package needed)

    path = build_random_model("smollm2-135m", tmp_path, "cuda", "bfloat16")
    ids = [[1, 2, 3, 4, 5], list(range(300, 340)), [7] * 9]
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    fp8 = LLM(model=str(path), quantization="fp8", gpu_memory_utilization=0.3)
    bf16 = LLM(model=str(path), gpu_memory_utilization=0.7)  # the fraction counts the first engine too
    layers = [m for m in fp8.engine.executor.runner.model.modules() if getattr(m, "qweight", None) is not None]
    assert layers and all(m.qweight.dtype == FP8 for m in layers)
    got = fp8.generate(ids, p, use_tqdm=False)
    want = bf16.generate(ids, p, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in want] == [12] * 3
    assert getattr(fp8.engine.executor.runner, "graphs", None)  # decode runs in captured CUDA graphs
    for o in got:
        assert len(o.outputs[0].token_ids) == 12
        assert all(torch.isfinite(torch.tensor(list(d.values()))).all() for d in o.outputs[0].logprobs)
    st = fp8.get_stats()
    assert st["free_kv_blocks"] == st["num_kv_blocks"]
