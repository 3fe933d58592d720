"""``kvserve serve`` fails loudly when a model cannot start (issue 62): ``/ready`` answers 503
while no replica of the model is up, and the command exits non-zero with the replica's own
error, not Serve's internals, once Serve gives up on the replica."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from helpers import free_port

from kvserve.deployments.operator.startup import replica_error
from kvserve.engine.model_loader import cache_dir

ROOT = Path(__file__).resolve().parents[2]

#: A DEPLOY_FAILED message as Ray Serve 2.60 writes it for a constructor that raised (colour
#: codes, the actor line and the frames included), as seen from `kvserve serve --model <broken>`.
SERVE_MESSAGE = (
    "The deployment failed to start 3 times in a row. This may be due to a problem with its constructor or "
    "initial health check failing. See controller logs for details. Error:\n"
    "\x1b[36mray::ServeReplica:kvserve:LLMServer.initialize_and_get_metadata()\x1b[39m (pid=9807, ip=127.0.0.1, "
    "actor_id=340a0db08d03e4e2610af83801000000)\n"
    '  File "/usr/lib/python3.11/concurrent/futures/_base.py", line 449, in result\n'
    "    return self.__get_result()\n"
    "           ^^^^^^^^^^^^^^^^^^^\n"
    '  File "/work/kvserve/engine/core_client.py", line 87, in _wait_ready\n'
    "    raise _remote_error(name, bad_input, message)\n"
    "RuntimeError: Error while deserializing header: invalid header length\n"
)


def test_replica_error_is_the_exception_not_the_frames():
    assert replica_error(SERVE_MESSAGE) == "RuntimeError: Error while deserializing header: invalid header length"
    chained = SERVE_MESSAGE + (
        "\nDuring handling of the above exception, another exception occurred:\n\n"
        'Traceback (most recent call last):\n  File "/x.py", line 1, in f\n    g()\n'
        "ValueError: the model folder has no config.json\n  hint: pass --model\n"
    )
    assert replica_error(chained) == "ValueError: the model folder has no config.json\n  hint: pass --model"
    assert (
        replica_error("Replica is unhealthy\nsecond line\nthird\nfourth") == "Replica is unhealthy\nsecond line\nthird"
    )
    assert replica_error("") == "(no error message)"


@pytest.fixture
def broken_model(tiny_llama_path, tmp_path) -> Path:
    """The tiny model's folder with its weights cut to 1000 bytes: config and tokenizer load, the
    weights do not."""
    bad = tmp_path / "broken-model"
    shutil.copytree(tiny_llama_path, bad)
    for f in bad.glob("*.safetensors"):
        f.write_bytes(f.read_bytes()[:1000])
    return bad


@pytest.mark.slow
def test_serve_exits_with_the_replicas_error(broken_model, tmp_path):
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    # two constructor tries per replica (Serve's default is 3): the same failure, sooner, with
    # time between for /ready to be asked
    env.update(
        HOME=str(tmp_path),
        PYTHONPATH=str(ROOT),
        KVSERVE_CACHE=str(cache_dir()),
        RAY_SERVE_MAX_PER_REPLICA_RETRY_COUNT="2",
    )
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kvserve.deployments.cli",
            "serve",
            "--model",
            str(broken_model),
            "--port",
            str(port),
            "--num-cpus",
            "4",
        ],
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    ready, models = [], []
    try:
        deadline = time.monotonic() + 400
        while p.poll() is None and time.monotonic() < deadline:
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/ready", timeout=5)
                # the gateway's answer; before the ingress has its route, Serve's proxy says 404
                ready.append(r.status_code if r.status_code != 404 else "no route yet")
                models.append(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=5).status_code)
            except httpx.HTTPError:
                pass  # not listening yet, or already stopped
            time.sleep(0.5)
        out, _ = p.communicate(timeout=120)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, 9)
            p.wait()
    assert p.returncode not in (0, None), out[-4000:]
    # while it lived, the gateway said it was not ready: no replica of the model was up
    # (how many answers come before Serve gives up depends on timing: none of them may be 200)
    assert set(ready) <= {503, "no route yet"}, (ready, out[-2000:])
    lines = out.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("kvserve: application"))
    end = next(i for i, ln in enumerate(lines) if ln.startswith("kvserve: the replicas' logs"))
    text = "\n".join(lines[start:end])  # what kvserve said of the failure
    assert "failed to start" in text and "LLMServer (DEPLOY_FAILED)" in text, out[-4000:]
    assert "Error while deserializing header" in text, out[-4000:]  # the replica's own error (safetensors')
    assert "Traceback" not in text and 'File "' not in text, text  # and none of the frames
    assert "RuntimeError: Deploying application" not in out  # Serve's own give-up, raised through the CLI no more
