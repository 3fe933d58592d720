"""Serving on several Ray nodes (the ``multinode`` fixture: a head and two worker raylets on this
machine): replicas spread over nodes with ``max_replicas_per_node``, a tensor-parallel replica
whose two ranks sit on two nodes (``placement_group_strategy: STRICT_SPREAD``, gloo through a TCP
store) and a pipeline-parallel one whose two stages do, each giving the same greedy tokens as the
engine alone; ``/v1/models`` (for an admin key) and the metrics name the nodes.

Then, on the same cluster (its tests remove nodes, so they come last), nodes are lost:

* a worker node dies (its raylet killed, as a lost machine) while streams run on it: those
  streams end with an SSE error event and ``[DONE]`` (never a hang), requests sent afterwards are
  served by the replica on the surviving node, Serve rebuilds the lost replica on a remaining
  node, and ``/ready`` answers 200 again. The ingress sits on the head (``ingress_resources``);
* the node of one tensor-parallel rank dies mid-generation: the step fails instead of hanging.

Each Serve test stops Serve when it ends: the next one starts it with other options."""

import asyncio
import time

import httpx
import pytest
from helpers import free_port, spread_tp_llm, stream_completion

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):"]
ADMIN = "sk-kvserve-multinode-admin"  # /v1/models shows the replicas' nodes to admin keys only


def _reference(tiny_llama_path, text: bool = False) -> list:
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(str(tiny_llama_path), dtype="float32", max_model_len=256, num_kv_blocks=32)  # see spread_tp_llm
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].text if text else o.outputs[0].token_ids for o in outs]


@pytest.mark.thorough
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_ranks_on_two_nodes_equal_one_process(multinode, tiny_llama_path, tp, pp):
    """The engine with a RayWorkerGroup spread over two nodes (no Serve): two tensor ranks, or
    two pipeline stages (activations sent from node to node). Thorough profile: the fast one has
    the same ranks and stages, a rank per node, equal to one process, through Serve
    (:func:`test_serve_spreads_replicas_and_tp_ranks_over_nodes`)."""
    from kvserve.engine import SamplingParams

    llm, group = spread_tp_llm(tiny_llama_path, collective_timeout_s=60, tp=tp, pp=pp)
    try:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
        info = group.worker_info
        assert len({i["node_id"] for i in info}) == 2  # one rank per node
    finally:
        llm.engine.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == _reference(tiny_llama_path)


def test_serve_spreads_replicas_and_tp_ranks_over_nodes(multinode, tiny_llama_path):
    from ray import serve
    from ray.serve.context import _get_global_client

    from kvserve.deployments.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # float32: replicas, TP ranks and pipeline stages are compared with one process token for token
    common = {
        "model": str(tiny_llama_path),
        "dtype": "float32",
        "max_num_seqs": 4,
        "max_model_len": 256,
        "torch_num_threads": 1,
    }
    app = build_app(
        {
            "models": [
                {
                    **common,
                    "served_model_name": "tiny-spread",
                    "num_replicas": 2,
                    "max_replicas_per_node": 1,
                    "replica_cpus": 1,
                },
                {
                    **common,
                    "served_model_name": "tiny-tp",
                    "num_replicas": 1,
                    "tensor_parallel_size": 2,
                    "placement_group_strategy": "STRICT_SPREAD",
                    "replica_cpus": 0.5,
                    "worker_cpus": 0.5,
                    "collective_timeout_s": 60,
                },
                {
                    **common,
                    "served_model_name": "tiny-pp",
                    "num_replicas": 1,
                    "pipeline_parallel_size": 2,
                    "placement_group_strategy": "STRICT_SPREAD",
                    "replica_cpus": 0.5,
                    "worker_cpus": 0.5,
                    "collective_timeout_s": 60,
                },
            ],
            "ingress_cpus": 0.25,
            "admin_api_keys": [ADMIN],
        }
    )
    serve.run(app, name="multinode", route_prefix="/")
    try:
        details = _get_global_client().get_serve_details()
        deps = details["applications"]["multinode"]["deployments"]
        spread = [r["node_id"] for r in deps["LLMServer"]["replicas"]]
        assert len(spread) == 2 and len(set(spread)) == 2  # max_replicas_per_node 1: two nodes
        tp = serve.get_deployment_handle("LLMServer-tiny-tp", "multinode")
        workers = tp.server_info.remote().result().workers
        assert len({r["node_id"] for r in workers["ranks"]}) == 2  # STRICT_SPREAD: a rank per node
        pp = serve.get_deployment_handle("LLMServer-tiny-pp", "multinode").server_info.remote().result()
        assert pp.pipeline_parallel_size == 2 and len({r["node_id"] for r in pp.workers["ranks"]}) == 2
        ref = _reference(tiny_llama_path, text=True)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
            assert "replicas" not in c.get("/v1/models").json()["data"][0]  # placement: admin keys only
            admin = {"Authorization": f"Bearer {ADMIN}"}
            cards = {m["id"]: m for m in c.get("/v1/models", headers=admin).json()["data"]}
            assert {r["node_id"] for r in cards["tiny-spread"]["replicas"]} == set(spread)
            assert all(r["state"] == "RUNNING" and r["node_ip"] for r in cards["tiny-spread"]["replicas"])
            assert cards["tiny-pp"]["pipeline_parallel_size"] == 2 and cards["tiny-tp"]["tensor_parallel_size"] == 2
            for model in ("tiny-spread", "tiny-tp", "tiny-pp"):
                for prompt, want in zip(PROMPTS, ref):
                    r = c.post(
                        "/v1/completions",
                        json={
                            "model": model,
                            "prompt": prompt,
                            "max_tokens": 12,
                            "temperature": 0,
                            "ignore_eos": True,
                            "cache": False,
                        },
                    )
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == want, model
            metrics = c.get("/metrics").text
        nodes = {
            line.split('node_id="')[1].split('"')[0]
            for line in metrics.splitlines()
            if line.startswith("kvserve:replica_info") and 'model_name="tiny-spread"' in line
        }
        assert nodes == set(spread)
    finally:
        serve.delete("multinode")
        serve.shutdown()  # the node-failure test starts Serve with options of its own


# ---- lost nodes (last: they remove worker nodes) ------------------------------------------------
def test_streams_on_a_killed_node_end_cleanly_and_the_model_recovers(multinode, tiny_llama_path):
    from ray import serve
    from ray.serve.context import _get_global_client

    from kvserve.deployments.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port}, proxy_location="HeadOnly")
    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny",
            "num_replicas": 2,
            "max_replicas_per_node": 1,
            "replica_cpus": 1,
            "max_num_seqs": 16,
            "max_model_len": 2048,
            "torch_num_threads": 1,
            "ingress_cpus": 0.25,
            "ingress_resources": {"head": 0.01},
            "graceful_shutdown_timeout_s": 5,
            "stream_interval": 8,
        }
    )  # 8 tokens a chunk: less CPU
    serve.run(app, name="failover", route_prefix="/")
    try:

        def replicas():
            deps = _get_global_client().get_serve_details()["applications"]["failover"]["deployments"]
            return deps["LLMServer"]["replicas"]

        by_node = {r["node_id"]: r for r in replicas()}
        victim = next(n for n, w in multinode.workers.items() if w.node_id in by_node)
        victim_id = multinode.workers[victim].node_id

        async def main():
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=120) as c:
                started = asyncio.Semaphore(0)
                streams = [
                    asyncio.create_task(
                        stream_completion(
                            c,
                            {
                                "model": "tiny",
                                "prompt": f"story {k}:",
                                "max_tokens": 600,
                                "temperature": 0,
                                "ignore_eos": True,
                                "cache": False,
                            },
                            started,
                        )
                    )
                    for k in range(12)
                ]
                for _ in streams:  # every stream has its first tokens (600 to go: they run for a while)
                    await asyncio.wait_for(started.acquire(), 120)
                t_kill = time.monotonic()
                multinode.cluster.remove_node(multinode.workers[victim], allow_graceful=False)
                ended = await asyncio.wait_for(asyncio.gather(*streams), 120)  # never a hang
                after = []
                for k in range(6):  # sent right after the loss: the surviving replica serves them
                    r = await c.post(
                        "/v1/completions",
                        json={"model": "tiny", "prompt": f"after {k}", "max_tokens": 4, "cache": False},
                    )
                    after.append(r.status_code)
                ready_s = None
                while time.monotonic() - t_kill < 120:
                    if (await c.get("/ready")).status_code == 200 and len(
                        {r["node_id"] for r in replicas() if r["state"] == "RUNNING"} - {victim_id}
                    ) == 2:
                        ready_s = time.monotonic() - t_kill
                        break
                    await asyncio.sleep(1.0)
                return ended, after, ready_s

        ended, after, ready_s = asyncio.run(main())
    finally:
        serve.delete("failover")
        serve.shutdown()
    assert all(s["status"] == 200 and s["done"] for s in ended), ended  # every stream ended with [DONE]
    cut = [s for s in ended if s["error"] is not None]
    assert cut, "no stream ran on the killed node"
    assert all(s["error"].get("message") and "Traceback" not in s["error"]["message"] for s in cut)
    assert all(s["error"] is None for s in ended if s not in cut) and len(cut) < len(ended)
    assert after == [200] * 6, after
    assert ready_s is not None, "the lost replica was not rebuilt on a remaining node within 120 s"
    print(
        f"\nrecovery: {len(cut)} of {len(ended)} streams cut; replica rebuilt and /ready 200 {ready_s:.1f} s "
        "after the node died"
    )


def test_a_tp_rank_lost_with_its_node_fails_the_step_instead_of_hanging(multinode, tiny_llama_path):
    """Tensor parallelism over two nodes (STRICT_SPREAD); the node of one rank dies mid-generation:
    the other rank's collective fails (the peer's socket closes; a silent peer would hit
    ``collective_timeout_s``) and the engine step raises, so the replica is replaced instead of
    hanging its requests (the pytest timeout would catch a hang)."""
    import threading

    from kvserve.engine import SamplingParams
    from kvserve.engine.step_isolation import StepFailedError

    spare = multinode.cluster.add_node(num_cpus=2)  # the first test took a worker node
    multinode.cluster.wait_for_nodes()
    llm, group = spread_tp_llm(tiny_llama_path, collective_timeout_s=20, num_kv_blocks=64)
    nodes = {i["node_id"] for i in group.worker_info}
    assert len(nodes) == 2
    alive = {w.node_id: w for w in [*multinode.workers.values(), spare]}
    victim = next(alive[n] for n in nodes if n in alive and n != multinode.head_id)
    killer = threading.Timer(1.0, multinode.cluster.remove_node, args=(victim,), kwargs={"allow_graceful": False})
    killer.start()
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with pytest.raises(StepFailedError):
        for _ in range(1000):  # generation keeps the ranks in collectives until the node dies
            llm.generate(["hello"] * 8, params, use_tqdm=False)
    killer.join()
    group.shutdown()
