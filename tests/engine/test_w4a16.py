"""4-bit weight checkpoints (GPTQ, AWQ, compressed-tensors W4A16) against Hugging Face transformers.

The checkpoints are real: ``benchmarks/quant_checkpoints.py`` quantizes the bundled SmolLM2 with
llmcompressor (GPTQ and AWQ recipes, in a cached environment of its own) and stores what HF
transformers generates from each saved folder (``reference.json``); the classic GPTQ and AWQ
layouts are those runs' integers moved into AutoGPTQ's and AutoAWQ's layouts. Outputs are judged
by vLLM's ``check_logprobs_close`` rule (equal tokens until a difference, which must be a near tie:
each side's token among the other's top 5), as bf16 is. The kernels are checked against float64 on
random weights, on this CPU's path (AVX-512 or AVX2) and under the Triton interpreter.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.engine import LLM, SamplingParams
from kvserve.engine.layers.w4a16 import (
    W4Weight,
    build_w4,
    pack_w4,
    resolve_quantization,
    unpack_w4,
    w4a16_config,
    w4a16_reference,
)
from kvserve.kernels import cpu_backend
from test_bf16 import TEXT, first_divergence_is_a_near_tie

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import quant_checkpoints  # noqa: E402

NEW_TOKENS = quant_checkpoints.NEW_TOKENS
TOP_K = quant_checkpoints.TOP_K


# ---- kernels on random weights -------------------------------------------------------------------


def random_w4(n: int, k: int, gs: int, seed: int = 0) -> tuple[W4Weight, torch.Tensor]:
    """A random 4-bit weight and its float64 dense value ``[n, k]``."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // gs, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 16, (n, k // gs), generator=g).float()
    dense = (codes.double().reshape(n, -1, gs) - zeros.double()[..., None]) * scales.double()[..., None]
    return build_w4(codes, scales, zeros, None), dense.reshape(n, k)


def assert_within_f32_rounding(
    y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, bias: torch.Tensor | None = None
) -> None:
    """``y`` (a float32 result) equals ``x @ dense.t() + bias`` (float64 ``[M, K]``, ``[N, K]``,
    ``[N]``) up to float32 rounding: the standard bound for a dot product of ``K`` terms in any
    order, ``|error| <= (K + 4) u (|x| @ |dense|^T + |bias|)`` with ``u = 2^-24`` (Higham,
    *Accuracy and Stability of Numerical Algorithms*, 2002, sec. 3.1; the 4 covers rounding the
    inputs and the widened weight to float32). A fixed tolerance fails on a cancelling sum whenever
    another BLAS (another CPU) sums in another order; a wrong column, group or scale misses by
    orders of magnitude more."""
    k = x.shape[-1]
    ref = x @ dense.t() + (0 if bias is None else bias)
    scale = x.abs() @ dense.abs().t() + (0 if bias is None else bias.abs())
    err = (y.double() - ref).abs()
    bound = (k + 4) * 2.0**-24 * scale
    worst = int((err - bound).argmax())
    assert bool((err <= bound).all()), (
        f"error {err.flatten()[worst]:.3g} over the float32 bound {bound.flatten()[worst]:.3g} at flat index {worst}"
    )


def test_packing_round_trips():
    codes = torch.randint(0, 16, (5, 96), dtype=torch.uint8)
    packed = pack_w4(codes)
    assert packed.shape == (5, 48) and packed.dtype == torch.uint8
    assert torch.equal(unpack_w4(packed), codes)
    assert (packed[0, 0] & 0xF) == codes[0, 0] and (packed[0, 0] >> 4) == codes[0, 16]  # the block layout


@pytest.mark.parametrize("rows", [1, 3, 8, 9, 40])  # the GEMV (<= 8 rows) and the widened weight for oneDNN
@pytest.mark.parametrize("gs", [32, 64, 192])  # 192 = K: one scale per row
def test_cpu_kernel_matches_float64(rows, gs):
    if not cpu_backend.load_kernel():
        pytest.skip(f"CPU kernels not built: {cpu_backend.kernel_error()}")
    w, dense = random_w4(70, 192, gs, seed=rows)
    x = torch.randn(rows, 192, dtype=torch.float64)
    bias = torch.randn(70, dtype=torch.float64)
    y = cpu_backend.w4a16_linear(x.float(), w.qweight, w.scales, w.szeros, w.group_size, bias.float())
    assert y.dtype == torch.float32 and y.shape == (rows, 70)
    assert_within_f32_rounding(y, x, dense, bias)
    assert_within_f32_rounding(w4a16_reference(x.float(), w, bias.float()), x, dense, bias)
    yb = cpu_backend.w4a16_linear(x.bfloat16(), w.qweight, w.scales, w.szeros, w.group_size, None)
    assert yb.dtype == torch.bfloat16
    torch.testing.assert_close(yb.double(), x.bfloat16().double() @ dense.t(), rtol=2e-2, atol=2e-2)


def test_act_order_and_split_columns_match_the_dense_weight():
    """An act-order ``g_idx`` sorts the columns (the activations are gathered to match), and a
    row-parallel share that cuts groups gets one scale per 32-value block."""
    n, k, gs = 16, 128, 64
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // gs, generator=g) + 0.1
    zeros = torch.full((n, k // gs), 8.0)
    perm = torch.randperm(k, generator=g)
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[perm] = torch.arange(k) // gs  # groups scattered over the columns
    dense = (codes.double() - 8) * scales.double()[:, g_idx]
    x = torch.randn(2, k, dtype=torch.float64)
    w = build_w4(codes, scales, zeros, g_idx)
    assert w.perm is not None
    assert_within_f32_rounding(w4a16_reference(x.float(), w), x, dense)
    with pytest.raises(ValueError, match="act-order"):
        build_w4(codes, scales, zeros, g_idx, cols=(0, 96))
    flat = (codes.double() - 8) * scales.double().repeat_interleave(gs, 1)
    half = build_w4(codes, scales, zeros, None, cols=(32, 96))  # cuts both groups
    assert half.group_size == 32 and half.shape == (n, 64)
    assert_within_f32_rounding(w4a16_reference(x[:, 32:96].float(), half), x[:, 32:96], flat[:, 32:96])


def test_triton_kernel_under_the_interpreter():
    """``kvserve/kernels/triton_w4a16.py`` on CPU tensors with ``TRITON_INTERPRET=1``, in a subprocess (the
    variable must precede the import; a bad load would crash the process)."""
    pytest.importorskip("triton")
    code = r"""
import torch
from kvserve.engine.layers.w4a16 import build_w4
from kvserve.kernels.triton_w4a16 import w4a16_matmul
torch.manual_seed(0)
for m, gs in ((1, 64), (5, 32), (19, 128)):
    n, k = 80, 128
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    scales = torch.rand(n, k // gs) * 0.05
    zeros = torch.randint(0, 16, (n, k // gs)).float()
    w = build_w4(codes, scales, zeros, None)
    dense = (codes.double().reshape(n, -1, gs) - zeros.double()[..., None]) * scales.double()[..., None]
    x = torch.randn(m, k)
    bias = torch.randn(n)
    y = w4a16_matmul(x, w.qweight, w.scales, w.szeros, w.group_size, bias)
    torch.testing.assert_close(y.double(), x.double() @ dense.reshape(n, k).t() + bias.double(), rtol=1e-4, atol=1e-4)
print("ok")
"""
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout[-2000:] + r.stderr[-4000:]


# ---- configs ---------------------------------------------------------------------------------------


def _hf(qc: dict | None):
    return SimpleNamespace(quantization_config=qc)


@pytest.mark.parametrize(
    "qc, message",
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "8 bits"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "LM head"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "multiple of 32"),
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "GEMM layout"),
        ({"quant_method": "bitsandbytes"}, "not supported"),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "int-quantized",
                "ignore": ["lm_head"],
                "config_groups": {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {"num_bits": 8, "strategy": "channel"},
                        "input_activations": {"num_bits": 8},
                    }
                },
            },
            "activations",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "format": "float-quantized",
                "ignore": ["lm_head"],
                "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
            },
            "format",
        ),
    ],
)
def test_unsupported_checkpoints_are_refused_by_name(qc, message):
    with pytest.raises(ValueError, match=message):
        w4a16_config(_hf(qc))


def test_quantization_is_detected_and_conflicts_refused():
    gptq = _hf({"quant_method": "gptq", "bits": 4, "group_size": 64, "desc_act": False})
    assert resolve_quantization(None, gptq) == "gptq" and resolve_quantization("gptq", gptq) == "gptq"
    with pytest.raises(ValueError, match="does not match"):
        resolve_quantization("awq", gptq)
    with pytest.raises(ValueError, match="does not match"):
        resolve_quantization("int8", gptq)
    with pytest.raises(ValueError, match="no quantization_config"):
        resolve_quantization("awq", _hf(None))
    assert resolve_quantization("int8", _hf(None)) == "int8" and resolve_quantization(None, _hf(None)) is None


# ---- real checkpoints against HF -------------------------------------------------------------------

CHECKPOINTS = [
    "gptq-g64",
    "gptq-g32",
    "awq-g32",
    "gptq-channel",
    "gptq-classic",
    "gptq-classic-actorder",
    "awq-classic",
]
METHOD = {
    "gptq-g64": "compressed-tensors",
    "gptq-g32": "compressed-tensors",
    "awq-g32": "compressed-tensors",
    "gptq-channel": "compressed-tensors",
    "gptq-classic": "gptq",
    "gptq-classic-actorder": "gptq",
    "awq-classic": "awq",
}


@pytest.fixture(scope="session")
def w4_checkpoints():
    """Every checkpoint's folder, made once (llmcompressor's environment and the quantization runs:
    minutes the first time, then cached)."""
    return {name: quant_checkpoints.checkpoint(name) for name in CHECKPOINTS}


def reference(path: Path) -> dict:
    return json.loads((path / "reference.json").read_text())


def check_against_reference(llm: LLM, ref: dict) -> int:
    """Greedy tokens of ``llm`` for the reference's prompts, judged by the near-tie rule; returns
    how many tokens were equal before the first difference, over all prompts."""
    outs = llm.generate(
        [g["prompt_ids"] for g in ref["greedy"]],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_K),
        use_tqdm=False,
    )
    compared = 0
    for g, o in zip(ref["greedy"], outs):
        ours = o.outputs[0].token_ids
        ok, n = first_divergence_is_a_near_tie(
            ours, [set(d) for d in o.outputs[0].logprobs], g["tokens"], [set(t) for t in g["top"]]
        )
        assert ok, f"{g['prompt']!r}: at token {n} ours {ours[n]} / HF {g['tokens'][n]} is not a near tie"
        compared += n
    return compared


def perplexity(llm: LLM) -> float:
    paragraphs = [p.strip() for p in TEXT.read_text().split("\n\n") if p.strip()]
    outs = llm.generate(paragraphs, SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    nll = [-next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKPOINTS)
def test_checkpoint_greedy_equals_hf(w4_checkpoints, name):
    path = w4_checkpoints[name]
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256)
    assert llm.engine.config.quantization == METHOD[name]  # detected from config.json
    layers = [m for m in llm.engine.executor.runner.model.modules() if getattr(m, "w4", None) is not None]
    assert len(layers) == 4 * 30  # qkv, o, gate_up, down of every layer: 4-bit in memory
    assert all(m.weight is None and m.w4.qweight.dtype == torch.uint8 for m in layers)
    ref = reference(path)
    compared = check_against_reference(llm, ref)
    assert compared >= len(ref["greedy"]) * NEW_TOKENS * 3 // 4, compared


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gptq-g32", "awq-g32"])
def test_perplexity_equals_hf_on_the_same_checkpoint(w4_checkpoints, name):
    """Perplexity over the shipped text equals HF's on the same checkpoint. (Against the float
    model it is far above the issue's +3 %, for HF too: the bundled SmolLM2 is already a Q4_1
    dequantization, and a second 4-bit grid costs it that much whatever the recipe;
    ``benchmarks/quantization.py`` reports it, docs/known-limits.md#w4a16 explains.)"""
    path = w4_checkpoints[name]
    ours = perplexity(LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256))
    assert abs(ours / reference(path)["perplexity"] - 1) <= 0.002, (ours, reference(path)["perplexity"])


def hf_dequantized(path: Path, dtype: torch.dtype, adapter: Path | None = None):
    """HF transformers on a compressed-tensors checkpoint, decompressed by compressed-tensors."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter))
    return model.eval()


def hf_greedy(model, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[set[int]]]]:
    toks, tops = [], []
    for ids in prompts:
        x = torch.tensor([ids])
        with torch.inference_mode():
            g = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
                output_scores=True,
                return_dict_in_generate=True,
            )
        toks.append(g.sequences[0, len(ids) :].tolist())
        tops.append([set(s[0].float().topk(TOP_K).indices.tolist()) for s in g.scores])
    return toks, tops


def check_close(llm: LLM, prompts, ref_tokens, ref_tops, lora=None) -> int:
    outs = llm.generate(
        prompts,
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=TOP_K),
        use_tqdm=False,
        lora_request=lora,
    )
    compared = 0
    for o, ref, top in zip(outs, ref_tokens, ref_tops):
        ok, n = first_divergence_is_a_near_tie(
            o.outputs[0].token_ids, [set(d) for d in o.outputs[0].logprobs], ref, top
        )
        assert ok, f"at token {n}: ours {o.outputs[0].token_ids[n]} / HF {ref[n]} is not a near tie"
        compared += n
    return compared


@pytest.mark.slow
def test_bfloat16_activations_close_to_hf_bf16_and_float32(w4_checkpoints):
    """bf16 activations over the 4-bit weights: every greedy output agrees with HF bf16 on the same
    checkpoint and with HF float32 (``reference.json``) up to a near tie. Where they part is not
    compared further: HF bf16 also rounds the widened weights to bf16 (the kernels here keep them
    exact in float32), so its first near tie comes early on some prompts; a wrong bf16 path would
    leave the top 5 of both references."""
    path = w4_checkpoints["gptq-g64"]
    ref = reference(path)
    prompts = [g["prompt_ids"] for g in ref["greedy"]]
    toks, tops = hf_greedy(hf_dequantized(path, torch.bfloat16), prompts)
    llm = LLM(model=str(path), dtype="bfloat16", device="cpu", num_kv_blocks=256)
    check_close(llm, prompts, toks, tops)
    check_close(llm, prompts, [g["tokens"] for g in ref["greedy"]], [[set(t) for t in g["top"]] for g in ref["greedy"]])


@pytest.mark.slow
def test_lora_on_a_4bit_base_equals_hf_with_peft(w4_checkpoints, smollm2_path, tmp_path):
    from kvserve.engine.lora_adapter import LoRARequest
    from test_lora import make_adapter

    path = w4_checkpoints["gptq-g64"]
    adapter = make_adapter(str(smollm2_path), tmp_path / "a", 8, 16, ["q_proj", "v_proj", "down_proj"], False, 0)
    prompts = [g["prompt_ids"] for g in reference(path)["greedy"]][:3]
    toks, tops = hf_greedy(hf_dequantized(path, torch.float32, adapter), prompts)
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256, enable_lora=True, max_lora_rank=8)
    lora = LoRARequest("a", 1, str(adapter))
    assert check_close(llm, prompts, toks, tops, lora=[lora] * len(prompts)) >= len(prompts) * NEW_TOKENS * 3 // 4
    base = llm.generate(
        prompts[:1], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False
    )
    assert base[0].outputs[0].token_ids != toks[0]  # the adapter changes the answer: it was applied


@pytest.mark.slow
def test_prefix_caching_chunked_prefill_and_spec_decode_keep_the_tokens(w4_checkpoints):
    path = w4_checkpoints["awq-classic"]
    ref = reference(path)
    prompts = [g["prompt_ids"] * 3 for g in ref["greedy"][:3]]  # repeats: n-gram drafts get accepted
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    plain = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=256, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    fancy = LLM(
        model=str(path),
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        max_num_batched_tokens=16,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 3,
            "prompt_lookup_max": 3,
            "prompt_lookup_min": 1,
            "adaptive": False,
        },
    )
    for _ in range(2):  # the second pass hits the prefix cache
        got = [o.outputs[0].token_ids for o in fancy.generate(prompts, params, use_tqdm=False)]
        assert got == want
    assert fancy.get_stats()["prefix_cache_hit_rate"] > 0


@pytest.mark.slow
def test_tensor_parallel_ranks_split_the_packed_weights(w4_checkpoints):
    """Two local rank processes: o_proj's 576 inputs split 288/288 cut a group of 64, so each rank
    keeps one scale per 32-value block; the outputs stay HF's. (An act-order checkpoint's row-parallel
    layers cannot be split: ``test_act_order_and_split_columns_match_the_dense_weight``.)"""
    path = w4_checkpoints["gptq-g64"]
    llm = LLM(
        model=str(path),
        dtype="float32",
        device="cpu",
        num_kv_blocks=256,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    )
    try:
        ref = reference(path)
        ref = dict(ref, greedy=ref["greedy"][:3])
        assert check_against_reference(llm, ref) >= len(ref["greedy"]) * NEW_TOKENS * 3 // 4
    finally:
        llm.engine.executor.shutdown()


def test_a_row_parallel_rank_refuses_an_act_order_split():
    """The layer itself, as a rank of 2 builds it: the refusal names act-order."""
    from kvserve.engine.layers.linear import RowParallelLinear
    from kvserve.engine.layers.w4a16 import W4A16Config

    n, k, gs = 8, 128, 32
    codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    g_idx = torch.randperm(k) // gs
    qweight = (codes.t().reshape(k // 8, 8, n).to(torch.int64) << (4 * torch.arange(8))[None, :, None]).sum(1)
    layer = RowParallelLinear((0, k // 2), n)
    layer.w4_config = W4A16Config("gptq", gs, True, True, zeros_minus_one=True)
    for name, t in {
        "qweight": (qweight - ((qweight >> 31) << 32)).to(torch.int32),
        "qzeros": torch.full((k // gs, n // 8), 0x77777777, dtype=torch.int32),
        "scales": torch.ones(k // gs, n, dtype=torch.float16),
        "g_idx": g_idx.to(torch.int32),
    }.items():
        layer.load(name, t)
    with pytest.raises(ValueError, match="act-order"):
        layer.finish_load()


@pytest.mark.slow
def test_int8_or_another_format_on_a_4bit_checkpoint_is_refused(w4_checkpoints):
    path = w4_checkpoints["awq-classic"]
    for q in ("int8", "gptq"):
        with pytest.raises(ValueError, match="does not match"):
            LLM(model=str(path), device="cpu", quantization=q)
