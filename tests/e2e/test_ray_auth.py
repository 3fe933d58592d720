"""Ray's control plane is closed to whoever lacks the cluster's token.

The unit tests check the environment `kvserve serve` sets up before it starts Ray
(kvserve/cluster/ray_auth.py). The slow tests play the attacker against the session's Ray (token auth
on, ports on 127.0.0.1, as `kvserve serve` runs it): a separate process on this machine,
without the token, tries to join the cluster and run a task, and calls the GCS and a Serve
replica over raw gRPC; the same process with the token succeeds. One test runs `kvserve serve`
itself and checks the token file it writes and where its ports listen.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _ray_auth_helpers import (
    ATTACKER,
    RAW_GRPC,
    _attacker_env,
    _collect,
    _is_loopback,
    _listeners,
    _ray_pids,
    _spawn,
    _this_machines_address,
)
from cli_process import start_kvserve
from helpers import DONE, HTTP, free_port, iter_sse

from kvserve.cluster.ray_auth import (
    LOOPBACK_VAR,
    TOKEN_PATH_VAR,
    TOKEN_VAR,
    ensure_join_auth,
    ensure_local_auth,
    is_loopback_address,
    join_failure_message,
)

ROOT = Path(__file__).resolve().parents[2]
RAY_CLI = Path(sys.executable).parent / "ray"


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


# ---- the environment `kvserve serve` sets up (no Ray started) ---------------------------------
def test_local_auth_turns_token_on_and_writes_a_private_token(tmp_path):
    env = {"HOME": str(tmp_path)}
    setup = ensure_local_auth(env, warn=pytest.fail)
    tok = tmp_path / ".ray" / "auth_token"
    assert env["RAY_AUTH_MODE"] == "token" and env[LOOPBACK_VAR] == "0"
    assert setup.mode == "token" and setup.token_source == str(tok) and setup.created and setup.loopback
    assert re.fullmatch(r"[0-9a-f]{64}", tok.read_text())
    assert _mode(tok) == 0o600 and _mode(tok.parent) == 0o700
    first = tok.read_text()
    again = ensure_local_auth(env, warn=pytest.fail)  # idempotent: the token stays
    assert not again.created and tok.read_text() == first


def test_local_auth_makes_rays_own_token_file_private(tmp_path):
    """`ray get-auth-token --generate` (and a plain `ray.init()`) write ~/.ray/auth_token with the
    umask: 0644 in a 0755 directory. kvserve keeps the token and makes it owner-only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    env["HOME"] = str(tmp_path)
    p = subprocess.run(
        [str(RAY_CLI), "get-auth-token", "--generate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert p.returncode == 0, p.stderr[-2000:]
    tok = tmp_path / ".ray" / "auth_token"
    ray_mode, ray_dir_mode = _mode(tok), _mode(tok.parent)
    assert tok.read_text() == p.stdout.strip()
    setup = ensure_local_auth({"HOME": str(tmp_path)}, warn=pytest.fail)
    assert not setup.created and tok.read_text() == p.stdout.strip()
    assert _mode(tok) == 0o600 and _mode(tok.parent) == 0o700
    print(f"ray get-auth-token --generate wrote {ray_mode:o} (dir {ray_dir_mode:o}); now 600 (dir 700)")


def test_local_auth_token_path_and_env_token(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    tok = tmp_path / "a" / "b" / "token"
    env = {"HOME": str(home), TOKEN_PATH_VAR: str(tok)}
    setup = ensure_local_auth(env, warn=pytest.fail)
    assert setup.token_source == str(tok) and setup.created
    assert _mode(tok) == 0o600 and _mode(tok.parent) == 0o700 and _mode(tok.parent.parent) == 0o700
    assert not (home / ".ray").exists()  # the user's default token file is left alone
    env = {"HOME": str(home), TOKEN_VAR: "s3cret", LOOPBACK_VAR: "1"}  # a token given, loopback opted out
    setup = ensure_local_auth(env, warn=pytest.fail)
    assert setup.mode == "token" and setup.token_source == TOKEN_VAR and not setup.loopback
    assert env[LOOPBACK_VAR] == "1" and not (home / ".ray").exists()


def test_local_auth_keeps_explicit_disabled_with_a_loud_warning(tmp_path):
    warnings = []
    env = {"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}
    setup = ensure_local_auth(env, warn=warnings.append)
    assert setup.mode == "disabled" and env["RAY_AUTH_MODE"] == "disabled"
    assert len(warnings) == 1 and "WARNING" in warnings[0] and "RAY_AUTH_MODE=disabled" in warnings[0]
    assert "run arbitrary code" in warnings[0]
    assert not (tmp_path / ".ray").exists()
    with pytest.raises(SystemExit, match="expected 'token'"):
        ensure_local_auth({"HOME": str(tmp_path), "RAY_AUTH_MODE": "tokn"})


def test_join_auth_needs_the_clusters_token(tmp_path):
    env = {"HOME": str(tmp_path)}
    with pytest.raises(SystemExit) as e:
        ensure_join_auth(env, "10.0.0.1:6379")
    msg = str(e.value)
    assert "no token was found" in msg and "RAY_AUTH_TOKEN_PATH" in msg and "ray get-auth-token" in msg
    assert LOOPBACK_VAR not in env  # a remote address: no loopback mode
    tok = tmp_path / "tok"
    tok.write_text("abc")
    os.chmod(tok, 0o644)
    env = {"HOME": str(tmp_path), TOKEN_PATH_VAR: str(tok)}
    setup = ensure_join_auth(env, "127.0.0.1:6379", warn=pytest.fail)
    assert setup.mode == "token" and env["RAY_AUTH_MODE"] == "token" and _mode(tok) == 0o600
    assert env[LOOPBACK_VAR] == "0"  # else Ray rewrites 127.0.0.1 to the machine's address
    warnings = []
    setup = ensure_join_auth({"HOME": str(tmp_path), "RAY_AUTH_MODE": "disabled"}, "auto", warn=warnings.append)
    assert setup.mode == "disabled" and warnings
    assert is_loopback_address("localhost:1") and is_loopback_address("ray://127.0.0.1:10001")
    assert not is_loopback_address("auto") and not is_loopback_address("10.1.2.3:6379")
    msg = join_failure_message("10.0.0.1:6379", ensure_join_auth({TOKEN_VAR: "x"}), ConnectionError("boom"))
    assert "could not join" in msg and "token" in msg


def test_cli_join_without_token_fails_fast_with_a_clear_message(tmp_path):
    """`kvserve serve --address` with no token here: a clear error before Ray is even imported."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", LOOPBACK_VAR))}
    env.update(HOME=str(tmp_path), PYTHONPATH=str(ROOT))
    code = (
        "import sys; from kvserve.deployments.cli import main\n"
        "try:\n    main(['serve', '--address', '10.255.255.1:6379'])\n"
        "finally:\n    assert 'ray' not in sys.modules, 'imported ray before checking the token'\n"
    )
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 1, (p.stdout, p.stderr[-3000:])
    assert "no token was found" in p.stderr and "ray get-auth-token" in p.stderr, p.stderr[-3000:]


# ---- the attacker, against the session's Ray ---------------------------------------------------
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_attacker_without_the_token_cannot_join_or_run_code(ray_session, tmp_path):
    host, port = ray_session.address.rsplit(":", 1)
    assert host == "127.0.0.1", ray_session.address  # the session's Ray is on loopback
    assert ray_session.auth.mode == "token"
    token = Path(ray_session.token_path).read_text().strip()
    assert _mode(Path(ray_session.token_path)) == 0o600
    cases = {  # name: extra env of the attacking process
        "no token, RAY_AUTH_MODE unset": {},
        "no token, RAY_AUTH_MODE=token": {"RAY_AUTH_MODE": "token"},
        "wrong token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "f" * 64},
        "the token": {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token},
    }
    procs, markers = {}, {}
    for i, (name, extra) in enumerate(cases.items()):
        home = tmp_path / f"home{i}"
        home.mkdir()
        markers[name] = tmp_path / f"pwned{i}"
        procs[name] = _spawn(
            ATTACKER, [ray_session.address, str(markers[name])], _attacker_env(home, **extra), tmp_path
        )
    procs["raw gRPC"] = _spawn(RAW_GRPC, [ray_session.address, token], _attacker_env(tmp_path / "home0"), tmp_path)
    # `kvserve serve --address` holding a wrong token: a clear message, not a hang
    kv_env = _attacker_env(tmp_path / "home1", RAY_AUTH_TOKEN="f" * 64, PYTHONPATH=str(ROOT))
    procs["kvserve join"] = subprocess.Popen(
        [sys.executable, "-m", "kvserve.deployments.cli", "serve", "--address", ray_session.address],
        env=kv_env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    res = _collect(procs)

    for name in ("no token, RAY_AUTH_MODE unset", "wrong token"):
        rc, out = res[name]
        assert rc != 0 and "TASK" not in out and "REFUSED" in out, f"{name}:\n{out[-3000:]}"
        # refused by the GCS for the token (not a network error): Ray logs the GCS's answer
        assert "Unauthenticated" in out or "InvalidAuthToken" in out, f"{name}:\n{out[-3000:]}"
    rc, out = res["no token, RAY_AUTH_MODE=token"]
    assert rc != 0 and "TASK" not in out and "AuthenticationError" in out, out[-3000:]
    for name, marker in markers.items():
        if name != "the token":
            assert not marker.exists(), f"{name}: the task ran: {marker.read_text()}"
    # the same process with the token joins and runs the task: the refusals above are the token's doing
    rc, out = res["the token"]
    assert rc == 0 and "TASK RAN" in out, out[-3000:]
    assert markers["the token"].read_text().startswith("code ran as uid")

    rc, out = res["raw gRPC"]
    assert rc == 0, out[-3000:]
    lines = [ln for ln in out.splitlines() if ln.split(" ", 1)[0] in ("none", "wrong", "right")]
    for ln in lines:
        label, call, _addr, status = ln.split(" ")[:4]
        assert status == ("OK" if label == "right" else "UNAUTHENTICATED"), ln
    assert len(lines) == 6, out[-3000:]

    rc, out = res["kvserve join"]
    assert rc == 1 and "could not join the Ray cluster" in out and "token" in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_token_holder_gets_a_serve_handle_and_replica_grpc_needs_the_token(ray_session, serve_app, tmp_path):
    """With the serve app up: the token holder streams from LLMServer through a handle (docs/serving.md's
    Python-handle pattern); every Ray-side TCP listener is on 127.0.0.1 except the Serve replicas'
    inter-deployment gRPC servers (Ray binds them to [::]), and those refuse calls without the token."""
    token = Path(ray_session.token_path).read_text().strip()
    rows = _listeners(_ray_pids())
    table = "\n".join(f"{ip:>22}:{port:<6} {title}" for _pid, title, ip, port in rows)
    print(table)
    open_rows = [r for r in rows if not _is_loopback(r[2])]
    replica_ports = [f"127.0.0.1:{port}" for _pid, title, _ip, port in open_rows if "ServeReplica" in title]
    # The tensor-parallel workers (ray::TPWorker) meet through a file:// rendezvous and keep the
    # gloo sockets on loopback: torch's TCPStore would listen on all interfaces with no auth.
    others = [r for r in open_rows if "ServeReplica" not in r[1]]
    assert not others, f"Ray listeners on a non-loopback address:\n{others}\nall:\n{table}"
    assert replica_ports, f"no Serve replica gRPC server found:\n{table}"

    home = tmp_path / "home"
    home.mkdir()
    procs = {
        "raw gRPC": _spawn(RAW_GRPC, [ray_session.address, token, *replica_ports], _attacker_env(home), tmp_path),
        "the token": _spawn(
            ATTACKER,
            [ray_session.address, str(tmp_path / "m"), "serve"],
            _attacker_env(home, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token),
            tmp_path,
        ),
    }
    res = _collect(procs)
    rc, out = res["the token"]
    assert rc == 0 and "TASK RAN" in out and "SERVE" in out, out[-3000:]
    rc, out = res["raw gRPC"]
    assert rc == 0, out[-3000:]
    for ln in out.splitlines():
        parts = ln.split(" ")
        if parts[0] in ("none", "wrong"):
            assert parts[3] == "UNAUTHENTICATED", ln
        elif parts[0] == "right" and parts[1].startswith("replica"):
            assert parts[3] != "UNAUTHENTICATED", ln  # past the token check (then an empty request fails)
    assert sum(ln.startswith("none replica") for ln in out.splitlines()) == len(replica_ports), out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dashboard_agent_http_needs_the_token(ray_session, tmp_path):
    """The node's dashboard agent takes job submissions (a shell command) over HTTP: without
    the token 401, with a wrong one 403; only its two health checks are public."""
    import ray

    info = ray._private.worker._global_node.address_info
    base = f"http://127.0.0.1:{info['dashboard_agent_listen_port']}"
    token = Path(ray_session.token_path).read_text().strip()
    marker = tmp_path / "pwned"
    job = {"entrypoint": f"touch {marker}", "submission_id": "kvserve-auth-probe"}
    assert HTTP.post(f"{base}/api/job_agent/jobs/", json=job, timeout=10).status_code == 401
    bad = {"Authorization": "Bearer " + "0" * 64}
    assert HTTP.post(f"{base}/api/job_agent/jobs/", json=job, headers=bad, timeout=10).status_code == 403
    time.sleep(2)
    assert not marker.exists()
    good = {"Authorization": f"Bearer {token}"}
    r = HTTP.get(f"{base}/api/job_agent/jobs/no-such-job/logs", headers=good, timeout=30)
    assert r.status_code not in (401, 403), (r.status_code, r.text[:300])
    assert HTTP.get(f"{base}/api/job_agent/jobs/no-such-job/logs", timeout=10).status_code == 401
    assert HTTP.get(f"{base}/api/healthz", timeout=10).status_code != 401  # public by Ray's design


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kvserve_serve_starts_ray_with_token_auth_on_loopback(tiny_llama_path, tmp_path):
    """`kvserve serve` as a user runs it (no RAY_* in the environment): it writes
    ~/.ray/auth_token with 0600, its Ray listens on 127.0.0.1, and a process without the token
    is refused while the HTTP API answers. Ctrl-C drains: /ready turns 503 "draining" and
    streams in flight finish with all their tokens and [DONE]."""
    import httpx

    home = tmp_path / "home"
    home.mkdir()
    port = free_port()
    p, out = start_kvserve(
        home,
        [
            "--model",
            str(tiny_llama_path),
            "--served-model-name",
            "tiny",
            "--num-replicas",
            "1",
            "--port",
            str(port),
            "--num-cpus",
            "4",
            "--max-num-seqs",
            "4",
            "--max-model-len",
            "2048",
            "--torch-num-threads",
            "1",
        ],
    )
    lines: list[str] = [out]
    try:
        m = re.search(r"GCS (127\.0\.0\.1:\d+), control-plane ports on 127\.0\.0\.1 only", out)
        assert m and "token authentication on" in out, out[-4000:]
        gcs = m.group(1)
        tok = home / ".ray" / "auth_token"
        assert _mode(tok) == 0o600 and _mode(tok.parent) == 0o700
        token = tok.read_text().strip()
        assert HTTP.get(f"http://127.0.0.1:{port}/v1/models", timeout=30).status_code == 200

        import psutil

        pids = [p.pid] + [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
        rows = _listeners(pids)
        table = "\n".join(f"{ip:>22}:{lport:<6} {title}" for _pid, title, ip, lport in rows)
        print(table)
        bad = [r for r in rows if not _is_loopback(r[2]) and "ServeReplica" not in r[1]]
        assert not bad, f"non-loopback listeners:\n{bad}\nall:\n{table}"
        ext = _this_machines_address()
        if ext:  # from the network, the GCS port is closed
            with pytest.raises(OSError):
                socket.create_connection((ext, int(gcs.rsplit(":", 1)[1])), timeout=5).close()

        attacker = _spawn(RAW_GRPC, [gcs, token], _attacker_env(tmp_path), tmp_path)
        rc, text = _collect({"raw gRPC": attacker})["raw gRPC"]
        assert rc == 0, text[-3000:]
        status = {
            tuple(ln.split(" ")[:2]): ln.split(" ")[3]
            for ln in text.splitlines()
            if ln.split(" ", 1)[0] in ("none", "wrong", "right")
        }
        assert status[("none", "gcs.GetAllNodeInfo")] == "UNAUTHENTICATED", text
        assert status[("right", "gcs.GetAllNodeInfo")] == "OK", text

        # Ctrl-C with streams in flight: they finish, /ready says "draining" meanwhile
        import concurrent.futures

        import threading

        started = [threading.Event() for _ in range(4)]

        def stream(i: int) -> tuple[int, str]:
            body = {"model": "tiny", "prompt": "hi", "max_tokens": 600, "ignore_eos": True, "stream": True}
            with HTTP.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=300) as r:
                parts = []
                for chunk in r.iter_text():
                    parts.append(chunk)
                    started[i].set()  # the stream is in flight: its first bytes arrived
                started[i].set()
                return r.status_code, "".join(parts)

        pool = concurrent.futures.ThreadPoolExecutor(4)
        streams = [pool.submit(stream, i) for i in range(4)]
        for ev in started:  # Ctrl-C once every stream is under way, so the drain has them all
            assert ev.wait(120), "a stream never started"
        p.send_signal(signal.SIGINT)
        ready = []
        for _ in range(20):
            try:
                ready.append(HTTP.get(f"http://127.0.0.1:{port}/ready", timeout=5).status_code)
            except httpx.HTTPError:
                break
            if ready[-1] != 200:
                break
            time.sleep(0.1)
        assert ready and ready[-1] in (503, 404), ready  # 503 draining, or already deleted (404)
        for f in streams:
            code, text = f.result(timeout=240)
            events = list(iter_sse(text))
            # no error event (the tiny model's random text may contain the word "error" itself)
            assert code == 200 and events[-1:] == [DONE] and not any("error" in e for e in events[:-1]), text[-500:]
            assert text.count('"text"') >= 1 and '"finish_reason":"length"' in text, text[-500:]
        pool.shutdown()
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                rest, _ = p.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                rest, _ = p.communicate()
            lines.append(rest or "")
    assert p.returncode == 0 and "kvserve: stopped." in "".join(lines), "".join(lines)[-3000:]
