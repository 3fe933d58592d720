"""Ray's autoscaler over its fake multi-node provider, on this machine: what the tests and the
benchmark use to see kvserve's scale-ups add Ray nodes (``ray.cluster_utils.AutoscalingCluster``).

The head is started with ``ray start --head --autoscaling-config``; its monitor process runs Ray's
real (v1) autoscaler over ``FakeMultiNodeProvider``, which "launches" a node of a type by starting a
raylet with that type's resources on this machine (its node id ``ffff...0000<n>``) and
"terminates" one by stopping its processes. Everything above the provider is Ray's: pending
resource demands start nodes, nodes idle for ``idle_timeout_minutes`` are removed.

:class:`FakeAutoscalingCluster` is ``AutoscalingCluster`` with three changes:

* The config is written out in full. The installed Ray wheel lacks
  ``autoscaler/_private/fake_multi_node/example.yaml``, which ``AutoscalingCluster`` reads as its
  base and the monitor reads as the ``fake_multinode`` provider's defaults; the same provider
  class is named as an ``external`` provider module instead.
* ``AutoscalingCluster.start()`` and ``shutdown()`` run ``ray stop --force``, which stops every Ray
  process of the user on the machine (another test session's cluster too). This cluster runs in
  a temp dir, with a GCS port, client-server port and dashboard-agent port of its own, and
  :meth:`FakeAutoscalingCluster.shutdown` ends only the processes it started: each inherits an
  environment marker (:data:`MARKER_VAR`), and they are signalled by pid.
* Token auth and loopback as ``kvserve serve`` runs Ray: the caller sets the token environment
  (``kvserve.cluster.ray_auth.ensure_local_auth``; ``tests/cluster/conftest.py`` does at import), which
  every Ray process of the cluster inherits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from helpers import free_port, stream_completion
from ray.cluster_utils import AutoscalingCluster

#: Ray's fake multi-node provider, loaded as an "external" provider module.
FAKE_PROVIDER = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
#: Every process of one cluster carries this variable (its value: the cluster's id).
MARKER_VAR = "KVSERVE_FAKE_CLUSTER_ID"


class FakeAutoscalingCluster(AutoscalingCluster):
    """A head raylet (``head_resources``: ``CPU``, ``object_store_memory`` in bytes, custom
    resources) and Ray's autoscaler launching ``worker_node_types`` (autoscaler node types:
    ``{"name": {"resources": {...}, "node_config": {}, "min_workers": 0, "max_workers": 2}}``).
    ``idle_timeout_minutes`` and other top-level cluster-config keys go in ``config_kwargs``.

    ``start()`` returns once the head runs (``address`` is its GCS); connect with
    ``ray.init(address=cluster.address)``. ``shutdown()`` ends every process the cluster started.
    """

    def __init__(self, head_resources: dict, worker_node_types: dict, **config_kwargs):
        self.port = free_port()
        self.cluster_id = uuid.uuid4().hex[:12]
        # short: Ray's unix sockets live under it (session_<date>_<pid>/sockets/plasma_store, < 108 bytes)
        self.temp_dir = tempfile.mkdtemp(prefix="kvs-as-", dir="/tmp")
        super().__init__(dict(head_resources), worker_node_types, **config_kwargs)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        """The fake provider's ``example.yaml`` written out, with the head and ``worker_node_types``.

        Raises:
            ValueError: ``autoscaler_v2`` (v2 needs the provider's fixed head node id; not used here).
        """
        if autoscaler_v2:
            raise ValueError("FakeAutoscalingCluster runs the v1 autoscaler")
        types = {name: {"node_config": {}, "min_workers": 0, **spec} for name, spec in worker_node_types.items()}
        types["ray.head.default"] = {"resources": dict(head_resources), "node_config": {}, "max_workers": 0}
        config = {
            "cluster_name": f"kvserve-fake-{self.cluster_id}",
            "max_workers": sum(spec.get("max_workers", 0) for spec in worker_node_types.values()),
            "provider": {
                "type": "external",
                "module": FAKE_PROVIDER,
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": self.address,
            },
            "available_node_types": types,
            "head_node_type": "ray.head.default",
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": 0.1,
            "auth": {},
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }
        config.update(config_kwargs)
        return config

    def start(self, _system_config=None, override_env=None, timeout_s: float = 120.0):
        """``ray start --head`` with the autoscaling config (the monitor's update period 1 s).

        Raises:
            subprocess.CalledProcessError / TimeoutExpired: ``ray start`` failed or hung.
        """
        config_path = os.path.join(self.temp_dir, "autoscaling.json")
        with open(config_path, "w") as f:
            json.dump(self._config, f)
        res = dict(self._head_resources)
        cmd = [
            os.path.join(os.path.dirname(sys.executable), "ray"),
            "start",
            "--head",
            f"--port={self.port}",
            "--node-ip-address=127.0.0.1",
            f"--temp-dir={self.temp_dir}",
            f"--autoscaling-config={config_path}",
            "--include-dashboard=false",
            "--disable-usage-stats",
            f"--ray-client-server-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--num-cpus={int(res.pop('CPU', 0))}",
        ]
        if "object_store_memory" in res:
            cmd.append(f"--object-store-memory={int(res.pop('object_store_memory'))}")
        if res:
            cmd.append(f"--resources={json.dumps(res)}")
        if _system_config is not None:
            cmd.append(f"--system-config={json.dumps(_system_config, separators=(',', ':'))}")
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        env.update({"AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", MARKER_VAR: self.cluster_id})
        env.update(override_env or {})
        subprocess.run(cmd, env=env, check=True, timeout=timeout_s, stdout=subprocess.DEVNULL)

    def pids(self) -> list[int]:
        """The live processes this cluster started (its GCS, raylets, monitor, agents, workers)."""
        import psutil

        want = f"{MARKER_VAR}={self.cluster_id}".encode()
        out = []
        for pid in psutil.pids():
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if pid != os.getpid() and want in f.read().split(b"\0"):
                        out.append(pid)
            except OSError:  # gone, or another user's
                continue
        return out

    def shutdown(self, timeout_s: float = 5.0) -> list[int]:
        """End this cluster's processes as ``ray stop`` does, but only these: SIGTERM to each (the
        monitor first, so it launches no node meanwhile), SIGKILL to those left after
        ``timeout_s`` (the GCS and the monitor take longer to exit; ``ray stop --force``, which
        ``AutoscalingCluster.shutdown`` runs, sends SIGKILL at once); remove the temp dir.
        Disconnect the driver (``ray.shutdown()``) first. Returns the pids that needed SIGKILL."""
        import psutil

        procs = _processes(self.pids())
        procs.sort(key=lambda p: 0 if any("monitor.py" in a for a in _cmdline(p)) else 1)
        _signal(procs, signal.SIGTERM)
        psutil.wait_procs(procs, timeout=timeout_s)
        late = _processes(self.pids())  # still there, or started meanwhile (a worker a raylet was spawning)
        _signal(late, signal.SIGKILL)
        psutil.wait_procs(late, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return [p.pid for p in late]


def _processes(pids: list[int]) -> list:
    import psutil

    out = []
    for pid in pids:
        try:
            out.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return out


def _signal(procs: list, sig: int) -> None:
    import psutil

    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            continue


def _cmdline(p) -> list[str]:
    import psutil

    try:
        return p.cmdline()
    except psutil.Error:
        return []


def wait_for(what: str, check, timeout_s: float, interval_s: float = 0.5):
    """Call ``check()`` every ``interval_s`` until it returns something truthy; return that.

    Raises:
        TimeoutError: not within ``timeout_s`` (the message names ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(interval_s)


# ---- a kvserve model on it ---------------------------------------------------------------------
#: The custom resource of the worker node type; the model's replicas require one each.
NODE_TYPE = "node-type-a"
#: The head: the ingress (0.25 CPU + ``head``), Serve's controller and proxy (0 CPU); no room for a
#: replica (1 CPU + ``node-type-a``).
HEAD_RESOURCES = {"CPU": 1, "head": 1, "object_store_memory": 100 * 2**20}


def worker_node_types(max_workers: int = 2) -> dict:
    """One autoscaler node type, ``type-a``: 1 CPU and :data:`NODE_TYPE`, 0..``max_workers`` nodes."""
    return {
        "type-a": {
            "resources": {"CPU": 1, NODE_TYPE: 1, "object_store_memory": 100 * 2**20},
            "node_config": {},
            "min_workers": 0,
            "max_workers": max_workers,
        }
    }


#: Policy knobs that let a test see both moves within a minute or two: demand above one replica's
#: queue target (requests waiting, or refused in the last 10 s) for 1 s scales up (no queue-drain
#: cap); a scale-down waits 10 s since the last scale event.
FAST_KNOBS = {
    "target_queue_per_replica": 1,
    "queue_drain_s": 0,
    "upscale_smoothing_s": 1,
    "upscale_cooldown_s": 1,
    "downscale_smoothing_s": 2,
    "downscale_cooldown_s": 10,
    "serve_downscale_delay_s": 1,
    "serve_look_back_period_s": 2,
    "serve_metrics_interval_s": 0.5,
}


def serve_config(
    model_path: str, port: int, app: str, min_replicas: int = 1, max_replicas: int = 2, knobs: dict | None = None
) -> dict:
    """A Serve deploy config (``serve deploy``'s schema) of kvserve's app serving the tiny model
    as ``tiny``: the ingress pinned to the head (``ingress_resources``), ``LLMServer`` autoscaled
    by kvserve's policy between ``min_replicas`` and ``max_replicas``, each replica needing one
    :data:`NODE_TYPE` (the model's ``replica_resources``)."""
    args = {
        "model": model_path,
        "served_model_name": "tiny",
        "dtype": "float32",
        "max_num_seqs": 2,
        "max_queued_requests": 1,
        "max_model_len": 512,
        "num_kv_blocks": 64,
        "torch_num_threads": 1,
        "replica_cpus": 1,
        "replica_resources": {NODE_TYPE: 1},
        "graceful_shutdown_timeout_s": 5,
        "min_replicas": min_replicas,
        "max_replicas": max_replicas,
        "autoscaling": dict(FAST_KNOBS if knobs is None else knobs),
        "ingress_cpus": 0.25,
        "ingress_resources": {"head": 0.01},
    }
    return {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": port},
        "applications": [
            {"name": app, "route_prefix": "/", "import_path": "kvserve.deployments.app:build_app", "args": args}
        ],
    }


def deploy(config: dict, timeout_s: float = 240.0) -> None:
    """Start Serve (the config's proxy and HTTP options) and deploy ``config``'s applications as
    ``serve deploy`` does; return once they are RUNNING.

    Raises:
        TimeoutError: not RUNNING within ``timeout_s`` (the message has Serve's status).
        RuntimeError: an application's deploy failed.
    """
    from ray import serve
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    serve.start(http_options=config["http_options"], proxy_location=config["proxy_location"])
    client = _get_global_client()
    client.deploy_apps(ServeDeploySchema.model_validate(config))
    names = [a["name"] for a in config["applications"]]

    def running():
        apps = serve.status().applications
        for name in names:
            st = apps.get(name)
            if st is not None and str(st.status).endswith("DEPLOY_FAILED"):
                raise RuntimeError(f"{name}: {st.message}")
        return all(n in apps and str(apps[n].status).endswith("RUNNING") for n in names)

    try:
        wait_for("the application RUNNING", running, timeout_s, 1.0)
    except TimeoutError as e:
        raise TimeoutError(f"{e}: {serve.status()}") from None


def replicas(app: str, deployment: str = "LLMServer") -> list[dict]:
    """Serve's replicas of ``deployment``: ``replica_id``, ``state`` (``RUNNING``, ``STARTING``,
    ``PENDING_MIGRATION``...), ``node_id`` (None until placed), ``start_time_s``."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    return details["applications"][app]["deployments"][deployment]["replicas"]


def target_replicas(app: str, deployment: str = "LLMServer") -> int:
    """Serve's current target replica count of ``deployment``."""
    from ray.serve.context import _get_global_client

    details = _get_global_client().get_serve_details()
    return details["applications"][app]["deployments"][deployment]["target_num_replicas"]


def alive_nodes() -> dict[str, dict]:
    """Ray's alive nodes by node id: their ``Resources``."""
    import ray

    return {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}


def decisions(app: str) -> list[dict]:
    """kvserve's policy decisions for ``app`` (``"event": "kvserve_autoscaling_decision"`` lines
    of the Serve controller's log; ``time`` is the controller's ``time.time()``), oldest first."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    out = []
    for f in logs.glob("controller_*.log"):
        for line in f.read_text(errors="replace").splitlines():
            if '"event": "kvserve_autoscaling_decision"' in line:
                rec = json.loads(line[line.index("{") :])
                if rec.get("application") == app:
                    out.append(rec)
    return sorted(out, key=lambda r: r["time"])


def served_request_ids(app: str, replica_id: str, deployment: str = "LLMServer") -> set[str]:
    """Request ids (Serve's ``x-request-id``, which the ingress's call to the model carries) of the
    ``stream`` calls that replica ended (``CALL stream OK`` lines of its Serve log; a request the
    replica refused ends so too: match them with a client's 200 responses)."""
    import ray

    path = (
        Path(ray._private.worker._global_node.get_logs_dir_path())
        / "serve"
        / (f"replica_{app}_{deployment}_{replica_id}.log")
    )
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return set()
    out = set()
    for line in text.splitlines():
        head, sep, tail = line.partition(" -- CALL stream OK")
        if sep and head.split(f" {replica_id} ", 1)[1:]:
            out.add(head.split(f" {replica_id} ", 1)[1].strip())
    return out


class StreamLoad:
    """``concurrency`` clients, each sending streamed completions of ``max_tokens`` tokens one
    after another (a refused one, 429, again after 0.2 s) until :meth:`stop`; in a thread of its
    own. ``records``: per request ``request_id`` (Serve's ``x-request-id``), ``status``,
    ``t_sent`` / ``t_first`` (``time.time()`` at the send and at the first token, None without
    one), ``done`` ([DONE] seen), ``error`` (an SSE error event)."""

    def __init__(self, base_url: str, concurrency: int = 12, max_tokens: int = 64, model: str = "tiny"):
        import threading

        self.base_url, self.concurrency, self.max_tokens, self.model = base_url, concurrency, max_tokens, model
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True)

    def start(self) -> "StreamLoad":
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 120.0) -> None:
        """Stop sending; wait (up to ``timeout_s``) for the requests in flight to end.

        Raises:
            TimeoutError: the clients did not end in time.
        """
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"the load's requests did not end within {timeout_s:.0f} s")

    def _main(self) -> None:
        import asyncio

        asyncio.run(self._run())

    async def _run(self) -> None:
        import asyncio

        import httpx

        async with httpx.AsyncClient(base_url=self.base_url, timeout=120) as c:
            await asyncio.gather(*(self._client(c, k) for k in range(self.concurrency)))

    async def _client(self, c, k: int) -> None:
        import asyncio

        n = 0
        while not self._stop.is_set():
            n += 1
            rec = {
                "request_id": None,
                "status": None,
                "t_sent": time.time(),
                "t_first": None,
                "done": False,
                "error": None,
            }
            body = {
                "model": self.model,
                "prompt": f"client {k} request {n}:",
                "max_tokens": self.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "cache": False,
            }
            try:
                rec.update(await stream_completion(c, body))
            except Exception as e:  # a connection problem is a record, not a crash of the load
                rec["error"] = {"message": f"{type(e).__name__}: {e}"}
            self.records.append(rec)
            if rec["status"] == 429:
                await asyncio.sleep(0.2)
