"""Offline throughput: kvserve engine vs Hugging Face transformers on one seeded workload.

Workload (seeded): N requests (default 64), prompt lengths uniform in 32..256 tokens of
random token ids, output lengths uniform in 16..128 with ignore_eos, greedy decoding.
Systems, in one run on the same weights (SmolLM2-135M-Instruct by default, float32):

* kvserve ``LLMEngine`` (continuous batching over the paged KV cache);
* HF ``generate`` in static batches of 16 (left-padded; a batch runs to its longest output);
* HF continuous batching (``model.continuous_batching_context_manager``), when available.

"Useful" output tokens are the tokens each request asked for (sum of output lengths), so
HF static's padding and overrun count as time, not as throughput. KV waste is the share
of allocated KV slots (whole blocks held by running requests) not holding a token,
averaged over engine steps.

Usage::

    python benchmarks/throughput.py                      # full run, writes benchmarks/results/throughput.json
    python benchmarks/throughput.py --quick              # 16 requests, kvserve only, smoke test
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader import resolve_model  # noqa: E402


def make_workload(n: int, seed: int, vocab: int, prompt_range=(32, 256), output_range=(16, 128)):
    """``n`` (prompt token ids, output length) pairs from a seeded RNG."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        work.append(([rng.randint(100, vocab - 100) for _ in range(plen)], olen))
    return work


def run_kvserve(model: str, work, **engine_kw) -> dict:
    llm = LLM(model=model, **engine_kw)
    eng = llm.engine
    # Warm-up outside the timed region (first-call allocations, thread pools).
    warm = [list(range(1000, 1064))]  # not a workload prompt: no prefix-cache hits from warm-up
    llm.generate(warm, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
    waste_num = waste_den = 0
    t0 = time.perf_counter()
    for i, (ids, olen) in enumerate(work):
        eng.add_request(f"bench-{i}", ids, SamplingParams(max_tokens=olen, temperature=0, ignore_eos=True))
    produced = 0
    steps = 0
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
        steps += 1
        s = eng.scheduler
        alloc = sum(len(r.block_table) for r in s.running) * s.kv.block_size
        if alloc:
            used = sum(r.num_computed_tokens for r in s.running)
            waste_num += alloc - used
            waste_den += alloc
    elapsed = time.perf_counter() - t0
    stats = eng.get_stats()
    return {
        "system": "kvserve",
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tok_per_s": produced / elapsed,
        "steps": steps,
        "max_running_batch": stats["max_running_batch"],
        "kv_waste": waste_num / max(waste_den, 1),
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "num_preemptions": stats["num_preemptions"],
        "num_kv_blocks": stats["num_kv_blocks"],
    }


def run_hf_static(model_path, work, batch_size: int = 16, pad_id: int = 2) -> dict:
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    useful = sum(o for _, o in work)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(work), batch_size):
            batch = work[b:b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(o for _, o in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - t0
    return {"system": f"hf_generate_static_bs{batch_size}", "elapsed_s": elapsed, "output_tokens": useful,
            "output_tok_per_s": useful / elapsed}


def run_hf_continuous(model_path, work) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    if not hasattr(model, "continuous_batching_context_manager"):
        return {"system": "hf_continuous_batching", "skipped": "not available in this transformers"}
    cfg = GenerationConfig(max_new_tokens=max(o for _, o in work), do_sample=False, eos_token_id=-1, pad_token_id=2)
    t0 = time.perf_counter()
    produced = 0
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=5) as manager:
        for i, (ids, olen) in enumerate(work):
            manager.add_request(ids, request_id=f"r{i}", max_new_tokens=olen)
        done = 0
        while done < len(work):
            res = manager.get_result(timeout=1)
            if res is not None and res.is_finished():
                done += 1
                produced += len(res.generated_tokens)
    elapsed = time.perf_counter() - t0
    return {"system": "hf_continuous_batching", "elapsed_s": elapsed, "output_tokens": produced,
            "output_tok_per_s": produced / elapsed}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or hub id (default SmolLM2-135M-Instruct)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--quick", action="store_true", help="16 requests, kvserve only")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    n = 16 if args.quick else args.num_requests
    path = str(resolve_model(args.model))
    from engine.model_loader import load_config
    work = make_workload(n, args.seed, load_config(path).vocab_size)
    results = {
        "workload": {"num_requests": n, "seed": args.seed, "prompt_len": [32, 256], "output_len": [16, 128],
                     "prompt_tokens": sum(len(p) for p, _ in work), "output_tokens": sum(o for _, o in work),
                     "greedy": True, "ignore_eos": True, "dtype": "float32"},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": path,
        "systems": [],
    }
    systems = [lambda: run_kvserve(path, work, max_num_batched_tokens=args.max_num_batched_tokens)]
    if not (args.quick or args.skip_hf):
        systems += [lambda: run_hf_static(path, work), lambda: run_hf_continuous(path, work)]
    for fn in systems:
        try:
            r = fn()
        except Exception as e:  # report, do not hide, a system that failed
            r = {"system": getattr(fn, "__name__", "?"), "error": f"{type(e).__name__}: {e}"}
        r["load_average_after"] = list(os.getloadavg())  # 2 cores: > 2 means shared CPU
        results["systems"].append(r)
        print(json.dumps(r), flush=True)
    by = {r["system"]: r for r in results["systems"]}
    if "kvserve" in by and "hf_generate_static_bs16" in by and "output_tok_per_s" in by["hf_generate_static_bs16"]:
        results["kvserve_over_hf_static"] = by["kvserve"]["output_tok_per_s"] / by["hf_generate_static_bs16"]["output_tok_per_s"]
    print(table(results))
    if not args.quick:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


def table(results: dict) -> str:
    rows = ["| system | output tok/s | elapsed s | notes |", "|---|---|---|---|"]
    for r in results["systems"]:
        if "output_tok_per_s" not in r:
            rows.append(f"| {r['system']} | - | - | {r.get('error') or r.get('skipped')} |")
            continue
        notes = ""
        if r["system"] == "kvserve":
            notes = (f"KV waste {r['kv_waste']:.1%}, prefix hit rate {r['prefix_cache_hit_rate']:.1%}, "
                     f"max batch {r['max_running_batch']}, preemptions {r['num_preemptions']}")
        rows.append(f"| {r['system']} | {r['output_tok_per_s']:.1f} | {r['elapsed_s']:.1f} | {notes} |")
    if "kvserve_over_hf_static" in results:
        rows.append(f"\nkvserve / HF static = {results['kvserve_over_hf_static']:.2f}x")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
