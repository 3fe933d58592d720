"""Helpers of test_ray_auth.py: the attacking processes (a Ray driver that tries to join and
run a task or get a Serve handle, raw gRPC calls to the GCS and to Serve replicas, each with no,
a wrong or the right token), their environment, and where this machine's processes listen.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvserve.cluster.ray_auth import LOOPBACK_VAR

ATTACKER = r"""
import os, sys, time
from pathlib import Path
import ray
marker = Path(sys.argv[2])
try:
    ray.init(address=sys.argv[1], log_to_driver=False)

    @ray.remote(num_cpus=0)  # num_cpus=0: runs even when the app holds every CPU
    def pwn(path):
        Path(path).write_text(f"code ran as uid {os.getuid()}")
        return "RAN"

    print("TASK", ray.get(pwn.remote(str(marker)), timeout=60), flush=True)
    if len(sys.argv) > 3:  # a Serve handle, as the docs' Python-handle example (docs/serving.md) gets one
        from ray import serve
        llm = serve.get_deployment_handle("LLMServer", app_name="kvserve")
        out = llm.complete.remote("The capital of France is", {"max_tokens": 4, "temperature": 0}).result(timeout_s=120)
        print("SERVE", repr(out.text), flush=True)
except BaseException as e:
    print("REFUSED", type(e).__name__, str(e)[:500].replace("\n", " | "), flush=True)
    sys.exit(3)
"""

RAW_GRPC = r"""
import sys, grpc
from ray.core.generated import gcs_service_pb2 as gcs, gcs_service_pb2_grpc as gcs_grpc
from ray.serve.generated import serve_pb2, serve_pb2_grpc
gcs_addr, token, replicas = sys.argv[1], sys.argv[2], sys.argv[3:]
for label, md in (("none", []), ("wrong", [("authorization", "Bearer " + "0" * 64)]),
                  ("right", [("authorization", "Bearer " + token)])):
    calls = [("gcs.GetAllNodeInfo", gcs_addr, lambda ch: gcs_grpc.NodeInfoGcsServiceStub(ch).GetAllNodeInfo(
                 gcs.GetAllNodeInfoRequest(), metadata=md, timeout=20)),
             ("gcs.InternalKVKeys", gcs_addr, lambda ch: gcs_grpc.InternalKVGcsServiceStub(ch).InternalKVKeys(
                 gcs.InternalKVKeysRequest(prefix=b""), metadata=md, timeout=20))]
    # a Serve replica's inter-deployment server unpickles what it is sent: with auth off, that is code execution
    calls += [("replica.HandleRequest", r, lambda ch: serve_pb2_grpc.ASGIServiceStub(ch).HandleRequest(
                  serve_pb2.ASGIRequest(), metadata=md, timeout=20)) for r in replicas]
    for name, addr, call in calls:
        with grpc.insecure_channel(addr) as ch:
            try:
                call(ch)
                print(label, name, addr, "OK", flush=True)
            except grpc.RpcError as e:
                print(label, name, addr, e.code().name, (e.details() or "")[:120].replace("\n", " "), flush=True)
"""


def _attacker_env(home: Path, **extra) -> dict:
    """This machine's other user: no RAY_AUTH_TOKEN*, an empty HOME (no ~/.ray/auth_token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "PYTHONPATH"))}
    # the session's Ray listens on 127.0.0.1; without this Ray rewrites 127.0.0.1 to the
    # machine's network address (where nothing listens) and the attempt proves nothing
    env[LOOPBACK_VAR] = "0"
    env["HOME"] = str(home)
    env.update(extra)
    return env


def _spawn(code: str, args: list[str], env: dict, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        env=env,
        cwd=cwd,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _collect(procs: dict[str, subprocess.Popen], timeout: float = 240) -> dict[str, tuple[int, str]]:
    out, deadline = {}, time.time() + timeout
    for name, p in procs.items():
        try:
            text, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            text, _ = p.communicate()
            pytest.fail(f"{name}: no answer within {timeout:.0f} s (it must fail, not hang):\n{text[-3000:]}")
        out[name] = (p.returncode, text)
    return out


def _listeners(pids) -> list[tuple[int, str, str, int]]:
    """(pid, process title, ip, port) of the TCP sockets these processes listen on."""
    import psutil

    rows = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            title = " ".join(proc.cmdline())[:80] or proc.name()
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        rows += [(pid, title, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return rows


def _ray_pids() -> list[int]:
    import psutil

    me = psutil.Process()
    return [me.pid] + [c.pid for c in me.children(recursive=True)]


def _is_loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")


def _this_machines_address() -> str | None:
    """A non-loopback address of this machine (the one a route out would use), if any."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.123", 9))  # no packet is sent
            ip = s.getsockname()[0]
        except OSError:
            return None
    return None if ip.startswith("127.") else ip
