"""KV-event routing and the host KV tier against today's routers (issue 42's benchmark).

A scaled-down copy of llm-d's prefix-cache benchmark. Workload (seeded per repeat; the same for
every arm of a repeat): ``--groups`` groups of users, each group sharing a system prompt of
``--system-tokens`` tokens; ``--users-per-group`` users per group, each a conversation of
``--turns`` turns whose context grows every turn (the previous turns, a synthetic assistant
answer of ~24 tokens, then a new user message of ~48 tokens); each user sends its next turn when
the previous one has ended, after an exponential think time (mean ``--think-s``); users start
uniformly over the first 10 s. The default load (3 groups of 2 users: 6 users on 2 replicas of 4
sequences each; users of a group share their system prompt, as llm-d's benchmark's do) is one
this box serves without refusals, so the arms differ in the work they make the replicas do, not
in what they refuse (an overloaded run's refusals come from the replicas' admission bounds and
the gateway's shedding, and make the arms' TTFTs incomparable). Streaming ``/v1/chat/completions``, greedy, ``max_tokens``
``--output-tokens`` with ``ignore_eos``. The distinct prefixes (system prompts plus every
conversation) exceed one replica's KV pool (``--num-kv-blocks``), so pools evict.

Server: a local Ray (token auth) and the kvserve app with the default model (SmolLM2-135M-Instruct,
float32) on ``--replicas`` replicas, one torch thread each; a fresh app per arm and repeat:

* ``default``: Serve's own router, power of two choices on queue length, no cache affinity (the
  issue's round-robin reference: Serve has no round robin, and a router of the benchmark's own
  would have to be importable in every replica);
* ``prefix``: today's prefix-aware router (``kvserve/deployments/routing/prefix_router.py``);
* ``kv``: the KV-event router (``kvserve/deployments/routing/kv_router.py``), no tier;
* ``kv_tier``: the KV-event router with a host tier of ``--kv-offloading-size`` GiB per replica;
* ``kv_tiers``: the KV-event router with both tiers: the host tier, and the cluster tier in Ray's
  object store (``--kv-cluster-tier-size`` GiB shared by the replicas,
  ``kvserve/deployments/replica/kv_cluster.py``): a prefix computed on one replica loads on another.

``--model tiny`` serves a tiny random-weight Llama (hidden 64, 2 layers: ``tests/tiny_models.py``)
instead of SmolLM2, for the many-replica case (``--replicas 3``): there the work is mostly the
serving path's, and a fetch from the cluster tier is rarely cheaper than recomputing (the tier
then computes instead, by its rule).

Arms run interleaved (``--repeats`` rounds, the arm order rotated each round). Per arm: TTFT
p50/p90, output tok/s, prompt tokens found in a pool and loaded from a host tier (the answers'
``cached_tokens``, and the app's ``external_prefix_cache_hits`` counter for the tier), of those
fetched from the cluster tier (``kv_cluster_hit_tokens``), tokens recomputed, preemptions,
refusals. Medians over the repeats. A bar plot beside the results file (``.png``).

Two component measures, in the same run:

* **a returning conversation** (``tier_ttft``): one engine (SmolLM2, float32) with a host tier;
  a prompt of ``--probe-tokens`` tokens, then enough other prompts to evict it from the pool, then
  the prompt again: its TTFT (loaded from the tier) against the TTFT of the same prompt on a
  fresh engine (recomputed); interleaved repeats;
* **routing cost** (``router_cost``): :class:`~kvserve.deployments.routing.kv_router.KVAwareRouter`'s
  decision time on fake replicas whose index holds ``3 x 20,000`` blocks, for 1,024-token
  token-id prompts.

Usage::

    python benchmarks/kv_routing.py                       # full run, writes benchmarks/results/kv_routing.json
    python benchmarks/kv_routing.py --repeats 1 --arms prefix,kv_tier --out /tmp/k.json   # smoke
    python benchmarks/kv_routing.py --model tiny --replicas 3 --groups 3 --users-per-group 3 \
        --skip-components --out benchmarks/results/kv_routing_tiny3.json        # the many-replica case
    python benchmarks/kv_routing.py --components-only --out benchmarks/results/kv_routing_components.json

Targets (issue 42): ``kv_tiers`` (else ``kv_tier``) vs ``prefix``: TTFT p90 <= 0.5x and output tok/s >= 1.3x, no more
refusals; a returning conversation from the tier: TTFT <= 1/3 of recomputing; routing <= 1 ms per
request (1,000 requests/s).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.common import Figures, Results, load_average, local_serve, percentile  # noqa: E402
from benchmarks.load_test import COMPLETE, DEFAULT_MODEL, Rec, load_tokenizer, stream_chat  # noqa: E402
from benchmarks.routing import make_system_prompts  # noqa: E402

ARMS = ("default", "prefix", "kv", "kv_tier", "kv_tiers")
RESULT_KEYS = ("what", "workload", "server", "started", "runs", "arms", "tier_ttft", "router_cost", "targets")
APP = "kvserve-kv-routing"
WORDS = [
    "river",
    "stone",
    "cloud",
    "table",
    "garden",
    "winter",
    "number",
    "light",
    "music",
    "paper",
    "field",
    "market",
    "engine",
    "signal",
    "harbor",
    "forest",
    "letter",
    "silver",
    "planet",
    "bridge",
]


# ---- workload -----------------------------------------------------------------------------------
def conversations(systems: list[str], users_per_group: int, turns: int, seed: int) -> list[list[list[dict]]]:
    """Per user, per turn, the chat messages sent (the context grows every turn)."""
    rng = random.Random(seed)
    out = []
    for g, system in enumerate(systems):
        for u in range(users_per_group):
            msgs = [{"role": "system", "content": system}]
            user_turns = []
            for t in range(turns):
                msgs = msgs + [
                    {
                        "role": "user",
                        "content": f"User {g}-{u}-{seed}, turn {t}: "
                        + " ".join(rng.choice(WORDS) for _ in range(40))
                        + "?",
                    }
                ]
                user_turns.append(list(msgs))
                msgs = msgs + [{"role": "assistant", "content": " ".join(rng.choice(WORDS) for _ in range(20)) + "."}]
            out.append(user_turns)
    return out


async def run_users(url: str, users: list[list[list[dict]]], args, seed: int) -> tuple[list[Rec], float]:
    """Every user's turns in order, each after the previous one ended and a think time."""
    import aiohttp

    rng = random.Random(seed)
    recs: list[Rec] = []

    async def user(turns, start):
        await asyncio.sleep(start)
        for msgs in turns:
            rec = Rec(index=len(recs))
            recs.append(rec)
            body = {
                "model": DEFAULT_MODEL,
                "messages": msgs,
                "max_tokens": args.output_tokens,
                "ignore_eos": True,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            await stream_chat(session, url + "/chat/completions", body, {}, args.request_timeout, rec, t0)
            await asyncio.sleep(think.pop())

    think = [rng.expovariate(1 / args.think_s) for _ in range(sum(len(u) for u in users))]
    starts = [rng.uniform(0, 10.0) for _ in users]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, limit_per_host=0)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(user(u, s) for u, s in zip(users, starts)))
        return recs, time.perf_counter() - t0


# ---- server side --------------------------------------------------------------------------------
def deploy(arm: str, args) -> None:
    from ray import serve

    import kvserve.deployments.app as app_mod

    app_args = {
        "model": args.model_path,
        "served_model_name": DEFAULT_MODEL,
        "dtype": "float32",
        "num_replicas": args.replicas,
        "torch_num_threads": 1,
        "max_num_seqs": args.max_num_seqs,
        "max_model_len": 2048,
        "num_kv_blocks": args.num_kv_blocks,
        "prefix_aware_routing": arm != "default",
        "kv_aware_routing": arm.startswith("kv"),
        "kv_offloading_size": args.kv_offloading_size if arm in ("kv_tier", "kv_tiers") else None,
        "kv_cluster_tier_size": args.kv_cluster_tier_size if arm == "kv_tiers" else None,
        "response_cache": False,
    }
    serve.run(app_mod.build_app(app_args), name=APP, route_prefix="/")


def replica_stats(url: str) -> dict:
    """The app's engine counters summed over replicas, from its Prometheus export (``/metrics``):
    prompt tokens found in the pools and loaded from the host tiers, preemptions."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url.rsplit("/v1", 1)[0] + "/metrics", timeout=60).text
    out = {
        "prefix_cache_hits": 0.0,
        "external_prefix_cache_hits": 0.0,
        "num_preemptions": 0.0,
        "kv_cluster_hit_tokens": 0.0,
        "kv_cluster_bytes_saved": 0.0,
        "kv_cluster_bytes_loaded": 0.0,
        "kv_cluster_load_fallbacks": 0.0,
    }
    for fam in text_string_to_metric_families(text):
        name = fam.name.removeprefix("kvserve:")
        for smp in fam.samples:
            if not smp.name.endswith("_total"):
                continue
            key = f"{name}_{smp.labels['direction']}" if name == "kv_cluster_bytes" else name
            if key in out:
                out[key] += smp.value
    return out


def run_arm(arm: str, rep: int, args, url: str, users) -> dict:
    import httpx
    from ray import serve

    print(f"[{arm} #{rep}] deploying ...", flush=True)
    deploy(arm, args)
    warm = {"model": DEFAULT_MODEL, "messages": [{"role": "user", "content": "Warm up."}], "max_tokens": 2}
    for _ in range(2 * args.replicas):
        httpx.post(url + "/chat/completions", json=warm, timeout=300).raise_for_status()
    time.sleep(3.0)  # replicas' first reports / publishes reach the routers
    before = replica_stats(url)
    load_start = load_average()
    recs, elapsed = asyncio.run(run_users(url, users, args, seed=1000 * rep + 7))
    after = replica_stats(url)
    serve.delete(APP)
    done = [r for r in recs if r.outcome == COMPLETE]
    prompt = sum(r.prompt_tokens or 0 for r in done)
    cached = sum(r.cached_tokens or 0 for r in done)
    host = int(after["external_prefix_cache_hits"] - before["external_prefix_cache_hits"])
    cluster = int(after["kv_cluster_hit_tokens"] - before["kv_cluster_hit_tokens"])
    outcomes: dict[str, int] = {}
    for r in recs:
        outcomes[r.outcome] = outcomes.get(r.outcome, 0) + 1
    ttft = [1000 * r.ttft for r in done if r.ttft is not None]
    s = {
        "arm": arm,
        "repeat": rep,
        "requests": len(recs),
        "completed": len(done),
        "outcomes": outcomes,
        "refused": sum(n for o, n in outcomes.items() if o != COMPLETE),
        "elapsed_s": round(elapsed, 2),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_p90": percentile(ttft, 90),
        "output_tok_per_s": sum(r.output_tokens or 0 for r in done) / elapsed,
        "prompt_tokens": prompt,
        "pool_hit_tokens": cached - host,
        "host_hit_tokens": host,
        "cluster_hit_tokens": cluster,
        "cluster_bytes": {
            d: int(after[f"kv_cluster_bytes_{d}"] - before[f"kv_cluster_bytes_{d}"]) for d in ("saved", "loaded")
        },
        "cluster_load_fallbacks": int(after["kv_cluster_load_fallbacks"] - before["kv_cluster_load_fallbacks"]),
        "recomputed_tokens": prompt - cached,
        "preemptions": int(after["num_preemptions"] - before["num_preemptions"]),
        "load_average": {"start": load_start, "end": load_average()},
    }
    print(
        f"[{arm} #{rep}] TTFT p50/p90 {s['ttft_ms_p50']:.0f}/{s['ttft_ms_p90']:.0f} ms, {s['output_tok_per_s']:.1f} "
        f"tok/s, pool/host(cluster)/recomputed {s['pool_hit_tokens']}/{host}({cluster})/{s['recomputed_tokens']}, outcomes {outcomes}, cluster bytes {s['cluster_bytes']}, "
        f"fallbacks {s['cluster_load_fallbacks']}",
        flush=True,
    )
    time.sleep(8.0)  # the replicas' processes exit before the next arm starts
    return s


# ---- component measures -------------------------------------------------------------------------
def tier_ttft(args) -> dict:
    """TTFT of a returning prompt loaded from the host tier vs recomputed (see the module docstring)."""
    from kvserve.engine import LLM, SamplingParams

    rng = random.Random(5)
    sp = SamplingParams(max_tokens=1, temperature=0)

    def prompt():
        return [rng.randrange(1000, 40000) for _ in range(args.probe_tokens)]

    blocks = 2 * (args.probe_tokens // 16) + 8  # room for two prompts: the third evicts the first
    tier = LLM(dtype="float32", num_kv_blocks=blocks, kv_offloading_size=0.5, max_model_len=blocks * 16)
    fresh = LLM(dtype="float32", num_kv_blocks=blocks, enable_prefix_caching=False, max_model_len=blocks * 16)
    loaded, recomputed = [], []
    for _ in range(args.probe_repeats):
        p = prompt()
        tier.generate([p], sp, use_tqdm=False)
        tier.generate([prompt(), prompt()], sp, use_tqdm=False)  # evict p from the pool
        hits0 = tier.engine.get_stats()["kv_offload_hit_tokens"]
        t0 = time.perf_counter()
        tier.generate([p], sp, use_tqdm=False)
        loaded.append(1000 * (time.perf_counter() - t0))
        assert tier.engine.get_stats()["kv_offload_hit_tokens"] > hits0, "the probe prompt was not loaded from the tier"
        t0 = time.perf_counter()
        fresh.generate([p], sp, use_tqdm=False)
        recomputed.append(1000 * (time.perf_counter() - t0))
    lo, re_ = statistics.median(loaded), statistics.median(recomputed)
    return {
        "prompt_tokens": args.probe_tokens,
        "repeats": args.probe_repeats,
        "loaded_ttft_ms": loaded,
        "recomputed_ttft_ms": recomputed,
        "loaded_ttft_ms_median": lo,
        "recomputed_ttft_ms_median": re_,
        "ratio": lo / re_,
    }


def router_cost(n: int = 1000) -> dict:
    """KVAwareRouter's decision time, microseconds, on fake replicas and a large index."""
    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from kvserve.deployments.contract.kv_event_hub import KVEventHubCore, ReplicaLoad
    from kvserve.deployments.contract.kv_index import request_hashes
    from kvserve.deployments.contract.types import GenerateRequest
    from kvserve.deployments.routing.kv_router import KVAwareRouter
    from kvserve.engine.kv_events import BlockStored, KVEventBatch

    class Replica:
        def __init__(self, name):
            self.replica_id = ReplicaID(name, DeploymentID(name="LLMServer", app_name="bench"))
            self.routing_stats, self.max_ongoing_requests, self.multiplexed_model_ids = {}, 100, set()
            self.node_id = self.availability_zone = None

        async def get_queue_len(self, *, deadline_s):
            return 0

    rng = random.Random(3)
    reps = [Replica(f"r{i}") for i in range(3)]
    hub = KVEventHubCore()
    prompts = [[rng.randrange(50000) for _ in range(1024)] for _ in range(64)]
    for i, r in enumerate(reps):
        hashes = [h for p in prompts[i::3] for h in request_hashes(p, 16, 64)]
        filler = [rng.getrandbits(62) for _ in range(20000 - len(hashes))]
        hub.publish(
            r.replica_id.unique_id,
            1,
            [KVEventBatch(0.0, [BlockStored(hashes + filler, None, [], 16)])],
            ReplicaLoad(),
            snapshot=(0, KVEventBatch(0.0)),
        )

    async def run():
        router = KVAwareRouter(
            deployment_id=DeploymentID(name="LLMServer", app_name="bench"),
            handle_source=DeploymentHandleSource.UNKNOWN,
            use_replica_queue_len_cache=True,
        )
        router.initialize_state(app_name="")
        router.update_replicas(reps)
        router.apply(hub.pull(None, 0))
        times = []
        for k in range(n):
            rid = f"q{k}"
            pr = PendingRequest(
                args=[GenerateRequest(prompt=prompts[k % len(prompts)] + [k])],
                kwargs={},
                metadata=RequestMetadata(request_id=rid, internal_request_id=rid, call_method="stream"),
            )
            t0 = time.perf_counter()
            await router.choose_replicas(reps, pr)
            times.append(1e6 * (time.perf_counter() - t0))
            router._sent.clear()
        return times, len(router.kv_index), router.num_kv_routed

    times, blocks, routed = asyncio.run(run())
    return {
        "decisions": n,
        "index_blocks": blocks,
        "prompt_tokens": 1024,
        "us_p50": percentile(times, 50),
        "us_p99": percentile(times, 99),
        "us_mean": sum(times) / n,
        "kv_routed": routed,
    }


# ---- results ------------------------------------------------------------------------------------
def medians(runs: list[dict]) -> dict:
    out = {}
    for arm in ARMS:
        rs = [r for r in runs if r["arm"] == arm]
        if not rs:
            continue
        keys = (
            "ttft_ms_p50",
            "ttft_ms_p90",
            "output_tok_per_s",
            "pool_hit_tokens",
            "host_hit_tokens",
            "cluster_hit_tokens",
            "recomputed_tokens",
            "refused",
        )
        out[arm] = {k: statistics.median(r.get(k, 0) for r in rs) for k in keys}
        out[arm]["spread"] = {k: [min(r[k] for r in rs), max(r[k] for r in rs)] for k in keys[:3]}
        out[arm]["repeats"] = len(rs)
    return out


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    f, t = Figures(), r.get("targets", {})
    if "ttft_p90_ratio" in t:
        f.summary(
            f"KV-event router with tiers ({t.get('arm', 'kv_tier')}) / prefix router: TTFT p90",
            t["ttft_p90_ratio"],
            "x",
            target="<= 0.5x",
            met=t["ttft_p90_ratio"] <= 0.5,
            headline=True,
        )
        f.summary(
            "KV-event router with tiers / prefix router: output tok/s",
            t["tok_s_ratio"],
            "x",
            target=">= 1.3x",
            met=t["tok_s_ratio"] >= 1.3,
        )
        f.summary(
            "refusals, KV-event router with tiers minus prefix router",
            t["refusals_more"],
            None,
            target="<= 0",
            met=t["refusals_more"] <= 0,
        )
    tt = r.get("tier_ttft")
    if tt:
        f.summary(
            f"returning {tt['prompt_tokens']}-token prompt: TTFT loaded from the host tier / recomputed",
            tt["ratio"],
            "x",
            target="<= 0.33x",
            met=tt["ratio"] <= 1 / 3,
        )
    rc = r.get("router_cost")
    if rc:
        f.summary(
            "KV-event router decision time, p99 (1,024-token prompts, 60,000-block index)",
            rc["us_p99"],
            "us",
            target="<= 1000 us",
            met=rc["us_p99"] <= 1000,
        )
    w = r["workload"]
    if not r["arms"]:
        return f
    f.table(
        "Arms (medians over repeats)",
        [
            "arm",
            "TTFT p50 (ms)",
            "TTFT p90 (ms)",
            "output tok/s",
            "pool-hit tokens",
            "host-tier-hit tokens",
            "of which from the cluster tier",
            "recomputed tokens",
            "refused",
            "repeats",
        ],
        [
            [
                a,
                m["ttft_ms_p50"],
                m["ttft_ms_p90"],
                m["output_tok_per_s"],
                m["pool_hit_tokens"],
                m["host_hit_tokens"],
                m.get("cluster_hit_tokens", 0),
                m["recomputed_tokens"],
                m["refused"],
                m["repeats"],
            ]
            for a, m in r["arms"].items()
        ],
        note=f"{w['groups']} groups x {w['users_per_group']} users x {w['turns']} turns, system prompts of "
        f"{w['system_tokens']} tokens, {r['server']['replicas']} replicas of {r['server']['model']} with "
        f"{w['num_kv_blocks']} KV blocks each; arms interleaved, a fresh app each",
    )
    return f


def plot(result: dict, path: Path) -> None:
    """TTFT p50/p90 and output tok/s per arm (medians, with the repeats' range)."""
    from benchmarks.common import pyplot

    plt = pyplot()
    arms = list(result["arms"])
    m = result["arms"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(arms))
    for off, key, label in ((-0.2, "ttft_ms_p50", "p50"), (0.2, "ttft_ms_p90", "p90")):
        vals = [m[a][key] for a in arms]
        err = [
            [v - m[a]["spread"][key][0] for a, v in zip(arms, vals)],
            [m[a]["spread"][key][1] - v for a, v in zip(arms, vals)],
        ]
        axes[0].bar([i + off for i in x], vals, 0.4, yerr=err, capsize=3, label=label)
    axes[0].set_ylabel("TTFT (ms)")
    vals = [m[a]["output_tok_per_s"] for a in arms]
    err = [
        [v - m[a]["spread"]["output_tok_per_s"][0] for a, v in zip(arms, vals)],
        [m[a]["spread"]["output_tok_per_s"][1] - v for a, v in zip(arms, vals)],
    ]
    axes[1].bar(list(x), vals, 0.6, yerr=err, capsize=3)
    axes[1].set_ylabel("output tok/s")
    for ax in axes:
        ax.set_xticks(list(x))
        ax.set_xticklabels(arms)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend()
    s = result["server"]
    fig.suptitle(f"{s['replicas']} replicas of {s['model']}: medians of interleaved repeats (bars: range)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--users-per-group", type=int, default=2)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="KV blocks per replica")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument(
        "--kv-offloading-size", type=float, default=1.0, help="GiB of host tier per replica (kv_tier, kv_tiers)"
    )
    ap.add_argument(
        "--kv-cluster-tier-size",
        type=float,
        default=2.0,
        help="GiB of the cluster tier, shared by the replicas (kv_tiers)",
    )
    ap.add_argument(
        "--model",
        choices=("smollm2", "tiny"),
        default="smollm2",
        help="SmolLM2-135M-Instruct, or the tiny random-weight Llama (the many-replica case)",
    )
    ap.add_argument(
        "--skip-components", action="store_true", help="no tier_ttft / router_cost (measured by the headline run)"
    )
    ap.add_argument(
        "--components-only",
        action="store_true",
        help="only tier_ttft and router_cost, on an idle app-less Ray (no arms)",
    )
    ap.add_argument("--probe-tokens", type=int, default=1024)
    ap.add_argument("--probe-repeats", type=int, default=3)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--out", default="benchmarks/results/kv_routing.json")
    args = ap.parse_args(argv)
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if not arms or set(arms) - set(ARMS):
        ap.error(f"--arms: choose from {ARMS}")
    args.model_path = None
    if args.model == "tiny":
        import tempfile

        sys.path.insert(0, str(ROOT / "tests"))
        from tiny_models import make_tiny_model

        args.model_path = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-tiny-")), arch="llama"))
    prov = Results(__file__, RESULT_KEYS)
    result: dict = {
        "what": "KV-event routing with and without a host tier vs the prefix router and Serve's default router, "
        "multi-turn conversations in groups sharing system prompts",
        "workload": {
            "groups": args.groups,
            "users_per_group": args.users_per_group,
            "turns": args.turns,
            "system_tokens": args.system_tokens,
            "user_turn_words": 40,
            "assistant_words": 20,
            "output_tokens": args.output_tokens,
            "think_s_mean": args.think_s,
            "num_kv_blocks": args.num_kv_blocks,
            "endpoint": "/v1/chat/completions stream",
        },
        "server": {
            "model": "SmolLM2-135M-Instruct"
            if args.model == "smollm2"
            else "tiny random-weight Llama (hidden 64, 2 layers)",
            "dtype": "float32",
            "replicas": args.replicas,
            "torch_num_threads_per_replica": 1,
            "max_num_seqs": args.max_num_seqs,
            "kv_offloading_size_gib": args.kv_offloading_size,
            "kv_cluster_tier_size_gib": args.kv_cluster_tier_size,
        },
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    if args.components_only:
        result["what"] = (
            "the component measures of the KV-routing benchmark alone, on an idle local Ray: a "
            "returning prompt's TTFT from the host tier vs recomputed, the KV-event router's "
            "decision time"
        )
    tok = load_tokenizer(None)
    runs = []
    with local_serve(max(os.cpu_count() or 1, 6)) as port:
        url = f"http://127.0.0.1:{port}/v1"
        for rep in range(0 if args.components_only else args.repeats):
            systems = make_system_prompts(tok, args.groups, args.system_tokens, seed=100 + rep)
            users = conversations(systems, args.users_per_group, args.turns, seed=rep)
            for arm in arms[rep % len(arms) :] + arms[: rep % len(arms)]:
                runs.append(run_arm(arm, rep, args, url, users))
        if not args.skip_components:  # after the arms: not beside Ray's start-up on a small box
            time.sleep(10.0)
            result["router_cost"] = router_cost()
            print("router cost:", result["router_cost"], flush=True)
            result["tier_ttft"] = tier_ttft(args)
            print("tier TTFT:", result["tier_ttft"], flush=True)
    result["runs"] = runs
    result["arms"] = medians(runs)
    m = result["arms"]
    best = "kv_tiers" if "kv_tiers" in m else "kv_tier"
    if best in m and "prefix" in m:
        result["targets"] = {
            "arm": best,
            "ttft_p90_ratio": m[best]["ttft_ms_p90"] / m["prefix"]["ttft_ms_p90"],
            "tok_s_ratio": m[best]["output_tok_per_s"] / m["prefix"]["output_tok_per_s"],
            "refusals_more": m[best]["refused"] - m["prefix"]["refused"],
        }
    out = Path(args.out)
    result = prov.write(out, result)
    if m:
        plot(result, out.with_suffix(".png"))
    for a, x in m.items():
        print(
            f"| {a} | TTFT p50/p90 {x['ttft_ms_p50']:.0f}/{x['ttft_ms_p90']:.0f} ms | {x['output_tok_per_s']:.1f} "
            f"tok/s | pool/host/recomputed {x['pool_hit_tokens']}/{x['host_hit_tokens']}/{x['recomputed_tokens']} |"
        )
    print("targets:", result.get("targets"))
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
