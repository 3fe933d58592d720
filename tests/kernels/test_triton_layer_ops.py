"""The fused Triton layer kernels (``kvserve/kernels/triton_layer_ops.py``: RMSNorm with the residual add,
rotary embedding, SiLU-and-mul) against the ATen ops of ``kvserve.engine.layers`` they replace on CUDA.

* Under ``TRITON_INTERPRET=1`` on CPU tensors, in a subprocess (the variable must precede the
  import of triton): each kernel on float32 and float16 (the interpreter's bfloat16 cast
  truncates), strided inputs included; then
  tiny Llama and Qwen3 engines with the layers routed through the kernels against the same engines
  on ATen's ops (float32: same tokens, logprobs within float32 rounding).
* ``@pytest.mark.gpu``: the same kernels compiled for the card, bfloat16 too, and a tiny model's forward on CUDA
  through both paths.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

#: The kernels against the modules' ATen path, on ``DEVICE`` (cpu under the interpreter, or cuda).
KERNEL_CHECKS = r"""
import torch
from kvserve.engine.layers.layernorm import GemmaRMSNorm, RMSNorm
from kvserve.engine.layers.rotary import RotaryEmbedding
from kvserve.kernels import triton_layer_ops as k

dev = DEVICE
torch.manual_seed(0)
ULP = {torch.float32: 2.0 ** -23, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


def within_one_ulp(got, ref, what):
    # 16-bit dtypes: each element equal to ATen's or one unit in the last place of the dtype away
    # (float32 sums and rsqrt in another order move a float32 result by a few ulps: float32 is
    # judged against float64 below, and by 1e-6 relative here)
    assert got.dtype == ref.dtype and got.shape == ref.shape, what
    ulp = 1e-6 if ref.dtype == torch.float32 else ULP[ref.dtype]
    tol = ref.float().abs() * ulp * 1.01 + 1e-30
    bad = ((got.float() - ref.float()).abs() > tol)
    assert not bad.any(), f"{what}: {int(bad.sum())} elements off by more than an ulp"
    return float((got != ref).float().mean())


# the interpreter's float32 -> bfloat16 cast truncates (about half of random values come out one
# ulp low), so bfloat16 is checked compiled on CUDA only
for dt in (torch.float32, torch.float16) + ((torch.bfloat16,) if dev == "cuda" else ()):
    # RMSNorm of [T, H] rows (strided), with and without the fused residual add; Gemma's variant
    H = 96
    for cls in (RMSNorm, GemmaRMSNorm):
        m = cls(H, 1e-6).to(device=dev, dtype=dt)
        m.weight.data.copy_(torch.randn(H) * 0.5 + (0.0 if cls is GemmaRMSNorm else 1.0))
        base = torch.randn(5, H + 32, device=dev).to(dt) * 3
        x = base[:, 16:16 + H]  # rows strided by H + 32
        within_one_ulp(k.rms_norm(x, m.weight, m.eps, cls is GemmaRMSNorm), m._norm(x), f"{cls.__name__} {dt}")
        r = torch.randn(5, H, device=dev).to(dt)
        r0 = r.clone()
        out = k.rms_norm(x, m.weight, m.eps, cls is GemmaRMSNorm, residual=r)
        assert torch.equal(r, x + r0), f"residual add {dt}"  # one rounding of the sum, as ATen
        within_one_ulp(out, m._norm(x + r0), f"{cls.__name__} + residual {dt}")
        # float32: against a float64 norm (the kernel's own summation, not only ATen's)
        if dt == torch.float32:
            x64 = x.double()
            ref = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + m.eps)
            ref = ref * (1 + m.weight.double()) if cls is GemmaRMSNorm else ref * m.weight.double()
            torch.testing.assert_close(k.rms_norm(x, m.weight, m.eps, cls is GemmaRMSNorm).double(), ref,
                                       rtol=1e-5, atol=1e-6)
    # per-head norm of q [T, heads, D] cut from a qkv row (Qwen3's q/k norm)
    m = RMSNorm(64, 1e-6).to(device=dev, dtype=dt)
    m.weight.data.copy_(torch.rand(64) + 0.5)
    qkv = torch.randn(3, (4 + 2 + 2) * 64, device=dev).to(dt)
    q = qkv[:, :256].view(3, 4, 64)
    within_one_ulp(k.rms_norm(q, m.weight, m.eps), m._norm(q), f"per-head norm {dt}")

    # rotary in place on strided q/k views: bit for bit ATen's "rotate half" products and sum
    rope = RotaryEmbedding(64, 512, 10000.0).to(dev)
    for rope_scaling in (None, {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64}):
        rope = RotaryEmbedding(64, 512, 10000.0, rope_scaling).to(dev)
        qkv = torch.randn(7, (4 + 2 + 2) * 64, device=dev).to(dt)
        q, kk = qkv[:, :256].view(7, 4, 64), qkv[:, 256:384].view(7, 2, 64)
        pos = torch.randint(0, 512, (7,), device=dev)
        cos = rope.cos[pos].unsqueeze(1).to(dt)
        sin = rope.sin[pos].unsqueeze(1).to(dt)
        ref_q, ref_k = (q * cos + rope._rotate_half(q) * sin), (kk * cos + rope._rotate_half(kk) * sin)
        v_before = qkv[:, 384:].clone()
        scale = float(qkv[:, :384].abs().max())
        k.rotary(q, kk, pos, rope.cos, rope.sin)
        if dev == "cuda":  # compiled, the products and the sum may be contracted (FMA): within rounding
            u = 2.0 ** -24 if dt == torch.float32 else ULP[dt]
            for got, ref in ((q, ref_q), (kk, ref_k)):
                torch.testing.assert_close(got, ref, rtol=u, atol=2 * u * scale)
            print(f"rotary {dt}: {float((q != ref_q).float().mean()):.4f} of q elements differ from ATen's")
        else:
            assert torch.equal(q, ref_q) and torch.equal(kk, ref_k), f"rotary {dt} {rope_scaling}"
        assert torch.equal(qkv[:, 384:], v_before), "rotary wrote outside q and k"

    # SiLU-and-mul of [T, 2I] rows (strided), I not a power of two
    inter = 200
    buf = torch.randn(6, 2 * inter + 8, device=dev).to(dt) * 4
    x = buf[:, :2 * inter]
    g, u = x.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(g) * u
    within_one_ulp(k.silu_and_mul(x), ref, f"silu_and_mul {dt}")

# an empty batch launches nothing and returns empty tensors
e = torch.empty(0, 64, device=dev)
assert k.rms_norm(e, torch.ones(64, device=dev), 1e-6).shape == (0, 64)
assert k.silu_and_mul(torch.empty(0, 128, device=dev)).shape == (0, 64)
try:
    k.rms_norm(torch.randn(64, 4, device=dev).t(), torch.ones(64, device=dev), 1e-6)
    raise AssertionError("a non-contiguous last dimension was accepted")
except ValueError:
    pass
print("kernels ok")
"""

#: Tiny engines with the layers on the kernels (use_fused_ops widened to CPU tensors) against the
#: same engines on ATen's ops: float32, greedy, 4 prompts, top-5 logprobs.
ENGINE_CHECK = r"""
import sys
import torch
from kvserve.engine import LLM, SamplingParams
from kvserve.kernels import gpu_ops

calls = []
real = gpu_ops.use_fused_ops
ON = [True]


def on_cpu(x):
    ok = ON[0] and x.dtype in (torch.float32, torch.bfloat16) and not torch.is_grad_enabled()
    calls.append(ok)
    return ok


gpu_ops.use_fused_ops = on_cpu
for path in sys.argv[1:]:
    llm = LLM(model=path, dtype="float32", enable_prefix_caching=False, attention_backend="torch",
              num_kv_blocks=64)
    prompts = [[(5 * i + 3 * j) % 300 + 7 for j in range(3 + 4 * i)] for i in range(4)]
    params = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=5) for _ in prompts]
    ON[0] = True
    fused = llm.generate(prompts, params, use_tqdm=False)
    assert any(calls), "the kernels were never asked for"
    ON[0] = False
    aten = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(fused, aten):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (path, a.outputs[0].token_ids, b.outputs[0].token_ids)
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert la.keys() == lb.keys()
            for t in la:
                assert abs(la[t] - lb[t]) <= 1e-4 + 1e-5 * abs(lb[t]), (path, t, la[t], lb[t])
print("engines ok")
"""


def _interpreted(code: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(
        os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1", KVSERVE_CPU_FUSED_OPS="0", KVSERVE_CPU_DECODE_LAYERS="0"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )


def test_kernels_under_the_interpreter():
    pytest.importorskip("triton")
    r = _interpreted(KERNEL_CHECKS.replace("DEVICE", "'cpu'"))
    assert r.returncode == 0 and "kernels ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


def test_tiny_engines_through_the_kernels_equal_aten(tiny_llama_path, tiny_qwen3_path):
    pytest.importorskip("triton")
    r = _interpreted(ENGINE_CHECK, str(tiny_llama_path), str(tiny_qwen3_path))
    assert r.returncode == 0 and "engines ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


_GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU")
def test_kernels_on_cuda():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run(
        [sys.executable, "-c", KERNEL_CHECKS.replace("DEVICE", "'cuda'")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        cwd=ROOT,
    )
    assert r.returncode == 0 and "kernels ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_model_forward_on_cuda_equals_aten(tmp_path, dtype, monkeypatch):
    """A tiny random Qwen3's (q/k norm, RoPE, SwiGLU) prefill forward on CUDA through the kernels
    against ATen's ops (float32: within float32 rounding; bfloat16: within bf16 rounding of the
    hidden states' scale). Built here from a transformers config: the GPU box has no model package."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from kvserve.engine.config import EngineConfig
    from kvserve.engine.model_runner import ModelRunner
    from kvserve.kernels import gpu_ops

    torch.manual_seed(0)
    Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=512,
            max_position_embeddings=256,
            tie_word_embeddings=False,
        )
    ).save_pretrained(tmp_path)
    cfg = EngineConfig(
        model=str(tmp_path),
        device="cuda",
        dtype=str(dtype).split(".")[-1],
        attention_backend="triton",
        enforce_eager=True,
        num_kv_blocks=16,
    )
    runner = ModelRunner(cfg, tmp_path)
    ids = torch.arange(5, 45, device="cuda")
    calls = []
    real = gpu_ops.use_fused_ops
    monkeypatch.setattr(gpu_ops, "use_fused_ops", lambda x: calls.append(real(x)) or calls[-1])
    fused, _ = runner._prefill_alone(ids)
    assert calls and all(calls), "the kernels were not used"
    monkeypatch.setattr(gpu_ops, "FUSED_OPS", False)
    aten, _ = runner._prefill_alone(ids)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert torch.allclose(fused.float(), aten.float(), rtol=tol, atol=tol * aten.float().abs().max().item())
