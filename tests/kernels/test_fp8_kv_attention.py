"""Attention over float8 (e4m3) KV caches: the torch path and the C++ CPU kernel against the float64
reference over the dequantized caches, a chunk attending to its own exact K/V (``exact_chunk_kv``),
and store_kv's rounding into a float8 cache. The Triton kernels' float8 cases are in
attention_cases.CASES (test_triton_attention.py)."""

from __future__ import annotations

import pytest
import torch
from attention_cases import CPU_CASES, DTYPES, _compare, _describe, _meta, make_problem, quantize_fp8, ref_attention


def _fp8_problem(spec: dict) -> tuple[dict, dict]:
    """A float32 problem with its caches stored as float8 e4m3 and the same problem with the
    dequantized caches (:func:`quantize_fp8`)."""
    p = make_problem(dict(spec, dtype="float32"))
    return p, quantize_fp8(p)


FP8_CASES = {k: v for k, v in CPU_CASES.items() if v["kind"] == "dispatch"}


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(FP8_CASES))
def test_fp8_kv_cache(name, backend, q_dtype, cpu_kernel):
    """Attention over float8 caches equals the float64 reference over the dequantized caches,
    for float32 and bfloat16 queries."""
    from kvserve.kernels.torch_backend import paged_attention_torch

    p, deq = _fp8_problem(FP8_CASES[name])
    p["q"] = deq["q"] = p["q"].to(DTYPES[q_dtype])
    fn = paged_attention_torch if backend == "torch" else cpu_kernel.paged_attention_cpu
    out = fn(
        p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], p["window"], p["softcap"], p["k_scale"], p["v_scale"]
    )
    ref = ref_attention(deq)
    if backend == "torch" and 0 in p["seqlens"]:  # the torch path leaves seq_len-0 rows unspecified
        rows = torch.repeat_interleave(torch.tensor([s > 0 for s in p["seqlens"]]), torch.tensor(p["qlens"]))
        out, ref = out[rows], ref[rows]
    assert out.dtype == DTYPES[q_dtype]
    rec = _compare(out, ref, q_dtype)
    assert rec["ok"], f"{name}: {_describe(rec)}"


def _step_kv(p: dict, orig: dict, deq: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This step's K/V ``[num_tokens, Hkv, D]`` (in ``dtype``) from ``orig``'s unquantized caches,
    and the reference problem for a backend given them: ``deq`` (float8 values) with the own
    slots of every chunk of >= 2 tokens holding the step's exact K/V; decode rows and context
    cached by earlier steps stay float8. Rows of seq_len-0 requests get zeros."""
    bs, bt = p["bs"], p["block_tables"]
    ref = dict(deq, k_cache=deq["k_cache"].clone(), v_cache=deq["v_cache"].clone())
    keys, values = [], []
    for i, (ql, sl) in enumerate(zip(p["qlens"], p["seqlens"])):
        for t in range(sl - ql, sl):
            if t < 0:
                keys.append(torch.zeros(p["Hkv"], p["D"], dtype=dtype))
                values.append(torch.zeros(p["Hkv"], p["D"], dtype=dtype))
                continue
            b, o = int(bt[i, t // bs]), t % bs
            keys.append(orig["k_cache"][b, o].to(dtype))
            values.append(orig["v_cache"][b, o].to(dtype))
            if ql >= 2:
                ref["k_cache"][b, o], ref["v_cache"][b, o] = keys[-1].float(), values[-1].float()
    return torch.stack(keys), torch.stack(values), ref


FRESH_CASES = dict(
    {
        k: FP8_CASES[k]
        for k in (
            "fp8_dispatch_mixed_g4_d128_fp16",
            "softcap_window_dispatch_g2_d64_fp32",
            "torch_decode_long_outlier",
            "cpu_short_chunks",
            "cpu_short_chunks_window_softcap",
            "rand_mixed_g8_d128_fp16",
        )
    },
    fp8_fresh_chunks_g2_d64_window=dict(
        kind="dispatch",
        H=4,
        Hkv=2,
        D=64,
        bs=16,
        dtype="float32",
        qlens=[1, 5, 16, 40, 1, 17, 30],
        seqlens=[90, 30, 16, 160, 17, 17, 200],
        window=24,
        seed=64,
        kv="fp8",
    ),
)


@pytest.mark.parametrize("q_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("name", list(FRESH_CASES))
def test_fp8_chunk_attends_to_its_own_exact_kv(name, backend, q_dtype, cpu_kernel):
    """With this step's ``key`` / ``value`` given (``exact_chunk_kv``), a chunk of >= 2 tokens
    attends to its own tokens at full precision and to earlier context through float8; decode
    rows read everything from float8: both backends equal the float64 reference of that mix
    (chunks of 2..16 tokens, which the cpu backend otherwise sends to its C++ kernel, included).
    Without them the same call reads only float8 (``test_fp8_kv_cache``); a model-dtype cache
    ignores them."""
    from kvserve.kernels.torch_backend import paged_attention_torch

    spec = FRESH_CASES[name]
    orig = make_problem(dict(spec, dtype="float32"))
    p, deq = _fp8_problem(spec)
    dt = DTYPES[q_dtype]
    p["q"] = p["q"].to(dt)
    key, value, ref_problem = _step_kv(p, orig, deq, dt)
    ref_problem["q"] = p["q"]
    fn = paged_attention_torch if backend == "torch" else cpu_kernel.paged_attention_cpu
    out = fn(
        p["q"],
        p["k_cache"],
        p["v_cache"],
        _meta(p),
        p["scale"],
        p["window"],
        p["softcap"],
        p["k_scale"],
        p["v_scale"],
        key=key,
        value=value,
    )
    ref = ref_attention(ref_problem)
    rows = torch.repeat_interleave(torch.tensor([s > 0 for s in p["seqlens"]]), torch.tensor(p["qlens"]))
    rec = _compare(out[rows], ref[rows], q_dtype)
    assert rec["ok"], f"{name}: {_describe(rec)}"
    chunk = rows & torch.repeat_interleave(torch.tensor([q >= 2 for q in p["qlens"]]), torch.tensor(p["qlens"]))
    if q_dtype == "float32" and chunk.any():  # the check tells the two apart: all-float8 is far off on the chunks
        all_fp8 = ref_attention(dict(deq, q=p["q"]))
        assert (out[chunk].double() - all_fp8[chunk]).abs().max() > 100 * rec["max_abs_err"]
    # a model-dtype cache ignores key / value: huge values there change nothing
    fp = dict(orig, q=p["q"].float())
    big = dict(key=torch.full(key.shape, 1e4), value=torch.full(value.shape, 1e4))
    a = fn(fp["q"], fp["k_cache"], fp["v_cache"], _meta(fp), fp["scale"], fp["window"], fp["softcap"])
    b = fn(fp["q"], fp["k_cache"], fp["v_cache"], _meta(fp), fp["scale"], fp["window"], fp["softcap"], **big)
    assert torch.equal(a[rows], b[rows])


def test_fp8_store_rounds_to_e4m3(cpu_kernel):
    """store_kv into a float8 cache keeps x within e4m3's half-ulp (2^-4 relative) after
    dequantization, clamps at +-448 * scale, and touches only the given slots."""
    from kvserve.kernels.torch_backend import FP8, dequantize, store_kv_torch

    g = torch.Generator().manual_seed(9)
    kc = torch.zeros(4, 8, 2, 64, dtype=FP8)
    vc = torch.zeros(4, 8, 2, 64, dtype=FP8)
    key = torch.randn(5, 2, 64, generator=g) * 3
    key[0, 0, 0] = 1e6  # beyond the range: clamped, not NaN
    val = torch.randn(5, 2, 64, generator=g)
    slots = torch.tensor([3, 9, 17, 30, 31])
    store_kv_torch(key, val, kc, vc, slots, k_scale=0.05, v_scale=0.01)
    k = dequantize(kc.view(torch.uint8).view(32, 2, 64)[slots].view(FP8), 0.05)
    v = dequantize(vc.view(torch.uint8).view(32, 2, 64)[slots].view(FP8), 0.01)
    assert k[0, 0, 0] == 448 * 0.05
    k_rel = ((k - key).abs() / key.abs().clamp_min(2**-6 * 0.05)).flatten()[1:]
    assert k_rel.max() <= 2**-4 + 1e-6
    assert ((v - val).abs() / val.abs().clamp_min(2**-6 * 0.01)).max() <= 2**-4 + 1e-6
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(torch.uint8).view(32, -1)[untouched].any()
