"""Cache warming (``kvserve warm``, ``kvserve/deployments/operator/warm.py``) on a day-shaped trace: the peak hour's
response cache hit rate and replica busy time, with and without warming the night before.

The trace: a universe of ``--prompts`` distinct questions asked with Zipf-distributed popularity
(rank ``k`` has weight ``1 / k ** s``, ``--zipf``), every request greedy with ``--max-tokens``
output tokens (cacheable, as the response cache needs).

Each run, on a kvserve app of one replica (local Ray with token auth, the default model,
exact response cache, memory backend):

1. **yesterday**: ``--history`` requests drawn from the trace, written as the request log with
   the gateway's own :class:`~kvserve.deployments.gateway.request_log.RequestLog` (``store`` mode, the
   lines a day of this traffic through the gateway leaves; sending them through a CPU engine
   would only make the run longer);
2. **off-peak** (the ``warm`` arm only): ``kvserve warm``'s plan of that log (the ``--top`` most
   frequent requests seen at least twice) replayed through the gateway at ``--warm-rate``
   requests per second (:func:`kvserve.deployments.operator.warm.replay`, as the command does);
3. **peak**: ``--peak`` requests drawn anew from the trace, ``--clients`` at a time; per request
   the end-to-end latency and whether the response cache answered (``x-kvserve-cache``); the
   replica's busy seconds (its engine's step time, ``engine_busy_s``) over the peak.

Arms ``cold`` and ``warm`` are interleaved (cold, warm, cold, warm, ...; ``--repeats`` each), and
every run has prompts of its own (a new universe, seeded by run), with the cache cleared first,
so nothing carries over between runs. Medians over the repeats, with min and max.

Usage::

    python benchmarks/cache_warming.py            # writes benchmarks/results/cache_warming.{json,png}

Results: ``benchmarks/results/cache_warming.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import Figures, Results, local_serve, percentile, pyplot  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("benchmark", "workload", "runs", "arms", "started")

APP = "kvserve-warm-bench"
ADMIN = "bench-warm-admin"
SUBJECTS = (
    "the moon",
    "a violin",
    "coffee",
    "rain",
    "a glacier",
    "bread",
    "a lighthouse",
    "copper",
    "tigers",
    "the Nile",
    "honey",
    "volcanoes",
    "chess",
    "a bicycle",
    "paper",
    "the ocean",
    "salt",
    "owls",
    "glass",
    "wind",
)
ASKS = (
    "Describe {} in one sentence.",
    "Give one fact about {}.",
    "Why do people like {}?",
    "What colour is {} usually?",
    "Name a use of {}.",
    "Write a short title about {}.",
)


def universe(n: int, seed: int) -> list[str]:
    """``n`` distinct questions, shuffled by ``seed`` (rank 1 first)."""
    qs = [a.format(s) for a in ASKS for s in SUBJECTS]
    rng = random.Random(seed)
    rng.shuffle(qs)
    if n > len(qs):
        raise ValueError(f"at most {len(qs)} prompts")
    return [f"{q} (set {seed})" for q in qs[:n]]


def draw(questions: list[str], k: int, s: float, rng: random.Random) -> list[str]:
    """``k`` requests from ``questions`` by Zipf popularity with exponent ``s``."""
    weights = [1.0 / (r + 1) ** s for r in range(len(questions))]
    return rng.choices(questions, weights=weights, k=k)


def body(model: str, q: str, max_tokens: int) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens, "temperature": 0.0}


async def peak(url: str, bodies: list[dict], clients: int) -> list[tuple[float, str]]:
    """Send ``bodies``, ``clients`` at a time; ``(seconds, x-kvserve-cache)`` per request."""
    import httpx

    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    out: list[tuple[float, str]] = []

    async def client(http):
        while not queue.empty():
            b = queue.get_nowait()
            t0 = time.perf_counter()
            r = await http.post(f"{url}/v1/chat/completions", json=b)
            r.raise_for_status()
            out.append((time.perf_counter() - t0, r.headers.get("x-kvserve-cache", "")))

    async with httpx.AsyncClient(timeout=600) as http:
        await asyncio.gather(*(client(http) for _ in range(clients)))
    return out


def one_run(args, url: str, model: str, handle, arm: str, seed: int) -> dict:
    import httpx

    from kvserve.deployments.gateway.request_log import RequestLog
    from kvserve.deployments.operator.warm import plan, read_log, replay

    qs = universe(args.prompts, seed)
    rng = random.Random(seed)
    log_dir = tempfile.mkdtemp(prefix="kvserve-warm-bench-log-")
    log = RequestLog(log_dir, "store", name="yesterday")
    for q in draw(qs, args.history, args.zipf, rng):
        log.record(model, "chat", body(model, q, args.max_tokens), True)
    log.close()
    httpx.delete(f"{url}/v1/cache", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=60).raise_for_status()
    run: dict = {"arm": arm, "seed": seed}
    if arm == "warm":
        p = plan(read_log(log_dir), top=args.top, min_count=2, top_system=0)
        run["warm"] = asyncio.run(replay(p, url, ADMIN, rate=args.warm_rate, concurrency=args.warm_concurrency))
        run["warm"]["planned"] = len(p.requests)
    busy0 = handle.get_stats.remote().result()["engine_busy_s"]
    t0 = time.perf_counter()
    res = asyncio.run(
        peak(url, [body(model, q, args.max_tokens) for q in draw(qs, args.peak, args.zipf, rng)], args.clients)
    )
    wall = time.perf_counter() - t0
    busy = handle.get_stats.remote().result()["engine_busy_s"] - busy0
    lat = [x for x, _ in res]
    hits = sum(1 for _, c in res if c in ("exact", "semantic"))
    run.update(
        {
            "peak_requests": len(res),
            "peak_hits": hits,
            "peak_hit_rate": hits / len(res),
            "peak_wall_s": wall,
            "peak_busy_s": busy,
            "latency_p50_s": percentile(lat, 50),
            "latency_p95_s": percentile(lat, 95),
        }
    )
    return run


def summarize(runs: list[dict]) -> dict:
    """Per arm: median, min and max over its runs of each measure."""
    out = {}
    for arm in ("cold", "warm"):
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        out[arm] = {
            k: {
                "median": statistics.median(r[k] for r in rs),
                "min": min(r[k] for r in rs),
                "max": max(r[k] for r in rs),
            }
            for k in ("peak_hit_rate", "peak_busy_s", "peak_wall_s", "latency_p50_s", "latency_p95_s")
        }
        if arm == "warm":
            out[arm]["warm_s"] = {"median": statistics.median(r["warm"]["seconds"] for r in rs)}
            out[arm]["warmed"] = {"median": statistics.median(r["warm"]["warmed"] for r in rs)}
    return out


def figures(r: dict) -> Figures:
    """The file's summary and tables, from its measured values."""
    f = Figures()
    a = r.get("arms", {})
    cold, warm = a.get("cold"), a.get("warm")
    if cold and warm:
        f.summary("peak hit rate, cold cache (median)", cold["peak_hit_rate"]["median"] * 100, "%")
        f.summary(
            "peak hit rate, warmed the night before (median)", warm["peak_hit_rate"]["median"] * 100, "%", headline=True
        )
        f.summary("replica busy time in the peak, cold (median)", cold["peak_busy_s"]["median"], "s")
        f.summary("replica busy time in the peak, warmed (median)", warm["peak_busy_s"]["median"], "s", headline=True)
        f.summary("off-peak warming run (median)", warm["warm_s"]["median"], "s")
    rows = []
    for arm, m in a.items():
        rows.append(
            [arm]
            + [
                f"{m[k]['median']:.4g} [{m[k]['min']:.4g}, {m[k]['max']:.4g}]"
                for k in ("peak_hit_rate", "peak_busy_s", "peak_wall_s", "latency_p50_s", "latency_p95_s")
            ]
        )
    w = r.get("workload", {})
    f.table(
        "Peak hour, median [min, max] over interleaved runs",
        ["arm", "hit rate", "replica busy (s)", "peak wall (s)", "latency p50 (s)", "latency p95 (s)"],
        rows,
        note=f"{w.get('peak')} peak requests by {w.get('clients')} clients over {w.get('prompts')} prompts "
        f"(Zipf s={w.get('zipf')}), {w.get('max_tokens')} output tokens; history {w.get('history')} "
        f"requests; warming: top {w.get('top')} seen twice, {w.get('warm_rate')} req/s.",
    )
    f.table(
        "Runs",
        ["arm", "seed", "hit rate", "busy (s)", "warmed", "warm run (s)"],
        [
            [
                x["arm"],
                x["seed"],
                x["peak_hit_rate"],
                x["peak_busy_s"],
                (x.get("warm") or {}).get("warmed"),
                (x.get("warm") or {}).get("seconds"),
            ]
            for x in r.get("runs", [])
        ],
    )
    return f


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    arms = result["arms"]
    names = list(arms)
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, label, scale in (
        (axes[0], "peak_hit_rate", "peak hit rate (%)", 100),
        (axes[1], "peak_busy_s", "replica busy in the peak (s)", 1),
    ):
        med = [arms[n][key]["median"] * scale for n in names]
        lo = [med[i] - arms[n][key]["min"] * scale for i, n in enumerate(names)]
        hi = [arms[n][key]["max"] * scale - med[i] for i, n in enumerate(names)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4, color=["#999", "#2a7"][: len(names)])
        ax.set_ylabel(label)
    fig.suptitle("Cache warming: peak hour, median and range of interleaved runs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default SmolLM2-135M-Instruct)")
    ap.add_argument("--prompts", type=int, default=60)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--history", type=int, default=400)
    ap.add_argument("--peak", type=int, default=120)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--top", type=int, default=100)
    ap.add_argument("--warm-rate", type=float, default=4.0)
    ap.add_argument("--warm-concurrency", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cache_warming.json"))
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    from kvserve.engine.model_loader import DEFAULT_MODEL

    model = DEFAULT_MODEL if args.model is None else args.model
    result: dict = {
        "benchmark": "cache warming on a day-shaped trace (deployments/operator/warm.py)",
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "workload": {
            k: getattr(args, k)
            for k in (
                "prompts",
                "zipf",
                "history",
                "peak",
                "clients",
                "max_tokens",
                "top",
                "warm_rate",
                "warm_concurrency",
                "repeats",
            )
        },
    }
    with local_serve(max(os.cpu_count() or 1, 4)) as port:
        from ray import serve

        from kvserve.deployments.app import build_app

        serve.run(
            build_app({"model": args.model, "num_replicas": 1, "max_num_seqs": 16, "admin_api_keys": [ADMIN]}),
            name=APP,
            route_prefix="/",
        )
        handle = serve.get_deployment_handle("LLMServer", APP)
        url = f"http://127.0.0.1:{port}"
        import httpx

        models = httpx.get(f"{url}/v1/models", timeout=60).json()["data"]
        model = models[0]["id"]
        httpx.post(f"{url}/v1/chat/completions", json={**body(model, "warm up", 4), "cache": False}, timeout=300)
        runs = []
        for rep in range(args.repeats):
            for i, arm in enumerate(("cold", "warm")):
                run = one_run(args, url, model, handle, arm, seed=1000 + 10 * rep + i)
                print(
                    f"{arm} #{rep}: hit rate {run['peak_hit_rate']:.2f}, busy {run['peak_busy_s']:.1f} s, "
                    f"wall {run['peak_wall_s']:.1f} s" + (f", warmed {run['warm']}" if arm == "warm" else ""),
                    flush=True,
                )
                runs.append(run)
        serve.delete(APP)
    result["runs"] = runs
    result["arms"] = summarize(runs)
    out = Path(args.out)
    plot(result, out.with_suffix(".png"))
    return prov.write(out, result)


if __name__ == "__main__":
    main()
