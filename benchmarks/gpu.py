#!/usr/bin/env python
"""kvserve GPU benchmarks: attention kernels, engine decode latency, engine throughput.

Parts (``--parts``, comma-separated; default all):

``attention``
    (1a) Paged *decode* attention (our Triton kernel, ``kvserve/kernels/triton_attention.py``), bf16,
    batch 64, contexts 512..8192, on the attention shapes of Qwen3-0.6B (16 q heads, 8 KV heads,
    head_dim 128) and Llama-3.2-1B (32 / 8 / 64). Reported as achieved bandwidth = bytes of
    K/V read (+ q and out) / time, next to the card's measured copy bandwidth (a torch copy of
    a 1 GiB tensor, read + write bytes / time) and next to torch SDPA on the same data laid
    out contiguously ``[batch, kv_heads, ctx, head_dim]`` (``enable_gqa=True``).
    (1b) Varlen causal *prefill* attention, ~16k tokens per call (batch = 16384 // ctx), as
    TFLOP/s (causal FLOPs = 2 matmuls x 2 x batch x heads x head_dim x ctx(ctx+1)/2), against
    SDPA ``is_causal=True`` on contiguous tensors. Both also report max|ours - SDPA|.
``engine-decode``
    (2) :func:`bench_engine_decode`: engine batch-1 decode ms/token, with and without CUDA
    graphs, against the HBM floor (weight bytes / measured copy bandwidth).
``decode-profile``
    (2b) :func:`bench_decode_profile`: where a batch-1 decode step's time goes, with CUDA graphs:
    wall ms/token, the GPU time of one replay of the batch-1 graph (CUDA events around replays
    queued back to back), the GPU kernels' time and count per token (``torch.profiler``), and the
    host functions that take the most time per token (``cProfile``).
``w4a16``
    (4) :func:`bench_w4a16`: the 4-bit weight matmul (``kvserve/kernels/triton_w4a16.py``) on Qwen3-0.6B's
    linear shapes (qkv, o, gate+up, down; random 4-bit weights in groups of 128) at 1, 16 and 256
    rows: ms, GB/s of weight bytes read (4-bit plus scales), against torch's bf16 matmul of the
    same weight widened (``F.linear``), and max|ours - bf16| relative to the output's scale.
``throughput``
    (3) :func:`bench_engine_throughput`: nano-vllm's workload (256 requests, prompt and output
    lengths uniform in 100..1024, random token ids < 10000, ``ignore_eos``, seed 0) through
    ``engine.LLM`` vs Hugging Face ``generate`` in static batches (``--hf-batch-size``; each
    batch runs to its longest request; only requested tokens are counted for both).

The engine parts use random-weight models of real shapes (Qwen3-0.6B, Llama-3.2-1B,
SmolLM2-135M) built from transformers configs, saved with ``save_pretrained`` in bf16 plus a
synthetic word-level tokenizer over the whole vocabulary (prompts are token ids; no model
package or download needed). Results: one table on stdout and JSON in ``benchmarks/results/gpu_<gpu-name>.json``
(written after every part). Timing: ``torch.cuda.Event`` pairs around single calls after
warmup, L2 flushed (256 MiB write) before each kernel call, median reported.

Without CUDA the script prints why and exits with status 1 (``--build-models-only`` works on
CPU too).

``--smoke`` (CPU, with or without a GPU present) is a dry run that proves the script works: all
parts at tiny sizes (:data:`SMOKE`) in float32 on CPU. The Triton kernels run under the Triton
interpreter (the script sets ``TRITON_INTERPRET=1`` before triton is imported) on one tiny GQA
shape (``tiny-gqa2``: 4 q heads, 2 KV heads, head_dim 64; contexts 40 and 70) and must match SDPA
within :data:`SMOKE_MAX_ABS_DIFF`; timing is ``time.perf_counter`` (no L2 flush); the engine
parts use a tiny random-weight Llama (``tiny-llama``) built like the real shapes, 8 requests of
8..32 tokens, HF ``generate`` in float32; the CUDA-graph decode row is skipped (reason in the
row). Everything runs except CUDA events, the L2 flush and CUDA-graph capture. Its numbers
say nothing about GPU performance: JSON goes to ``--out`` (default: a file in the system temp
dir, never ``benchmarks/results``). Exit status 1 if any part failed or a kernel was off.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures  # noqa: E402

#: The top-level keys this script writes (besides benchmarks.common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "gpu",
    "smoke",
    "device",
    "dtype",
    "kv_cache_dtype",
    "sms",
    "torch",
    "triton",
    "date",
    "copy_bandwidth_gbps",
    "args",
    "decode_attention",
    "prefill_attention",
    "engine_skipped",
    "engine_decode",
    "decode_profile",
    "throughput",
    "w4a16",
)

ATTN_SHAPES = {
    "qwen3-0.6b": dict(num_heads=16, num_kv_heads=8, head_dim=128),
    "llama-3.2-1b": dict(num_heads=32, num_kv_heads=8, head_dim=64),
    "tiny-gqa2": dict(num_heads=4, num_kv_heads=2, head_dim=64),  # --smoke only
}

# Random-weight models of real shapes (transformers config fields).
MODEL_SPECS = {
    "qwen3-0.6b": (
        "qwen3",
        dict(
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=3072,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=40960,
            rms_norm_eps=1e-6,
            use_sliding_window=False,
            attention_bias=False,
        ),
    ),
    "llama-3.2-1b": (
        "llama",
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=8192,
            vocab_size=128256,
            tie_word_embeddings=True,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
        ),
    ),
    "smollm2-135m": (
        "llama",
        dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=64,
            intermediate_size=1536,
            vocab_size=49152,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
            rms_norm_eps=1e-5,
        ),
    ),
    # --smoke only: same builder, tiny shape.
    "tiny-llama": (
        "llama",
        dict(
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            intermediate_size=256,
            vocab_size=12000,
            tie_word_embeddings=True,
            max_position_embeddings=2048,
            rms_norm_eps=1e-5,
        ),
    ),
}

# --smoke: argument overrides (tiny sizes) ...
SMOKE = dict(
    shapes="tiny-gqa2",
    contexts="40,70",
    batch=2,
    prefill_tokens=140,
    block_size=16,
    models="tiny-llama",
    num_requests=8,
    hf_batch_size=4,
    hf_max_requests=None,
    warmup=1,
    iters=3,
)
# ... and sizes that have no argument: decode prompt / new tokens, workload length range
# (tokens), copy-bandwidth buffer (bytes), KV pool (blocks; the CPU default would be 2 GiB).
SMOKE_ENGINE = dict(
    prompt_len=16, new_tokens=16, min_len=8, max_len=32, copy_bytes=64 << 20, engine_kw=dict(num_kv_blocks=256)
)
SMOKE_MAX_ABS_DIFF = 1e-4  # max|ours - SDPA| in float32 (observed ~1e-6)
#: 4-bit matmul shapes (name: N, K): Qwen3-0.6B's linear layers; --smoke: one tiny shape.
W4A16_SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
W4A16_SMOKE_SHAPES = {"tiny": (64, 128)}
W4A16_ROWS, W4A16_SMOKE_ROWS = (1, 16, 256), (1, 5)
#: the 4-bit matmul's max|ours - dense| / max|dense| allowed (bf16 on a GPU, float32 in --smoke)
W4A16_MAX_REL_DIFF, W4A16_SMOKE_MAX_REL_DIFF = 2e-2, 1e-5


# ----------------------------------------------------------------------------- timing


class Timer:
    """Median time of single calls in ms, after ``warmup`` calls.

    CUDA: ``torch.cuda.Event`` pairs, L2 flushed (256 MiB write) before each call. Other
    devices (``--smoke``): ``time.perf_counter`` around each call, no flush."""

    def __init__(self, warmup: int = 5, iters: int = 20, device: str = "cuda"):
        import torch

        self.torch = torch
        self.warmup, self.iters = warmup, iters
        self.cuda = torch.device(device).type == "cuda"
        self._flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda") if self.cuda else None

    def __call__(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            if not self.cuda:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
                continue
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]


def _sync(device) -> None:
    """Wait for queued CUDA work (no-op on CPU)."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def copy_bandwidth(timer: Timer, nbytes: int = 1 << 30, device: str = "cuda") -> float:
    """Device copy bandwidth in GB/s: (read + write bytes) / time of ``dst.copy_(src)`` of an
    ``nbytes``-byte tensor."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    src = dst = None  # freed (not del: the closures above name them)
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- attention


def _paged_problem(
    batch: int,
    q_len: int,
    ctx: int,
    shape: dict,
    block_size: int,
    dtype,
    seed: int = 0,
    device: str = "cuda",
    kv_cache_dtype: str = "auto",
) -> dict:
    """Random paged cache holding ``batch`` requests of ``ctx`` tokens in scattered blocks, and
    ``q_len`` queries per request (the last ``q_len`` positions), plus contiguous copies
    (``kv_cache_dtype="fp8"``: the caches in float8 e4m3 with a per-cache ``k_scale`` /
    ``v_scale``, the contiguous copies dequantized to ``dtype``)."""
    import torch
    from kvserve.kernels.backend import AttentionMetadata

    g = torch.Generator(device=device).manual_seed(seed)
    H, Hkv, D = shape["num_heads"], shape["num_kv_heads"], shape["head_dim"]
    nblk = -(-ctx // block_size)
    num_blocks = batch * nblk
    perm = torch.randperm(num_blocks, device=device, generator=g)
    block_tables = perm.view(batch, nblk).to(torch.int32).contiguous()
    k_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device, dtype=dtype, generator=g)
    v_cache = torch.randn(num_blocks, block_size, Hkv, D, device=device, dtype=dtype, generator=g)
    q = torch.randn(batch * q_len, H, D, device=device, dtype=dtype, generator=g)
    cu = torch.arange(0, (batch + 1) * q_len, q_len, device=device, dtype=torch.int32)
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    meta = AttentionMetadata(
        cu_seqlens_q=cu,
        seq_lens=seq_lens,
        block_tables=block_tables,
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        query_lens_cpu=[q_len] * batch,
        seq_lens_cpu=[ctx] * batch,
        max_seqlen_q=q_len,
        max_seqlen_k=ctx,
    )

    def contiguous(cache):  # [batch, Hkv, ctx, D]
        return cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()

    scales = dict(k_scale=1.0, v_scale=1.0)
    k_deq, v_deq = k_cache, v_cache
    if kv_cache_dtype == "fp8":  # largest value -> 224; SDPA gets the dequantized values
        scales = {n: float(c.float().abs().max()) * 2 / 448 for n, c in (("k_scale", k_cache), ("v_scale", v_cache))}
        k_cache, v_cache = (
            (c.float() / scales[n]).clamp(-448, 448).to(torch.float8_e4m3fn)
            for n, c in (("k_scale", k_cache), ("v_scale", v_cache))
        )
        k_deq = (k_cache.float() * scales["k_scale"]).to(dtype)
        v_deq = (v_cache.float() * scales["v_scale"]).to(dtype)
    return dict(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        meta=meta,
        k=contiguous(k_deq),
        v=contiguous(v_deq),
        H=H,
        Hkv=Hkv,
        D=D,
        batch=batch,
        q_len=q_len,
        ctx=ctx,
        **scales,
    )


def _sdpa(q, k, v, causal: bool):
    """Reference: torch SDPA with GQA (``enable_gqa``, no K/V head copies)."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


def bench_decode_attention(
    timer: Timer,
    shape_name: str,
    batch: int,
    ctx: int,
    block_size: int,
    copy_bw: float,
    dtype: str = "bfloat16",
    device: str = "cuda",
    kv_cache_dtype: str = "auto",
) -> dict:
    """Paged decode attention (1 query per request, ``ctx`` keys): median ms, GB/s of K/V + q +
    out bytes, the same for SDPA on contiguous K/V, and max|ours - SDPA|."""
    import torch
    from kvserve.kernels import triton_attention as ta

    p = _paged_problem(
        batch,
        1,
        ctx,
        ATTN_SHAPES[shape_name],
        block_size,
        getattr(torch, dtype),
        device=device,
        kv_cache_dtype=kv_cache_dtype,
    )
    scale = p["D"] ** -0.5
    out = torch.empty_like(p["q"])
    ours = lambda: ta.paged_attention(  # noqa: E731
        p["q"],
        p["k_cache"],
        p["v_cache"],
        p["meta"],
        scale,
        out=out,
        k_scale=p["k_scale"],
        v_scale=p["v_scale"],
    )
    qs = p["q"].view(batch, 1, p["H"], p["D"]).transpose(1, 2)  # [B, H, 1, D]
    ref = lambda: _sdpa(qs, p["k"], p["v"], causal=False)  # noqa: E731
    ms = timer(ours)
    ms_sdpa = timer(ref)
    err = (ours().float() - ref().transpose(1, 2).reshape_as(out).float()).abs().max().item()
    es = p["q"].element_size()  # bytes per element
    kv_bytes = 2 * batch * ctx * p["Hkv"] * p["D"] * p["k_cache"].element_size()
    io_bytes = kv_bytes + 2 * p["q"].numel() * es  # + q read + out written (SDPA reads q's dtype)
    sdpa_bytes = 2 * batch * ctx * p["Hkv"] * p["D"] * es + 2 * p["q"].numel() * es
    splits = ta.choose_num_splits(batch, p["Hkv"], ctx, ta._num_sms(p["q"].device))
    res = dict(
        shape=shape_name,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        batch=batch,
        ctx=ctx,
        block_size=block_size,
        num_splits=splits,
        ms=ms,
        gbps=io_bytes / (ms * 1e-3) / 1e9,
        sdpa_ms=ms_sdpa,
        sdpa_gbps=sdpa_bytes / (ms_sdpa * 1e-3) / 1e9,
        max_abs_diff_vs_sdpa=err,
    )
    res["frac_of_copy_bw"] = res["gbps"] / copy_bw
    p = out = None  # freed (not del: the closures above name them)
    _empty_cache()
    return res


def bench_prefill_attention(
    timer: Timer,
    shape_name: str,
    ctx: int,
    block_size: int,
    tokens: int = 16384,
    dtype: str = "bfloat16",
    device: str = "cuda",
    kv_cache_dtype: str = "auto",
) -> dict:
    """Causal varlen prefill of ``tokens // ctx`` requests of ``ctx`` tokens: median ms,
    TFLOP/s (causal FLOPs), the same for SDPA ``is_causal=True``, and max|ours - SDPA|."""
    import torch
    from kvserve.kernels import triton_attention as ta

    batch = max(1, tokens // ctx)
    p = _paged_problem(
        batch,
        ctx,
        ctx,
        ATTN_SHAPES[shape_name],
        block_size,
        getattr(torch, dtype),
        device=device,
        kv_cache_dtype=kv_cache_dtype,
    )
    scale = p["D"] ** -0.5
    out = torch.empty_like(p["q"])
    ours = lambda: ta.paged_attention(  # noqa: E731
        p["q"],
        p["k_cache"],
        p["v_cache"],
        p["meta"],
        scale,
        out=out,
        k_scale=p["k_scale"],
        v_scale=p["v_scale"],
    )
    qs = p["q"].view(batch, ctx, p["H"], p["D"]).transpose(1, 2).contiguous()
    ref = lambda: _sdpa(qs, p["k"], p["v"], causal=True)  # noqa: E731
    ms = timer(ours)
    ms_sdpa = timer(ref)
    err = (ours().float() - ref().transpose(1, 2).reshape_as(out).float()).abs().max().item()
    flops = 4 * batch * p["H"] * p["D"] * ctx * (ctx + 1) / 2
    res = dict(
        shape=shape_name,
        dtype=dtype,
        kv_cache_dtype=kv_cache_dtype,
        batch=batch,
        ctx=ctx,
        block_size=block_size,
        ms=ms,
        tflops=flops / (ms * 1e-3) / 1e12,
        sdpa_ms=ms_sdpa,
        sdpa_tflops=flops / (ms_sdpa * 1e-3) / 1e12,
        max_abs_diff_vs_sdpa=err,
    )
    p = out = qs = None  # freed (not del: the closures above name them)
    _empty_cache()
    return res


# ----------------------------------------------------------------------------- models


def bench_w4a16(
    timer: Timer,
    name: str,
    n: int,
    k: int,
    rows: int,
    dtype: str = "bfloat16",
    device: str = "cuda",
    group_size: int = 128,
) -> dict:
    """The Triton 4-bit matmul on ``[rows, k] x [n, k]^T`` against torch's matmul of the widened
    weight in ``dtype``: median ms of each, GB/s of the 4-bit weight bytes (packed values, scales
    and zero terms), and max|ours - dense| / max|dense|."""
    import torch
    from kvserve.engine.layers.w4a16 import build_w4
    from kvserve.kernels.triton_w4a16 import w4a16_matmul

    g = torch.Generator().manual_seed(0)
    gs = min(group_size, k)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // gs, generator=g) * 0.02
    zeros = torch.randint(0, 16, (n, k // gs), generator=g).float()
    w = build_w4(codes, scales, zeros, None).to(torch.device(device))
    dt = getattr(torch, dtype)
    dense = ((codes.float().reshape(n, -1, gs) - zeros[..., None]) * scales[..., None]).reshape(n, k).to(device, dt)
    x = torch.randn(rows, k, generator=g).to(device, dt)
    ours = lambda: w4a16_matmul(x, w.qweight, w.scales, w.szeros, w.group_size)  # noqa: E731
    ref = lambda: torch.nn.functional.linear(x, dense)  # noqa: E731
    ms, ms_ref = timer(ours), timer(ref)
    want = ref().float()
    rel = ((ours().float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    nbytes = w.nbytes()
    res = dict(
        shape=name,
        n=n,
        k=k,
        rows=rows,
        group_size=gs,
        dtype=dtype,
        ms=ms,
        weight_gbps=nbytes / (ms * 1e-3) / 1e9,
        dense_ms=ms_ref,
        dense_gbps=dense.numel() * dense.element_size() / (ms_ref * 1e-3) / 1e9,
        max_rel_diff=rel,
    )
    w = dense = x = None  # freed (not del: the closures above name them)
    _empty_cache()
    return res


def build_random_model(name: str, root: Path, device: str = "cuda", dtype: str = "bfloat16") -> Path:
    """Random-weight model folder of a ``MODEL_SPECS`` shape, saved in ``dtype``, with a
    synthetic tokenizer over the whole vocabulary (see :func:`write_synthetic_tokenizer`).

    Cached in ``root / name`` (not keyed by dtype); built in a side folder and renamed when
    complete, so an interrupted build is never reused.
    """
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    arch, fields = MODEL_SPECS[name]
    out = root / name
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file() and list(out.glob("*.safetensors")):
        return out
    partial = root / f".{name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    write_synthetic_tokenizer(partial, fields["vocab_size"])
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch](
        **fields, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.02
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.save_pretrained(os.fspath(partial), safe_serialization=True)
    del model
    gc.collect()
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def write_synthetic_tokenizer(out: Path, vocab_size: int) -> None:
    """Save a word-level tokenizer with one token ``<tN>`` per id ``0 <= N < vocab_size``.

    The engine needs a tokenizer to detokenize, but prompts here are token ids, so any
    tokenizer does as long as it covers every id a random-weight model can sample (a real
    tokenizer of another model would not: Qwen3's vocabulary is 151,936). Built with the
    ``tokenizers`` library, so the GPU machine needs no model package. BOS = 1, EOS = PAD = 2.
    """
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tok.decoder = decoders.Sequence([])  # tokens concatenate as written
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<t0>", bos_token="<t1>", eos_token="<t2>", pad_token="<t2>"
    )
    fast.save_pretrained(os.fspath(out))


def weight_bytes(model_dir: Path) -> int:
    """Bytes of weights read per decode step: every stored tensor (tied embeddings are stored
    once and read in full by the lm_head); an untied input embedding is only gathered."""
    from safetensors import safe_open

    cfg = json.loads((model_dir / "config.json").read_text())
    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(os.fspath(f), framework="pt") as st:
            for k in st.keys():
                if not cfg.get("tie_word_embeddings") and k.endswith("embed_tokens.weight"):
                    continue
                sl = st.get_slice(k)
                n = 1
                for s in sl.get_shape():
                    n *= s
                total += n * {"BF16": 2, "F16": 2, "F32": 4}.get(sl.get_dtype(), 2)
    return total


def _engine_api():
    """``(LLM, SamplingParams)`` or raise ImportError with the reason."""
    try:
        from kvserve.engine import LLM, SamplingParams

        return LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001
        raise ImportError(f"engine.LLM not importable: {type(exc).__name__}: {exc}") from exc


def _graphs_captured(llm) -> bool:
    """Whether the engine's model runner holds captured decode CUDA graphs."""
    runner = getattr(getattr(llm.engine, "executor", None), "runner", None)
    return bool(getattr(runner, "graphs", None))


def _release(llm) -> None:
    """Shut the engine down (drops the model runner: weights, KV cache, graphs)."""
    for name in ("shutdown", "close"):
        fn = getattr(llm, name, None) or getattr(getattr(llm, "engine", None), name, None)
        if callable(fn):
            try:
                fn()
            except Exception:  # noqa: BLE001
                pass
            break
    del llm
    gc.collect()
    _empty_cache()


# ----------------------------------------------------------------------------- part (2)


def _timed_generate(llm, SamplingParams, rng: random.Random, prompt_len: int, n: int, device) -> float:
    """Wall seconds of one greedy ``generate`` of ``n`` tokens (``ignore_eos``) on a fresh random
    prompt of ``prompt_len`` token ids (fresh, so no prefix-cache hit), synchronised with the
    device before and after. Raises ``RuntimeError`` if the engine returned another count."""
    prompt = [rng.randint(0, 10000) for _ in range(prompt_len)]
    sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False)
    _sync(device)
    t0 = time.perf_counter()
    out = llm.generate([prompt], [sp], use_tqdm=False)
    _sync(device)
    dt = time.perf_counter() - t0
    got = len(out[0].outputs[0].token_ids)
    if got != n:
        raise RuntimeError(f"asked for {n} tokens, got {got}")
    return dt


def bench_engine_decode(
    model_dir: Path,
    copy_bw_gbps: float,
    *,
    prompt_len: int = 128,
    new_tokens: int = 256,
    backend: str = "triton",
    cuda_graphs: tuple[bool, ...] = (False, True),
    device: str = "cuda",
    dtype: str = "bfloat16",
    engine_kw: dict | None = None,
) -> list[dict]:
    """HOOK (2): engine batch-1 decode latency vs the HBM floor.

    For each CUDA-graph setting: ``LLM(model, dtype=dtype, device=device, max_num_seqs=1,
    enforce_eager=not graphs, attention_backend=backend, **engine_kw)``; ms/token =
    ``(t(1 + new_tokens) - t(1)) / new_tokens`` where ``t(n)`` is the wall time of a
    ``generate`` of ``n`` tokens (greedy, ``ignore_eos``) on a fresh random prompt of
    ``prompt_len`` tokens (fresh, so prefix caching gives both calls the same prefill).
    Floor = weight bytes / measured copy bandwidth. ``graphs_captured`` says whether the engine
    really captured graphs (it does only on CUDA with the triton backend); off CUDA the graph
    row is skipped, with the reason in ``skipped``.
    """
    import torch

    LLM, SamplingParams = _engine_api()
    floor_ms = weight_bytes(model_dir) / (copy_bw_gbps * 1e9) * 1e3
    rng = random.Random(0)
    results = []
    for graphs in cuda_graphs:
        if graphs and torch.device(device).type != "cuda":
            results.append(
                dict(
                    model=model_dir.name,
                    cuda_graphs=True,
                    backend=backend,
                    skipped=f"CUDA graphs need a CUDA device (this run: {device})",
                )
            )
            continue
        llm = LLM(
            model=os.fspath(model_dir),
            dtype=dtype,
            device=device,
            max_num_seqs=1,
            enforce_eager=not graphs,
            attention_backend=backend,
            **(engine_kw or {}),
        )
        captured = _graphs_captured(llm)

        def run(n: int) -> float:
            return _timed_generate(llm, SamplingParams, rng, prompt_len, n, device)

        run(16)  # warmup (compiles kernels, captures graphs)
        t1 = min(run(1) for _ in range(3))
        tn = min(run(1 + new_tokens) for _ in range(2))
        ms = (tn - t1) / new_tokens * 1e3
        row = dict(
            model=model_dir.name,
            cuda_graphs=graphs,
            graphs_captured=captured,
            backend=backend,
            dtype=dtype,
            kv_cache_dtype=(engine_kw or {}).get("kv_cache_dtype", "auto"),
            quantization=(engine_kw or {}).get("quantization"),
            prompt_len=prompt_len,
            new_tokens=new_tokens,
            ms_per_token=ms,
            hbm_floor_ms=floor_ms,
            floor_frac=floor_ms / ms,
            weight_gb=weight_bytes(model_dir) / 1e9,
        )
        if graphs != captured:
            row["note"] = (
                "CUDA graphs requested but not captured (the engine captures them only on CUDA with the triton backend)"
                if graphs
                else "graphs captured although enforce_eager=True"
            )
        results.append(row)
        run = None  # freed (not del: the closures above name them)
        _release(llm)
        llm = None  # freed (not del: the closures above name them)
    return results


def bench_decode_profile(
    model_dir: Path,
    *,
    prompt_len: int = 128,
    new_tokens: int = 64,
    backend: str = "triton",
    device: str = "cuda",
    dtype: str = "bfloat16",
    engine_kw: dict | None = None,
    top: int = 20,
) -> dict:
    """HOOK (2b): where one stream's decode step spends its time (batch 1, CUDA graphs where the
    engine captures them).

    One engine (``max_num_seqs=1``), a warm-up generate, then three generates of
    ``1 + new_tokens`` tokens on fresh prompts of ``prompt_len`` tokens: plain (``wall_ms_per_token``
    = wall time / ``new_tokens``, so the prefill is counted in: it is one step of 1 + new_tokens),
    under ``cProfile`` (``host_top``: the ``top`` functions by own time, microseconds and calls
    per token) and under ``torch.profiler`` (``kernels_top``: the ``top`` GPU kernels by time,
    microseconds and launches per token; ``gpu_busy_ms_per_token``, the sum of every kernel's
    and copy's time per token; ``kernels_per_token``). ``graph_replay_ms``: the GPU time of one
    replay of the batch-1 decode graph (50 replays queued between two CUDA events), i.e. the
    decoder layers alone, without the LM head and sampling. On CPU (``--smoke``) there are no
    kernels or graphs: those fields are None.
    """
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    LLM, SamplingParams = _engine_api()
    cuda = torch.device(device).type == "cuda"
    llm = LLM(
        model=os.fspath(model_dir),
        dtype=dtype,
        device=device,
        max_num_seqs=1,
        enforce_eager=not cuda,
        attention_backend=backend,
        **(engine_kw or {}),
    )
    rng = random.Random(1)

    def gen(n: int) -> float:
        return _timed_generate(llm, SamplingParams, rng, prompt_len, n, device)

    n = 1 + new_tokens
    res = dict(
        model=model_dir.name,
        backend=backend,
        dtype=dtype,
        prompt_len=prompt_len,
        new_tokens=new_tokens,
        graphs_captured=_graphs_captured(llm),
    )
    try:
        gen(16)
        res["wall_ms_per_token"] = gen(n) / new_tokens * 1e3
        prof = cProfile.Profile()
        prof.enable()
        gen(n)
        prof.disable()
        st = pstats.Stats(prof).stats  # (file, line, name) -> (prim calls, calls, tottime, cumtime, callers)
        ranked = sorted(st.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
        res["host_top"] = [
            dict(
                function=f"{Path(f).name}:{line}({name})",
                calls_per_token=v[1] / new_tokens,
                own_us_per_token=v[2] / new_tokens * 1e6,
                cum_us_per_token=v[3] / new_tokens * 1e6,
            )
            for (f, line, name), v in ranked
        ]
        res["graph_replay_ms"] = res["gpu_busy_ms_per_token"] = res["kernels_per_token"] = None
        res["kernels_top"] = []
        if cuda:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
                gen(n)
            dev_events = [e for e in tp.key_averages() if str(getattr(e, "device_type", "")).endswith("CUDA")]
            dev_events.sort(key=lambda e: e.self_device_time_total, reverse=True)
            res["gpu_busy_ms_per_token"] = sum(e.self_device_time_total for e in dev_events) / new_tokens / 1e3
            res["kernels_per_token"] = sum(e.count for e in dev_events) / new_tokens
            res["kernels_top"] = [
                dict(
                    kernel=e.key[:120],
                    launches_per_token=e.count / new_tokens,
                    us_per_token=e.self_device_time_total / new_tokens,
                )
                for e in dev_events[:top]
            ]
            runner = llm.engine.executor.runner
            if runner.graphs is not None and 1 in runner.graphs.graphs:
                graph = runner.graphs.graphs[1][0]
                for _ in range(5):
                    graph.replay()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                a.record()
                for _ in range(50):
                    graph.replay()
                b.record()
                torch.cuda.synchronize()
                res["graph_replay_ms"] = a.elapsed_time(b) / 50
    finally:
        _release(llm)
    return res


# ----------------------------------------------------------------------------- part (3)


def nano_vllm_workload(
    num_requests: int = 256, min_len: int = 100, max_len: int = 1024, seed: int = 0
) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py workload: random ids < 10000, prompt and output lengths uniform."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_len))] for _ in range(num_requests)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, outputs


def bench_engine_throughput(
    model_dir: Path,
    *,
    num_requests: int = 256,
    max_num_seqs: int = 256,
    backend: str = "triton",
    hf_batch_size: int = 64,
    hf_max_requests: int | None = None,
    run_hf: bool = True,
    device: str = "cuda",
    dtype: str = "bfloat16",
    min_len: int = 100,
    max_len: int = 1024,
    engine_kw: dict | None = None,
) -> dict:
    """HOOK (3): output tokens/s of the engine vs HF ``generate`` on nano-vllm's workload
    (``num_requests`` prompts and outputs of ``min_len..max_len`` tokens).

    Engine: all requests at once (continuous batching, CUDA graphs on where the engine can
    capture them: ``cuda_graphs`` in the result says whether it did). HF: static batches
    of ``hf_batch_size`` in request order, left padding, greedy, ``min_new_tokens =
    max_new_tokens =`` the batch's longest output (so EOS cannot stop it; checked); throughput
    counts only the requested tokens. ``hf_max_requests`` limits HF to the first N requests.
    Both get a short warmup generate first.
    """
    import torch

    LLM, SamplingParams = _engine_api()
    prompts, outs = nano_vllm_workload(num_requests, min_len, max_len)
    res = dict(
        model=model_dir.name,
        num_requests=num_requests,
        backend=backend,
        dtype=dtype,
        kv_cache_dtype=(engine_kw or {}).get("kv_cache_dtype", "auto"),
        quantization=(engine_kw or {}).get("quantization"),
        prompt_tokens=sum(map(len, prompts)),
        output_tokens=sum(outs),
    )
    llm = LLM(
        model=os.fspath(model_dir),
        dtype=dtype,
        device=device,
        max_num_seqs=max_num_seqs,
        enforce_eager=False,
        attention_backend=backend,
        **(engine_kw or {}),
    )
    res["cuda_graphs"] = _graphs_captured(llm)
    llm.generate(
        [prompts[0][:64]],
        [SamplingParams(max_tokens=16, ignore_eos=True, temperature=0, detokenize=False)],
        use_tqdm=False,
    )
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False) for n in outs]
    _sync(device)
    t0 = time.perf_counter()
    results = llm.generate(prompts, sps, use_tqdm=False)
    _sync(device)
    dt = time.perf_counter() - t0
    got = sum(len(r.outputs[0].token_ids) for r in results)
    if got != sum(outs):
        raise RuntimeError(f"engine generated {got} tokens, asked for {sum(outs)}")
    res.update(engine_s=dt, engine_tok_s=got / dt, engine_tokens=got)
    _release(llm)
    del llm, results

    if run_hf:
        from transformers import AutoModelForCausalLM

        model = (
            AutoModelForCausalLM.from_pretrained(os.fspath(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
        )

        def hf_generate(batch: list[list[int]], new: int) -> None:
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            with torch.inference_mode():
                seq = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                )
            if seq.shape[1] - width != new:
                raise RuntimeError(f"HF generated {seq.shape[1] - width} tokens, asked for {new}")

        hf_generate([prompts[0][:64]], 16)  # warmup (CUDA context, cuBLAS, kernels)
        n = min(num_requests, hf_max_requests or num_requests)
        useful = 0
        _sync(device)
        t0 = time.perf_counter()
        for s in range(0, n, hf_batch_size):
            want = outs[s : s + hf_batch_size]
            hf_generate(prompts[s : s + hf_batch_size], max(want))
            useful += sum(want)
        _sync(device)
        hf_dt = time.perf_counter() - t0
        res.update(
            hf_requests=n,
            hf_batch_size=hf_batch_size,
            hf_s=hf_dt,
            hf_tok_s=useful / hf_dt,
            speedup_vs_hf=(got / dt) / (useful / hf_dt),
        )
        del model
        gc.collect()
        _empty_cache()
    return res


# ----------------------------------------------------------------------------- driver


def _gpu_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def _print_table(title: str, rows: list[dict], cols: list[tuple[str, str]]) -> None:
    print(f"\n== {title}")
    print(" | ".join(h for h, _ in cols))
    for r in rows:
        cells = []
        for _, k in cols:
            v = r.get(k)
            cells.append(f"{v:.3g}" if isinstance(v, float) else str(v))
        print(" | ".join(cells))


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="See the module docstring for what each part measures.",
    )
    ap.add_argument(
        "--parts",
        default="attention,engine-decode,decode-profile,throughput,w4a16",
        help="comma-separated: attention, engine-decode, decode-profile, throughput, w4a16",
    )
    ap.add_argument("--shapes", default="qwen3-0.6b,llama-3.2-1b", help=f"attention shapes ({', '.join(ATTN_SHAPES)})")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--batch", type=int, default=64, help="decode batch (default 64)")
    ap.add_argument(
        "--prefill-tokens", type=int, default=16384, help="query tokens per prefill call (batch = this // ctx)"
    )
    ap.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    ap.add_argument(
        "--models", default="qwen3-0.6b,llama-3.2-1b,smollm2-135m", help=f"engine parts: {', '.join(MODEL_SPECS)}"
    )
    ap.add_argument(
        "--model-root",
        type=Path,
        default=None,
        help="where random-weight model folders are built / reused (default "
        "$KVSERVE_BENCH_MODELS or /tmp/kvserve-bench-models; --smoke: a "
        "temporary folder, removed afterwards)",
    )
    ap.add_argument("--backend", default="triton", help="engine attention backend")
    ap.add_argument(
        "--quantization",
        default=None,
        choices=["fp8"],
        help="engine parts: float8 weights and activations (torch._scaled_mm)",
    )
    ap.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "fp8"],
        help="KV cache: the model dtype, or float8 e4m3 with per-layer scales (attention parts: per-cache scales)",
    )
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-max-requests", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="JSON path (default benchmarks/results/gpu_<gpu-name>.json; --smoke: "
        "kvserve-gpu-smoke-cpu.json in the system temp dir)",
    )
    ap.add_argument(
        "--build-models-only", action="store_true", help="only build the random-weight model folders (works on CPU)"
    )
    ap.add_argument(
        "--smoke",
        action="store_true",
        help="CPU dry run of every part at tiny sizes in float32 (Triton "
        "interpreter); overrides the size arguments, see SMOKE",
    )
    args = ap.parse_args(argv)
    if args.smoke:
        for k, v in SMOKE.items():
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:  # before triton is imported: the kernels are decorated at import
        os.environ["TRITON_INTERPRET"] = "1"
    import torch

    if args.smoke:  # tiny ops: OpenMP threads only add spin-waits (30x slower on a busy host)
        torch.set_num_threads(1)
    models = [m for m in args.models.split(",") if m]
    tmp_root = None
    if args.model_root is None and args.smoke and not args.build_models_only:
        args.model_root = tmp_root = Path(tempfile.mkdtemp(prefix="kvserve-smoke-models-"))
    elif args.model_root is None:
        args.model_root = Path(os.environ.get("KVSERVE_BENCH_MODELS", "/tmp/kvserve-bench-models"))
    if args.build_models_only:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for m in models:
            print(build_random_model(m, args.model_root, dev))
        return 0
    if args.smoke:
        try:
            return _run(args, models, torch, smoke=True)
        finally:
            if tmp_root is not None:
                shutil.rmtree(tmp_root, ignore_errors=True)
    if not torch.cuda.is_available():
        print(
            "benchmarks/gpu.py: no CUDA GPU visible (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}); these benchmarks need one. Nothing was run.",
            file=sys.stderr,
        )
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("benchmarks/gpu.py: unset TRITON_INTERPRET to benchmark compiled kernels", file=sys.stderr)
        return 1
    return _run(args, models, torch, smoke=False)


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values (a
    run that stopped early has only its first parts)."""
    f = Figures().summary("copy bandwidth", r["copy_bandwidth_gbps"], "GB/s")
    kv = f"KV cache {r.get('kv_cache_dtype')}"
    for x in r.get("throughput", []):
        if "engine_tok_s" in x:
            f.summary(
                f"{r['gpu']}, {x['model']} shape, nano-vllm workload ({r['dtype']}, {kv}): engine tok/s",
                x["engine_tok_s"],
                "tok/s",
                headline=x["model"] == "qwen3-0.6b",
            )
    targets = {"qwen3-0.6b": 12000, "llama-3.2-1b": 18000}  # issue 46's GPU targets (tok/s)
    for x in r.get("engine_decode", []):
        if x.get("cuda_graphs") and x.get("ms_per_token") is not None and x["model"] == "qwen3-0.6b":
            f.summary(
                f"{r['gpu']}, {x['model']} shape, batch-1 decode with CUDA graphs",
                x["ms_per_token"],
                "ms/token",
                target="<= 1.5",
                met=x["ms_per_token"] <= 1.5,
            )
    for x in r.get("throughput", []):
        if "engine_tok_s" in x and x["model"] in targets:
            f.summary(
                f"{r['gpu']}, {x['model']} shape, nano-vllm workload: target",
                x["engine_tok_s"],
                "tok/s",
                target=f">= {targets[x['model']]}",
                met=x["engine_tok_s"] >= targets[x["model"]],
            )
    dec = r.get("decode_attention", [])
    f.table(
        "Paged decode attention",
        [
            "shape",
            "batch",
            "context",
            "ours (ms)",
            "ours (GB/s)",
            "of copy bandwidth (%)",
            "torch SDPA, contiguous K/V (ms)",
        ],
        [[x["shape"], x["batch"], x["ctx"], x["ms"], x["gbps"], x["frac_of_copy_bw"] * 100, x["sdpa_ms"]] for x in dec],
        note=f"Random-weight models of the real shapes, {r['dtype']}, {kv}.",
    )
    f.table(
        "Varlen causal prefill attention",
        ["shape", "batch", "context", "ours (TFLOP/s)", "torch SDPA (TFLOP/s)"],
        [[x["shape"], x["batch"], x["ctx"], x["tflops"], x["sdpa_tflops"]] for x in r.get("prefill_attention", [])],
    )
    f.table(
        "Engine batch-1 decode against the HBM floor",
        ["model", "mode", "ms/token", "HBM floor (ms)", "skipped or failed"],
        [
            [
                x["model"],
                "graphs" if x.get("cuda_graphs") else "eager",
                x.get("ms_per_token"),
                x.get("hbm_floor_ms"),
                x.get("skipped") or x.get("error"),
            ]
            for x in r.get("engine_decode", [])
        ],
        note="The HBM floor: weight bytes / copy bandwidth."
        + (f" Engine parts skipped: {r['engine_skipped']}" if r.get("engine_skipped") else ""),
    )
    prof = r.get("decode_profile", [])
    f.table(
        "Where a batch-1 decode step's time goes",
        ["model", "wall ms/token", "graph replay (ms)", "GPU busy ms/token", "kernels/token", "failed"],
        [
            [
                x["model"],
                x.get("wall_ms_per_token"),
                x.get("graph_replay_ms"),
                x.get("gpu_busy_ms_per_token"),
                x.get("kernels_per_token"),
                x.get("error"),
            ]
            for x in prof
        ],
        note="Graph replay: the decoder layers' batch-1 CUDA graph alone (no LM head, no sampling). "
        "GPU busy: every kernel and copy of a step, from torch.profiler.",
    )
    for x in prof:
        if x.get("host_top"):
            f.table(
                f"{x['model']}: host functions by own time per token (cProfile)",
                ["function", "calls/token", "own us/token", "cumulative us/token"],
                [
                    [h["function"], h["calls_per_token"], h["own_us_per_token"], h["cum_us_per_token"]]
                    for h in x["host_top"]
                ],
            )
        if x.get("kernels_top"):
            f.table(
                f"{x['model']}: GPU kernels by time per token (torch.profiler)",
                ["kernel", "launches/token", "us/token"],
                [[k["kernel"], k["launches_per_token"], k["us_per_token"]] for k in x["kernels_top"]],
            )
    f.table(
        "4-bit weight matmul (Triton) against the widened weight",
        ["shape", "rows", "ms", "weight GB/s", "dense ms", "max rel diff"],
        [
            [x["shape"], x["rows"], x["ms"], x["weight_gbps"], x["dense_ms"], x["max_rel_diff"]]
            for x in r.get("w4a16", [])
        ],
        note="Qwen3-0.6B's linear shapes, groups of 128; the dense matmul is "
        "torch's in the run's dtype on the same weight widened.",
    )
    tp = r.get("throughput", [])
    hf = next((x for x in tp if x.get("hf_requests")), None)
    f.table(
        "Throughput on nano-vllm's workload",
        ["model", "requests", "CUDA graphs", "engine tok/s", "HF tok/s", "speed-up over HF (x)", "failed"],
        [
            [
                x["model"],
                x.get("num_requests"),
                x.get("cuda_graphs"),
                x.get("engine_tok_s"),
                x.get("hf_tok_s"),
                x.get("speedup_vs_hf"),
                x.get("error"),
            ]
            for x in tp
        ],
        note=f"HF `generate`: static batches of {hf['hf_batch_size']}, the first {hf['hf_requests']} requests."
        if hf
        else "No HF baseline in this run.",
    )
    return f


def _run(args: argparse.Namespace, models: list[str], torch, smoke: bool) -> int:
    """Run the selected parts; ``smoke``: on CPU in float32 (see the module docstring)."""
    import triton

    from benchmarks.common import Results

    prov = Results(__file__, RESULT_KEYS)
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    device, dtype = ("cpu", "float32") if smoke else ("cuda", "bfloat16")
    sizes = SMOKE_ENGINE if smoke else {}
    engine_kw = dict(sizes.get("engine_kw") or {}, kv_cache_dtype=args.kv_cache_dtype)
    if args.quantization:
        engine_kw["quantization"] = args.quantization
    kv = args.kv_cache_dtype
    gpu = "none (--smoke, CPU)" if smoke else torch.cuda.get_device_name()
    if args.out:
        out_path = args.out
    elif smoke:
        out_path = Path(tempfile.gettempdir()) / "kvserve-gpu-smoke-cpu.json"
    else:
        out_path = ROOT / "benchmarks" / "results" / f"gpu_{_gpu_slug(gpu)}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.warmup, args.iters, device)
    copy_bw = copy_bandwidth(timer, sizes.get("copy_bytes", 1 << 30), device)
    report = dict(
        gpu=gpu,
        smoke=smoke,
        device=device,
        dtype=dtype,
        kv_cache_dtype=kv,
        sms=None if smoke else torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__,
        triton=triton.__version__,
        date=time.strftime("%Y-%m-%dT%H:%M:%S"),
        copy_bandwidth_gbps=copy_bw,
        args={k: str(v) for k, v in vars(args).items()},
    )
    print(f"{gpu}: copy bandwidth {copy_bw:.0f} GB/s")
    if smoke:
        print("smoke run: tiny sizes on CPU (Triton interpreter), timings mean nothing")
    failures: list[str] = []

    def save():  # after every part, so a crash keeps the parts done (each write is the whole file)
        prov.write(out_path, report)

    save()
    ctxs = [int(c) for c in args.contexts.split(",") if c]
    shapes = [s for s in args.shapes.split(",") if s]
    if "attention" in parts:
        dec = [
            bench_decode_attention(timer, s, args.batch, c, args.block_size, copy_bw, dtype, device, kv)
            for s in shapes
            for c in ctxs
        ]
        report["decode_attention"] = dec
        save()
        pre = [
            bench_prefill_attention(timer, s, c, args.block_size, args.prefill_tokens, dtype, device, kv)
            for s in shapes
            for c in ctxs
        ]
        report["prefill_attention"] = pre
        save()
        if smoke:
            failures += [
                f"{r['shape']} ctx {r['ctx']}: max|ours - SDPA| {r['max_abs_diff_vs_sdpa']:.3g} > {SMOKE_MAX_ABS_DIFF}"
                for r in dec + pre
                if not r["max_abs_diff_vs_sdpa"] <= SMOKE_MAX_ABS_DIFF
            ]
        _print_table(
            f"paged decode attention, {dtype}, batch {args.batch} (copy bandwidth {copy_bw:.0f} GB/s)",
            dec,
            [
                ("shape", "shape"),
                ("ctx", "ctx"),
                ("splits", "num_splits"),
                ("ms", "ms"),
                ("GB/s", "gbps"),
                ("of copy", "frac_of_copy_bw"),
                ("sdpa ms", "sdpa_ms"),
                ("sdpa GB/s", "sdpa_gbps"),
                ("max|diff|", "max_abs_diff_vs_sdpa"),
            ],
        )
        _print_table(
            f"varlen causal prefill attention, {dtype}",
            pre,
            [
                ("shape", "shape"),
                ("batch", "batch"),
                ("ctx", "ctx"),
                ("ms", "ms"),
                ("TFLOP/s", "tflops"),
                ("sdpa ms", "sdpa_ms"),
                ("sdpa TFLOP/s", "sdpa_tflops"),
                ("max|diff|", "max_abs_diff_vs_sdpa"),
            ],
        )
    if parts & {"engine-decode", "decode-profile", "throughput"}:
        try:
            _engine_api()
        except ImportError as exc:
            report["engine_skipped"] = str(exc)
            print(f"\nengine parts skipped: {exc}")
            parts -= {"engine-decode", "decode-profile", "throughput"}
    if "decode-profile" in parts:
        prof_rows = []
        for m in models:
            try:
                prof_rows.append(
                    bench_decode_profile(
                        build_random_model(m, args.model_root, device, dtype),
                        backend=args.backend,
                        device=device,
                        dtype=dtype,
                        engine_kw=engine_kw,
                        **{k: sizes[k] for k in ("prompt_len", "new_tokens") if k in sizes},
                    )
                )
            except Exception as exc:  # noqa: BLE001 - keep the other models
                traceback.print_exc()
                prof_rows.append(dict(model=m, error=f"{type(exc).__name__}: {exc}"))
            report["decode_profile"] = prof_rows
            save()
        for x in prof_rows:
            print(
                f"\n== decode profile {x.get('model')}: wall {x.get('wall_ms_per_token')} ms/token, graph replay "
                f"{x.get('graph_replay_ms')} ms, GPU busy {x.get('gpu_busy_ms_per_token')} ms/token, "
                f"{x.get('kernels_per_token')} kernels/token {x.get('error', '')}"
            )
            for k in x.get("kernels_top", []):
                print(f"  {k['us_per_token']:8.1f} us {k['launches_per_token']:6.1f}x  {k['kernel']}")
            for h in x.get("host_top", []):
                print(
                    f"  {h['own_us_per_token']:8.1f} us own {h['cum_us_per_token']:8.1f} cum "
                    f"{h['calls_per_token']:6.1f}x  {h['function']}"
                )
    if "engine-decode" in parts:
        rows = []
        for m in models:
            try:
                rows += bench_engine_decode(
                    build_random_model(m, args.model_root, device, dtype),
                    copy_bw,
                    backend=args.backend,
                    device=device,
                    dtype=dtype,
                    engine_kw=engine_kw,
                    **{k: sizes[k] for k in ("prompt_len", "new_tokens") if k in sizes},
                )
            except Exception as exc:  # noqa: BLE001 - keep the other models
                traceback.print_exc()
                rows.append(dict(model=m, error=f"{type(exc).__name__}: {exc}"))
            report["engine_decode"] = rows
            save()
        _print_table(
            "engine batch-1 decode",
            rows,
            [
                ("model", "model"),
                ("graphs", "cuda_graphs"),
                ("captured", "graphs_captured"),
                ("ms/tok", "ms_per_token"),
                ("floor ms", "hbm_floor_ms"),
                ("floor/ms", "floor_frac"),
                ("skipped", "skipped"),
                ("error", "error"),
            ],
        )
    if "throughput" in parts:
        rows = []
        for m in models:
            try:
                rows.append(
                    bench_engine_throughput(
                        build_random_model(m, args.model_root, device, dtype),
                        num_requests=args.num_requests,
                        backend=args.backend,
                        hf_batch_size=args.hf_batch_size,
                        hf_max_requests=args.hf_max_requests,
                        run_hf=not args.no_hf,
                        device=device,
                        dtype=dtype,
                        engine_kw=engine_kw,
                        **{k: sizes[k] for k in ("min_len", "max_len") if k in sizes},
                    )
                )
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                rows.append(dict(model=m, error=f"{type(exc).__name__}: {exc}"))
            report["throughput"] = rows
            save()
        _print_table(
            "throughput, nano-vllm workload",
            rows,
            [
                ("model", "model"),
                ("graphs", "cuda_graphs"),
                ("engine tok/s", "engine_tok_s"),
                ("hf tok/s", "hf_tok_s"),
                ("speedup", "speedup_vs_hf"),
                ("error", "error"),
            ],
        )
    if "w4a16" in parts:
        shapes4 = W4A16_SMOKE_SHAPES if smoke else W4A16_SHAPES
        rows4 = [
            bench_w4a16(timer, name, n, k, m, dtype, device)
            for name, (n, k) in shapes4.items()
            for m in (W4A16_SMOKE_ROWS if smoke else W4A16_ROWS)
        ]
        report["w4a16"] = rows4
        save()
        bound = W4A16_SMOKE_MAX_REL_DIFF if smoke else W4A16_MAX_REL_DIFF
        failures += [
            f"w4a16 {r['shape']} rows {r['rows']}: max rel diff {r['max_rel_diff']:.3g} > {bound}"
            for r in rows4
            if not r["max_rel_diff"] <= bound
        ]
        _print_table(
            f"4-bit weight matmul (Triton), {dtype}",
            rows4,
            [
                ("shape", "shape"),
                ("rows", "rows"),
                ("ms", "ms"),
                ("weight GB/s", "weight_gbps"),
                (f"{dtype} ms", "dense_ms"),
                ("rel diff", "max_rel_diff"),
            ],
        )
    print(f"\nwrote {out_path}")
    if smoke:
        failures += [
            f"{part} {r.get('model')}: {r['error']}"
            for part in ("engine_decode", "throughput")
            for r in report.get(part, [])
            if "error" in r
        ]
        if "engine_skipped" in report:
            failures.append(report["engine_skipped"])
        for f in failures:
            print(f"smoke FAILED: {f}", file=sys.stderr)
        return 1 if failures else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
