#!/usr/bin/env python
"""kvserve GPU benchmarks: attention kernels, engine decode latency, engine throughput.

Parts (``--parts``, comma-separated; default all):

``attention``
    (1a) Paged *decode* attention (our Triton kernel, ``kernels/triton_attention.py``), bf16,
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
``throughput``
    (3) :func:`bench_engine_throughput`: nano-vllm's workload (256 requests, prompt and output
    lengths uniform in 100..1024, random token ids < 10000, ``ignore_eos``, seed 0) through
    ``engine.LLM`` vs Hugging Face ``generate`` in static batches (``--hf-batch-size``; each
    batch runs to its longest request; only requested tokens are counted for both).

The engine parts use random-weight models of real shapes (Qwen3-0.6B, Llama-3.2-1B,
SmolLM2-135M) built from transformers configs, saved with ``save_pretrained`` in bf16 plus the
tokenizer files of kvserve's default model (prompts are token ids, so the tokenizer only has to
load). Results: one table on stdout and JSON in ``benchmarks/results/gpu_<gpu-name>.json``
(written after every part). Timing: ``torch.cuda.Event`` pairs around single calls after
warmup, L2 flushed (256 MiB write) before each kernel call, median reported.

Without CUDA the script prints why and exits with status 1 (``--build-models-only`` works on
CPU too).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

ATTN_SHAPES = {
    "qwen3-0.6b": dict(num_heads=16, num_kv_heads=8, head_dim=128),
    "llama-3.2-1b": dict(num_heads=32, num_kv_heads=8, head_dim=64),
}

# Random-weight models of real shapes (transformers config fields).
MODEL_SPECS = {
    "qwen3-0.6b": ("qwen3", dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16,
                                 num_key_value_heads=8, head_dim=128, intermediate_size=3072,
                                 vocab_size=151936, tie_word_embeddings=True,
                                 max_position_embeddings=40960, rms_norm_eps=1e-6,
                                 use_sliding_window=False, attention_bias=False)),
    "llama-3.2-1b": ("llama", dict(hidden_size=2048, num_hidden_layers=16,
                                   num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                   intermediate_size=8192, vocab_size=128256,
                                   tie_word_embeddings=True, max_position_embeddings=131072,
                                   rms_norm_eps=1e-5)),
    "smollm2-135m": ("llama", dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
                                   num_key_value_heads=3, head_dim=64, intermediate_size=1536,
                                   vocab_size=49152, tie_word_embeddings=True,
                                   max_position_embeddings=8192, rms_norm_eps=1e-5)),
}

_TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "chat_template.jinja", "added_tokens.json", "vocab.json", "merges.txt"]


# ----------------------------------------------------------------------------- timing

class Timer:
    """CUDA-event timing of single calls, L2 flushed before each, median in ms."""

    def __init__(self, warmup: int = 5, iters: int = 20):
        import torch
        self.torch = torch
        self.warmup, self.iters = warmup, iters
        self._flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")

    def __call__(self, fn) -> float:
        torch = self.torch
        for _ in range(self.warmup):
            fn()
        times = []
        for _ in range(self.iters):
            self._flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return times[len(times) // 2]


def copy_bandwidth(timer: Timer, nbytes: int = 1 << 30) -> float:
    """Device copy bandwidth in GB/s: (read + write bytes) / time of ``dst.copy_(src)``."""
    import torch
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / (ms * 1e-3) / 1e9


# ----------------------------------------------------------------------------- attention

def _paged_problem(batch: int, q_len: int, ctx: int, shape: dict, block_size: int, dtype,
                   seed: int = 0, device: str = "cuda") -> dict:
    """Random paged cache holding ``batch`` requests of ``ctx`` tokens in scattered blocks, and
    ``q_len`` queries per request (the last ``q_len`` positions), plus contiguous copies."""
    import torch
    from kernels.attention import AttentionMetadata
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
    meta = AttentionMetadata(cu_seqlens_q=cu, seq_lens=seq_lens, block_tables=block_tables,
                             slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
                             query_lens_cpu=[q_len] * batch, seq_lens_cpu=[ctx] * batch,
                             max_seqlen_q=q_len, max_seqlen_k=ctx)

    def contiguous(cache):  # [batch, Hkv, ctx, D]
        return cache[block_tables.long()].flatten(1, 2)[:, :ctx].transpose(1, 2).contiguous()

    return dict(q=q, k_cache=k_cache, v_cache=v_cache, meta=meta, k=contiguous(k_cache),
                v=contiguous(v_cache), H=H, Hkv=Hkv, D=D, batch=batch, q_len=q_len, ctx=ctx)


def _sdpa(q, k, v, causal: bool):
    """SDPA with GQA; repeats K/V heads if this torch has no ``enable_gqa`` (note in JSON)."""
    import torch.nn.functional as F
    try:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
    except TypeError:
        rep = q.shape[1] // k.shape[1]
        return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                              v.repeat_interleave(rep, 1), is_causal=causal)


def bench_decode_attention(timer: Timer, shape_name: str, batch: int, ctx: int,
                           block_size: int, copy_bw: float) -> dict:
    import torch
    from kernels import triton_attention as ta
    p = _paged_problem(batch, 1, ctx, ATTN_SHAPES[shape_name], block_size, torch.bfloat16)
    scale = p["D"] ** -0.5
    out = torch.empty_like(p["q"])
    ours = lambda: ta.paged_attention(p["q"], p["k_cache"], p["v_cache"], p["meta"], scale,  # noqa: E731
                                      out=out)
    qs = p["q"].view(batch, 1, p["H"], p["D"]).transpose(1, 2)  # [B, H, 1, D]
    ref = lambda: _sdpa(qs, p["k"], p["v"], causal=False)  # noqa: E731
    ms = timer(ours)
    ms_sdpa = timer(ref)
    err = (ours().float() - ref().transpose(1, 2).reshape_as(out).float()).abs().max().item()
    kv_bytes = 2 * batch * ctx * p["Hkv"] * p["D"] * 2
    io_bytes = kv_bytes + 2 * p["q"].numel() * 2
    splits = ta.choose_num_splits(batch, p["Hkv"], ctx, ta._num_sms(p["q"].device))
    res = dict(shape=shape_name, batch=batch, ctx=ctx, block_size=block_size,
               num_splits=splits, ms=ms, gbps=io_bytes / (ms * 1e-3) / 1e9,
               sdpa_ms=ms_sdpa, sdpa_gbps=io_bytes / (ms_sdpa * 1e-3) / 1e9,
               max_abs_diff_vs_sdpa=err)
    res["frac_of_copy_bw"] = res["gbps"] / copy_bw
    del p, out
    torch.cuda.empty_cache()
    return res


def bench_prefill_attention(timer: Timer, shape_name: str, ctx: int, block_size: int,
                            tokens: int = 16384) -> dict:
    import torch
    from kernels import triton_attention as ta
    batch = max(1, tokens // ctx)
    p = _paged_problem(batch, ctx, ctx, ATTN_SHAPES[shape_name], block_size, torch.bfloat16)
    scale = p["D"] ** -0.5
    out = torch.empty_like(p["q"])
    ours = lambda: ta.paged_attention(p["q"], p["k_cache"], p["v_cache"], p["meta"], scale,  # noqa: E731
                                      out=out)
    qs = p["q"].view(batch, ctx, p["H"], p["D"]).transpose(1, 2).contiguous()
    ref = lambda: _sdpa(qs, p["k"], p["v"], causal=True)  # noqa: E731
    ms = timer(ours)
    ms_sdpa = timer(ref)
    err = (ours().float() - ref().transpose(1, 2).reshape_as(out).float()).abs().max().item()
    flops = 4 * batch * p["H"] * p["D"] * ctx * (ctx + 1) / 2
    res = dict(shape=shape_name, batch=batch, ctx=ctx, block_size=block_size, ms=ms,
               tflops=flops / (ms * 1e-3) / 1e12, sdpa_ms=ms_sdpa,
               sdpa_tflops=flops / (ms_sdpa * 1e-3) / 1e12, max_abs_diff_vs_sdpa=err)
    del p, out, qs
    torch.cuda.empty_cache()
    return res


# ----------------------------------------------------------------------------- models

def build_random_model(name: str, root: Path, device: str = "cuda") -> Path:
    """Random-weight bf16 model folder of a real shape (cached in ``root / name``)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config
    arch, fields = MODEL_SPECS[name]
    out = root / name
    if (out / "config.json").is_file() and list(out.glob("*.safetensors")):
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = {"qwen3": Qwen3Config, "llama": LlamaConfig}[arch](
        **fields, bos_token_id=1, eos_token_id=2, pad_token_id=2, initializer_range=0.02)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(os.fspath(out), safe_serialization=True)
    del model
    gc.collect()
    try:  # any tokenizer will do: prompts are token ids
        from engine.model_loader import resolve_model
        src = resolve_model(None)
        for f in _TOKENIZER_FILES:
            if (src / f).is_file():
                shutil.copyfile(src / f, out / f)
    except Exception as exc:  # noqa: BLE001
        print(f"[gpu.py] warning: no tokenizer copied into {out}: {exc}", file=sys.stderr)
    return out


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
        from engine import LLM, SamplingParams
        return LLM, SamplingParams
    except Exception as exc:  # noqa: BLE001
        raise ImportError(f"engine.LLM not importable: {type(exc).__name__}: {exc}") from exc


def _release(llm) -> None:
    import torch
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
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- part (2)

def bench_engine_decode(model_dir: Path, copy_bw_gbps: float, *, prompt_len: int = 128,
                        new_tokens: int = 256, backend: str = "triton",
                        cuda_graphs: tuple[bool, ...] = (False, True)) -> list[dict]:
    """HOOK (2): engine batch-1 decode latency vs the HBM floor.

    For each CUDA-graph setting: ``LLM(model, dtype="bfloat16", max_num_seqs=1,
    enforce_eager=not graphs, attention_backend=backend)``; ms/token =
    ``(t(1 + new_tokens) - t(1)) / new_tokens`` where ``t(n)`` is the wall time of a
    ``generate`` of ``n`` tokens (greedy, ``ignore_eos``) on a fresh random prompt of
    ``prompt_len`` tokens (fresh, so prefix caching gives both calls the same prefill).
    Floor = weight bytes / measured copy bandwidth.
    """
    import torch
    LLM, SamplingParams = _engine_api()
    floor_ms = weight_bytes(model_dir) / (copy_bw_gbps * 1e9) * 1e3
    rng = random.Random(0)
    results = []
    for graphs in cuda_graphs:
        llm = LLM(model=os.fspath(model_dir), dtype="bfloat16", max_num_seqs=1,
                  enforce_eager=not graphs, attention_backend=backend)

        def run(n: int) -> float:
            prompt = [rng.randint(0, 10000) for _ in range(prompt_len)]
            sp = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = llm.generate([prompt], [sp], use_tqdm=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            got = len(out[0].outputs[0].token_ids)
            if got != n:
                raise RuntimeError(f"asked for {n} tokens, got {got}")
            return dt

        run(16)  # warmup (compiles kernels, captures graphs)
        t1 = min(run(1) for _ in range(3))
        tn = min(run(1 + new_tokens) for _ in range(2))
        ms = (tn - t1) / new_tokens * 1e3
        results.append(dict(model=model_dir.name, cuda_graphs=graphs, backend=backend,
                            prompt_len=prompt_len, new_tokens=new_tokens, ms_per_token=ms,
                            hbm_floor_ms=floor_ms, floor_frac=floor_ms / ms,
                            weight_gb=weight_bytes(model_dir) / 1e9))
        _release(llm)
    return results


# ----------------------------------------------------------------------------- part (3)

def nano_vllm_workload(num_requests: int = 256, min_len: int = 100, max_len: int = 1024,
                       seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """nano-vllm's bench.py workload: random ids < 10000, prompt and output lengths uniform."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(min_len, max_len))]
               for _ in range(num_requests)]
    outputs = [rng.randint(min_len, max_len) for _ in range(num_requests)]
    return prompts, outputs


def bench_engine_throughput(model_dir: Path, *, num_requests: int = 256,
                            max_num_seqs: int = 256, backend: str = "triton",
                            hf_batch_size: int = 64, hf_max_requests: int | None = None,
                            run_hf: bool = True) -> dict:
    """HOOK (3): output tokens/s of the engine vs HF ``generate`` on nano-vllm's workload.

    Engine: all requests at once (continuous batching, CUDA graphs on). HF: static batches
    of ``hf_batch_size`` in request order, left padding, greedy, ``min_new_tokens =
    max_new_tokens =`` the batch's longest output (so EOS cannot stop it); throughput counts
    only the requested tokens. ``hf_max_requests`` limits HF to the first N requests.
    """
    import torch
    LLM, SamplingParams = _engine_api()
    prompts, outs = nano_vllm_workload(num_requests)
    res = dict(model=model_dir.name, num_requests=num_requests, backend=backend,
               prompt_tokens=sum(map(len, prompts)), output_tokens=sum(outs))
    llm = LLM(model=os.fspath(model_dir), dtype="bfloat16", max_num_seqs=max_num_seqs,
              enforce_eager=False, attention_backend=backend)
    llm.generate([prompts[0][:64]], [SamplingParams(max_tokens=16, ignore_eos=True,
                                                    temperature=0, detokenize=False)], use_tqdm=False)
    sps = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, detokenize=False) for n in outs]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    results = llm.generate(prompts, sps, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    got = sum(len(r.outputs[0].token_ids) for r in results)
    res.update(engine_s=dt, engine_tok_s=got / dt, engine_tokens=got)
    _release(llm)

    if run_hf:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(os.fspath(model_dir),
                                                     dtype=torch.bfloat16).cuda().eval()
        n = min(num_requests, hf_max_requests or num_requests)
        useful = 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for s in range(0, n, hf_batch_size):
            batch = prompts[s:s + hf_batch_size]
            want = outs[s:s + hf_batch_size]
            width = max(map(len, batch))
            ids = torch.zeros(len(batch), width, dtype=torch.long)
            mask = torch.zeros(len(batch), width, dtype=torch.long)
            for i, p in enumerate(batch):  # left padding
                ids[i, width - len(p):] = torch.tensor(p)
                mask[i, width - len(p):] = 1
            with torch.inference_mode():
                model.generate(input_ids=ids.cuda(), attention_mask=mask.cuda(),
                               max_new_tokens=max(want), min_new_tokens=max(want),
                               do_sample=False, pad_token_id=0)
            useful += sum(want)
        torch.cuda.synchronize()
        hf_dt = time.perf_counter() - t0
        res.update(hf_requests=n, hf_batch_size=hf_batch_size, hf_s=hf_dt,
                   hf_tok_s=useful / hf_dt, speedup_vs_hf=(got / dt) / (useful / hf_dt))
        del model
        gc.collect()
        torch.cuda.empty_cache()
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="See the module docstring for what each part measures.")
    ap.add_argument("--parts", default="attention,engine-decode,throughput",
                    help="comma-separated: attention, engine-decode, throughput")
    ap.add_argument("--shapes", default=",".join(ATTN_SHAPES),
                    help=f"attention shapes ({', '.join(ATTN_SHAPES)})")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--batch", type=int, default=64, help="decode batch (default 64)")
    ap.add_argument("--prefill-tokens", type=int, default=16384,
                    help="query tokens per prefill call (batch = this // ctx)")
    ap.add_argument("--block-size", type=int, default=16, help="KV cache block size")
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.2-1b,smollm2-135m",
                    help=f"engine parts: {', '.join(MODEL_SPECS)}")
    ap.add_argument("--model-root", type=Path,
                    default=Path(os.environ.get("KVSERVE_BENCH_MODELS",
                                                "/tmp/kvserve-bench-models")),
                    help="where random-weight model folders are built / reused")
    ap.add_argument("--backend", default="triton", help="engine attention backend")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-max-requests", type=int, default=None)
    ap.add_argument("--no-hf", action="store_true", help="skip the HF generate baseline")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None,
                    help="JSON path (default benchmarks/results/gpu_<gpu-name>.json)")
    ap.add_argument("--build-models-only", action="store_true",
                    help="only build the random-weight model folders (works on CPU)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    models = [m for m in args.models.split(",") if m]
    if args.build_models_only:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        for m in models:
            print(build_random_model(m, args.model_root, dev))
        return 0
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA GPU visible (torch.cuda.is_available() is False, "
              f"torch {torch.__version__}); these benchmarks need one. Nothing was run.",
              file=sys.stderr)
        return 1
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("benchmarks/gpu.py: unset TRITON_INTERPRET to benchmark compiled kernels",
              file=sys.stderr)
        return 1
    import triton
    parts = {p.strip() for p in args.parts.split(",") if p.strip()}
    gpu = torch.cuda.get_device_name()
    out_path = args.out or ROOT / "benchmarks" / "results" / f"gpu_{_gpu_slug(gpu)}.json"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    timer = Timer(args.warmup, args.iters)
    copy_bw = copy_bandwidth(timer)
    report = dict(gpu=gpu, sms=torch.cuda.get_device_properties(0).multi_processor_count,
                  torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S"), copy_bandwidth_gbps=copy_bw,
                  args={k: str(v) for k, v in vars(args).items()})
    print(f"{gpu}: copy bandwidth {copy_bw:.0f} GB/s")

    def save():
        out_path.write_text(json.dumps(report, indent=2))

    save()
    ctxs = [int(c) for c in args.contexts.split(",") if c]
    shapes = [s for s in args.shapes.split(",") if s]
    if "attention" in parts:
        dec = [bench_decode_attention(timer, s, args.batch, c, args.block_size, copy_bw)
               for s in shapes for c in ctxs]
        report["decode_attention"] = dec
        save()
        pre = [bench_prefill_attention(timer, s, c, args.block_size, args.prefill_tokens)
               for s in shapes for c in ctxs]
        report["prefill_attention"] = pre
        save()
        _print_table(f"paged decode attention, bf16, batch {args.batch} "
                     f"(copy bandwidth {copy_bw:.0f} GB/s)", dec,
                     [("shape", "shape"), ("ctx", "ctx"), ("splits", "num_splits"),
                      ("ms", "ms"), ("GB/s", "gbps"), ("of copy", "frac_of_copy_bw"),
                      ("sdpa ms", "sdpa_ms"), ("sdpa GB/s", "sdpa_gbps"),
                      ("max|diff|", "max_abs_diff_vs_sdpa")])
        _print_table("varlen causal prefill attention, bf16", pre,
                     [("shape", "shape"), ("batch", "batch"), ("ctx", "ctx"), ("ms", "ms"),
                      ("TFLOP/s", "tflops"), ("sdpa ms", "sdpa_ms"),
                      ("sdpa TFLOP/s", "sdpa_tflops"), ("max|diff|", "max_abs_diff_vs_sdpa")])
    if parts & {"engine-decode", "throughput"}:
        try:
            _engine_api()
        except ImportError as exc:
            report["engine_skipped"] = str(exc)
            print(f"\nengine parts skipped: {exc}")
            parts -= {"engine-decode", "throughput"}
    if "engine-decode" in parts:
        rows = []
        for m in models:
            try:
                rows += bench_engine_decode(build_random_model(m, args.model_root), copy_bw,
                                            backend=args.backend)
            except Exception as exc:  # noqa: BLE001 - keep the other models
                rows.append(dict(model=m, error=f"{type(exc).__name__}: {exc}"))
            report["engine_decode"] = rows
            save()
        _print_table("engine batch-1 decode", rows,
                     [("model", "model"), ("graphs", "cuda_graphs"), ("ms/tok", "ms_per_token"),
                      ("floor ms", "hbm_floor_ms"), ("floor/ms", "floor_frac"),
                      ("error", "error")])
    if "throughput" in parts:
        rows = []
        for m in models:
            try:
                rows.append(bench_engine_throughput(
                    build_random_model(m, args.model_root), num_requests=args.num_requests,
                    backend=args.backend, hf_batch_size=args.hf_batch_size,
                    hf_max_requests=args.hf_max_requests, run_hf=not args.no_hf))
            except Exception as exc:  # noqa: BLE001
                rows.append(dict(model=m, error=f"{type(exc).__name__}: {exc}"))
            report["throughput"] = rows
            save()
        _print_table("throughput, nano-vllm workload", rows,
                     [("model", "model"), ("engine tok/s", "engine_tok_s"),
                      ("hf tok/s", "hf_tok_s"), ("speedup", "speedup_vs_hf"),
                      ("error", "error")])
    print(f"\nwrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
