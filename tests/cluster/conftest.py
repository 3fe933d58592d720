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


#: Fixtures that hold a Ray instance for the rest of the session once set up (torn down when
#: the session ends): ``tests/e2e/conftest.py``'s ``ray_session`` (``serve_app`` uses it).
SESSION_RAY_FIXTURES = ("ray_session",)


@pytest.fixture(scope="module")
def own_ray(request):
    """This module's tests start a Ray cluster of their own, and a process connects to one Ray
    at a time. If this process is already connected to a Ray instance:

    * when a test that ran earlier in this session set up a session-scoped Ray fixture
      (:data:`SESSION_RAY_FIXTURES`), that fixture owns the instance until the session ends
      (its teardown, and any later test using it, still need it): fail, naming the fix;
    * otherwise nothing of this session holds it (e.g. a library call started one
      implicitly): shut it down cleanly (Serve, then Ray) and go on; a later ``ray_session``
      starts its own.

    Never a skip: ``pytest tests/e2e tests/cluster`` used to skip every cluster test silently.
    """
    import ray

    if not ray.is_initialized():
        return
    items = request.session.items
    here = next((i for i, item in enumerate(items) if getattr(item, "module", None) is request.module),
                len(items))
    holders = [item.nodeid for item in items[:here] if set(SESSION_RAY_FIXTURES) & set(item.fixturenames)]
    if holders:
        pytest.fail(f"{request.module.__name__} starts a Ray cluster of its own, but this pytest session is "
                    f"already connected to the Ray instance of tests/e2e/conftest.py's session fixture "
                    f"(set up for {holders[0]}, held until the session ends). Run tests/cluster first or alone: "
                    f"`pytest tests/cluster tests/e2e` or `make test` (tests/ in path order: tests/cluster "
                    f"before tests/e2e), or `pytest tests/cluster` on its own.", pytrace=False)
    from ray import serve

    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="module")
def multinode(own_ray):
    """A head (2 logical CPUs, resource ``head``) and the :data:`WORKERS` nodes; yields the
    ``Cluster``, its worker ``Node`` objects by name and the head's node id; torn down after the
    module (Ray disconnected, every raylet stopped). A Ray instance already up in this process
    is shut down or makes the module fail (:func:`own_ray`), never a skip."""
    import ray
    from helpers import shutdown_ray_cluster
    from ray.cluster_utils import Cluster

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

