"""Multi-node Ray clusters run on this machine: recovery after a node dies, and the nodes Ray's
autoscaler adds for kvserve's scale-ups (``--parts recovery,scale-up``).

Recovery part: each run starts a fresh ``ray.cluster_utils.Cluster`` (a head with the ingress, two worker
raylets; token auth on), serves the tiny random-weight Llama with two replicas on two nodes
(``max_replicas_per_node: 1``), starts ``--streams`` streamed completions of ``--tokens`` tokens,
waits until every stream has its first tokens, then kills the raylet of a worker node that holds a
replica. Measured per run: the streams cut (an SSE error event then ``[DONE]``) and completed,
requests sent right after the loss that failed (target: none), and the seconds from the kill until
``/ready`` answers 200 with two running replicas again (target < 30 s). Median of ``--runs``.

All "nodes" share this machine's two cores and one IP: the figure includes Serve noticing the
loss, placing and starting a replica (loading the model) while the surviving streams keep the
cores busy; on separate machines the survivors would not compete with the rebuild.

Scale-up part (``--parts scale-up``): Ray's autoscaler adds a node for a replica that
kvserve's policy asks for. Each run starts a fresh ``FakeAutoscalingCluster``
(``tests/autoscaling_cluster.py``: ``ray start --head`` with Ray's autoscaler over its fake
multi-node provider; a head with the ingress, a node type with 1 CPU and ``node-type-a``, 0..2
nodes), deploys the tiny model (replicas need ``node-type-a``; 1..2 replicas, the policy with short
delays: the test's ``FAST_KNOBS``), waits for the first replica on the first node the autoscaler
started, then runs ``--concurrency`` clients of streamed completions (refused ones sent again).
Measured per run, from the policy's first scale-up decision (its ``kvserve_autoscaling_decision``
line in the Serve controller's log, the controller's clock) to: Serve's target at 2, the new node
registered (alive in Ray's node table), the new replica RUNNING (Serve's status; both polled every
0.25 s) and the first token of a request the new replica served (the client's clock; the request
found by its ``x-request-id`` in that replica's Serve log). With the load stopped, the same for the
way down: the policy's scale-down decision to the idle node gone. Median of ``--scale-up-runs``.

Usage::

    python benchmarks/multinode.py                  # all parts, 3 runs of each (-> multinode.json, pipeline.json)
    python benchmarks/multinode.py --parts scale-up # only the scale-up part (multinode.json then holds only it)
    python benchmarks/multinode.py --parts pipeline # PP=2 vs PP=1 (benchmarks/pipeline.py -> pipeline.json)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from benchmarks.common import Figures, Results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: The top-level keys this script writes (besides benchmarks.common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "parts",
    "cluster",
    "workload",
    "runs",
    "recovery_s_median",
    "requests_after_failed_total",
    "targets",
    "scale_up",
    "pipeline",
)


def one_run(model_path: str, streams: int, tokens: int) -> dict:
    import httpx
    import ray
    from helpers import free_port, shutdown_ray_cluster, stream_completion
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.context import _get_global_client

    from kvserve.deployments.app import build_app

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}, "include_dashboard": False}
    )
    workers = [cluster.add_node(num_cpus=3) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
        serve.run(
            build_app(
                {
                    "model": model_path,
                    "served_model_name": "tiny",
                    "num_replicas": 2,
                    "max_replicas_per_node": 1,
                    "replica_cpus": 1,
                    "max_num_seqs": 16,
                    "max_model_len": 2048,
                    "torch_num_threads": 1,
                    "ingress_cpus": 0.25,
                    "ingress_resources": {"head": 0.01},
                }
            ),
            name="bench",
            route_prefix="/",
        )

        def replicas():
            return _get_global_client().get_serve_details()["applications"]["bench"]["deployments"]["LLMServer"][
                "replicas"
            ]

        held = {r["node_id"] for r in replicas()}
        victim = next(w for w in workers if w.node_id in held)

        async def main():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=300) as c:
                started = asyncio.Semaphore(0)
                tasks = [
                    asyncio.create_task(
                        stream_completion(
                            c,
                            {
                                "model": "tiny",
                                "prompt": f"story {k}:",
                                "max_tokens": tokens,
                                "temperature": 0,
                                "ignore_eos": True,
                                "cache": False,
                            },
                            started,
                        )
                    )
                    for k in range(streams)
                ]
                for _ in tasks:
                    await asyncio.wait_for(started.acquire(), 120)
                t_kill = time.monotonic()
                cluster.remove_node(victim, allow_graceful=False)
                after = [
                    (
                        await c.post(
                            "/v1/completions",
                            json={"model": "tiny", "prompt": f"after {k}", "max_tokens": 4, "cache": False},
                        )
                    ).status_code
                    for k in range(6)
                ]
                recovered = None
                while time.monotonic() - t_kill < 300:
                    running = {r["node_id"] for r in replicas() if r["state"] == "RUNNING"} - {victim.node_id}
                    if len(running) == 2 and (await c.get("/ready")).status_code == 200:
                        recovered = time.monotonic() - t_kill
                        break
                    await asyncio.sleep(0.5)
                ended = await asyncio.gather(*tasks)
                return ended, after, recovered

        ended, after, recovered = asyncio.run(main())
        serve.delete("bench")
    finally:
        shutdown_ray_cluster(cluster)
    return {
        "streams_cut": sum(e["error"] is not None for e in ended),
        "streams_completed": sum(e["error"] is None and e["done"] for e in ended),
        "streams_without_done": sum(not e["done"] for e in ended),
        "requests_after_failed": sum(s != 200 for s in after),
        "statuses_after": after,
        "recovery_s": recovered,
    }


def main(argv=None) -> dict:
    """The recovery part: ``--runs`` :func:`one_run` runs and their median (written by :func:`run`)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=600)
    a = ap.parse_args(argv)
    from tiny_models import make_tiny_model

    from benchmarks.common import private_ray_token

    private_ray_token()
    model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-tiny-")), arch="llama"))
    runs = [one_run(model, a.streams, a.tokens) for _ in range(a.runs)]
    rec = [r["recovery_s"] for r in runs if r["recovery_s"] is not None]
    result = {
        "cluster": "ray.cluster_utils.Cluster on one machine: head (2 logical CPUs, "
        "the ingress) + 2 worker raylets (3 logical CPUs each), one IP, two cores",
        "workload": {
            "streams": a.streams,
            "tokens_per_stream": a.tokens,
            "model": "tiny random-weight Llama",
            "replicas": 2,
            "max_replicas_per_node": 1,
            "runs": a.runs,
        },
        "runs": runs,
        "recovery_s_median": round(statistics.median(rec), 2) if rec else None,
        "requests_after_failed_total": sum(r["requests_after_failed"] for r in runs),
        "targets": {"recovery_s_below": 30, "requests_lost": 0},
    }
    print(json.dumps({k: result[k] for k in ("runs", "recovery_s_median", "requests_after_failed_total")}, indent=1))
    return result


#: The parts of this benchmark (``--parts``).
PARTS = ("recovery", "scale-up", "pipeline")
SCALE_UP_APP = "scale-up"


def scale_up_run(model_path: str, concurrency: int, max_tokens: int, timeout_s: float = 300.0) -> dict:
    """One scale-up run on a fresh fake autoscaling cluster (see the module docstring): seconds
    from the policy's scale-up decision to each step, the scale-down's, and the load's counts.

    Raises:
        TimeoutError: a step did not happen within ``timeout_s``.
    """
    import ray
    from autoscaling_cluster import (
        HEAD_RESOURCES,
        FakeAutoscalingCluster,
        StreamLoad,
        alive_nodes,
        decisions,
        deploy,
        serve_config,
        served_request_ids,
        wait_for,
        worker_node_types,
    )
    from helpers import free_port, shutdown_ray_cluster
    from ray import serve
    from ray.serve.context import _get_global_client

    def deployment() -> dict:
        return _get_global_client().get_serve_details()["applications"][SCALE_UP_APP]["deployments"]["LLMServer"]

    load_average = round(os.getloadavg()[0], 2)  # this machine's other work (the runs share its 2 cores)
    cluster = FakeAutoscalingCluster(HEAD_RESOURCES, worker_node_types(max_workers=2), idle_timeout_minutes=0.1)
    seen: dict[str, float] = {}
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False)
        head = ray.get_runtime_context().get_node_id()
        port = free_port()
        deploy(serve_config(model_path, port, SCALE_UP_APP), timeout_s=timeout_s)
        [first] = [r for r in deployment()["replicas"] if r["state"] == "RUNNING"]
        load = StreamLoad(f"http://127.0.0.1:{port}", concurrency=concurrency, max_tokens=max_tokens).start()
        t_load = time.time()
        new: dict[str, str] = {}
        served: list[dict] = []

        def up_step() -> bool:  # one poll: each step's time is taken after the call that saw it
            dep = deployment()
            now = time.time()
            if dep["target_num_replicas"] >= 2:
                seen.setdefault("target", now)
            if "node" not in new and (nodes := set(alive_nodes()) - {head, first["node_id"]}):
                new["node"], seen["node"] = nodes.pop(), time.time()
            for r in dep["replicas"]:
                if r["replica_id"] != first["replica_id"] and r["state"] == "RUNNING" and "replica" not in new:
                    new["replica"], new["replica_node"], seen["running"] = r["replica_id"], r["node_id"], now
            if "replica" in new:
                ids = served_request_ids(SCALE_UP_APP, new["replica"])
                served[:] = [
                    r
                    for r in list(load.records)
                    if r["request_id"] in ids and r["status"] == 200 and r["t_first"] is not None
                ]
            return bool(served)

        try:
            wait_for("a request served by a second replica", up_step, timeout_s, 0.25)
        finally:
            load.stop()
        t_stop = time.time()
        kept: dict[str, str] = {}

        def down_step() -> bool:
            dep = deployment()
            now = time.time()
            if len(dep["replicas"]) == 1 and dep["replicas"][0]["state"] == "RUNNING":
                seen.setdefault("one_replica", now)
                kept.setdefault("node", dep["replicas"][0]["node_id"])
            if kept and set(alive_nodes()) == {head, kept["node"]}:
                seen["node_removed"] = time.time()
            return "node_removed" in seen

        wait_for("back to one replica and the idle node removed", down_step, timeout_s, 0.25)
        made = decisions(SCALE_UP_APP)
        serve.delete(SCALE_UP_APP)
    finally:
        shutdown_ray_cluster(cluster)
    up = next(d for d in made if d["action"] == "up")
    down = next(d for d in made if d["action"] == "down" and d["time"] > up["time"])
    first_token = min(r["t_first"] for r in served)
    records = load.records
    return {
        "load_start_to_decision_s": round(up["time"] - t_load, 2),
        "decision_reason": up["reason"],
        "decision_to_serve_target_s": round(seen["target"] - up["time"], 2),
        "decision_to_node_s": round(seen["node"] - up["time"], 2),
        "decision_to_replica_running_s": round(seen["running"] - up["time"], 2),
        "decision_to_first_token_s": round(first_token - up["time"], 2),
        "new_replica_on_new_node": new["replica_node"] == new["node"],
        "load_stop_to_down_decision_s": round(down["time"] - t_stop, 2),
        "down_decision_to_one_replica_s": round(seen["one_replica"] - down["time"], 2),
        "down_decision_to_node_removed_s": round(seen["node_removed"] - down["time"], 2),
        "streams_served": sum(r["status"] == 200 for r in records),
        "streams_failed": sum(r["status"] == 200 and (not r["done"] or r["error"] is not None) for r in records),
        "refused_429": sum(r["status"] == 429 for r in records),
        "other_statuses": sorted({r["status"] for r in records} - {200, 429}, key=str),
        "load_average_1m_at_start": load_average,
    }


def scale_up(runs: int, concurrency: int, max_tokens: int) -> dict:
    """``runs`` :func:`scale_up_run` runs, their medians, the machine and the date."""
    import datetime

    from tiny_models import make_tiny_model

    from benchmarks.common import private_ray_token

    private_ray_token()
    model = str(make_tiny_model(Path(tempfile.mkdtemp(prefix="kvserve-tiny-")), arch="llama"))
    results = [scale_up_run(model, concurrency, max_tokens) for _ in range(runs)]
    keys = (
        "decision_to_serve_target_s",
        "decision_to_node_s",
        "decision_to_replica_running_s",
        "decision_to_first_token_s",
        "load_start_to_decision_s",
        "down_decision_to_node_removed_s",
    )
    return {
        "date": datetime.date.today().isoformat(),
        "cluster": "FakeAutoscalingCluster (tests/autoscaling_cluster.py): ray start --head with Ray's v1 "
        "autoscaler over its fake multi-node provider on one machine; head 1 logical CPU (the "
        "ingress); node type type-a: 1 logical CPU + node-type-a, 0..2 nodes, idle timeout 6 s",
        "workload": {
            "model": "tiny random-weight Llama, float32, CPU",
            "replicas": "1..2, each needing node-type-a",
            "max_num_seqs": 2,
            "max_queued_requests": 1,
            "concurrency": concurrency,
            "max_tokens": max_tokens,
            "runs": runs,
            "poll_interval_s": 0.25,
        },
        "runs": results,
        "median": {k: round(statistics.median(r[k] for r in results), 2) for k in keys},
    }


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f, t = Figures(), r.get("targets") or {}
    if "recovery_s_median" in r:
        below = t.get("recovery_s_below")
        f.summary(
            "a worker node killed mid-traffic: seconds until both replicas run and /ready is 200 (median; "
            "raylets on one machine)",
            r["recovery_s_median"],
            "s",
            target=f"< {below} s" if below else None,
            met=r["recovery_s_median"] < below if below and r["recovery_s_median"] is not None else None,
            headline=True,
        )
        f.summary(
            "requests sent right after the loss that failed",
            r["requests_after_failed_total"],
            target=f"<= {t['requests_lost']}" if "requests_lost" in t else None,
            met=r["requests_after_failed_total"] <= t["requests_lost"] if "requests_lost" in t else None,
        )
        w = r["workload"]
        f.table(
            "Node loss",
            [
                "run",
                "whole again after (s)",
                "streams cut",
                "streams completed",
                "streams without [DONE]",
                "requests after the loss failed",
            ],
            [
                [
                    i + 1,
                    x["recovery_s"],
                    x["streams_cut"],
                    x["streams_completed"],
                    x["streams_without_done"],
                    x["requests_after_failed"],
                ]
                for i, x in enumerate(r["runs"])
            ],
            note=f"{r['cluster']}: {w['streams']} streams of {w['tokens_per_stream']} tokens over "
            f"{w['replicas']} replicas, one per node; a worker node's raylet killed mid-stream.",
        )
    s = r.get("scale_up")
    if s:
        m, sw = s["median"], s["workload"]
        f.summary(
            "kvserve's scale-up decision to the first token of a replica on a node Ray's autoscaler added "
            "(median; Ray's fake multi-node provider on one machine)",
            m["decision_to_first_token_s"],
            "s",
            headline=True,
        )
        f.summary("of which the scale-up decision to the new node", m["decision_to_node_s"], "s")
        cols = (
            "load_start_to_decision_s",
            "decision_to_serve_target_s",
            "decision_to_node_s",
            "decision_to_replica_running_s",
            "decision_to_first_token_s",
            "down_decision_to_node_removed_s",
        )
        rows = [
            [i + 1, x["decision_reason"]]
            + [x[k] for k in cols]
            + [f"{x['streams_served']} / {x['streams_failed']} / {x['refused_429']}", x.get("load_average_1m_at_start")]
            for i, x in enumerate(s["runs"])
        ]
        rows.append(["median", None] + [m[k] for k in cols] + [None, None])
        f.table(
            "Scale-up with Ray's autoscaler",
            [
                "run",
                "reason",
                "load to decision (s)",
                "decision to Serve's target 2 (s)",
                "to the new node (s)",
                "to the replica RUNNING (s)",
                "to its first token (s)",
                "scale-down decision to the node removed (s)",
                "streams served / failed / refused (429)",
                "load average",
            ],
            rows,
            note=f"{s['date']}; {s['cluster']}: the {sw['model']}, replicas {sw['replicas']}, {sw['concurrency']} "
            f"clients streaming {sw['max_tokens']}-token completions (refused ones sent again), polled every "
            f"{sw['poll_interval_s']} s; the first token by the client's clock. A real cloud node boots in "
            "minutes: add that to the node step.",
        )
    pp = r.get("pipeline")
    if pp:
        f.summary("pipeline parallelism, PP=2 / the engine alone (from pipeline.json)", pp["pp2_over_pp1"], "x")
        f.summary("tensor parallelism, TP=2 / the engine alone (from pipeline.json)", pp["tp2_over_pp1"], "x")
    return f


def run(argv=None) -> dict:
    """``--parts``: the recovery part (:func:`main`, its options as before), the scale-up part
    (:func:`scale_up`) and the pipeline part (``benchmarks/pipeline.py``: PP=2 against PP=1 on
    the same cores, written to ``pipeline.json``, summarised here). The results file is written
    whole: it holds the parts this run ran, nothing of an earlier run."""
    ap = argparse.ArgumentParser(
        description="parts: " + ", ".join(PARTS) + "; other options go to the recovery "
        "part (python benchmarks/multinode.py --parts recovery --help)"
    )
    ap.add_argument("--parts", default=",".join(PARTS), help="comma-separated, of " + ", ".join(PARTS))
    ap.add_argument("--scale-up-runs", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=12, help="scale-up part: concurrent streaming clients")
    ap.add_argument("--scale-up-tokens", type=int, default=64, help="scale-up part: max_tokens per request")
    ap.add_argument("--out", default=str(RESULTS / "multinode.json"))
    a, rest = ap.parse_known_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    if not parts or set(parts) - set(PARTS):
        ap.error(f"--parts: expected some of {', '.join(PARTS)}, got {a.parts!r}")
    prov = Results(__file__, RESULT_KEYS)
    result: dict = {"parts": parts}
    if "recovery" in parts:
        result.update(main(rest))
    if "scale-up" in parts:
        result["scale_up"] = scale_up(a.scale_up_runs, a.concurrency, a.scale_up_tokens)
        print(json.dumps({k: result["scale_up"][k] for k in ("runs", "median")}, indent=1))
    if "pipeline" in parts:  # its own file (benchmarks/pipeline.py); a summary here
        from benchmarks.pipeline import main as pipeline_main

        pp = pipeline_main(["--out", str(RESULTS / "pipeline.json")])
        result["pipeline"] = {
            "file": "benchmarks/results/pipeline.json",
            "pp2_over_pp1": pp["configs"]["pp2"]["vs_pp1"],
            "tp2_over_pp1": pp["configs"]["tp2"]["vs_pp1"],
        }
    return prov.write(a.out, result)


if __name__ == "__main__":
    run()
