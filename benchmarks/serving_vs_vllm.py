"""``kvserve serve`` against ``vllm serve`` as users compare servers: vLLM's own client,
interleaved repeats, fresh prompts for every level and repeat.

Each *server configuration* (``--servers``) is started on the same model folder and dtype, on
this machine, with nothing else running, and driven with ``vllm bench serve`` (vLLM's benchmark
client, from the cached vLLM environment of :mod:`benchmarks.peer_vllm`): ``--backend openai
--endpoint /v1/completions --dataset-name random --random-input-len 128 --random-output-len 64
--ignore-eos``, at each ``--concurrency`` (default 1, 8, 32, 64; 8 prompts at concurrency 1, 4 x
the concurrency otherwise, at least 32, at most 128).

How the comparison is kept fair (issue 41):

* **Interleaved repeats.** ``--repeats`` rounds (default 3); in each round every configuration is
  started, runs every level, and is stopped, the order reversed from one round to the next
  (A B C, C B A, A B C, ...), so a drift of the machine lands on every configuration alike.
  Reported: the median over the rounds, with the lowest and highest.
* **Fresh prompts.** Each (round, level) has its own ``--seed`` (``seed + 1000 * round + level
  index``), the same for every configuration of that round: the servers see identical prompts,
  and no prompt of one level or round comes again, so no prefix cache carries over. Each run
  records both servers' prefix-cache hit rate over that run (their ``/metrics`` counters before
  and after: ``kvserve:prefix_cache_{queries,hits}_total``,
  ``vllm:prefix_cache_{queries,hits}_total``).
* **The same streaming granularity.** ``--stream-interval`` (default 1: every token) goes to
  both servers when the installed vLLM takes the flag (recorded either way).
* **vLLM as its CPU docs set it up.** ``vllm`` is vLLM's documented default on this box: TCMalloc
  and Intel OpenMP preloaded (``LD_PRELOAD``) where they are installed (which were found is
  recorded), its threads bound by ``VLLM_CPU_OMP_THREADS_BIND=auto``, and its default reserved
  core for the front end; ``vllm-allcores`` is the same with no core reserved and both bound
  (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``, ``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>``), the setting
  kvserve's offline comparisons use. kvserve's alternatives run when named: ``kvserve-thread``,
  its engine stepping in a thread of the replica's process (``--no-engine-core-process``),
  ``kvserve-nochannel``, every chunk on its request's own Serve stream (``--no-replica-channels``),
  ``kvserve-omp-passive`` (``OMP_WAIT_POLICY=PASSIVE``) and ``kvserve-pinned`` (the engine's
  OpenMP threads bound one per core), the last two set in the environment (:data:`KVSERVE_ENV`).
  All get the same KV pool as kvserve's CPU default (2 GiB;
  vLLM's own default reserves 92 % of the RAM). kvserve runs with its defaults but for the
  response cache, which is off (the random prompts never repeat, and it is not what is measured).
* **Provenance.** Every configuration's full command line, the environment variables that steer
  it, vLLM's own account of its engine configuration (the ``non-default args`` line of its log),
  kvserve's ``/v1/models`` card, the load average before and after every run, and the machine.

Usage::

    python benchmarks/serving_vs_vllm.py                                   # float32, writes benchmarks/results/
    python benchmarks/serving_vs_vllm.py --dtype bfloat16 --out benchmarks/results/serving_vs_vllm_bf16.json
    python benchmarks/serving_vs_vllm.py --servers kvserve --concurrency 1,8 --repeats 1 --out /tmp/x.json

Results: ``benchmarks/results/serving_vs_vllm.json`` (``--out``; per configuration, level and
round: output tok/s, requests/s, TTFT / TPOT / ITL / E2E p50 and p99 in ms as ``vllm bench
serve`` reports them, the prefix-cache hit rate, the load average) and a PNG beside it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures, Results, load_average, pyplot, resolve  # noqa: E402
from benchmarks.load_test import LocalServer  # noqa: E402
from benchmarks.peer_vllm import KV_CACHE_BYTES, VLLM_VERSION, ensure_venv, vllm_env  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("client", "model", "dtype", "workload", "started", "repeats", "order", "servers", "kvserve_over_vllm")

SERVED = "smollm2"
#: What each run reports, from ``vllm bench serve``'s result file.
METRICS = (
    "completed",
    "failed",
    "duration",
    "request_throughput",
    "output_throughput",
    "median_ttft_ms",
    "p99_ttft_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_e2el_ms",
    "p99_e2el_ms",
)
#: The figures summarised over rounds (median, lowest, highest).
SUMMARISED = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "p99_ttft_ms", "prefix_cache_hit_rate")
CONFIGS = (
    "kvserve",
    "vllm",
    "vllm-allcores",
    "kvserve-thread",
    "kvserve-nochannel",
    "kvserve-omp-passive",
    "kvserve-pinned",
)
#: kvserve's alternative set-ups (run when named): its engine stepping in a thread of the replica's
#: process, and every chunk on its request's own stream (no gateway channel).
KVSERVE_ALTERNATIVES = {"kvserve-thread": ["--no-engine-core-process"], "kvserve-nochannel": ["--no-replica-channels"]}
#: kvserve's alternatives by environment (issue 41 item 1), which every process of its Ray instance
#: inherits: the engine's OpenMP threads sleep at once when idle instead of spinning first (GNU
#: OpenMP's default spins about 0.3 ms; ``PASSIVE`` gives the serving processes the core sooner but
#: wakes the team later), and its threads bound one per core (``OMP_PROC_BIND=close``,
#: ``OMP_PLACES=cores``: no migration, but the serving processes then share a bound core).
KVSERVE_ENV = {
    "kvserve-omp-passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "kvserve-pinned": {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"},
}
#: What ``--servers`` runs unless told.
DEFAULT_SERVERS = ("kvserve", "vllm", "vllm-allcores")
#: Environment variables recorded with each configuration (prefixes).
STEERING = ("VLLM_", "OMP_", "KMP_", "LD_PRELOAD", "KVSERVE_", "RAY_", "TORCH", "MKL_")
#: Where TCMalloc and Intel OpenMP may be installed (vLLM's CPU docs preload both).
PRELOADS = {
    "tcmalloc": (
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
        "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
        "/usr/lib64/libtcmalloc_minimal.so.4",
    ),
    "iomp": ("{venv}/lib/libiomp5.so", "{venv}/lib/python3*/site-packages/intel_openmp*/lib/libiomp5.so"),
}


def vllm_cli(*args: str) -> list[str]:
    """The command line of ``vllm <args>`` in the cached environment (through peer_vllm's
    ``--cli``, which maps the distribution name ``vllm`` onto ``vllm-cpu``)."""
    return [str(ensure_venv()), str(ROOT / "benchmarks" / "peer_vllm.py"), "--cli", *args]


def preloads() -> dict[str, str | None]:
    """The TCMalloc and Intel OpenMP libraries found here (None: not installed)."""
    venv = str(ensure_venv().parents[1])
    found = {}
    for name, patterns in PRELOADS.items():
        hits = [p for pat in patterns for p in sorted(glob.glob(pat.format(venv=venv)))]
        found[name] = hits[0] if hits else None
    return found


def vllm_takes(flag: str) -> bool:
    """Whether the installed ``vllm serve`` has ``flag`` (from its ``--help``)."""
    r = subprocess.run(vllm_cli("serve", "--help=all"), env=vllm_env(), capture_output=True, text=True, timeout=300)
    return flag in r.stdout + r.stderr


def config_env(kind: str) -> dict[str, str]:
    """The environment of vLLM configuration ``kind`` (``vllm`` or ``vllm-allcores``, see the
    module docstring); kvserve runs in this process's environment."""
    env = vllm_env()  # both cores bound, none reserved (vllm-allcores)
    env["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM's default: its log then has its settings (``non-default args``)
    if kind == "vllm":  # the documented defaults
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
        env.pop("VLLM_CPU_NUM_OF_RESERVED_CPU", None)
    libs = [p for p in preloads().values() if p]
    if libs:
        env["LD_PRELOAD"] = ":".join([*libs, *filter(None, [os.environ.get("LD_PRELOAD")])])
    return env


def server(kind: str, model: str, dtype: str, log: Path, stream_interval: int | None = None) -> LocalServer:
    """A (not yet started) server of configuration ``kind`` on a free loopback port, logging to
    ``log`` (``--stream-interval`` given when ``stream_interval`` is not None; ``benchmarks/idle_cpu.py``
    starts its peer through this too); ``with`` starts it, waits until it is ready and stops its
    whole process tree on exit (:class:`benchmarks.load_test.LocalServer`)."""
    common = ["--served-model-name", SERVED, "--dtype", dtype]
    if stream_interval is not None:
        common += ["--stream-interval", str(stream_interval)]
    if kind.startswith("kvserve"):
        extra = KVSERVE_ALTERNATIVES.get(kind, [])
        return LocalServer(
            ["--model", model, *common, "--no-response-cache", *extra],
            log_path=str(log),
            env={**os.environ, **KVSERVE_ENV.get(kind, {})},
        )
    return LocalServer(
        [*common, "--host", "127.0.0.1", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES)],
        log_path=str(log),
        command=vllm_cli("serve", model),
        env=config_env(kind),
    )


def prefix_counters(port: int) -> tuple[float, float]:
    """``(queries, hits)``: the server's prefix-cache counters in tokens, summed over their
    series, from ``/metrics`` (kvserve's ``kvserve:`` and vLLM's ``vllm:`` names)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {"queries": 0.0, "hits": 0.0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            for k in out:
                if s.name.endswith(f"prefix_cache_{k}_total"):
                    out[k] += s.value
    return out["queries"], out["hits"]


def bench(port: int, model: str, concurrency: int, num_prompts: int, seed: int, tmp: Path) -> dict:
    """One ``vllm bench serve`` run against the server on ``port``: its :data:`METRICS`, the
    prefix-cache hit rate over the run and the load average before and after.

    Raises:
        RuntimeError: the client failed (its output's tail).
    """
    name = f"c{concurrency}-s{seed}.json"
    cmd = vllm_cli(
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        "128",
        "--random-output-len",
        "64",
        "--ignore-eos",
        "--num-prompts",
        str(num_prompts),
        "--max-concurrency",
        str(concurrency),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(tmp),
        "--result-filename",
        name,
        "--disable-tqdm",
    )
    load_before = load_average()
    q0, h0 = prefix_counters(port)
    r = subprocess.run(cmd, env=vllm_env(), capture_output=True, text=True, timeout=1800, cwd=tmp)
    if r.returncode or not (tmp / name).exists():
        raise RuntimeError(f"vllm bench serve exited {r.returncode}:\n" + (r.stdout + r.stderr)[-3000:])
    q1, h1 = prefix_counters(port)
    data = json.loads((tmp / name).read_text())
    return {
        **{k: data.get(k) for k in METRICS},
        "prefix_cache_hit_rate": round((h1 - h0) / (q1 - q0), 4) if q1 > q0 else None,
        "load_average_before": load_before,
        "load_average_after": load_average(),
    }


def num_prompts(concurrency: int) -> int:
    return 8 if concurrency == 1 else min(128, max(32, 4 * concurrency))


def settings(kind: str, srv: LocalServer) -> dict:
    """What configuration ``kind`` ran with (``srv``, running): its command line, the steering
    environment, and the server's own account (kvserve's ``/v1/models`` card; vLLM's
    ``non-default args`` log line)."""
    out = {"command": srv.args, "env": {k: v for k, v in sorted(srv.base_env.items()) if k.startswith(STEERING)}}
    if kind.startswith("kvserve"):
        with urllib.request.urlopen(f"http://127.0.0.1:{srv.port}/v1/models", timeout=30) as r:
            out["model_card"] = json.loads(r.read())["data"][0]
    else:
        lines = [ln for ln in Path(srv.log_path).read_text(errors="replace").splitlines() if "non-default args" in ln]
        out["vllm_log"] = lines[-1].split("non-default args", 1)[1].strip(": ") if lines else None
    return out


def summary(runs: list[dict]) -> dict:
    """Per figure of :data:`SUMMARISED`: ``{"median", "min", "max"}`` over the rounds."""
    out = {}
    for k in SUMMARISED:
        xs = [r[k] for r in runs if r.get(k) is not None]
        out[k] = (
            {"median": round(statistics.median(xs), 3), "min": round(min(xs), 3), "max": round(max(xs), 3)}
            if xs
            else None
        )
    return out


def ratios(result: dict, peer: str) -> dict:
    """kvserve / ``peer`` per level, from the medians over rounds (throughput: higher is better)."""
    kv, vl = result["servers"].get("kvserve"), result["servers"].get(peer)
    if not kv or not vl:
        return {}
    out = {}
    for c, a in kv["levels"].items():
        b = vl["levels"].get(c)
        if b:
            tput = a["output_throughput"]["median"] / b["output_throughput"]["median"]
            out[c] = {
                "output_throughput": round(tput, 3),
                "median_ttft": round(a["median_ttft_ms"]["median"] / b["median_ttft_ms"]["median"], 3),
                "median_ttft_diff_ms": round(a["median_ttft_ms"]["median"] - b["median_ttft_ms"]["median"], 1),
                "median_tpot": round(a["median_tpot_ms"]["median"] / b["median_tpot_ms"]["median"], 3),
            }
    return out


def plot(result: dict, path: str) -> None:
    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    styles = {
        "kvserve": ("o-", "tab:blue"),
        "vllm": ("s--", "tab:orange"),
        "vllm-allcores": ("^:", "tab:red"),
        "kvserve-thread": ("d-.", "tab:green"),
        "kvserve-nochannel": ("v-.", "tab:purple"),
    }
    for kind, s in result["servers"].items():
        style, color = styles.get(kind, ("x-", "gray"))
        cs = sorted(s["levels"], key=int)
        med = [s["levels"][c]["output_throughput"]["median"] for c in cs]
        lo = [m - s["levels"][c]["output_throughput"]["min"] for m, c in zip(med, cs)]
        hi = [s["levels"][c]["output_throughput"]["max"] - m for m, c in zip(med, cs)]
        a.errorbar([int(c) for c in cs], med, yerr=[lo, hi], fmt=style, color=color, label=kind, capsize=3)
        b.plot(
            [int(c) for c in cs],
            [s["levels"][c]["median_ttft_ms"]["median"] for c in cs],
            style,
            color=color,
            label=f"{kind} p50",
        )
    a.set(xscale="log", xlabel="concurrency", ylabel="output tokens/s", title="throughput (median, range over rounds)")
    b.set(xscale="log", yscale="log", xlabel="concurrency", ylabel="TTFT p50, ms", title="time to first token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(
        f"{result['model']} ({result['dtype']}), vllm bench serve, random 128 in / 64 out, "
        f"{result['repeats']} interleaved rounds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values.

    The headline is kvserve against ``vllm-allcores`` (both cores to each engine, the split of
    the offline comparisons), with ``vllm`` (vLLM's docs default, one core reserved for its front
    end) as a second headline row beside it, both at concurrency 32; the first in the file's
    summary is the like-for-like one."""
    f = Figures()
    how = f"{r['dtype']}, median of {r['repeats']} interleaved rounds"
    # which cores each vLLM configuration gives its engine (the module docstring)
    cores = {
        "vllm-allcores": " (both cores to each engine)",
        "vllm": " (vLLM's docs default: one core reserved for its front end and one for its engine)",
    }
    per_peer = r.get("kvserve_over_vllm") or {}
    for peer in sorted(per_peer, key=lambda p: (p != "vllm-allcores", p != "vllm", p)):  # issue 41's targets
        per_level = per_peer[peer]
        for c, x in per_level.items():
            if c != "1":
                f.summary(
                    f"`kvserve serve` / `{peer}`{cores.get(peer, '') if c == '32' else ''} output tok/s at "
                    f"concurrency {c}, {how}",
                    x["output_throughput"],
                    "x",
                    target=">= 1.2x",
                    met=x["output_throughput"] >= 1.2,
                    headline=c == "32" and peer in cores,
                )
            if c in ("1", "32"):
                f.summary(
                    f"`kvserve serve` / `{peer}` TPOT p50 at concurrency {c}, {how}",
                    x["median_tpot"],
                    "x",
                    target="<= 1.0x",
                    met=x["median_tpot"] <= 1.0,
                )
            if c == "1":
                f.summary(
                    f"`kvserve serve` minus `{peer}` TTFT p50 at concurrency 1, {how}",
                    x["median_ttft_diff_ms"],
                    "ms",
                    target="<= +10 ms",
                    met=x["median_ttft_diff_ms"] <= 10,
                )
    w = r["workload"]
    f.table(
        "Medians over rounds",
        [
            "server",
            "concurrency",
            "output tok/s",
            "(lowest - highest)",
            "TTFT p50 (ms)",
            "TPOT p50 (ms)",
            "TTFT p99 (ms)",
            "prefix-cache hit rate",
        ],
        [
            [
                kind,
                int(c),
                x["output_throughput"]["median"],
                f"{x['output_throughput']['min']} - {x['output_throughput']['max']}",
                x["median_ttft_ms"]["median"],
                x["median_tpot_ms"]["median"],
                x["p99_ttft_ms"]["median"],
                (x["prefix_cache_hit_rate"] or {}).get("median"),
            ]
            for kind, s in r["servers"].items()
            for c, x in s["levels"].items()
        ],
        note=f"Client: {r['client']}; {r['model']} in {r['dtype']}; random prompts of {w['input_len']} tokens, "
        f"{w['output_len']} output tokens (`--ignore-eos`), a seed per round and level; stream interval "
        f"{w['stream_interval']} on both sides (vLLM took it: {w['vllm_stream_interval']}). Order of the "
        f"rounds: {'; '.join(' '.join(o) for o in r['order'])}.",
    )
    f.table(
        "Every run",
        [
            "server",
            "round",
            "concurrency",
            "seed",
            "output tok/s",
            "TTFT p50 (ms)",
            "TPOT p50 (ms)",
            "failed",
            "prefix-cache hit rate",
            "load before",
            "load after",
        ],
        [
            [
                kind,
                x["round"],
                x["concurrency"],
                x["seed"],
                x["output_throughput"],
                x["median_ttft_ms"],
                x["median_tpot_ms"],
                x["failed"],
                x["prefix_cache_hit_rate"],
                x["load_average_before"],
                x["load_average_after"],
            ]
            for kind, s in r["servers"].items()
            for x in s["runs"]
        ],
    )
    for peer, per_level in (r.get("kvserve_over_vllm") or {}).items():
        f.table(
            f"kvserve / {peer}",
            ["concurrency", "output tok/s (x)", "TTFT p50 (x)", "TTFT p50 difference (ms)", "TPOT p50 (x)"],
            [
                [c, x["output_throughput"], x["median_ttft"], x["median_ttft_diff_ms"], x["median_tpot"]]
                for c, x in per_level.items()
            ],
            note="Medians over rounds. Throughput: higher is better; latencies: lower is better.",
        )
    return f


def derive(result: dict, levels: list[int] | None = None) -> dict:
    """Fill in ``result``'s derived figures from its raw runs (in place, and returned): each
    configuration's ``levels`` (:func:`summary` of its runs per concurrency; ``levels`` None: the
    concurrencies its runs have, in the order they ran) and ``kvserve_over_vllm``
    (:func:`ratios` for every vLLM configuration that ran)."""
    for s in result["servers"].values():
        cs = levels if levels is not None else list(dict.fromkeys(r["concurrency"] for r in s["runs"]))
        s["levels"] = {str(c): summary([r for r in s["runs"] if r["concurrency"] == c]) for c in cs}
    peers = [k for k in result["servers"] if not k.startswith("kvserve")]
    result["kvserve_over_vllm"] = {p: ratios(result, p) for p in peers if ratios(result, p)}
    return result


def rerender(path: str | os.PathLike, plot_path: str | None = None) -> dict:
    """Derive an existing results file's figures again from the runs it recorded, measuring
    nothing: the medians and ratios in it must be what :func:`derive` gives from its raw runs
    (else ValueError: they were not written by this code), then its ``summary`` and ``tables``
    come from ``figures`` (``benchmarks/migrate_results.py``'s ``migrate``, the derivation
    ``Results.write`` runs) and its plot is drawn again (``plot_path``, default: next to it). The
    file keeps the measurement's provenance (script, commit, machine, command, load average) and
    gains ``schema_migrated_by``: this command and the commit it ran at. Returns the file's new
    content.

    Raises:
        ValueError: the file was not written by this script, its derived figures differ from its
            runs', or ``figures`` does not follow the results schema.
    """
    from benchmarks.common import _command, git_commit, measured_part
    from benchmarks.migrate_results import migrate

    path = Path(path)
    data = json.loads(path.read_text())
    if data.get("script") != Path(__file__).resolve().relative_to(ROOT).as_posix():
        raise ValueError(f"{path} was written by {data.get('script')!r}, not benchmarks/serving_vs_vllm.py")
    recorded = measured_part(data)
    again = derive(json.loads(json.dumps(recorded)))
    if json.loads(json.dumps(again)) != recorded:
        raise ValueError(f"{path}: its medians or ratios are not what its runs give (derive()); measure again")
    migrate(path, f"{_command()} (at commit {git_commit()})", rederive=True)
    out = json.loads(path.read_text())
    plot(out, plot_path or str(path.with_suffix(".png")))
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model folder or bundled name (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument(
        "--servers",
        default=",".join(DEFAULT_SERVERS),
        help=f"configurations, of {', '.join(CONFIGS)} (default {','.join(DEFAULT_SERVERS)})",
    )
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved rounds (default 3)")
    ap.add_argument("--stream-interval", type=int, default=1, help="both servers' --stream-interval (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/serving_vs_vllm.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out)")
    ap.add_argument(
        "--from-results",
        action="store_true",
        help="measure nothing: derive the medians, ratios, summary and plot of an existing --out again "
        "from the runs it recorded (its provenance kept; the re-render's command and commit added)",
    )
    args = ap.parse_args(argv)
    if args.from_results:
        return rerender(args.out, args.plot)
    kinds = args.servers.split(",")
    unknown = set(kinds) - set(CONFIGS)
    if unknown:
        ap.error(f"unknown server configurations {sorted(unknown)}; known: {', '.join(CONFIGS)}")
    levels = [int(x) for x in args.concurrency.split(",")]
    prov = Results(__file__, RESULT_KEYS)

    model, _ = resolve(args.model)
    peers = [k for k in kinds if not k.startswith("kvserve")]
    vllm_si = bool(peers) and vllm_takes("--stream-interval")
    result: dict = {
        "client": f"vllm bench serve (vllm-cpu {VLLM_VERSION})",
        "model": Path(model).name,
        "dtype": args.dtype,
        "repeats": args.repeats,
        "order": [],
        "workload": {
            "dataset": "random",
            "input_len": 128,
            "output_len": 64,
            "ignore_eos": True,
            "seed": args.seed,
            "stream_interval": args.stream_interval,
            "vllm_stream_interval": vllm_si,
            "preloads": preloads() if peers else None,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "servers": {k: {"startup_s": [], "settings": None, "runs": []} for k in kinds},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.repeats):
            order = kinds if rnd % 2 == 0 else kinds[::-1]
            result["order"].append(order)
            for kind in order:
                log = Path(tmp) / f"{kind}-{rnd}.log"
                si = args.stream_interval if kind.startswith("kvserve") or vllm_si else None
                t0 = time.monotonic()
                with server(kind, model, args.dtype, log, si) as srv:
                    s = result["servers"][kind]
                    s["startup_s"].append(round(time.monotonic() - t0, 1))
                    if s["settings"] is None:
                        s["settings"] = settings(kind, srv)
                    for i, c in enumerate(levels):
                        seed = args.seed + 1000 * rnd + i
                        r = bench(srv.port, model, c, num_prompts(c), seed, Path(tmp))
                        s["runs"].append(
                            {"round": rnd, "concurrency": c, "num_prompts": num_prompts(c), "seed": seed, **r}
                        )
                        print(
                            f"[{kind} round {rnd}] c={c}: {r['output_throughput']:.1f} tok/s, TTFT p50 "
                            f"{r['median_ttft_ms']:.0f} ms, TPOT p50 {r['median_tpot_ms']:.1f} ms, prefix hits "
                            f"{r['prefix_cache_hit_rate']}",
                            flush=True,
                        )
    derive(result, levels)
    result = prov.write(args.out, result)
    plot(result, args.plot or str(Path(args.out).with_suffix(".png")))
    print(json.dumps(result.get("kvserve_over_vllm", {}), indent=1))
    return result


if __name__ == "__main__":  # vLLM spawns processes
    main()
