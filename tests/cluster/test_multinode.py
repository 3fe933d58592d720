"""Serving on several Ray nodes (the ``multinode`` fixture: a head and two worker raylets on this
machine): replicas spread over nodes with ``max_replicas_per_node``, a tensor-parallel replica
whose two ranks sit on two nodes (``placement_group_strategy: STRICT_SPREAD``, gloo through a TCP
store) and a pipeline-parallel one whose two stages do, each giving the same greedy tokens as the
engine alone; ``/v1/models`` (for an admin key) and the metrics name the nodes."""
import httpx
import pytest
from helpers import free_port, spread_tp_llm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):"]
ADMIN = "sk-kvserve-multinode-admin"  # /v1/models shows the replicas' nodes to admin keys only


def _reference(tiny_llama_path, text: bool = False) -> list:
    from engine import LLM, SamplingParams

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
    from engine import SamplingParams

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

    from deployments.app import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    # float32: replicas, TP ranks and pipeline stages are compared with one process token for token
    common = {"model": str(tiny_llama_path), "dtype": "float32", "max_num_seqs": 4, "max_model_len": 256, "torch_num_threads": 1}
    app = build_app({"models": [
        {**common, "served_model_name": "tiny-spread", "num_replicas": 2, "max_replicas_per_node": 1,
         "replica_cpus": 1},
        {**common, "served_model_name": "tiny-tp", "num_replicas": 1, "tensor_parallel_size": 2,
         "placement_group_strategy": "STRICT_SPREAD", "replica_cpus": 0.5, "worker_cpus": 0.5,
         "collective_timeout_s": 60},
        {**common, "served_model_name": "tiny-pp", "num_replicas": 1, "pipeline_parallel_size": 2,
         "placement_group_strategy": "STRICT_SPREAD", "replica_cpus": 0.5, "worker_cpus": 0.5,
         "collective_timeout_s": 60},
    ], "ingress_cpus": 0.25, "admin_api_keys": [ADMIN]})
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
                    r = c.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 12,
                                                        "temperature": 0, "ignore_eos": True, "cache": False})
                    assert r.status_code == 200, r.text
                    assert r.json()["choices"][0]["text"] == want, model
            metrics = c.get("/metrics").text
        nodes = {line.split('node_id="')[1].split('"')[0] for line in metrics.splitlines()
                 if line.startswith("kvserve:replica_info") and 'model_name="tiny-spread"' in line}
        assert nodes == set(spread)
    finally:
        serve.delete("multinode")
