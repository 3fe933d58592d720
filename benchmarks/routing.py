"""Prefix-aware replica routing vs Serve's default router (and Ray's ``PrefixCacheAffinityRouter``).

Workload (seeded, the same for every router): 8 system prompts of 512 tokens each, each request
one of them (uniformly at random) plus a short unique user turn (``Question k: ...``, ~15
tokens), streaming ``/v1/chat/completions``, ``max_tokens`` uniform in ``--output-tokens`` with
``ignore_eos``, greedy; Poisson arrivals at ``--rate`` for ``--duration`` seconds, sent open
loop with aiohttp (``benchmarks/load_test.py``'s sender).

Server: a local Ray (token auth, as ``kvserve serve`` starts it) and the kvserve app with the
default model (SmolLM2-135M-Instruct) on 2 fixed replicas, one torch thread each (2 replicas
share this machine's 2 cores), ``--num-kv-blocks`` KV blocks per replica. For each router in
``--routers`` a fresh app (fresh prefix caches) runs the same arrivals:

* ``prefix_aware``: ``kvserve/deployments/routing/prefix_router.py`` (the default app's router);
* ``default``: Serve's power of two choices (``prefix_aware_routing: false``);
* ``ray_prefix_tree``: Ray's ``PrefixCacheAffinityRouter`` through :class:`RayPrefixTreeAdapter`
  (it reads ``.prompt`` / ``.messages`` attributes of Ray LLM's request objects; our
  ``LLMServer.generate`` takes plain arguments, so the adapter gives it the text), with
  ``imbalanced_threshold`` = the margin of ours.

Why a KV pool of 192 blocks: the pool then holds 6 of the 8 prompts (32 blocks each) beside the
running requests' blocks, so a replica that sees every prompt keeps evicting them (the regime
the issue's "default router: about 0.5" describes: more prefixes than one replica caches),
while each replica under prefix affinity sees about half of them, which fit. With the default
2 GiB pool (~2,900 blocks) every replica caches all 8 after its first miss on each, and any
router converges to the same hit rate (only the first 8 vs 16 misses differ).

Per router: prefix-cache hit rate (prompt tokens the engine found cached / prompt tokens, from
each answer's ``usage.prompt_tokens_details.cached_tokens``, i.e. the engine's per-request
``num_cached_tokens``) and the share of requests that hit their system prompt, TTFT p50 / p90
/ p99, E2E p50, throughput (completed requests/s and output tokens/s over the run), outcomes,
how many replicas served each system prompt (from the replicas' routing reports), and the load
average during the run. Also the router's hashing cost per request (its tokenizer, the
workload's messages). Targets (issue): hit rate >= 0.8; TTFT p50 <= 0.6 x the default's.

Usage::

    python benchmarks/routing.py                                  # full run, writes benchmarks/results/
    python benchmarks/routing.py --duration 30 --routers prefix_aware,default --out /tmp/r.json   # smoke

Results: ``benchmarks/results/routing.json`` and ``benchmarks/results/routing.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import Figures, Results, load_average, local_serve, percentile, pyplot  # noqa: E402
from benchmarks.load_test import (  # noqa: E402
    COMPLETE,
    DEFAULT_MODEL,
    Rec,
    dist_ms,
    load_tokenizer,  # noqa: E402
    output_lengths,
    output_range,
    poisson_arrivals,
    stream_chat,
)

ROUTERS = ("prefix_aware", "default", "ray_prefix_tree")
#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("what", "workload", "server", "routing_cost", "started", "runs", "targets")
APP = "kvserve-routing"
NUM_PROMPTS = 8
SYSTEM_TOKENS = 512


# ---- Ray's router, adapted to LLMServer.generate's arguments -------------------------------------
try:
    from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import (
        PrefixCacheAffinityRouter as _RayPrefixRouter,
    )
except ImportError:  # not in this Ray build
    _RayPrefixRouter = None

if _RayPrefixRouter is not None:

    class RayPrefixTreeAdapter(_RayPrefixRouter):
        """Ray's ``PrefixCacheAffinityRouter`` with the prompt text taken from
        ``LLMServer.generate(prompt, sampling_params, messages=...)`` (its own
        ``_extract_text_from_request`` raises ValueError on these arguments). Token-id prompts
        and other methods' requests give a placeholder (its match rate divides by the length)."""

        def _extract_text_from_request(self, pending_request) -> str:
            args, kwargs = pending_request.args or (), pending_request.kwargs or {}
            messages = kwargs.get("messages")
            prompt = args[0] if args else kwargs.get("prompt")
            text = self._normalize_prompt_to_string(messages if messages is not None else prompt)
            return text or " "


def router_options(name: str, margin: int) -> dict | None:
    """The ``request_router_config`` of the ``ray_prefix_tree`` arm (None for the others)."""
    if name != "ray_prefix_tree":
        return None
    if _RayPrefixRouter is None:
        raise SystemExit("ray_prefix_tree: this Ray has no PrefixCacheAffinityRouter")
    return {
        "request_router_class": RayPrefixTreeAdapter,
        "request_router_kwargs": {"imbalanced_threshold": margin},
        "request_routing_stats_period_s": 1.0,
    }


# ---- workload -----------------------------------------------------------------------------------
def make_system_prompts(tokenizer, n: int, tokens: int, seed: int) -> list[str]:
    """``n`` system prompts of ``tokens`` tokens (the content alone), random single-token words."""
    words = [
        w[1:]
        for w, _ in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        if w.startswith("\u0120") and w[1:].isalpha() and w[1:].islower() and 3 <= len(w) <= 9
    ][:20000]
    rng = random.Random(seed)
    out = []
    for i in range(n):
        text = f"You are assistant {i}. Follow these notes:"
        while len(tokenizer.encode(text, add_special_tokens=False)) < tokens:
            text += " " + " ".join(rng.choice(words) for _ in range(16))
        while len(tokenizer.encode(text, add_special_tokens=False)) > tokens:
            text = text.rsplit(" ", 1)[0]
        out.append(text)
    return out


def make_requests(systems: list[str], n: int, out_tokens: tuple[int, int], seed: int, model: str) -> list[dict]:
    """``n`` chat bodies: a seeded system prompt each, a unique short user turn."""
    rng = random.Random(seed)
    lengths = output_lengths(n, out_tokens, seed)
    words = ["river", "stone", "cloud", "table", "garden", "winter", "number", "light", "music", "paper"]
    bodies = []
    for k in range(n):
        user = f"Question {k}: " + " ".join(rng.choice(words) for _ in range(rng.randint(4, 8))) + "?"
        bodies.append(
            {
                "model": model,
                "messages": [
                    {"role": "system", "content": systems[rng.randrange(len(systems))]},
                    {"role": "user", "content": user},
                ],
                "max_tokens": lengths[k],
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
    return bodies


async def send_all(url: str, bodies: list[dict], arrivals: list[float], timeout: float) -> tuple[list[Rec], float]:
    """Request i at ``arrivals[i]`` (open loop); every answer read to its end."""
    import aiohttp

    recs = [Rec(index=i, due=a) for i, a in enumerate(arrivals)]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0)) as session:
        t0 = time.perf_counter()
        tasks = []
        for rec, body in zip(recs, bodies):
            delay = t0 + rec.due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(
                asyncio.create_task(stream_chat(session, url + "/chat/completions", body, {}, timeout, rec, t0))
            )
        await asyncio.gather(*tasks)
        return recs, time.perf_counter() - t0


# ---- server side --------------------------------------------------------------------------------
def deploy(router: str, args) -> None:
    from ray import serve

    import kvserve.deployments.app as app_mod

    app_args = {
        "model": None,
        "num_replicas": 2,
        "torch_num_threads": 1,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": 1024,
        "num_kv_blocks": args.num_kv_blocks or None,
        "prefix_aware_routing": router == "prefix_aware",
        "prefix_routing_margin": args.margin,
    }
    extra = router_options(router, args.margin)
    orig = app_mod.llm_deployment_options
    if extra is not None:
        app_mod.llm_deployment_options = lambda m, name: {**orig(m, name), "request_router_config": extra}
    try:
        app = app_mod.build_app(app_args)
    finally:
        app_mod.llm_deployment_options = orig
    serve.run(app, name=APP, route_prefix="/")


def replica_reports() -> list[set[int]]:
    """The prefix hashes each live LLMServer replica of the app reports (``record_routing_stats``)."""
    import ray
    from ray._private.state import state

    out = []
    for a in state.actor_table(None).values():
        if (a.get("ActorClassName") or "") == f"ServeReplica:{APP}:LLMServer" and a["State"] == "ALIVE":
            actor = ray.get_actor(a["Name"], namespace="serve")
            out.append(set(ray.get(actor.record_routing_stats.remote(), timeout=60)["prefix_hashes"]))
    return out


class LoadSampler:
    """The 1-minute load average every ``period`` seconds while running."""

    def __init__(self, period: float = 5.0):
        self.period, self.samples, self._stop = period, [], threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.wait(self.period):
            self.samples.append(os.getloadavg()[0])

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()


# ---- one router -----------------------------------------------------------------------------------
def run_router(
    router: str, args, url: str, bodies: list[dict], arrivals: list[float], prefix_hashes: list[int], system_blocks: int
) -> dict:
    import httpx
    from ray import serve

    print(f"[{router}] deploying ...", flush=True)
    t0 = time.monotonic()
    deploy(router, args)
    deploy_s = time.monotonic() - t0
    warm = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 4}
    for _ in range(4):  # first-call allocations on both replicas; no workload prefix
        httpx.post(url + "/chat/completions", json=warm, timeout=300).raise_for_status()
    time.sleep(3.0)  # the replicas' routing reports reach the routers
    load_start = load_average()
    print(f"[{router}] {len(arrivals)} requests at {args.rate} req/s ...", flush=True)
    with LoadSampler() as load:
        recs, elapsed = asyncio.run(send_all(url, bodies, arrivals, args.request_timeout))
    reports = replica_reports()
    serve.delete(APP)
    done = [r for r in recs if r.outcome == COMPLETE]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    hit_requests = sum(1 for r in done if (r.cached_tokens or 0) >= (system_blocks - 1) * 16)
    outcomes: dict[str, int] = {}
    for r in recs:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    s = {
        "router": router,
        "deploy_s": round(deploy_s, 1),
        "num_requests": len(recs),
        "completed": len(done),
        "outcomes": outcomes,
        "elapsed_s": round(elapsed, 2),
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
        # without the cold start (each prompt's first request misses under any router; a second replica's too)
        "prefix_cache_hit_rate_after_first_16": (
            sum(r.cached_tokens or 0 for r in done if r.index >= 16)
            / max(1, sum(r.prompt_tokens or 0 for r in done if r.index >= 16))
        ),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "requests_hitting_their_system_prompt": hit_requests / len(done) if done else None,
        "ttft_ms": dist_ms([r.ttft for r in done if r.ttft is not None]),
        "e2e_ms": dist_ms([r.e2e for r in done if r.e2e is not None]),
        "completed_rps": len(done) / elapsed,
        "output_tok_per_s": sum(r.output_tokens or 0 for r in done) / elapsed,
        "client_send_lateness_ms_p99": 1000 * (percentile([max(0.0, r.sent - r.due) for r in recs], 99) or 0.0),
        "replicas_serving_each_system_prompt": [sum(h in rep for rep in reports) for h in prefix_hashes],
        "system_prompts_reported_by_each_replica": [sum(h in rep for h in prefix_hashes) for rep in reports],
        "load_average": {
            "start": load_start,
            "end": load_average(),
            "during_1min_mean": round(sum(load.samples) / len(load.samples), 2) if load.samples else None,
            "during_1min_max": max(load.samples, default=None),
        },
        "lost_samples": [
            {"index": r.index, "outcome": r.outcome, "detail": r.detail} for r in recs if r.outcome != COMPLETE
        ][:5],
    }
    print(
        f"[{router}] hit rate {s['prefix_cache_hit_rate']:.3f}, TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/"
        f"{s['ttft_ms']['p99']:.0f} ms, {s['completed_rps']:.2f} req/s, outcomes {outcomes}, "
        f"replicas per prompt {s['replicas_serving_each_system_prompt']}, prompts per replica "
        f"{s['system_prompts_reported_by_each_replica']}, load {s['load_average']}",
        flush=True,
    )
    time.sleep(10.0)  # the replicas' processes exit before the next router's start
    return s


def routing_cost(tokenizer_path: str, bodies: list[dict]) -> dict:
    """The router's hashing time per request on this workload, microseconds: the first request
    of each system prompt (tokenize its leading 2 KiB) and the others (cached leading text)."""
    from transformers import PreTrainedTokenizerFast

    from kvserve.deployments.routing.prefix_hasher import PrefixHasher

    hasher = PrefixHasher(PreTrainedTokenizerFast.from_pretrained(tokenizer_path), 16)
    first, rest, seen = [], [], set()
    for b in bodies:
        t0 = time.perf_counter()
        hasher.of_request(None, b["messages"])
        dt = 1e6 * (time.perf_counter() - t0)
        key = b["messages"][0]["content"]
        (rest if key in seen else first).append(dt)
        seen.add(key)
    return {
        "first_per_system_prompt_us_mean": sum(first) / len(first),
        "cached_us_p50": percentile(rest, 50),
        "cached_us_p99": percentile(rest, 99),
    }


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    runs = result["runs"]
    names = [r["router"] for r in runs]
    x = range(len(runs))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    ax = axes[0]
    ax.bar(x, [r["prefix_cache_hit_rate"] or 0 for r in runs], 0.6, color="tab:green")
    ax.axhline(0.8, color="red", ls="--", lw=1, label="target 0.8")
    ax.set_xticks(list(x), names)
    ax.set_ylim(0, 1)
    ax.set_title("prefix-cache hit rate (prompt tokens)")
    ax.legend(fontsize=8)
    ax = axes[1]
    w = 0.38
    ax.bar([i - w / 2 for i in x], [r["ttft_ms"]["p50"] / 1000 for r in runs], w, label="p50")
    ax.bar([i + w / 2 for i in x], [r["ttft_ms"]["p99"] / 1000 for r in runs], w, label="p99")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("s")
    ax.set_title("TTFT")
    ax.legend(fontsize=8)
    ax = axes[2]
    ax.bar(x, [r["output_tok_per_s"] for r in runs], 0.6, color="tab:purple")
    ax.set_xticks(list(x), names)
    ax.set_title("output tokens/s")
    wl = result["workload"]
    fig.suptitle(
        f"2 replicas, {wl['num_system_prompts']} system prompts x {wl['system_prompt_tokens']} tokens, "
        f"Poisson {wl['rate_rps']} req/s, {wl['num_kv_blocks']} KV blocks/replica, "
        f"{result['machine']['cores']} CPU cores",
        fontsize=10,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    f, t = Figures(), r.get("targets", {})
    if "hit_rate" in t:
        f.summary(
            "prefix-aware routing: prefix-cache hit rate", t["hit_rate"], target=">= 0.8", met=t.get("hit_rate >= 0.8")
        )
    if "ttft_p50_over_default" in t:
        f.summary(
            "prefix-aware routing: TTFT p50 / Serve's default router",
            t["ttft_p50_over_default"],
            "x",
            target="<= 0.6x",
            met=t.get("ttft_p50 <= 0.6 x default"),
            headline=True,
        )
    for k, v in r.get("routing_cost", {}).items():
        f.summary(f"routing cost per request, {k.replace('_us', '').replace('_', ' ')}", v, "us")
    w, srv = r["workload"], r.get("server", {})

    def load(x):
        la = x.get("load_average")
        return la.get("during_1min_mean") if isinstance(la, dict) else la

    f.table(
        "Routers",
        [
            "router",
            "prefix-cache hit rate",
            "requests hitting their system prompt",
            "TTFT p50 (ms)",
            "TTFT p99 (ms)",
            "E2E p50 (ms)",
            "req/s",
            "load (1-min mean)",
        ],
        [
            [
                x["router"],
                x["prefix_cache_hit_rate"],
                x.get("requests_hitting_their_system_prompt"),
                x["ttft_ms"]["p50"],
                x["ttft_ms"]["p99"],
                x.get("e2e_ms", {}).get("p50"),
                x["completed_rps"],
                load(x),
            ]
            for x in r["runs"]
        ],
        note=f"{w['num_requests']} chat streams, {w['num_system_prompts']} system prompts of "
        f"{w['system_prompt_tokens']} tokens, Poisson {w['rate_rps']} req/s for {w['duration_s']} s, "
        f"{srv.get('replicas')} replicas, {w['num_kv_blocks']} KV blocks each; the same arrivals for every "
        "router.",
    )
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--routers", default=",".join(ROUTERS), help=f"comma-separated, of {ROUTERS}")
    ap.add_argument("--rate", type=float, default=0.3, help="Poisson arrival rate, requests/s")
    ap.add_argument("--duration", type=float, default=240.0, help="seconds of arrivals per router")
    ap.add_argument("--output-tokens", type=output_range, default="16-48", help="max_tokens: N or LO-HI (uniform)")
    ap.add_argument("--num-kv-blocks", type=int, default=192, help="KV blocks per replica (0: the engine's default)")
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--margin", type=int, default=8, help="prefix_routing_margin (and Ray's imbalanced_threshold)")
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/routing.json")
    args = ap.parse_args(argv)
    routers = [r.strip() for r in args.routers.split(",") if r.strip()]
    if not routers or set(routers) - set(ROUTERS):
        ap.error(f"--routers: choose from {ROUTERS}")
    prov = Results(__file__, RESULT_KEYS)

    from kvserve.deployments.contract.prefix import block_hashes
    from kvserve.engine.model_loader import resolve_model

    model_path = str(resolve_model(None))
    tok = load_tokenizer(None)
    systems = make_system_prompts(tok, NUM_PROMPTS, SYSTEM_TOKENS, args.seed)
    arrivals = poisson_arrivals(args.rate, args.seed + 1, args.duration)
    bodies = make_requests(systems, len(arrivals), args.output_tokens, args.seed + 2, DEFAULT_MODEL)
    system_blocks = SYSTEM_TOKENS // 16
    # each system prompt's chained hash at block 24 (inside the system prompt), as the engine computes it
    prefix_hashes = []
    for s in systems:
        ids = tok.apply_chat_template(
            [{"role": "system", "content": s}, {"role": "user", "content": "x"}],
            tokenize=True,
            add_generation_prompt=True,
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        prefix_hashes.append(block_hashes(list(ids), 16, 24)[-1])
    result: dict = {
        "what": "prefix-aware routing vs Serve's default router (and Ray's PrefixCacheAffinityRouter), same arrivals",
        "workload": {
            "num_system_prompts": NUM_PROMPTS,
            "system_prompt_tokens": SYSTEM_TOKENS,
            "user_turn": "Question k: 4-8 words? (~15 tokens, unique)",
            "endpoint": "/v1/chat/completions stream",
            "output_tokens": "{}-{}".format(*args.output_tokens),
            "ignore_eos": True,
            "temperature": 0.0,
            "arrivals": "Poisson",
            "rate_rps": args.rate,
            "duration_s": args.duration,
            "num_requests": len(arrivals),
            "seed": args.seed,
            "num_kv_blocks": args.num_kv_blocks or "default",
            "kv_blocks_per_system_prompt": system_blocks,
        },
        "server": {
            "model": "SmolLM2-135M-Instruct (default)",
            "replicas": 2,
            "torch_num_threads_per_replica": 1,
            "max_num_seqs": args.max_num_seqs,
            "prefix_routing_margin": args.margin,
            "note": "2 replicas share the machine's cores (one torch thread each)",
        },
        "routing_cost": routing_cost(model_path, bodies),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(f"workload: {len(arrivals)} requests; routing cost {result['routing_cost']}", flush=True)
    runs = []
    with local_serve(max(os.cpu_count() or 1, 6)) as port:
        url = f"http://127.0.0.1:{port}/v1"
        for r in routers:
            runs.append(run_router(r, args, url, bodies, arrivals, prefix_hashes, system_blocks))
    result["runs"] = runs
    by = {r["router"]: r for r in runs}
    if "prefix_aware" in by:
        ours = by["prefix_aware"]
        t = {"hit_rate >= 0.8": (ours["prefix_cache_hit_rate"] or 0) >= 0.8, "hit_rate": ours["prefix_cache_hit_rate"]}
        if "default" in by:
            ratio = ours["ttft_ms"]["p50"] / by["default"]["ttft_ms"]["p50"]
            t.update({"ttft_p50 <= 0.6 x default": ratio <= 0.6, "ttft_p50_over_default": round(ratio, 3)})
        if "ray_prefix_tree" in by:
            ray_r = by["ray_prefix_tree"]
            t["vs_ray_prefix_tree"] = {
                "hit_rate": [ours["prefix_cache_hit_rate"], ray_r["prefix_cache_hit_rate"]],
                "ttft_p50_ms": [ours["ttft_ms"]["p50"], ray_r["ttft_ms"]["p50"]],
                "ttft_p99_ms": [ours["ttft_ms"]["p99"], ray_r["ttft_ms"]["p99"]],
            }
        result["targets"] = t
    out = Path(args.out)
    result = prov.write(out, result)
    plot(result, out.with_suffix(".png"))
    print("| router | hit rate | hit sys prompt | TTFT p50/p99 ms | E2E p50 ms | req/s | out tok/s | load (mean) |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r['router']} | {r['prefix_cache_hit_rate']:.3f} | {r['requests_hitting_their_system_prompt']:.2f} | "
            f"{r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} | {r['e2e_ms']['p50']:.0f} | "
            f"{r['completed_rps']:.2f} | {r['output_tok_per_s']:.1f} | {r['load_average']['during_1min_mean']} |"
        )
    print("targets:", result.get("targets"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return result


if __name__ == "__main__":
    main()
