"""Online serving benchmark (in the style of vLLM's ``benchmark_serving.py``).

An aiohttp load generator streams ``/v1/completions`` requests (token-id prompts, so the
prompt lengths are exact) at a fixed concurrency or a Poisson request rate, and measures
per request: TTFT (time to the first streamed token), ITL (time between streamed chunks)
and E2E latency; in all: output tokens/s, requests/s and errors.

Workload (``benchmarks/common.py``, the same as ``benchmarks/throughput.py``'s, seeded): 64
requests, prompt lengths uniform in 32..256 tokens of random token ids, output lengths
uniform in 16..128 with ``ignore_eos``, greedy. The offline engine's throughput run is
``throughput.py``'s kvserve run (``benchmarks.common.run_kvserve``).

In the same run a local Ray Serve app (``kvserve.deployments.app.build_app``, one replica) is started (unless
``--base-url`` points at a running server) and the offline engine (``engine.LLM``) is loaded
in this process; then, ``--rounds`` times, the offline engine and the HTTP server each run the
workload (alternating, so both see the same background load on a shared machine; prefix
caching is off in both so repeated rounds stay comparable). Reported:

* ``http_over_offline_throughput`` = best HTTP streaming output tok/s (all requests in flight,
  ``--request-rate inf``) / best offline output tok/s (target >= 0.90);
* ``added_ttft_ms_p50``: median over the same prompts of (TTFT over HTTP at concurrency 1)
  - (TTFT of an in-process ``AsyncLLMEngine`` at concurrency 1), alternating prompt by
  prompt: the latency the serving path adds (target <= 10 ms).

Usage::

    python benchmarks/serving.py                                 # full run, writes benchmarks/results/
    python benchmarks/serving.py --base-url http://127.0.0.1:8000/v1 --skip-offline   # a running server
    python benchmarks/serving.py --concurrency 8 --num-requests 32 --out /tmp/x.json

Results: ``benchmarks/results/serving.json`` and ``benchmarks/results/serving_latency.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Figures,
    Results,
    add_model_arg,
    greedy,
    load_average,
    local_serve,
    make_workload,
    percentile,
    pyplot,
    resolve,
    run_kvserve,
    workload_info,
)

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "workload",
    "engine",
    "model",
    "rounds",
    "runs",
    "offline_ttft_ms",
    "serving_path_ttft_ms",
    "best_offline_output_tok_per_s",
    "best_http_output_tok_per_s",
    "http_over_offline_throughput",
    "added_ttft_ms_p50",
    "added_ttft_ms_mean",
    "targets",
)


# ---- one streamed request -------------------------------------------------------------------
@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # requested
    ok: bool = False
    error: str | None = None
    start: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    response_id: str | None = None


async def stream_completion(
    session, url: str, model: str | None, prompt, max_tokens: int, api_key: str | None = None
) -> RequestResult:
    res = RequestResult(prompt_len=len(prompt), output_len=max_tokens)
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res.start = time.perf_counter()
    last = None
    pieces = []
    try:
        async with session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            buf = b""
            async for chunk in resp.content.iter_any():
                buf += chunk
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    if not event.startswith(b"data: "):
                        continue
                    data = event[6:]
                    if data == b"[DONE]":
                        continue
                    now = time.perf_counter()
                    obj = json.loads(data)
                    if "error" in obj:
                        res.error = obj["error"].get("message", "error")
                        return res
                    if res.response_id is None:
                        res.response_id = obj.get("id")
                    if obj.get("usage"):
                        res.output_tokens = obj["usage"]["completion_tokens"]
                    for ch in obj.get("choices") or []:
                        if ch.get("text"):
                            pieces.append(ch["text"])
                            if res.ttft is None:
                                res.ttft = now - res.start
                            else:
                                res.itl.append(now - last)
                            last = now
            res.e2e = time.perf_counter() - res.start
            res.text = "".join(pieces)
            res.ok = res.ttft is not None
            if not res.ok:
                res.error = "no tokens received"
    except Exception as e:  # counted as an error, the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_http(
    base_url: str,
    model: str | None,
    work,
    concurrency: int | None,
    request_rate: float,
    seed: int = 0,
    api_key: str | None = None,
) -> tuple[list[RequestResult], float]:
    import aiohttp

    url = base_url.rstrip("/") + "/completions"
    limit = concurrency or len(work)
    sem = asyncio.Semaphore(limit)
    rng = random.Random(seed)
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(ids, olen):
            async with sem:
                return await stream_completion(session, url, model, ids, olen, api_key)

        t0 = time.perf_counter()
        tasks = []
        for ids, olen in work:
            tasks.append(asyncio.create_task(one(ids, olen)))
            if request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        elapsed = time.perf_counter() - t0
    return list(results), elapsed


# ---- metrics --------------------------------------------------------------------------------
def summary_ms(xs: list[float]) -> dict:
    if not xs:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    return {
        "mean": 1000 * statistics.fmean(xs),
        "p50": 1000 * percentile(xs, 50),
        "p90": 1000 * percentile(xs, 90),
        "p99": 1000 * percentile(xs, 99),
    }


def summarize(name: str, results: list[RequestResult], elapsed: float, **extra) -> dict:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens or r.output_len for r in ok)
    return {
        "run": name,
        **extra,
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "error_samples": [r.error for r in results if not r.ok][:3],
        "elapsed_s": elapsed,
        "output_tokens": out_tokens,
        "output_tok_per_s": out_tokens / elapsed if elapsed > 0 else 0.0,
        "request_throughput_per_s": len(ok) / elapsed if elapsed > 0 else 0.0,
        "ttft_ms": summary_ms([r.ttft for r in ok]),
        "itl_ms": summary_ms([x for r in ok for x in r.itl]),
        "e2e_ms": summary_ms([r.e2e for r in ok]),
    }


# ---- offline engine ------------------------------------------------------------------------
class Offline:
    """The offline engine in this process: ``engine.LLM`` for throughput and an
    ``AsyncLLMEngine`` over the same ``LLMEngine`` for TTFT (used one at a time). The engine is
    built, run and stepped in one thread, as ``AsyncLLMEngine.from_config`` does in a replica
    (OpenMP keeps a worker team per calling thread; mixing threads slows CPU steps)."""

    def __init__(self, model_path: str, engine_kw: dict):
        from kvserve.engine import LLM
        from kvserve.engine.async_engine import AsyncLLMEngine, step_thread

        self.pool = step_thread("offline-step")
        self.llm = self.pool.submit(LLM, model=model_path, **engine_kw).result()
        self.aeng = AsyncLLMEngine(self.llm.engine, step_pool=self.pool)

    def throughput(self, work) -> dict:
        """``benchmarks.common.run_kvserve`` (the throughput benchmark's kvserve run)."""
        r = self.pool.submit(run_kvserve, self.llm, work).result()
        return {
            "run": "offline_engine",
            **{k: r[k] for k in ("elapsed_s", "output_tokens", "output_tok_per_s", "max_running_batch", "texts")},
        }

    async def ttft(self, ids, olen) -> float | None:
        t0 = time.perf_counter()
        first = None
        async for out in self.aeng.generate(ids, greedy(olen)):
            if first is None and out.outputs[0].delta_text:
                first = time.perf_counter() - t0
        return first


async def interleaved_ttft(
    offline: "Offline", base_url: str, model: str | None, work, api_key: str | None
) -> tuple[list[float | None], list[RequestResult], float]:
    """Concurrency 1, alternating per prompt: in-process engine, then the same prompt over
    HTTP, so both see the same background load."""
    import aiohttp

    url = base_url.rstrip("/") + "/completions"
    async for _ in offline.aeng.generate(work[0][0][:16], greedy(2)):
        pass
    off, http = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as session:
        await stream_completion(session, url, model, work[0][0][:16], 2, api_key)
        t0 = time.perf_counter()
        for ids, olen in work:
            off.append(await offline.ttft(ids, olen))
            http.append(await stream_completion(session, url, model, ids, olen, api_key))
    return off, http, time.perf_counter() - t0


# ---- local server ---------------------------------------------------------------------------
def launch_server(stack, model: str | None, app_args: dict, num_cpus: int) -> str:
    """Start the app on a local Ray Serve (token auth on, ``benchmarks.common.local_serve``) that
    ``stack`` (an ``ExitStack``) shuts down; returns the ``/v1`` base URL."""
    port = stack.enter_context(local_serve(num_cpus))
    from ray import serve

    from kvserve.deployments.app import build_app

    serve.run(build_app({"model": model, **app_args}), name="kvserve", route_prefix="/")
    return f"http://127.0.0.1:{port}/v1"


async def warmup(base_url: str, model: str | None, work) -> None:
    await run_http(base_url, model, [(work[0][0][:16], 4)], None, math.inf)


def serving_path_ttft(results: list[RequestResult]) -> dict:
    """Client TTFT minus the engine's own TTFT (request arrival in the engine -> first token
    sampled) of the same requests, read from the LLMServer: the serving path's share (HTTP,
    proxy, ingress, routing, handle streaming, SSE), without run-to-run noise."""
    from ray import serve

    llm = serve.get_deployment_handle("LLMServer", "kvserve")
    ids = [f"{r.response_id}-0" for r in results if r.ok and r.response_id]
    metrics = llm.recent_request_metrics.remote(ids).result()
    diffs = [
        r.ttft - metrics[f"{r.response_id}-0"]["engine_ttft_s"]
        for r in results
        if r.ok and f"{r.response_id}-0" in metrics and metrics[f"{r.response_id}-0"]["engine_ttft_s"]
    ]
    return {**summary_ms(diffs), "n": len(diffs)}


# ---- plot -----------------------------------------------------------------------------------
def plot(runs: dict[str, list[RequestResult]], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, results in runs.items():
        ok = [r for r in results if r.ok]
        for ax, xs in zip(axes, ([r.ttft for r in ok], [x for r in ok for x in r.itl], [r.e2e for r in ok])):
            xs = sorted(1000 * x for x in xs)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
    for ax, title in zip(axes, ("TTFT", "ITL (between streamed chunks)", "E2E latency")):
        ax.set_title(title)
        ax.set_xlabel("ms")
        ax.set_ylabel("CDF")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_xscale("log")
    axes[2].set_xscale("log")
    fig.suptitle("kvserve over HTTP (SSE streaming, Ray Serve)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---- main -----------------------------------------------------------------------------------
def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--base-url", default=None, help="benchmark a running server instead of launching one")
    ap.add_argument("--served-model-name", default=None)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--concurrency", type=int, default=None, help="fixed concurrency (default: all in flight)")
    ap.add_argument("--request-rate", type=float, default=math.inf, help="Poisson arrivals per second (default inf)")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="offline and HTTP runs alternate this many times; the best of each is compared "
        "(robust to other load on the machine)",
    )
    ap.add_argument("--ttft-requests", type=int, default=16, help="requests of the concurrency-1 TTFT phase")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray instance")
    ap.add_argument("--out", default="benchmarks/results/serving.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: next to --out, *_latency.png)")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)

    from kvserve.engine.model_loader import DEFAULT_MODEL

    path, vocab = resolve(args.model)
    work = make_workload(args.num_requests, args.seed, vocab)
    ttft_work = [(ids, 8) for ids, _ in make_workload(args.ttft_requests, args.seed + 1000, vocab)]
    # Random prompts share no prefixes; without prefix caching, repeated rounds stay comparable.
    engine_kw = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": False,
    }
    served = args.served_model_name or (args.model or DEFAULT_MODEL)
    label = (
        f"http c={args.concurrency}"
        if args.concurrency
        else ("http all-in-flight" if args.request_rate == math.inf else f"http rate={args.request_rate}/s")
    )
    result: dict = {
        "workload": {**workload_info(work, args.seed), "endpoint": "/v1/completions (stream, token-id prompts)"},
        "engine": engine_kw,
        "model": path,
        "rounds": args.rounds,
        "runs": [],
    }
    launched = args.base_url is None
    base_url = args.base_url
    stack = contextlib.ExitStack()
    if launched:
        print("launching Ray Serve ...", flush=True)
        # one replica, pinned: the comparison is one replica against one in-process engine (the
        # default deployment would autoscale, and extra replicas on this box share its cores)
        # The same requests every round: the response cache would answer later rounds (off), and
        # all requests arrive at once, so the admission bounds must hold the whole workload.
        app_args = {
            **engine_kw,
            "served_model_name": served,
            "num_replicas": 1,
            "response_cache": False,
            "max_queued_requests": len(work),
            "max_queued_prompt_tokens": sum(len(p) for p, _ in work),
        }
        base_url = launch_server(stack, args.model, app_args, args.num_cpus)
    offline = None if args.skip_offline else Offline(path, engine_kw)
    plots: dict[str, list[RequestResult]] = {}
    best_http = best_off = None
    try:
        asyncio.run(warmup(base_url, served, work))
        for rnd in range(args.rounds):
            if offline is not None:
                print(f"round {rnd}: offline engine ...", flush=True)
                off = offline.throughput(work)
                result["runs"].append(
                    {**{k: v for k, v in off.items() if k != "texts"}, "round": rnd, "load_average": load_average()}
                )
                print(json.dumps(result["runs"][-1]), flush=True)
                if best_off is None or off["output_tok_per_s"] > best_off["output_tok_per_s"]:
                    best_off = off
            print(f"round {rnd}: {label} ...", flush=True)
            res, elapsed = asyncio.run(
                run_http(base_url, served, work, args.concurrency, args.request_rate, args.seed, args.api_key)
            )
            s = summarize(
                label,
                res,
                elapsed,
                concurrency=args.concurrency,
                request_rate=args.request_rate,
                round=rnd,
                load_average=load_average(),
            )
            if offline is not None:
                same = sum(r.ok and r.text == t for r, t in zip(res, off["texts"]))
                s["same_text_as_offline"] = f"{same}/{len(res)}"
            result["runs"].append(s)
            print(json.dumps(s), flush=True)
            if s["errors"]:
                print(f"round {rnd}: {s['errors']} requests failed; the round does not count", flush=True)
            elif best_http is None or s["output_tok_per_s"] > best_http[0]["output_tok_per_s"]:
                best_http = (s, res)
        if best_http is None:
            raise SystemExit("every HTTP round had failed requests (see error_samples above)")
        plots[label] = best_http[1]
        print("concurrency 1 (TTFT) ...", flush=True)
        if offline is not None:
            off_ttfts, res1, elapsed1 = asyncio.run(
                interleaved_ttft(offline, base_url, served, ttft_work, args.api_key)
            )
            result["offline_ttft_ms"] = summary_ms([t for t in off_ttfts if t is not None])
        else:
            res1, elapsed1 = asyncio.run(run_http(base_url, served, ttft_work, 1, math.inf, args.seed, args.api_key))
        plots["http c=1"] = res1
        s1 = summarize("http c=1", res1, elapsed1, concurrency=1)
        result["runs"].append(s1)
        print(json.dumps(s1), flush=True)
        if launched:
            result["serving_path_ttft_ms"] = serving_path_ttft(res1)
    finally:
        stack.close()

    if offline is not None:
        result["best_offline_output_tok_per_s"] = best_off["output_tok_per_s"]
        result["best_http_output_tok_per_s"] = best_http[0]["output_tok_per_s"]
        result["http_over_offline_throughput"] = best_http[0]["output_tok_per_s"] / best_off["output_tok_per_s"]
        diffs = [r.ttft - t for r, t in zip(res1, off_ttfts) if r.ok and t is not None]
        result["added_ttft_ms_p50"] = 1000 * percentile(diffs, 50) if diffs else None
        result["added_ttft_ms_mean"] = 1000 * statistics.fmean(diffs) if diffs else None
        result["targets"] = {
            "http_over_offline_throughput >= 0.90": result["http_over_offline_throughput"] >= 0.90,
            "added_ttft_ms_p50 <= 10": (result["added_ttft_ms_p50"] or 1e9) <= 10,
        }
        if "serving_path_ttft_ms" in result:
            result["targets"]["serving_path_ttft_ms.p50 <= 10"] = (result["serving_path_ttft_ms"]["p50"] or 1e9) <= 10
    out = Path(args.out)
    result = prov.write(out, result)
    png = Path(args.plot) if args.plot else out.with_name(out.stem + "_latency.png")
    plot(plots, png)
    print(report(result))
    print(f"wrote {out} and {png}")
    return result


def figures(r: dict) -> Figures:
    """The file's summary and runs table (``benchmarks.common.Figures``), from its measured values."""
    f, t = Figures(), r.get("targets", {})
    ms = "ms"
    if "http_over_offline_throughput" in r:
        f.summary(
            "HTTP streaming / offline engine throughput, one replica",
            r["http_over_offline_throughput"],
            "x",
            target=">= 0.90",
            met=t.get("http_over_offline_throughput >= 0.90"),
            headline=True,
        )
        f.summary("best offline engine output tok/s", r["best_offline_output_tok_per_s"], "tok/s")
        f.summary("best HTTP streaming output tok/s (all requests in flight)", r["best_http_output_tok_per_s"], "tok/s")
        f.summary(
            "added TTFT at concurrency 1, p50 (HTTP minus in-process engine, same prompts)",
            r.get("added_ttft_ms_p50"),
            ms,
            target="<= 10 ms",
            met=t.get("added_ttft_ms_p50 <= 10"),
        )
        f.summary("offline TTFT p50", (r.get("offline_ttft_ms") or {}).get("p50"), ms)
    if "serving_path_ttft_ms" in r:
        f.summary(
            "serving path TTFT p50 (client minus the replica engine's own TTFT of the same request)",
            r["serving_path_ttft_ms"].get("p50"),
            ms,
            target="<= 10 ms",
            met=t.get("serving_path_ttft_ms.p50 <= 10"),
        )
    f.targets(t, ("http_over_offline_throughput >= 0.90", "added_ttft_ms_p50 <= 10", "serving_path_ttft_ms.p50 <= 10"))

    def p(run, key, q):
        return (run.get(key) or {}).get(q)

    f.table(
        "Runs",
        [
            "run",
            "round",
            "completed / errors",
            "output tok/s",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "ITL p50 (ms)",
            "E2E p50 (ms)",
            "same text as offline",
            "load",
        ],
        [
            [
                x["run"],
                x.get("round"),
                f"{x['completed']} / {x['errors']}" if "completed" in x else None,
                x["output_tok_per_s"],
                p(x, "ttft_ms", "p50"),
                p(x, "ttft_ms", "p99"),
                p(x, "itl_ms", "p50"),
                p(x, "e2e_ms", "p50"),
                x.get("same_text_as_offline"),
                x.get("load_average"),
            ]
            for x in r["runs"]
        ],
        note=f"{r['workload']['num_requests']} requests ({r['workload']['endpoint']}), best of {r['rounds']} "
        "rounds each; the offline engine and the HTTP server alternate.",
    )
    return f


def report(r: dict) -> str:
    lines = [
        "| run | ok/err | out tok/s | req/s | TTFT p50/p99 ms | ITL p50/p99 ms | E2E p50/p99 ms |",
        "|---|---|---|---|---|---|---|",
    ]

    def f(d, k):
        v = (d or {}).get(k)
        return "-" if v is None else f"{v:.1f}"

    for run in r["runs"]:
        if "ttft_ms" not in run:
            lines.append(f"| {run['run']} | - | {run['output_tok_per_s']:.1f} | - | - | - | - |")
            continue
        lines.append(
            f"| {run['run']} | {run['completed']}/{run['errors']} | {run['output_tok_per_s']:.1f} | "
            f"{run['request_throughput_per_s']:.2f} | {f(run['ttft_ms'], 'p50')}/{f(run['ttft_ms'], 'p99')} | "
            f"{f(run['itl_ms'], 'p50')}/{f(run['itl_ms'], 'p99')} | "
            f"{f(run['e2e_ms'], 'p50')}/{f(run['e2e_ms'], 'p99')} |"
        )
    if "http_over_offline_throughput" in r:
        lines.append(
            f"\nHTTP streaming / offline throughput = {r['http_over_offline_throughput']:.3f} (target >= 0.90; "
            f"best of {r['rounds']} rounds each: {r['best_http_output_tok_per_s']:.1f} / "
            f"{r['best_offline_output_tok_per_s']:.1f} tok/s)"
        )
        lines.append(
            f"added TTFT at concurrency 1, p50 = {r['added_ttft_ms_p50']:.1f} ms (target <= 10 ms): HTTP TTFT "
            f"- in-process engine TTFT, same prompts alternating; offline TTFT p50 = "
            f"{r['offline_ttft_ms']['p50']:.1f} ms"
        )
    if r.get("serving_path_ttft_ms", {}).get("p50") is not None:
        sp = r["serving_path_ttft_ms"]
        lines.append(
            f"serving path's share of TTFT at concurrency 1 (client TTFT - engine TTFT of the same request): "
            f"p50 {sp['p50']:.1f} ms, p90 {sp['p90']:.1f} ms, mean {sp['mean']:.1f} ms"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
