"""Attention kernels against a float64 reference.

* Triton kernels (``kernels/triton_attention.py``) run under ``TRITON_INTERPRET=1`` on CPU tensors,
  in a *subprocess*: an out-of-bounds load can crash the interpreter. This file is its own
  runner: ``python tests/kernels/test_kernels.py --device cpu CASE...`` prints one JSON line per case.
  The module fixture runs all cases in one child process (to pay the torch/triton import once)
  and, if the child dies, records the case it was in as crashed and starts a fresh child for
  the rest.
* The torch backend's path (``kernels/torch_backend.py``, ``paged_attention_torch``) runs
  in-process on the same problems.
* ``@pytest.mark.gpu`` tests compile the kernels for real on CUDA (fp16 and bf16) and are
  skipped without CUDA.

The reference (``ref_attention``) is deliberately naive: per request, gather its ``seq_len``
keys/values slot by slot through the block table, in float64; per head, full softmax over keys
``j <= ctx + i`` (``ctx = seq_len - query_len``) for query row ``i``; with a sliding ``window``
also ``j > ctx + i - window``; with a ``softcap`` the scores are ``softcap * tanh(s / softcap)``.

Error metric: ``rel_err = max|out - ref| / max|ref|`` over the whole output. Bounds:

* fp32 caches (fp32 arithmetic, ieee dots): ``rel_err <= 2e-5``.
* fp16 caches (inputs exact in fp16; fp16 operands into the dots, probabilities rounded to fp16
  before ``P @ V``, fp32 accumulation, output rounded to fp16; unit roundoff 2^-11 ~ 4.9e-4):
  ``rel_err <= 4e-3``.
* bf16 (GPU only; unit roundoff 2^-8 ~ 3.9e-3): ``rel_err <= 3e-2``.

Outputs and unused cache slots are filled with NaN before each call, so a row that is never
written, or a read of a slot past ``seq_len`` that leaks into the result, fails the test.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BOUNDS = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

# ------------------------------------------------------------------------------------------
# Cases. qlens[i] query rows for request i, seqlens[i] tokens in the cache (ctx = seq - q).
# Shapes are chosen so that the interpreter runs few programs: large tiles, 1-2 KV heads.
# ------------------------------------------------------------------------------------------
CASES: dict[str, dict] = {
    "split_heuristic": dict(kind="heuristic"),
    # store_kv: slots in random blocks, some -1 (skipped), key/value non-contiguous views.
    "store_fp32_h2_d64": dict(kind="store", Hkv=2, D=64, bs=16, dtype="float32", T=70, seed=1),
    "store_fp16_h1_d128_bs256": dict(kind="store", Hkv=1, D=128, bs=256, dtype="float16", T=40,
                                     seed=2),
    "store_fp16_h3_d64_bs8": dict(kind="store", Hkv=3, D=64, bs=8, dtype="float16", T=33, seed=3),
    # varlen prefill (direct kernel call): GQA 1/2/4/8, d 64/128/256, chunks mid-block,
    # prefix-cached context, query_len 1 rows in a mixed batch.
    "prefill_g1_d64_fp32_bs16": dict(kind="prefill", H=2, Hkv=2, D=64, bs=16, dtype="float32",
                                     qlens=[37, 1, 130], seqlens=[37, 50, 200], seed=10),
    "prefill_g2_d128_fp16_bs16": dict(kind="prefill", H=2, Hkv=1, D=128, bs=16, dtype="float16",
                                      qlens=[300, 5], seqlens=[300, 26], seed=11),
    "prefill_g4_d64_fp16_bs32": dict(kind="prefill", H=4, Hkv=1, D=64, bs=32, dtype="float16",
                                     qlens=[64, 1, 1, 90], seqlens=[164, 8, 201, 123], seed=12),
    "prefill_g8_d128_fp32_bs8": dict(kind="prefill", H=8, Hkv=1, D=128, bs=8, dtype="float32",
                                     qlens=[45, 1, 17], seqlens=[295, 301, 17], seed=13),
    "prefill_g2_d64_fp32_bs256": dict(kind="prefill", H=4, Hkv=2, D=64, bs=256, dtype="float32",
                                      qlens=[200, 3], seqlens=[300, 259], seed=14),
    # Chunks whose first position sits at / next to a key-tile edge (126, 127, 128, 127 + 64):
    # exercises the split between the unmasked and the causally-masked key loops.
    "prefill_tile_edges_g2_d64_fp32": dict(kind="prefill", H=2, Hkv=1, D=64, bs=16,
                                           dtype="float32", qlens=[5, 3, 130, 2, 70],
                                           seqlens=[131, 130, 258, 129, 197], seed=16),
    "prefill_g2_d256_fp16_bs16": dict(kind="prefill", H=2, Hkv=1, D=256, bs=16, dtype="float16",
                                      qlens=[40, 1], seqlens=[77, 30], seed=15),
    # paged decode: no split, forced splits (power of two and not), heuristic, seq_len 1 and
    # block-boundary lengths, a seq_len 0 padding row (output must be 0, not NaN).
    "decode_g1_d64_fp32_nosplit": dict(kind="decode", H=2, Hkv=2, D=64, bs=16, dtype="float32",
                                       seqlens=[1, 16, 17, 100, 260], splits=1, seed=20),
    "decode_g4_d128_fp16_split4": dict(kind="decode", H=4, Hkv=1, D=128, bs=16, dtype="float16",
                                       seqlens=[1, 33, 300, 513], splits=4, seed=21),
    "decode_g8_d64_fp32_split3": dict(kind="decode", H=8, Hkv=1, D=64, bs=32, dtype="float32",
                                      seqlens=[64, 65, 390], splits=3, seed=22),
    "decode_g2_d128_fp16_auto": dict(kind="decode", H=4, Hkv=2, D=128, bs=256, dtype="float16",
                                     seqlens=[600, 255, 257], splits=None, seed=23),
    "decode_g1_d256_fp32_split2_pad": dict(kind="decode", H=1, Hkv=1, D=256, bs=16,
                                           dtype="float32", seqlens=[0, 40, 129], splits=2,
                                           seed=24),
    # paged_attention dispatch through AttentionMetadata.
    "dispatch_mixed_g4_d128_fp16": dict(kind="dispatch", H=8, Hkv=2, D=128, bs=16,
                                        dtype="float16", qlens=[1, 23, 1, 60, 1],
                                        seqlens=[90, 40, 17, 60, 300], seed=30),
    "dispatch_decode_g8_d64_fp32": dict(kind="dispatch", H=8, Hkv=1, D=64, bs=16,
                                        dtype="float32", qlens=[1, 1, 1], seqlens=[5, 700, 48],
                                        seed=31),
    # Sliding window (Gemma / Mistral local layers): window smaller than a tile (so rows of one
    # tile start their windows in different key tiles, and some rows see no key of a tile),
    # window larger than a tile with a long cached context (the unmasked middle loop runs),
    # window 1 (only the query's own key), chunks mid-block, query_len 1 rows among prefills.
    "window_prefill_w40_g2_d64_fp32": dict(kind="prefill", H=2, Hkv=1, D=64, bs=16,
                                           dtype="float32", qlens=[200, 1, 37, 150],
                                           seqlens=[200, 90, 300, 400], window=40, seed=50),
    "window_prefill_w300_g1_d64_fp32": dict(kind="prefill", H=1, Hkv=1, D=64, bs=32,
                                            dtype="float32", qlens=[130, 260],
                                            seqlens=[700, 260], window=300, seed=51),
    "window_prefill_w1_g4_d64_fp16": dict(kind="prefill", H=4, Hkv=1, D=64, bs=16,
                                          dtype="float16", qlens=[20, 1], seqlens=[50, 9],
                                          window=1, seed=52),
    # paged decode with a window: forced splits over the window only, heuristic, padding row.
    "window_decode_w64_g2_d64_fp32_split3": dict(kind="decode", H=4, Hkv=2, D=64, bs=16,
                                                 dtype="float32", seqlens=[1, 16, 64, 65, 700],
                                                 splits=3, window=64, seed=53),
    "window_decode_w300_g4_d128_fp16_auto": dict(kind="decode", H=4, Hkv=1, D=128, bs=16,
                                                 dtype="float16", seqlens=[0, 299, 301, 1100],
                                                 splits=None, window=300, seed=54),
    # logit soft-capping (Gemma 2), alone and with a window, prefill + decode through dispatch.
    "softcap_prefill_g2_d64_fp32": dict(kind="prefill", H=2, Hkv=1, D=64, bs=16,
                                        dtype="float32", qlens=[70, 1], seqlens=[150, 33],
                                        softcap=5.0, seed=55),
    "softcap_window_dispatch_g2_d64_fp32": dict(kind="dispatch", H=4, Hkv=2, D=64, bs=16,
                                                dtype="float32", qlens=[1, 45, 1],
                                                seqlens=[100, 80, 17], window=24, softcap=5.0,
                                                seed=56),
    "softcap_window_decode_g2_d64_fp32_split2": dict(kind="decode", H=2, Hkv=1, D=64, bs=16,
                                                     dtype="float32", seqlens=[40, 300],
                                                     splits=2, window=100, softcap=5.0,
                                                     seed=57),
    # float8 e4m3 caches (kv="fp8": caches quantized with a per-cache scale, reference over the
    # dequantized values): store rounding + clamping, prefill, split decode with window and
    # softcap, a mixed batch with 16-bit dots.
    "fp8_store_h2_d64": dict(kind="store", Hkv=2, D=64, bs=16, dtype="float32", T=70, seed=60,
                             kv="fp8"),
    "fp8_prefill_g2_d64_fp32": dict(kind="prefill", H=4, Hkv=2, D=64, bs=16, dtype="float32",
                                    qlens=[70, 1, 130], seqlens=[70, 90, 300], seed=61, kv="fp8"),
    "fp8_decode_g4_d128_fp32_split3_window_softcap": dict(
        kind="decode", H=4, Hkv=1, D=128, bs=16, dtype="float32", seqlens=[0, 40, 300, 513],
        splits=3, window=200, softcap=5.0, seed=62, kv="fp8"),
    "fp8_dispatch_mixed_g4_d128_fp16": dict(kind="dispatch", H=8, Hkv=2, D=128, bs=16,
                                            dtype="float16", qlens=[1, 23, 1, 60],
                                            seqlens=[90, 40, 17, 160], seed=63, kv="fp8"),
}


def _random_cases(seed: int = 1234) -> dict[str, dict]:
    """Fixed-seed sweep: every (GQA ratio, head_dim, dtype) gets one mixed batch through
    ``paged_attention`` (query lengths 1..300, random cached context 0..300, random block size)
    and one decode-only batch (contexts 1..1100, random split count incl. the heuristic)."""
    import random
    rng = random.Random(seed)
    cases = {}
    for group in (1, 2, 4, 8):
        for D in (64, 128):
            for dtype in ("float32", "float16"):
                Hkv = rng.choice([1, 2]) if group < 8 else 1
                bs = rng.choice([8, 16, 32, 256])
                n = rng.randint(1, 4)
                qlens = [1 if rng.random() < 0.35 else rng.randint(2, 300) for _ in range(n)]
                ctx = [0 if rng.random() < 0.25 else rng.randint(1, 300) for _ in range(n)]
                tag = f"g{group}_d{D}_{'fp32' if dtype == 'float32' else 'fp16'}"
                cases[f"rand_mixed_{tag}"] = dict(
                    kind="dispatch", H=group * Hkv, Hkv=Hkv, D=D, bs=bs, dtype=dtype,
                    qlens=qlens, seqlens=[q + c for q, c in zip(qlens, ctx)],
                    seed=rng.randint(0, 10**6))
                nd = rng.randint(1, 4)
                cases[f"rand_decode_{tag}"] = dict(
                    kind="decode", H=group * Hkv, Hkv=Hkv, D=D, bs=bs, dtype=dtype,
                    seqlens=[rng.randint(1, 1100) for _ in range(nd)],
                    splits=rng.choice([None, 1, 2, 3, 5]), seed=rng.randint(0, 10**6))
    return cases


CASES.update(_random_cases())

# Problems for the in-process torch path (no Triton).
TORCH_CASES = {k: v for k, v in CASES.items() if v["kind"] not in ("store", "heuristic")}
# More decode rows than one length bucket of the torch path holds (DECODE_BUCKET_ROWS = 16),
# in arbitrary length order, between prefill chunks.
_r = random.Random(7)
TORCH_CASES["torch_decode_buckets"] = dict(
    kind="dispatch", H=8, Hkv=2, D=64, bs=16, dtype="float32",
    qlens=[1] * 20 + [70] + [1] * 21 + [9], seqlens=[_r.randint(1, 300) for _ in range(20)] + [70]
    + [_r.randint(1, 300) for _ in range(21)] + [140], seed=40)
# One long decode row among short ones: it gets a bucket of its own (short rows are not padded to it).
TORCH_CASES["torch_decode_long_outlier"] = dict(
    kind="dispatch", H=9, Hkv=3, D=64, bs=16, dtype="float32",
    qlens=[1] * 8 + [1, 5], seqlens=[_r.randint(20, 60) for _ in range(8)] + [1500, 45], seed=41)
# Windowed decode rows of many lengths (more than one bucket) between windowed prefill chunks.
TORCH_CASES["torch_window_decode_buckets"] = dict(
    kind="dispatch", H=4, Hkv=2, D=64, bs=8, dtype="float32",
    qlens=[1] * 18 + [30, 1, 1], seqlens=[_r.randint(1, 120) for _ in range(18)] + [90, 7, 500],
    window=20, seed=42)
# Soft-capping in the torch path with a plain causal prefill (no cached context, no window).
TORCH_CASES["torch_softcap_causal"] = dict(
    kind="dispatch", H=4, Hkv=1, D=64, bs=16, dtype="float32", qlens=[33, 1],
    seqlens=[33, 60], softcap=3.0, seed=43)


def test_decode_buckets_split_at_long_rows():
    """A decode row more than twice as long as its bucket's first row opens a new bucket."""
    from kernels.torch_backend import _decode_plan

    p = make_problem(TORCH_CASES["torch_decode_long_outlier"])
    plan = _decode_plan(_meta(p), p["k_cache"])
    sizes = [len(rows) for rows, _gather, _mask in plan]
    assert sizes == [8, 1], sizes
    widths = [mask.shape[-1] for _rows, _gather, mask in plan]
    assert widths[0] <= 60 and widths[1] == 1500
    # with a window of 64 every row reads at most 64 keys: one bucket, 64 wide
    plan = _decode_plan(_meta(p), p["k_cache"], 64)
    assert [len(rows) for rows, _g, _m in plan] == [9] and plan[0][2].shape[-1] == 64


@pytest.mark.parametrize("window,softcap", [(0, None), (-3, None), (2.5, None), (True, None),
                                            (None, 0.0), (None, -1.0), (None, float("inf"))])
def test_bad_window_or_softcap_raises(window, softcap):
    from kernels.torch_backend import paged_attention_torch

    p = make_problem(dict(H=2, Hkv=1, D=16, bs=4, dtype="float32", qlens=[3], seqlens=[5], seed=1))
    with pytest.raises(ValueError, match="window|softcap"):
        paged_attention_torch(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], window, softcap)


# ------------------------------------------------------------------------------------------
# Problem construction and reference
# ------------------------------------------------------------------------------------------

def make_problem(spec: dict, device: str = "cpu", dtype: str | None = None) -> dict:
    """Random paged-cache problem. Blocks are scattered (random permutation); every slot that
    is not one of a request's first ``seq_len`` tokens holds NaN."""
    gen = torch.Generator().manual_seed(spec["seed"])
    dt = DTYPES[dtype or spec["dtype"]]
    H, Hkv, D, bs = spec["H"], spec["Hkv"], spec["D"], spec["bs"]
    seqlens = list(spec["seqlens"])
    qlens = list(spec.get("qlens") or [1] * len(seqlens))
    nblk = [(s + bs - 1) // bs for s in seqlens]
    num_blocks = sum(nblk) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    width = max(nblk + [1]) + 1
    block_tables = torch.zeros(len(seqlens), width, dtype=torch.int32)
    k_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"))
    v_cache = torch.full((num_blocks, bs, Hkv, D), float("nan"))
    used = 0
    for i, s in enumerate(seqlens):
        ids = perm[used:used + nblk[i]]
        used += nblk[i]
        block_tables[i, :nblk[i]] = ids.to(torch.int32)
        for t in range(s):
            b, o = int(ids[t // bs]), t % bs
            k_cache[b, o] = torch.randn(Hkv, D, generator=gen)
            v_cache[b, o] = torch.randn(Hkv, D, generator=gen)
    T = sum(qlens)
    q = 2.0 * torch.randn(T, H, D, generator=gen)  # sharper softmax than unit scores
    cu = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(qlens), 0)
    return dict(q=q.to(dt).to(device), k_cache=k_cache.to(dt).to(device),
                v_cache=v_cache.to(dt).to(device), block_tables=block_tables.to(device),
                seq_lens=torch.tensor(seqlens, dtype=torch.int32, device=device),
                cu_seqlens_q=cu.to(device), qlens=qlens, seqlens=seqlens,
                scale=D ** -0.5, H=H, Hkv=Hkv, D=D, bs=bs,
                window=spec.get("window"), softcap=spec.get("softcap"))


def quantize_fp8(p: dict) -> dict:
    """Store ``p``'s caches as float8 e4m3 in place (per-cache scale: the largest value maps to
    224) and return the same problem with the dequantized caches (their dtype as before),
    whose float64 reference is what attention over the float8 caches must compute. NaN slots
    stay NaN."""
    from kernels.torch_backend import FP8, FP8_MAX
    deq = dict(p)
    for name, key in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        c = p[name].float()
        s = float(torch.nan_to_num(c).abs().max()) * 2 / FP8_MAX
        q8 = (c / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        p[name], p[key] = q8, s
        deq[name] = (q8.float() * s).to(c.device)
    return deq


def ref_attention(p: dict) -> torch.Tensor:
    """float64 causal paged attention (optional sliding window and logit soft-capping), one
    request / head at a time, slot by slot."""
    q = p["q"].double().cpu()
    kc, vc = p["k_cache"].double().cpu(), p["v_cache"].double().cpu()
    bt = p["block_tables"].cpu()
    bs, group = p["bs"], p["H"] // p["Hkv"]
    out = torch.zeros_like(q)
    start = 0
    for i, (ql, sl) in enumerate(zip(p["qlens"], p["seqlens"])):
        if sl == 0:
            start += ql
            continue
        blocks = [int(bt[i, t // bs]) for t in range(sl)]
        k = torch.stack([kc[blocks[t], t % bs] for t in range(sl)])  # [sl, Hkv, D]
        v = torch.stack([vc[blocks[t], t % bs] for t in range(sl)])
        ctx = sl - ql
        qpos = (ctx + torch.arange(ql))[:, None]
        allowed = torch.arange(sl)[None, :] <= qpos  # [ql, sl]
        if p.get("window"):
            allowed &= torch.arange(sl)[None, :] > qpos - p["window"]
        for h in range(p["H"]):
            s = q[start:start + ql, h] @ k[:, h // group].T * p["scale"]
            if p.get("softcap"):
                s = p["softcap"] * torch.tanh(s / p["softcap"])
            s = s.masked_fill(~allowed, float("-inf"))
            out[start:start + ql, h] = torch.softmax(s, -1) @ v[:, h // group]
        start += ql
    return out


def _meta(p: dict):
    from kernels.backend import AttentionMetadata
    return AttentionMetadata(
        cu_seqlens_q=p["cu_seqlens_q"], seq_lens=p["seq_lens"], block_tables=p["block_tables"],
        slot_mapping=torch.empty(0, dtype=torch.int64), query_lens_cpu=p["qlens"],
        seq_lens_cpu=p["seqlens"], max_seqlen_q=max(p["qlens"]), max_seqlen_k=max(p["seqlens"]))


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict:
    out = out.double().cpu()
    nonfinite = int((~torch.isfinite(out)).sum())
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    rel = err / max(ref.abs().max().item(), 1e-30)
    bound = BOUNDS[dtype]
    return dict(ok=bool(nonfinite == 0 and rel <= bound), max_abs_err=err, rel_err=rel,
                bound=bound, nonfinite=nonfinite)


def run_case(name: str, device: str = "cpu", dtype: str | None = None) -> dict:
    """Run one Triton case (interpreter on CPU, compiled on CUDA); returns a result dict."""
    from kernels import triton_attention as ta
    spec = CASES[name]
    if spec["kind"] == "heuristic":
        return _run_heuristic()
    dtype = dtype or spec["dtype"]
    if spec["kind"] == "store":
        return _run_store(spec, device, dtype)
    p = make_problem(spec, device, dtype)
    ref_problem = p
    ws = dict(window=p["window"], softcap=p["softcap"])
    if spec.get("kv") == "fp8":
        ref_problem = quantize_fp8(p)
        ws.update(k_scale=p["k_scale"], v_scale=p["v_scale"])
    out = torch.full_like(p["q"], float("nan"))
    if spec["kind"] == "prefill":
        ta.varlen_prefill_attention(p["q"], p["k_cache"], p["v_cache"], p["block_tables"],
                                    p["seq_lens"], p["cu_seqlens_q"], max(p["qlens"]),
                                    p["scale"], out=out, **ws)
    elif spec["kind"] == "decode":
        ta.paged_decode_attention(p["q"], p["k_cache"], p["v_cache"], p["block_tables"],
                                  p["seq_lens"], p["scale"], max(p["seqlens"]), out=out,
                                  num_splits=spec["splits"], **ws)
    else:
        out = ta.paged_attention(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"],
                                 out=out, **ws)
    return _compare(out, ref_attention(ref_problem), dtype)


def _run_heuristic() -> dict:
    """Split-K choice (pure Python, but importing the module decorates the kernels, which
    fixes interpreter-or-not for the process: hence also in the child)."""
    from kernels.triton_attention import choose_num_splits
    checks = [
        choose_num_splits(64, 8, 8192, 132) == 1,  # big batch fills the GPU: no split
        choose_num_splits(1, 8, 8192, 132) == 32,  # batch 1, long context: capped at 32
        choose_num_splits(1, 8, 300, 132) == 1,  # too few keys to split
        choose_num_splits(4, 8, 2048, 132) == 8,  # 256 keys per split
    ]
    for args in [(1, 1, 10**6, 1000), (3, 2, 1000, 8), (100, 1, 100, 4)]:
        n = choose_num_splits(*args)
        checks.append(1 <= n <= 32 and n & (n - 1) == 0)
    return dict(ok=all(checks), checks=checks)


def _run_store(spec: dict, device: str, dtype: str) -> dict:
    from kernels import triton_attention as ta
    gen = torch.Generator().manual_seed(spec["seed"])
    Hkv, D, bs, T = spec["Hkv"], spec["D"], spec["bs"], spec["T"]
    num_blocks = (T + bs - 1) // bs + 2
    fp8 = spec.get("kv") == "fp8"
    dt = torch.float8_e4m3fn if fp8 else DTYPES[dtype]
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.2] = -1
    # Views with a padded token stride (as when K/V are slices of a fused qkv projection).
    kv = torch.randn(T, 2, Hkv, D, generator=gen)
    scales = dict(k_scale=2.0 ** -4, v_scale=0.01) if fp8 else {}
    if fp8:  # values across e4m3's whole range (subnormals, some past 448 * scale) and, in K,
        # every exact tie between neighbouring e4m3 values (round to nearest even)
        kv *= torch.logspace(-5, 1.5, T * 2 * Hkv * D)[torch.randperm(T * 2 * Hkv * D, generator=gen)].view(kv.shape)
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[grid.isfinite()].unique()
        ties = torch.cat([(grid[1:] + grid[:-1]) / 2, grid]) * scales["k_scale"]
        rows = kv[:, 0].view(T, Hkv * D)  # a view (raises if it cannot be): writes land in kv
        i = torch.arange(ties.numel())
        rows[i // (Hkv * D), i % (Hkv * D)] = ties[torch.randperm(ties.numel(), generator=gen)]
    key, value = kv[:, 0], kv[:, 1]
    # The caches are the middle of NaN buffers with one guard block on each side: a write
    # through a negative (skipped) slot or past the end lands in a guard and is detected.
    k_buf = torch.full((num_blocks + 2, bs, Hkv, D), float("nan"), dtype=dt)
    v_buf = torch.full_like(k_buf, float("nan"))
    exp_k, exp_v = k_buf.clone(), v_buf.clone()
    keep = slots >= 0
    if fp8:  # torch's own float8 rounding (nearest even) of the clamped, scaled values
        key_q, value_q = ((x / s).clamp(-448, 448)
                          for x, s in ((key, scales["k_scale"]), (value, scales["v_scale"])))
    else:
        key_q, value_q = key, value
    raw = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)  # no float8 indexing in ATen
    raw(exp_k)[1:-1].reshape(-1, Hkv, D)[slots[keep]] = raw(key_q[keep].to(dt))
    raw(exp_v)[1:-1].reshape(-1, Hkv, D)[slots[keep]] = raw(value_q[keep].to(dt))
    k_buf, v_buf = k_buf.to(device), v_buf.to(device)
    ta.store_kv(key.to(device), value.to(device), k_buf[1:-1], v_buf[1:-1], slots.to(device),
                **scales)

    def same(a, b):
        a = a.cpu()
        if fp8:  # bit patterns (NaN guards included)
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return bool(((a == b) | (a.isnan() & b.isnan())).all())

    ok = same(k_buf, exp_k) and same(v_buf, exp_v)
    return dict(ok=ok, max_abs_err=0.0 if ok else float("nan"), rel_err=0.0, bound=0.0,
                nonfinite=0, written=int(keep.sum()))


# ------------------------------------------------------------------------------------------
# Subprocess driver
# ------------------------------------------------------------------------------------------

def _child_env(interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cases_in_subprocess(names: list[str], device: str, dtype: str | None = None,
                            timeout: float = 600) -> dict[str, dict]:
    """Run ``names`` in child processes; a crash marks the current case and restarts."""
    results: dict[str, dict] = {}
    todo = list(names)
    deadline = time.monotonic() + timeout
    while todo:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device]
        if dtype:
            cmd += ["--dtype", dtype]
        try:
            proc = subprocess.run(cmd + todo, capture_output=True, text=True, cwd=str(ROOT),
                                  env=_child_env(device == "cpu"),
                                  timeout=max(1.0, deadline - time.monotonic()))
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr, rc = "timeout", -1
        current = None
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec.get("status") == "start":
                current = rec["case"]
            else:
                results[rec["case"]] = rec
                current = None
        todo = [n for n in todo if n not in results]
        if current is not None:  # the child died inside this case
            results[current] = dict(case=current, ok=False,
                                    error=f"child crashed (rc={rc}): {stderr[-2000:]}")
            todo.remove(current)
        elif todo:  # died before starting anything: give up on the rest
            for n in todo:
                results[n] = dict(case=n, ok=False, error=f"child failed (rc={rc}): "
                                                          f"{stderr[-2000:]}")
            break
        if stderr == "timeout":
            for n in todo:
                results[n] = dict(case=n, ok=False, error="timeout")
            break
    return results


def _main(argv: list[str]) -> None:
    import argparse
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 for CPU runs"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    for name in args.cases or list(CASES):
        print(json.dumps(dict(case=name, status="start")), flush=True)
        t0 = time.perf_counter()
        try:
            rec = run_case(name, args.device, args.dtype)
        except Exception as exc:  # noqa: BLE001 - reported per case
            rec = dict(ok=False, error=f"{type(exc).__name__}: {exc}")
        rec.update(case=name, seconds=round(time.perf_counter() - t0, 2))
        print(json.dumps(rec), flush=True)


# ------------------------------------------------------------------------------------------
# pytest
# ------------------------------------------------------------------------------------------

def _describe(rec: dict) -> str:
    return json.dumps({k: rec.get(k) for k in ("rel_err", "max_abs_err", "bound", "nonfinite",
                                                "seconds", "error") if k in rec})


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return run_cases_in_subprocess(list(CASES), "cpu", timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter(name, interpreter_results):
    rec = interpreter_results[name]
    assert rec.get("ok"), f"{name}: {_describe(rec)}"


@pytest.mark.parametrize("name", list(TORCH_CASES))
def test_torch_reference_path(name):
    from kernels.torch_backend import paged_attention_torch
    spec = TORCH_CASES[name]
    p = make_problem(spec)
    out = paged_attention_torch(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"],
                                p["window"], p["softcap"])
    if 0 in p["seqlens"]:  # the torch path leaves seq_len-0 padding rows unspecified
        keep = torch.tensor([s > 0 for s in p["seqlens"]])
        rows = torch.repeat_interleave(keep, torch.tensor(p["qlens"]))
        out, ref = out[rows], ref_attention(p)[rows]
    else:
        ref = ref_attention(p)
    rec = _compare(out, ref, spec["dtype"])
    assert rec["ok"], f"{name}: {_describe(rec)}"


# The C++ CPU kernel (kernels/cpu_backend.py) takes float32 or bfloat16 queries and caches; each case
# runs in both (fp16 problems are recast). Plus
# short chunks (query length 2..16: the kernel's, not SDPA's) next to long ones and decode rows.
CPU_CASES = dict(TORCH_CASES)
CPU_CASES["cpu_short_chunks"] = dict(
    kind="dispatch", H=6, Hkv=2, D=64, bs=16, dtype="float32", qlens=[16, 2, 1, 17, 5, 1],
    seqlens=[40, 2, 33, 17, 260, 1], seed=44)
CPU_CASES["cpu_short_chunks_window_softcap"] = dict(
    kind="dispatch", H=4, Hkv=1, D=64, bs=8, dtype="float32", qlens=[7, 1, 16, 30],
    seqlens=[50, 9, 16, 100], window=6, softcap=4.0, seed=45)


@pytest.fixture(scope="module")
def cpu_kernel():
    from kernels import cpu_backend
    if not cpu_backend.load_kernel():
        pytest.skip(f"cpu attention kernel cannot be built here: {cpu_backend.kernel_error()}")
    return cpu_backend


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(CPU_CASES))
def test_cpu_kernel(name, dtype, cpu_kernel):
    """The CPU kernel (and, for chunks longer than it takes, the SDPA path) against the float64
    reference over the same float32 or bfloat16 values; bfloat16 output is rounded once."""
    p = make_problem(dict(CPU_CASES[name], dtype=dtype))
    out = cpu_kernel.paged_attention_cpu(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"],
                                         p["window"], p["softcap"])
    assert out.dtype == DTYPES[dtype]
    rec = _compare(out, ref_attention(p), dtype)  # seq_len-0 rows: the kernel writes zeros
    assert rec["ok"], f"{name}: {_describe(rec)}"


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
    from kernels.torch_backend import paged_attention_torch
    p, deq = _fp8_problem(FP8_CASES[name])
    p["q"] = deq["q"] = p["q"].to(DTYPES[q_dtype])
    fn = paged_attention_torch if backend == "torch" else cpu_kernel.paged_attention_cpu
    out = fn(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], p["window"], p["softcap"],
             p["k_scale"], p["v_scale"])
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


FRESH_CASES = dict({k: FP8_CASES[k] for k in ("fp8_dispatch_mixed_g4_d128_fp16", "softcap_window_dispatch_g2_d64_fp32",
                                                "torch_decode_long_outlier", "cpu_short_chunks",
                                                "cpu_short_chunks_window_softcap", "rand_mixed_g8_d128_fp16")},
                   fp8_fresh_chunks_g2_d64_window=dict(
    kind="dispatch", H=4, Hkv=2, D=64, bs=16, dtype="float32", qlens=[1, 5, 16, 40, 1, 17, 30],
    seqlens=[90, 30, 16, 160, 17, 17, 200], window=24, seed=64, kv="fp8"))


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
    from kernels.torch_backend import paged_attention_torch
    spec = FRESH_CASES[name]
    orig = make_problem(dict(spec, dtype="float32"))
    p, deq = _fp8_problem(spec)
    dt = DTYPES[q_dtype]
    p["q"] = p["q"].to(dt)
    key, value, ref_problem = _step_kv(p, orig, deq, dt)
    ref_problem["q"] = p["q"]
    fn = paged_attention_torch if backend == "torch" else cpu_kernel.paged_attention_cpu
    out = fn(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], p["window"], p["softcap"],
             p["k_scale"], p["v_scale"], key=key, value=value)
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
    from kernels.torch_backend import FP8, dequantize, store_kv_torch
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
    k_rel = ((k - key).abs() / key.abs().clamp_min(2 ** -6 * 0.05)).flatten()[1:]
    assert k_rel.max() <= 2 ** -4 + 1e-6
    assert ((v - val).abs() / val.abs().clamp_min(2 ** -6 * 0.01)).max() <= 2 ** -4 + 1e-6
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.view(torch.uint8).view(32, -1)[untouched].any()


def test_cpu_fused_ops_match_aten(cpu_kernel):
    """The fused element-wise ops against the ATen formulas they replace (float64 reference),
    on strided row views as the model passes them, with row counts on both sides of the
    single-thread / thread-pool split."""
    from engine.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(5)
    for rows in (1, 64, 700):
        H = 576
        x = torch.randn(rows, 2 * H, generator=g)[:, :H]  # strided rows
        res = torch.randn(rows, H, generator=g)
        w = torch.randn(H, generator=g)
        ref = lambda t, off=0.0: ((t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5))
                                  * (w.double() + off))
        for off in (0.0, 1.0):
            out = cpu_kernel.rms_norm(x, w, 1e-5, off)
            assert (out.double() - ref(x, off)).abs().max() < 1e-5
        r0 = res.clone()
        out, r = cpu_kernel.add_rms_norm(x, res, w, 1e-5)
        assert r is res and torch.allclose(res, r0 + x, atol=0, rtol=0)  # residual updated in place
        assert (out.double() - ref(r0 + x)).abs().max() < 1e-5
        gu = torch.randn(rows, 2 * 1536, generator=g)
        ref_sm = torch.nn.functional.silu(gu[:, :1536].double()) * gu[:, 1536:].double()
        assert (cpu_kernel.silu_and_mul(gu).double() - ref_sm).abs().max() < 1e-5
        rope = RotaryEmbedding(64, 4096, 10000.0)
        qkv = torch.randn(rows, (9 + 3 + 3) * 64, generator=g)
        q, k = qkv[:, :576].reshape(rows, 9, 64), qkv[:, 576:768].reshape(rows, 3, 64)
        pos = torch.randint(0, 4096, (rows,), generator=g)
        cos, sin = rope.cos[pos][:, None].double(), rope.sin[pos][:, None].double()
        rot = lambda t: t * cos + torch.cat((-t[..., 32:], t[..., :32]), -1) * sin
        q_ref, k_ref, v_before = rot(q.double()), rot(k.double()), qkv[:, 768:].clone()
        q2, k2 = cpu_kernel.rotary(q, k, pos, rope.cos, rope.sin)
        assert q2.data_ptr() == q.data_ptr()  # in place, in the qkv buffer
        assert (q.double() - q_ref).abs().max() < 1e-5 and (k.double() - k_ref).abs().max() < 1e-5
        assert torch.equal(qkv[:, 768:], v_before)  # v untouched


def test_cpu_fused_ops_in_bfloat16(cpu_kernel):
    """bfloat16 inputs: each op equals the float64 formula over the same bfloat16 values,
    rounded once to bfloat16 (within one bfloat16 ulp, 2^-8 relative, plus a small absolute
    slack for outputs near zero); the residual add rounds like ATen's bfloat16 add."""
    from engine.layers.rotary import RotaryEmbedding
    g = torch.Generator().manual_seed(6)
    bf = torch.bfloat16

    def close(out, ref):
        assert out.dtype == bf
        err = (out.double() - ref).abs()
        assert (err <= 2 ** -8 * ref.abs() + 1e-3 * ref.abs().max()).all(), float(err.max())

    for rows in (1, 64, 300):
        H = 576
        x = torch.randn(rows, 2 * H, generator=g).to(bf)[:, :H]
        res = torch.randn(rows, H, generator=g).to(bf)
        w = torch.randn(H, generator=g).to(bf)
        ref = lambda t: (t.double() * torch.rsqrt(t.double().pow(2).mean(-1, keepdim=True) + 1e-5)) * w.double()
        close(cpu_kernel.rms_norm(x, w, 1e-5), ref(x))
        r0 = res.clone()
        out, r = cpu_kernel.add_rms_norm(x, res, w, 1e-5)
        assert r is res and torch.equal(res, r0 + x)
        close(out, ref(r0 + x))
        gu = torch.randn(rows, 2 * 1536, generator=g).to(bf)
        close(cpu_kernel.silu_and_mul(gu), torch.nn.functional.silu(gu[:, :1536].double()) * gu[:, 1536:].double())
        rope = RotaryEmbedding(64, 4096, 10000.0)
        q = torch.randn(rows, 9, 64, generator=g).to(bf)
        k = torch.randn(rows, 3, 64, generator=g).to(bf)
        pos = torch.randint(0, 4096, (rows,), generator=g)
        cos, sin = rope.cos[pos][:, None].double(), rope.sin[pos][:, None].double()
        rot = lambda t: t * cos + torch.cat((-t[..., 32:], t[..., :32]), -1) * sin
        q_ref, k_ref = rot(q.double()), rot(k.double())
        cpu_kernel.rotary(q, k, pos, rope.cos, rope.sin)
        close(q, q_ref)
        close(k, k_ref)


def test_cpu_fused_ops_reject_mixed_dtypes(cpu_kernel):
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeError, match="same dtype"):
        cpu_kernel.add_rms_norm(x, torch.randn(4, 64).bfloat16(), torch.ones(64), 1e-5)
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        cpu_kernel.silu_and_mul(torch.randn(4, 64).half())


@pytest.mark.parametrize("large_on_aten", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 64, 600])
def test_linear_with_prepacked_weight_matches_float64(monkeypatch, rows, large_on_aten):
    """engine.layers.linear.linear on a prepacked weight (oneDNN blocked layout) and on the
    ATen route for large batches: float32 results equal float64 within float32 rounding."""
    import engine.layers.linear as L
    monkeypatch.setattr(L, "_LARGE_ON_ATEN", large_on_aten)
    monkeypatch.setattr(L, "CPU_LINEAR", "onednn")
    g = torch.Generator().manual_seed(rows)
    w, b = torch.randn(300, 200, generator=g) / 10, torch.randn(300, generator=g)
    x = torch.randn(rows, 400, generator=g)[:, :200].contiguous()
    packed = L.prepack_weight(w)
    assert packed is not None and packed.is_mkldnn
    ref = x.double() @ w.double().T + b.double()
    with torch.inference_mode():
        for y in (L.linear(x, w, b, packed), L.linear(x, w, b)):
            assert y.dtype == torch.float32 and y.shape == (rows, 300)
            assert (y.double() - ref).abs().max() / ref.abs().max() < 1e-5


def test_prepack_is_skipped_where_it_does_not_apply(monkeypatch):
    import engine.layers.linear as L
    assert L.prepack_weight(torch.randn(8, 8).half()) is None
    monkeypatch.setattr(L, "CPU_LINEAR", "aten")
    assert L.prepack_weight(torch.randn(8, 8)) is None


def test_flash_attn_backend_calls(monkeypatch):
    """flash-attn cannot be installed here: a fake module checks what the backend passes
    (decode-only batch -> ``flash_attn_with_kvcache``, anything else -> paged varlen)."""
    import types
    from kernels import flash_attn_backend as fab
    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
               alibi_slopes=None, deterministic=False, return_attn_probs=False,
               block_table=None):
        calls.append(("varlen", dict(q=q, k=k, cu_seqlens_q=cu_seqlens_q,
                                     cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                     max_seqlen_k=max_seqlen_k, scale=softmax_scale,
                                     causal=causal, block_table=block_table,
                                     window_size=window_size, softcap=softcap)))
        return torch.zeros_like(q)

    def with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                     cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                     block_table=None, softmax_scale=None, causal=False, **kw):
        calls.append(("kvcache", dict(q=q, cache_seqlens=cache_seqlens, block_table=block_table,
                                      scale=softmax_scale, causal=causal,
                                      window_size=kw.get("window_size"), softcap=kw.get("softcap"))))
        return torch.zeros_like(q)

    def store_kv(*args):
        calls.append(("store", args))

    fake = types.SimpleNamespace(flash_attn_varlen_func=varlen,
                                 flash_attn_with_kvcache=with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    # the Triton scatter, faked: importing the kernel module here would compile-mode it
    monkeypatch.setitem(sys.modules, "kernels.triton_attention", types.SimpleNamespace(store_kv=store_kv))
    monkeypatch.setattr(fab, "_funcs", None)
    assert fab.FlashAttnBackend.import_error() is None
    backend = fab.FlashAttnBackend()
    spec = dict(H=4, Hkv=2, D=64, bs=256, dtype="float16", seed=5)
    p = make_problem(dict(spec, qlens=[3, 1, 40], seqlens=[300, 20, 40]))
    out = backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125)
    name, kw = calls[-1]
    assert name == "varlen" and kw["causal"] and kw["scale"] == 0.125 and out.shape == p["q"].shape
    assert kw["cu_seqlens_k"].tolist() == [0, 300, 320, 360]
    assert kw["cu_seqlens_k"].dtype == torch.int32 and kw["block_table"] is p["block_tables"]
    assert kw["k"] is p["k_cache"] and (kw["max_seqlen_q"], kw["max_seqlen_k"]) == (40, 300)
    assert kw["window_size"] == (-1, -1) and kw["softcap"] == 0.0  # full attention, no capping
    backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125, window=16, softcap=30.0)
    assert calls[-1][1]["window_size"] == (15, 0) and calls[-1][1]["softcap"] == 30.0
    p = make_problem(dict(spec, qlens=[1, 1], seqlens=[300, 7]))
    out = backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125)
    name, kw = calls[-1]
    assert name == "kvcache" and kw["q"].shape == (2, 1, 4, 64) and out.shape == (2, 4, 64)
    assert kw["cache_seqlens"] is p["seq_lens"] and kw["block_table"] is p["block_tables"]
    backend.forward(p["q"], p["k_cache"], p["v_cache"], _meta(p), 0.125, window=512)
    assert calls[-1][0] == "kvcache" and calls[-1][1]["window_size"] == (511, 0)
    slots = torch.tensor([3, -1])
    backend.store_kv(p["q"], p["q"], p["k_cache"], p["v_cache"], slots)
    assert calls[-1][0] == "store" and calls[-1][1][4] is slots


# GPU: real compile (no interpreter), fp16 + bf16.
_GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_gpu(dtype):
    res = run_cases_in_subprocess(list(CASES), "cuda", dtype=dtype, timeout=600)
    bad = {n: _describe(r) for n, r in res.items() if not r.get("ok")}
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU")
def test_triton_gpu_fp32():
    res = run_cases_in_subprocess(list(CASES), "cuda", dtype="float32", timeout=600)
    bad = {n: _describe(r) for n, r in res.items() if not r.get("ok")}
    assert not bad, bad


if __name__ == "__main__":
    _main(sys.argv[1:])
