"""The float8 (e4m3) KV cache through the engine: capacity, calibration, HF agreement, every
request's blocks returned. The kernels' float8 paths against the float64 reference are in
``test_kernels.py`` (``test_fp8_kv_cache``, ``test_fp8_store_rounds_to_e4m3``); SmolLM2 with it
in ``test_int8_weights.py::test_smollm2_quantized_answers_paris``."""
import json
import os
import subprocess
import sys
from pathlib import Path

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

ROOT = Path(__file__).resolve().parents[2]


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


FP8_RUNS = ({}, {"max_num_batched_tokens": 7, "enable_prefix_caching": False},
            {"num_kv_blocks": 40, "block_size": 4})


def fp8_engine_runs(path, ids: list[list[int]], backend: str) -> list[dict]:
    """Greedy 24-token runs of the float8 engine, one per ``FP8_RUNS`` config: tokens, the
    per-layer scales, whether every block came back, the preemption count."""
    res = []
    for kw in FP8_RUNS:
        llm = LLM(model=str(path), dtype="float32", kv_cache_dtype="fp8", attention_backend=backend, **kw)
        outs = llm.generate(ids, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
        stats = llm.get_stats()
        res.append(dict(tokens=[o.outputs[0].token_ids for o in outs],
                        scales=[(m.self_attn.k_scale, m.self_attn.v_scale)
                                for m in llm.engine.executor.runner.model.layers],
                        all_blocks_free=stats["free_kv_blocks"] == stats["num_kv_blocks"],
                        preemptions=stats["num_preemptions"]))
    return res


_TRITON_CHILD = """
import json, sys
sys.path[:0] = ["tests", "tests/engine"]
from test_kv_fp8 import fp8_engine_runs
print(json.dumps(fp8_engine_runs(sys.argv[1], json.loads(sys.argv[2]), "triton")))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
def test_tiny_model_fp8_equals_hf_with_fp8_rounding(tmp_path, backend):
    """Greedy output equals HF float32 whose K/V are rounded as the float8 cache rounds them
    (same per-layer scales), also chunked and under preemption; every block comes back. Triton
    runs its kernels in the interpreter, in a child process (the variable must be set before
    any kernel is decorated)."""
    path = make_tiny_model(tmp_path / "llama", arch="llama", initializer_range=0.2, num_hidden_layers=3)
    tok = load_tokenizer(path)
    ids = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):", "List three colors:")]
    ids.append(list(range(100, 180)))
    if backend == "triton":
        env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="2",
                   PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        proc = subprocess.run([sys.executable, "-c", _TRITON_CHILD, str(path), json.dumps(ids)],
                              capture_output=True, text=True, cwd=str(ROOT), env=env, timeout=280, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs = json.loads(proc.stdout.strip().splitlines()[-1])
    else:
        runs = fp8_engine_runs(path, ids, backend)
    ref = hf_greedy_fp8(path, ids, 24, [tuple(s) for s in runs[0]["scales"]])
    for kw, run in zip(FP8_RUNS, runs):
        assert run["tokens"] == ref, kw
        assert run["all_blocks_free"], kw
        if "num_kv_blocks" in kw:
            assert run["preemptions"] > 0


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
    """flash-attn 2 has no float8 KV path; Triton needs float8 conversions (compute capability
    >= 8.9); a backend without the capability is refused with the reason."""
    assert TritonBackend.supports_fp8_kv and not FlashAttnBackend.supports_fp8_kv
    assert "no float8 KV cache path" in FlashAttnBackend.fp8_kv_unsupported_reason(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "compute capability >= 8.9, this GPU has 8.0" in TritonBackend.fp8_kv_unsupported_reason(torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert TritonBackend.fp8_kv_unsupported_reason(torch.device("cuda")) is None
    monkeypatch.setattr(TorchBackend, "supports_fp8_kv", False)
    with pytest.raises(ValueError, match="kv_cache_dtype='fp8' is not supported here: the torch attention backend has no"):
        ModelRunner(EngineConfig(device="cpu", attention_backend="torch", kv_cache_dtype="fp8"), tiny_llama_path)
