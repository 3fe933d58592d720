"""Offline throughput: kvserve engine vs Hugging Face transformers on one seeded workload.

Workload (seeded): N requests (default 64), prompt lengths uniform in 32..256 tokens of
random token ids, output lengths uniform in 16..128 with ignore_eos, greedy decoding.
Systems, in one run on the same weights (SmolLM2-135M-Instruct by default, float32):

* kvserve ``LLMEngine`` (continuous batching over the paged KV cache);
* HF ``generate`` in static batches of 16 (left-padded; a batch runs to its longest output);
* HF ``generate`` static batches of 16 again with every ``nn.Linear`` on oneDNN (as kvserve's
  CPU matmuls): the margin without the matmul library's share (on this AMD box ATen's
  ``F.linear`` calls MKL, which takes an AVX2 path);
* HF continuous batching (``model.continuous_batching_context_manager``), when available;
* batch-1 decode latency at a 512-token context, ms per token, kvserve vs HF ``generate``.

"Useful" output tokens are the tokens each request asked for (sum of output lengths), so
HF static's padding and overrun count as time, not as throughput. KV waste is the share
of allocated KV slots (whole blocks held by running requests) not holding a token, over
all engine steps, from the scheduler's own ``kv_allocated_slots`` / ``kv_used_slots``.
The workload, the kvserve run and HF static are in ``benchmarks/common.py`` (``serving.py``
runs the same workload through the same kvserve run).

Usage::

    python benchmarks/throughput.py                      # full run, writes benchmarks/results/throughput.json
    python benchmarks/throughput.py --quick              # 16 requests, kvserve only, smoke test
    python benchmarks/throughput.py --num-requests 4 --out /tmp/t.json   # every system, few requests
"""
from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    add_model_arg,
    load_average,
    load_hf_model,
    make_workload,
    resolve,
    run_hf_static,
    run_kvserve,
    workload_info,
    write_json,
)
from engine import LLM  # noqa: E402


def run_hf_continuous(model_path, work) -> dict:
    from transformers import GenerationConfig
    model = load_hf_model(model_path)
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


@contextlib.contextmanager
def hf_with_onednn_linears():
    """HF transformers with every ``nn.Linear`` on oneDNN, as kvserve runs its matmuls on CPU
    (``engine/layers/linear.py``): the comparison without the matmul library's share."""
    import torch.nn.functional as F
    original = F.linear

    def onednn_linear(x, w, b=None):
        if x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
        return original(x, w, b)

    F.linear = onednn_linear
    try:
        yield
    finally:
        F.linear = original


def batch1_latency(path: str, context: int, new_tokens: int, seed: int, vocab: int) -> dict:
    """Batch-1 decode latency at ``context`` tokens, ms per output token, for kvserve and HF
    ``generate`` (same random prompt, greedy, no EOS): (time for 1 + ``new_tokens`` tokens -
    time for 1 token) / ``new_tokens``, so the prefill cancels out. Best of 3 each."""
    import random

    from transformers import GenerationConfig

    from benchmarks.common import decode_ms_per_token, greedy, load_hf_model

    prompt = [random.Random(seed).randint(100, vocab - 100) for _ in range(context)]
    llm = LLM(model=path, enable_prefix_caching=False)

    def ours(n):
        t = time.perf_counter()
        llm.generate([prompt], greedy(n), use_tqdm=False)
        return time.perf_counter() - t

    model = load_hf_model(path)
    ids = torch.tensor([prompt])
    cfg = lambda n: GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None,
                                     pad_token_id=2)

    def hf(n):
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg(n))
        return time.perf_counter() - t

    out = {"context_tokens": context, "new_tokens": new_tokens,
           "kvserve_ms_per_token": decode_ms_per_token(ours, new_tokens),
           "hf_generate_ms_per_token": decode_ms_per_token(hf, new_tokens)}
    out["kvserve_over_hf"] = out["kvserve_ms_per_token"] / out["hf_generate_ms_per_token"]
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
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
    path, vocab = resolve(args.model)
    work = make_workload(n, args.seed, vocab)
    results = {
        "workload": {**workload_info(work, args.seed), "dtype": "float32"},
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "torch": torch.__version__},
        "model": path,
        "systems": [],
    }

    def kvserve() -> dict:
        r = run_kvserve(LLM(model=path, max_num_batched_tokens=args.max_num_batched_tokens), work)
        del r["texts"]
        return {"system": "kvserve", **r}

    def hf_static_onednn() -> dict:
        with hf_with_onednn_linears():
            r = run_hf_static(path, work)
        return {**r, "system": r["system"] + "_onednn_linears"}

    def batch1() -> dict:
        return {"system": "batch1_decode", **batch1_latency(path, 512, 64, args.seed, vocab)}

    # HF continuous batching runs its model in a thread of its own; it goes last, since OpenMP
    # then keeps a second worker team that slowed later runs of this process (25 vs 19.5 ms/token)
    systems = [kvserve]
    if not (args.quick or args.skip_hf):
        systems += [batch1, lambda: run_hf_static(path, work), hf_static_onednn, lambda: run_hf_continuous(path, work)]
    for fn in systems:
        try:
            r = fn()
        except Exception as e:  # report, do not hide, a system that failed
            r = {"system": getattr(fn, "__name__", "?"), "error": f"{type(e).__name__}: {e}"}
        r["load_average_after"] = load_average()  # 2 cores: > 2 means shared CPU
        results["systems"].append(r)
        print(json.dumps(r), flush=True)
    by = {r["system"]: r for r in results["systems"]}
    if "kvserve" in by and "hf_generate_static_bs16" in by and "output_tok_per_s" in by["hf_generate_static_bs16"]:
        results["kvserve_over_hf_static"] = by["kvserve"]["output_tok_per_s"] / by["hf_generate_static_bs16"]["output_tok_per_s"]
    if "batch1_decode" in by:
        results["batch1_decode"] = by["batch1_decode"]
        results["systems"].remove(by["batch1_decode"])
    results["targets"] = {
        "kvserve_over_hf_static >= 3.0": results.get("kvserve_over_hf_static", 0) >= 3.0,
        "batch-1 decode ms/token <= 0.6x HF": results.get("batch1_decode", {}).get("kvserve_over_hf", 9) <= 0.6}
    print(table(results))
    if not args.quick:
        write_json(args.out, results)
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
        rows.append(f"\nkvserve / HF static = {results['kvserve_over_hf_static']:.2f}x (target >= 3.0)")
    if "batch1_decode" in results:
        b = results["batch1_decode"]
        rows.append(f"batch-1 decode at {b['context_tokens']} tokens: kvserve {b['kvserve_ms_per_token']:.2f} ms/token, "
                    f"HF {b['hf_generate_ms_per_token']:.2f} ms/token = {b['kvserve_over_hf']:.2f}x (target <= 0.6)")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
