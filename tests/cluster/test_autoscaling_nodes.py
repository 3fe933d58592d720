"""kvserve's autoscaling policy makes Ray's autoscaler add and remove nodes (issue 29, part 4).

Ray's autoscaler runs over its fake multi-node provider on this machine
(``tests/autoscaling_cluster.py``): a head that holds the ingress and no replica, and a node type
``type-a`` (1 CPU and the custom resource ``node-type-a``, 0..2 nodes, idle timeout 6 s). The
tiny random-weight model's replicas each need a ``node-type-a`` (Serve's per-deployment
``ray_actor_options`` in the deploy config), 1..2 replicas, kvserve's policy with short delays.

* Deploying starts the first ``type-a`` node (the autoscaler) and the first replica on it.
* Concurrent streamed completions overload that replica (2 running, 1 queued, the rest 429 and
  sent again): the policy decides to scale up, Ray's autoscaler starts a second node, the
  second replica lands on it and streams a request to ``[DONE]``.
* With the load stopped the policy scales down to one replica and the autoscaler removes the
  node left idle. No streamed request that was admitted failed.

Token auth is on (``tests/cluster/conftest.py``); the module stops every process its cluster
started. Timings are not asserted (the benchmark measures them: ``benchmarks/multinode.py
--parts scale-up``); every wait is bounded.
"""

import pytest
from autoscaling_cluster import (
    HEAD_RESOURCES,
    NODE_TYPE,
    FakeAutoscalingCluster,
    StreamLoad,
    alive_nodes,
    decisions,
    deploy,
    replicas,
    serve_config,
    served_request_ids,
    target_replicas,
    wait_for,
    worker_node_types,
)
from helpers import free_port, shutdown_ray_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

APP = "as-nodes"


@pytest.fixture(scope="module")
def fake_autoscaling(own_ray):
    """A :class:`FakeAutoscalingCluster` (no worker node yet) with this process connected;
    yields it and the head's node id; afterwards Serve, the driver and every process of the
    cluster are stopped, which the teardown checks. A Ray instance already up in this process is
    shut down or makes the module fail (``own_ray`` in ``tests/cluster/conftest.py``)."""
    import ray

    cluster = FakeAutoscalingCluster(HEAD_RESOURCES, worker_node_types(max_workers=2), idle_timeout_minutes=0.1)
    try:
        cluster.start()
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster, ray.get_runtime_context().get_node_id()
    finally:
        shutdown_ray_cluster(cluster)
        assert cluster.pids() == [], "processes of the fake cluster left running"


def _running(app: str) -> dict[str, str]:
    """Running replicas: replica id -> node id."""
    return {r["replica_id"]: r["node_id"] for r in replicas(app) if r["state"] == "RUNNING"}


def test_scale_up_adds_a_node_and_scale_down_removes_it(fake_autoscaling, tiny_llama_path):
    cluster, head_id = fake_autoscaling
    port = free_port()
    deploy(serve_config(str(tiny_llama_path), port, APP), timeout_s=300)
    first = _running(APP)
    assert len(first) == 1
    [(first_replica, first_node)] = first.items()
    nodes = alive_nodes()
    assert set(nodes) == {head_id, first_node}  # the autoscaler started one node, for the first replica
    assert nodes[first_node].get(NODE_TYPE) == 1 and NODE_TYPE not in nodes[head_id]

    load = StreamLoad(f"http://127.0.0.1:{port}", concurrency=12, max_tokens=64).start()
    try:
        # the policy decides, Serve targets 2, the autoscaler starts a node, the replica runs there
        wait_for("a second replica running", lambda: len(_running(APP)) == 2, 300)
        second_replica, second_node = next((r, n) for r, n in _running(APP).items() if r != first_replica)
        nodes = alive_nodes()
        assert second_node not in (head_id, first_node) and set(nodes) == {head_id, first_node, second_node}
        assert nodes[second_node].get(NODE_TYPE) == 1

        def served_there():
            ids = served_request_ids(APP, second_replica)
            return [r for r in list(load.records) if r["request_id"] in ids and r["status"] == 200]

        served = wait_for("a streamed request served by the new replica", served_there, 120)
    finally:
        load.stop()
    assert any(r["done"] and r["error"] is None and r["t_first"] is not None for r in served), served
    ups = [d for d in decisions(APP) if d["action"] == "up"]
    assert ups and ups[0]["desired"] == 2, "kvserve's policy logged no scale-up decision"

    # no load: the policy scales down to one replica, the autoscaler removes the idle node
    wait_for("the policy back at one replica", lambda: target_replicas(APP) == 1 and len(replicas(APP)) == 1, 240)
    [(kept_replica, kept_node)] = wait_for("one replica running", lambda: _running(APP), 60).items()
    assert kept_node in (first_node, second_node)
    wait_for("the idle node removed", lambda: set(alive_nodes()) == {head_id, kept_node}, 180)
    assert any(d["action"] == "down" for d in decisions(APP)), "kvserve's policy logged no scale-down decision"

    admitted = [r for r in load.records if r["status"] == 200]
    assert admitted and all(r["done"] and r["error"] is None for r in admitted), [
        r for r in admitted if not r["done"] or r["error"] is not None
    ][:3]
    assert {r["status"] for r in load.records} <= {200, 429}, {r["status"] for r in load.records}
    # the bounded queue refused some: the load did overload the replica (tests/e2e's single-node
    # scale-up and scale-down, the same policy through Serve, is the thorough profile's)
    assert len(admitted) < len(load.records), "the bounded queue refused nothing: the load did not overload"
    print(
        f"\n{len(admitted)} streams served, {len(load.records) - len(admitted)} refused (429, sent again); "
        f"replicas {first_replica} -> +{second_replica} -> {kept_replica} left"
    )
