"""``kvserve serve`` against ``vllm serve`` as users compare servers: vLLM's own client.

Starts each server in turn on the same model folder and dtype, on this machine, with nothing
else running, and drives it with ``vllm bench serve`` (vLLM's benchmark client, from the
cached vLLM environment of :mod:`benchmarks.peer_vllm`): ``--backend openai --endpoint
/v1/completions --dataset-name random --random-input-len 128 --random-output-len 64
--ignore-eos``, at each ``--concurrency`` (default 1, 8, 32, 64; 8 prompts at concurrency 1,
4 x the concurrency otherwise, at least 32, at most 128). Both servers run with their defaults
but for the model, the dtype, the port and: the response cache off in kvserve (the random
prompts never repeat, and it is not what is measured) and vLLM's KV pool at 2 GiB (kvserve's
CPU default; vLLM's own CPU default reserves 92 % of the RAM).

vLLM gets both cores (``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``);
the client shares them with either server alike.

Usage::

    python benchmarks/serving_vs_vllm.py                      # both servers, float32, writes benchmarks/results/
    python benchmarks/serving_vs_vllm.py --servers kvserve --concurrency 1,8 --out /tmp/x.json

Results: ``benchmarks/results/serving_vs_vllm.json`` (per server and concurrency: output
tok/s, requests/s, TTFT / TPOT / ITL / E2E p50 and p99 in ms, as ``vllm bench serve`` reports
them) and ``benchmarks/results/serving_vs_vllm.png`` (tok/s and TTFT against concurrency).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures, Results, load_average, pyplot, resolve  # noqa: E402
from benchmarks.load_test import LocalServer  # noqa: E402
from benchmarks.peer_vllm import VLLM_VERSION, ensure_venv, vllm_env  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("client", "model", "dtype", "workload", "started", "servers", "kvserve_over_vllm")

SERVED = "smollm2"
KV_BYTES = 2 << 30
#: What each run reports, from ``vllm bench serve``'s result file.
METRICS = ("completed", "failed", "duration", "request_throughput", "output_throughput", "median_ttft_ms",
           "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms", "median_itl_ms", "p99_itl_ms", "median_e2el_ms",
           "p99_e2el_ms")


def vllm_cli(*args: str) -> list[str]:
    """The command line of ``vllm <args>`` in the cached environment (through peer_vllm's
    ``--cli``, which maps the distribution name ``vllm`` onto ``vllm-cpu``)."""
    return [str(ensure_venv()), str(ROOT / "benchmarks" / "peer_vllm.py"), "--cli", *args]


def server(kind: str, model: str, dtype: str, log: Path) -> LocalServer:
    """A (not yet started) server of ``kind`` (``kvserve`` or ``vllm``) on a free loopback port,
    logging to ``log``; ``with`` starts it, waits until it is ready and stops its whole process
    tree on exit (:class:`benchmarks.load_test.LocalServer`)."""
    common = ["--served-model-name", SERVED, "--dtype", dtype]
    if kind == "kvserve":
        return LocalServer(["--model", model, *common, "--no-response-cache"], log_path=str(log))
    return LocalServer([*common, "--host", "127.0.0.1", "--kv-cache-memory-bytes", str(KV_BYTES)],
                       log_path=str(log), command=vllm_cli("serve", model), env=vllm_env())


def bench(port: int, model: str, concurrency: int, num_prompts: int, seed: int, tmp: Path) -> dict:
    """One ``vllm bench serve`` run against the server on ``port``: its :data:`METRICS`.

    Raises:
        RuntimeError: the client failed (its output's tail).
    """
    name = f"c{concurrency}.json"
    cmd = vllm_cli("bench", "serve", "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}",
                   "--endpoint", "/v1/completions", "--model", SERVED, "--tokenizer", model,
                   "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
                   "--ignore-eos", "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency),
                   "--seed", str(seed), "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
                   "--save-result", "--result-dir", str(tmp), "--result-filename", name, "--disable-tqdm")
    r = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=1800, cwd=tmp)
    if r.returncode or not (tmp / name).exists():
        raise RuntimeError(f"vllm bench serve exited {r.returncode}:\n" + (r.stdout + r.stderr)[-3000:])
    data = json.loads((tmp / name).read_text())
    return {k: data.get(k) for k in METRICS}


def num_prompts(concurrency: int) -> int:
    return 8 if concurrency == 1 else min(128, max(32, 4 * concurrency))


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    for kind, style, color in (("kvserve", "o-", "tab:blue"), ("vllm", "s--", "tab:orange")):
        runs = result["servers"].get(kind, {}).get("runs", [])
        if not runs:
            continue
        cs = [r["concurrency"] for r in runs]
        a.plot(cs, [r["output_throughput"] for r in runs], style, color=color, label=kind)
        b.plot(cs, [r["median_ttft_ms"] for r in runs], style, color=color, label=f"{kind} p50")
        b.plot(cs, [r["p99_ttft_ms"] for r in runs], style, color=color, alpha=0.4, label=f"{kind} p99")
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput")
    b.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFT, ms", title="time to first token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{result['model']} ({result['dtype']}), vllm bench serve, random 128 in / 64 out")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    ratios = r.get("kvserve_over_vllm") or {}
    for c, x in ratios.items():
        f.summary(f"`kvserve serve` / `vllm serve` output tok/s at concurrency {c}, {r['dtype']}, `vllm bench serve`",
                  x["output_throughput"], "x", headline=c == "32")
    w = r["workload"]
    f.table("Runs", ["server", "concurrency", "prompts", "output tok/s", "TTFT p50 (ms)", "TTFT p99 (ms)",
                     "TPOT p50 (ms)", "TPOT p99 (ms)", "failed", "load before"],
            [[kind, x["concurrency"], x["num_prompts"], x["output_throughput"], x["median_ttft_ms"], x["p99_ttft_ms"],
              x["median_tpot_ms"], x["p99_tpot_ms"], x["failed"], x.get("load_average_before")]
             for kind, s in r["servers"].items() for x in s["runs"]],
            note=f"Client: {r['client']}; {r['model']} in {r['dtype']}; random prompts of {w['input_len']} tokens, "
                 f"{w['output_len']} output tokens (`--ignore-eos`). Start-up to ready: "
                 + ", ".join(f"{k} {s['startup_s']} s" for k, s in r["servers"].items()) + ".")
    f.table("kvserve / vLLM", ["concurrency", "output tok/s (x)", "TTFT p50 (x)", "TPOT p50 (x)"],
            [[c, x["output_throughput"], x["median_ttft"], x["median_tpot"]] for c, x in ratios.items()],
            note="Throughput: higher is better; latencies: lower is better.")
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or bundled name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--servers", default="kvserve,vllm")
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/serving_vs_vllm.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    ap.add_argument("--replot", action="store_true", help="only draw the plot of an existing --out")
    args = ap.parse_args(argv)
    if args.replot:
        result = json.loads(Path(args.out).read_text())
        plot(result, args.plot or str(Path(args.out).with_suffix(".png")))
        return result
    prov = Results(__file__, RESULT_KEYS)

    model, _ = resolve(args.model)
    result: dict = {"client": f"vllm bench serve (vllm-cpu {VLLM_VERSION})", "model": Path(model).name,
                    "dtype": args.dtype, "workload": {"dataset": "random", "input_len": 128, "output_len": 64,
                                                      "ignore_eos": True, "seed": args.seed},
                    "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "servers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in args.servers.split(","):
            t0 = time.monotonic()
            with server(kind, model, args.dtype, Path(tmp) / f"{kind}.log") as srv:
                startup_s, port = time.monotonic() - t0, srv.port
                runs = []
                for c in (int(x) for x in args.concurrency.split(",")):
                    load = load_average()
                    r = bench(port, model, c, num_prompts(c), args.seed, Path(tmp))
                    runs.append({"concurrency": c, "num_prompts": num_prompts(c), **r, "load_average_before": load})
                    print(f"[{kind}] c={c}: {r['output_throughput']:.1f} tok/s, TTFT p50 {r['median_ttft_ms']:.0f} "
                          f"ms p99 {r['p99_ttft_ms']:.0f} ms, TPOT p50 {r['median_tpot_ms']:.1f} ms", flush=True)
            result["servers"][kind] = {"startup_s": round(startup_s, 1), "runs": runs}
    kv, vl = result["servers"].get("kvserve"), result["servers"].get("vllm")
    if kv and vl:
        result["kvserve_over_vllm"] = {
            str(a["concurrency"]): {"output_throughput": round(a["output_throughput"] / b["output_throughput"], 3),
                                    "median_ttft": round(a["median_ttft_ms"] / b["median_ttft_ms"], 3),
                                    "median_tpot": round(a["median_tpot_ms"] / b["median_tpot_ms"], 3)}
            for a, b in zip(kv["runs"], vl["runs"])}
    result = prov.write(args.out, result)
    plot(result, args.plot or str(Path(args.out).with_suffix(".png")))
    print(json.dumps(result.get("kvserve_over_vllm", {}), indent=1))
    return result


if __name__ == "__main__":  # vLLM spawns processes
    main()
