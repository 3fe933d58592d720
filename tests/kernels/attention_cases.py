"""Paged-attention problems and their float64 reference, shared by the kernel tests of this folder
(test_triton_attention.py, test_torch_attention.py, test_cpu_kernels.py, test_fp8_kv_attention.py,
test_flash_attn_backend.py) and by the Triton runner (triton_case_runner.py).

``CASES`` are the Triton cases (store, varlen prefill, paged decode, dispatch, sliding windows,
soft-capping, float8 caches and a fixed-seed sweep); ``TORCH_CASES`` the problems of the in-process
torch path (``kvserve/kernels/torch_backend.py``); ``CPU_CASES`` those of the C++ CPU kernel.

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
import random
import sys
from pathlib import Path

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
    "store_fp16_h1_d128_bs256": dict(kind="store", Hkv=1, D=128, bs=256, dtype="float16", T=40, seed=2),
    "store_fp16_h3_d64_bs8": dict(kind="store", Hkv=3, D=64, bs=8, dtype="float16", T=33, seed=3),
    # varlen prefill (direct kernel call): GQA 1/2/4/8, d 64/128/256, chunks mid-block,
    # prefix-cached context, query_len 1 rows in a mixed batch.
    "prefill_g1_d64_fp32_bs16": dict(
        kind="prefill", H=2, Hkv=2, D=64, bs=16, dtype="float32", qlens=[37, 1, 130], seqlens=[37, 50, 200], seed=10
    ),
    "prefill_g2_d128_fp16_bs16": dict(
        kind="prefill", H=2, Hkv=1, D=128, bs=16, dtype="float16", qlens=[300, 5], seqlens=[300, 26], seed=11
    ),
    "prefill_g4_d64_fp16_bs32": dict(
        kind="prefill",
        H=4,
        Hkv=1,
        D=64,
        bs=32,
        dtype="float16",
        qlens=[64, 1, 1, 90],
        seqlens=[164, 8, 201, 123],
        seed=12,
    ),
    "prefill_g8_d128_fp32_bs8": dict(
        kind="prefill", H=8, Hkv=1, D=128, bs=8, dtype="float32", qlens=[45, 1, 17], seqlens=[295, 301, 17], seed=13
    ),
    "prefill_g2_d64_fp32_bs256": dict(
        kind="prefill", H=4, Hkv=2, D=64, bs=256, dtype="float32", qlens=[200, 3], seqlens=[300, 259], seed=14
    ),
    # Chunks whose first position sits at / next to a key-tile edge (126, 127, 128, 127 + 64):
    # exercises the split between the unmasked and the causally-masked key loops.
    "prefill_tile_edges_g2_d64_fp32": dict(
        kind="prefill",
        H=2,
        Hkv=1,
        D=64,
        bs=16,
        dtype="float32",
        qlens=[5, 3, 130, 2, 70],
        seqlens=[131, 130, 258, 129, 197],
        seed=16,
    ),
    "prefill_g2_d256_fp16_bs16": dict(
        kind="prefill", H=2, Hkv=1, D=256, bs=16, dtype="float16", qlens=[40, 1], seqlens=[77, 30], seed=15
    ),
    # paged decode: no split, forced splits (power of two and not), heuristic, seq_len 1 and
    # block-boundary lengths, a seq_len 0 padding row (output must be 0, not NaN).
    "decode_g1_d64_fp32_nosplit": dict(
        kind="decode", H=2, Hkv=2, D=64, bs=16, dtype="float32", seqlens=[1, 16, 17, 100, 260], splits=1, seed=20
    ),
    "decode_g4_d128_fp16_split4": dict(
        kind="decode", H=4, Hkv=1, D=128, bs=16, dtype="float16", seqlens=[1, 33, 300, 513], splits=4, seed=21
    ),
    "decode_g8_d64_fp32_split3": dict(
        kind="decode", H=8, Hkv=1, D=64, bs=32, dtype="float32", seqlens=[64, 65, 390], splits=3, seed=22
    ),
    "decode_g2_d128_fp16_auto": dict(
        kind="decode", H=4, Hkv=2, D=128, bs=256, dtype="float16", seqlens=[600, 255, 257], splits=None, seed=23
    ),
    "decode_g1_d256_fp32_split2_pad": dict(
        kind="decode", H=1, Hkv=1, D=256, bs=16, dtype="float32", seqlens=[0, 40, 129], splits=2, seed=24
    ),
    # paged_attention dispatch through AttentionMetadata.
    "dispatch_mixed_g4_d128_fp16": dict(
        kind="dispatch",
        H=8,
        Hkv=2,
        D=128,
        bs=16,
        dtype="float16",
        qlens=[1, 23, 1, 60, 1],
        seqlens=[90, 40, 17, 60, 300],
        seed=30,
    ),
    "dispatch_decode_g8_d64_fp32": dict(
        kind="dispatch", H=8, Hkv=1, D=64, bs=16, dtype="float32", qlens=[1, 1, 1], seqlens=[5, 700, 48], seed=31
    ),
    # Sliding window (Gemma / Mistral local layers): window smaller than a tile (so rows of one
    # tile start their windows in different key tiles, and some rows see no key of a tile),
    # window larger than a tile with a long cached context (the unmasked middle loop runs),
    # window 1 (only the query's own key), chunks mid-block, query_len 1 rows among prefills.
    "window_prefill_w40_g2_d64_fp32": dict(
        kind="prefill",
        H=2,
        Hkv=1,
        D=64,
        bs=16,
        dtype="float32",
        qlens=[200, 1, 37, 150],
        seqlens=[200, 90, 300, 400],
        window=40,
        seed=50,
    ),
    "window_prefill_w300_g1_d64_fp32": dict(
        kind="prefill",
        H=1,
        Hkv=1,
        D=64,
        bs=32,
        dtype="float32",
        qlens=[130, 260],
        seqlens=[700, 260],
        window=300,
        seed=51,
    ),
    "window_prefill_w1_g4_d64_fp16": dict(
        kind="prefill", H=4, Hkv=1, D=64, bs=16, dtype="float16", qlens=[20, 1], seqlens=[50, 9], window=1, seed=52
    ),
    # paged decode with a window: forced splits over the window only, heuristic, padding row.
    "window_decode_w64_g2_d64_fp32_split3": dict(
        kind="decode",
        H=4,
        Hkv=2,
        D=64,
        bs=16,
        dtype="float32",
        seqlens=[1, 16, 64, 65, 700],
        splits=3,
        window=64,
        seed=53,
    ),
    "window_decode_w300_g4_d128_fp16_auto": dict(
        kind="decode",
        H=4,
        Hkv=1,
        D=128,
        bs=16,
        dtype="float16",
        seqlens=[0, 299, 301, 1100],
        splits=None,
        window=300,
        seed=54,
    ),
    # logit soft-capping (Gemma 2), alone and with a window, prefill + decode through dispatch.
    "softcap_prefill_g2_d64_fp32": dict(
        kind="prefill", H=2, Hkv=1, D=64, bs=16, dtype="float32", qlens=[70, 1], seqlens=[150, 33], softcap=5.0, seed=55
    ),
    "softcap_window_dispatch_g2_d64_fp32": dict(
        kind="dispatch",
        H=4,
        Hkv=2,
        D=64,
        bs=16,
        dtype="float32",
        qlens=[1, 45, 1],
        seqlens=[100, 80, 17],
        window=24,
        softcap=5.0,
        seed=56,
    ),
    "softcap_window_decode_g2_d64_fp32_split2": dict(
        kind="decode",
        H=2,
        Hkv=1,
        D=64,
        bs=16,
        dtype="float32",
        seqlens=[40, 300],
        splits=2,
        window=100,
        softcap=5.0,
        seed=57,
    ),
    # float8 e4m3 caches (kv="fp8": caches quantized with a per-cache scale, reference over the
    # dequantized values): store rounding + clamping, prefill, split decode with window and
    # softcap, a mixed batch with 16-bit dots.
    "fp8_store_h2_d64": dict(kind="store", Hkv=2, D=64, bs=16, dtype="float32", T=70, seed=60, kv="fp8"),
    "fp8_prefill_g2_d64_fp32": dict(
        kind="prefill",
        H=4,
        Hkv=2,
        D=64,
        bs=16,
        dtype="float32",
        qlens=[70, 1, 130],
        seqlens=[70, 90, 300],
        seed=61,
        kv="fp8",
    ),
    "fp8_decode_g4_d128_fp32_split3_window_softcap": dict(
        kind="decode",
        H=4,
        Hkv=1,
        D=128,
        bs=16,
        dtype="float32",
        seqlens=[0, 40, 300, 513],
        splits=3,
        window=200,
        softcap=5.0,
        seed=62,
        kv="fp8",
    ),
    "fp8_dispatch_mixed_g4_d128_fp16": dict(
        kind="dispatch",
        H=8,
        Hkv=2,
        D=128,
        bs=16,
        dtype="float16",
        qlens=[1, 23, 1, 60],
        seqlens=[90, 40, 17, 160],
        seed=63,
        kv="fp8",
    ),
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
                    kind="dispatch",
                    H=group * Hkv,
                    Hkv=Hkv,
                    D=D,
                    bs=bs,
                    dtype=dtype,
                    qlens=qlens,
                    seqlens=[q + c for q, c in zip(qlens, ctx)],
                    seed=rng.randint(0, 10**6),
                )
                nd = rng.randint(1, 4)
                cases[f"rand_decode_{tag}"] = dict(
                    kind="decode",
                    H=group * Hkv,
                    Hkv=Hkv,
                    D=D,
                    bs=bs,
                    dtype=dtype,
                    seqlens=[rng.randint(1, 1100) for _ in range(nd)],
                    splits=rng.choice([None, 1, 2, 3, 5]),
                    seed=rng.randint(0, 10**6),
                )
    return cases


CASES.update(_random_cases())

# Problems for the in-process torch path (no Triton).
TORCH_CASES = {k: v for k, v in CASES.items() if v["kind"] not in ("store", "heuristic")}
# More decode rows than one length bucket of the torch path holds (DECODE_BUCKET_ROWS = 16),
# in arbitrary length order, between prefill chunks.
_r = random.Random(7)
TORCH_CASES["torch_decode_buckets"] = dict(
    kind="dispatch",
    H=8,
    Hkv=2,
    D=64,
    bs=16,
    dtype="float32",
    qlens=[1] * 20 + [70] + [1] * 21 + [9],
    seqlens=[_r.randint(1, 300) for _ in range(20)] + [70] + [_r.randint(1, 300) for _ in range(21)] + [140],
    seed=40,
)
# One long decode row among short ones: it gets a bucket of its own (short rows are not padded to it).
TORCH_CASES["torch_decode_long_outlier"] = dict(
    kind="dispatch",
    H=9,
    Hkv=3,
    D=64,
    bs=16,
    dtype="float32",
    qlens=[1] * 8 + [1, 5],
    seqlens=[_r.randint(20, 60) for _ in range(8)] + [1500, 45],
    seed=41,
)
# Windowed decode rows of many lengths (more than one bucket) between windowed prefill chunks.
TORCH_CASES["torch_window_decode_buckets"] = dict(
    kind="dispatch",
    H=4,
    Hkv=2,
    D=64,
    bs=8,
    dtype="float32",
    qlens=[1] * 18 + [30, 1, 1],
    seqlens=[_r.randint(1, 120) for _ in range(18)] + [90, 7, 500],
    window=20,
    seed=42,
)
# Soft-capping in the torch path with a plain causal prefill (no cached context, no window).
TORCH_CASES["torch_softcap_causal"] = dict(
    kind="dispatch", H=4, Hkv=1, D=64, bs=16, dtype="float32", qlens=[33, 1], seqlens=[33, 60], softcap=3.0, seed=43
)


# The C++ CPU kernel (kvserve/kernels/cpu_backend.py) takes float32 or bfloat16 queries and caches; each case
# runs in both (fp16 problems are recast). Plus
# short chunks (query length 2..16: the kernel's, not SDPA's) next to long ones and decode rows.
CPU_CASES = dict(TORCH_CASES)
CPU_CASES["cpu_short_chunks"] = dict(
    kind="dispatch",
    H=6,
    Hkv=2,
    D=64,
    bs=16,
    dtype="float32",
    qlens=[16, 2, 1, 17, 5, 1],
    seqlens=[40, 2, 33, 17, 260, 1],
    seed=44,
)
CPU_CASES["cpu_short_chunks_window_softcap"] = dict(
    kind="dispatch",
    H=4,
    Hkv=1,
    D=64,
    bs=8,
    dtype="float32",
    qlens=[7, 1, 16, 30],
    seqlens=[50, 9, 16, 100],
    window=6,
    softcap=4.0,
    seed=45,
)


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
        ids = perm[used : used + nblk[i]]
        used += nblk[i]
        block_tables[i, : nblk[i]] = ids.to(torch.int32)
        for t in range(s):
            b, o = int(ids[t // bs]), t % bs
            k_cache[b, o] = torch.randn(Hkv, D, generator=gen)
            v_cache[b, o] = torch.randn(Hkv, D, generator=gen)
    T = sum(qlens)
    q = 2.0 * torch.randn(T, H, D, generator=gen)  # sharper softmax than unit scores
    cu = torch.zeros(len(qlens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(qlens), 0)
    return dict(
        q=q.to(dt).to(device),
        k_cache=k_cache.to(dt).to(device),
        v_cache=v_cache.to(dt).to(device),
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seqlens, dtype=torch.int32, device=device),
        cu_seqlens_q=cu.to(device),
        qlens=qlens,
        seqlens=seqlens,
        scale=D**-0.5,
        H=H,
        Hkv=Hkv,
        D=D,
        bs=bs,
        window=spec.get("window"),
        softcap=spec.get("softcap"),
    )


def quantize_fp8(p: dict) -> dict:
    """Store ``p``'s caches as float8 e4m3 in place (per-cache scale: the largest value maps to
    224) and return the same problem with the dequantized caches (their dtype as before),
    whose float64 reference is what attention over the float8 caches must compute. NaN slots
    stay NaN."""
    from kvserve.kernels.torch_backend import FP8, FP8_MAX

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
            s = q[start : start + ql, h] @ k[:, h // group].T * p["scale"]
            if p.get("softcap"):
                s = p["softcap"] * torch.tanh(s / p["softcap"])
            s = s.masked_fill(~allowed, float("-inf"))
            out[start : start + ql, h] = torch.softmax(s, -1) @ v[:, h // group]
        start += ql
    return out


def _meta(p: dict):
    from kvserve.kernels.backend import AttentionMetadata

    return AttentionMetadata(
        cu_seqlens_q=p["cu_seqlens_q"],
        seq_lens=p["seq_lens"],
        block_tables=p["block_tables"],
        slot_mapping=torch.empty(0, dtype=torch.int64),
        query_lens_cpu=p["qlens"],
        seq_lens_cpu=p["seqlens"],
        max_seqlen_q=max(p["qlens"]),
        max_seqlen_k=max(p["seqlens"]),
    )


def _compare(out: torch.Tensor, ref: torch.Tensor, dtype: str) -> dict:
    out = out.double().cpu()
    nonfinite = int((~torch.isfinite(out)).sum())
    err = (out - ref).abs().max().item() if out.numel() else 0.0
    rel = err / max(ref.abs().max().item(), 1e-30)
    bound = BOUNDS[dtype]
    return dict(
        ok=bool(nonfinite == 0 and rel <= bound), max_abs_err=err, rel_err=rel, bound=bound, nonfinite=nonfinite
    )


def _describe(rec: dict) -> str:
    return json.dumps(
        {k: rec.get(k) for k in ("rel_err", "max_abs_err", "bound", "nonfinite", "seconds", "error") if k in rec}
    )


# head_dim beyond the vector paths' common case: 256 (Gemma 3; the weighted V rows in four chunks of
# four vectors with AVX-512), 80 (a chunk of four vectors and one of one), 40 (whole AVX2 vectors, not
# whole AVX-512 ones: the scalar loops there) and 36 (the scalar loops on every CPU); decode rows and
# short chunks crossing block edges, block sizes that are and are not multiples of the vector width.
for _d, _bs in ((256, 16), (80, 8), (40, 16), (36, 4)):
    CPU_CASES[f"cpu_head_dim_{_d}"] = dict(
        kind="dispatch",
        H=4,
        Hkv=2,
        D=_d,
        bs=_bs,
        dtype="float32",
        qlens=[1, 3, 16, 1, 40],
        seqlens=[37, 21, 50, 3, 70],
        seed=46 + _d,
    )
