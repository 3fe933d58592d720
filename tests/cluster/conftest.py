"""A Ray cluster of several nodes on this one machine, as Ray tests its own multi-node behaviour
(``ray.cluster_utils.Cluster``: a head raylet and worker raylets, each with its own logical
CPUs and a custom resource standing in for a node type), with token authentication on and the
nodes on 127.0.0.1, as ``kvserve serve`` runs Ray."""
import atexit
import os
import shutil
import tempfile
from types import SimpleNamespace

if "RAY_AUTH_TOKEN_PATH" not in os.environ:  # the e2e conftest may have set the session's token already
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.pop("RAY_AUTH_TOKEN", None)
    _DIR = tempfile.mkdtemp(prefix="kvserve-ray-auth-")
    atexit.register(shutil.rmtree, _DIR, True)
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(_DIR, "auth_token")
    from cluster.ray_auth import ensure_local_auth

    ensure_local_auth()
os.environ.setdefault("RAY_worker_niceness", "0")

import pytest  # noqa: E402

#: The worker nodes: name -> (logical CPUs, custom resource standing in for its node type).
WORKERS = {"a": (3, {"node-type-a": 1}), "b": (3, {"node-type-b": 1})}


@pytest.fixture(scope="module")
def multinode():
    """A head (2 logical CPUs, resource ``head``) and the :data:`WORKERS` nodes; yields the
    ``Cluster``, its worker ``Node`` objects by name and the head's node id; torn down after the
    module (Ray disconnected, every raylet stopped)."""
    import ray
    from helpers import shutdown_ray_cluster
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        pytest.skip("this pytest session already runs a one-node Ray instance (run tests/cluster first or alone)")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1},
                                                           "include_dashboard": False})
    workers = {name: cluster.add_node(num_cpus=cpus, resources=res) for name, (cpus, res) in WORKERS.items()}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    head_id = ray.get_runtime_context().get_node_id()
    try:
        yield SimpleNamespace(cluster=cluster, workers=workers, head_id=head_id,
                              worker_ids={n: w.node_id for n, w in workers.items()})
    finally:
        shutdown_ray_cluster(cluster)

