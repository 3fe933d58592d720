"""kvserve's autoscaling policy driving a real Serve deployment (tiny model, short delays):
a burst of concurrent requests scales the LLMServer up, and it scales back down after.

Thorough profile only (``make test-thorough``): the fast one has the same policy scaling a
real Serve deployment up under a burst (refused requests counted as demand, the "up" decision
logged) and back down ("down" logged) in ``tests/cluster/test_autoscaling_nodes.py``, where each
scale-up also adds a Ray node."""

import asyncio
import time

import httpx
import pytest
from autoscaling_cluster import decisions

pytestmark = [pytest.mark.slow, pytest.mark.thorough, pytest.mark.timeout(600)]

APP = "kvserve-autoscale"
#: Longest the burst is kept up waiting for the second replica to run (seconds).
BURST_LIMIT_S = 240


def _replicas(serve) -> int:
    dep = serve.status().applications[APP].deployments["LLMServer"]
    return sum(n for state, n in dep.replica_states.items() if str(state).endswith("RUNNING"))


def test_burst_scales_up_then_down(ray_session, serve_app, tiny_llama_path):
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-as",
            "max_num_seqs": 2,
            "max_model_len": 512,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.1,
            "autoscaling": {
                "min_replicas": 1,
                "max_replicas": 3,
                "target_queue_per_replica": 1,
                "upscale_smoothing_s": 1,
                "upscale_cooldown_s": 1,
                "downscale_smoothing_s": 2,
                "downscale_cooldown_s": 4,
                "serve_downscale_delay_s": 1,
                "serve_look_back_period_s": 2,
                "serve_metrics_interval_s": 0.5,
            },
        }
    )
    serve.run(app, name=APP, route_prefix="/as")
    url = f"{serve_app.root}/as/v1/completions"
    timeline: list[tuple[float, int]] = []
    refused: list[int] = []
    t0 = time.time()

    async def burst():
        async with httpx.AsyncClient(timeout=300) as client:

            async def one(i):
                # the replica's queue is bounded (2 running + 1 queued): the rest of a wave is refused
                # at once, which the policy counts as waiting demand; a refused client retries
                body = {"model": "tiny-as", "prompt": f"request {i}", "max_tokens": 120, "ignore_eos": True}
                while True:
                    r = await client.post(url, json=body)
                    if r.status_code != 429:
                        break
                    refused.append(i)
                    await asyncio.sleep(0.5)
                assert r.status_code == 200, r.text

            async def watch(stop):
                while not stop.is_set():
                    timeline.append((time.time() - t0, _replicas(serve)))
                    await asyncio.sleep(0.5)

            stop = asyncio.Event()
            watcher = asyncio.create_task(watch(stop))
            # keep a queue of ~24 requests on a 2-seat replica until a second replica runs: the
            # policy decides within seconds, but starting a replica (torch, the engine) takes
            # 15-30 s on a loaded 2-core box, so a fixed number of waves races the start
            wave = 0
            while wave < 3 or (max(n for _, n in timeline) < 2 and time.time() - t0 < BURST_LIMIT_S):
                await asyncio.gather(*(one(wave * 24 + i) for i in range(24)))
                wave += 1
            stop.set()
            await watcher

    try:
        asyncio.run(burst())
        peak = max(n for _, n in timeline)
        assert refused, "the bounded queue refused nothing: the burst did not overload the replica"
        assert peak >= 2, f"never scaled up: {timeline}"
        deadline = time.time() + 120
        while time.time() < deadline:
            n = _replicas(serve)
            timeline.append((time.time() - t0, n))
            if n == 1:
                break
            time.sleep(1)
        assert timeline[-1][1] == 1, f"never scaled back down: {timeline}"
        print("replica timeline (s, replicas):", timeline[::4])
        # both moves were kvserve's policy deciding (not Serve's request-based default),
        # each logged as one structured line in the controller's log
        actions = {d["action"] for d in decisions(APP)}
        assert {"up", "down"} <= actions, f"policy decisions logged: {actions}"
    finally:
        serve.delete(APP)
