"""`kvserve serve` as a user runs it, in a process of its own (its own Ray, no RAY_* from the
test session's environment), for the tests that need a second, independent server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvserve.engine.model_loader import cache_dir

ROOT = Path(__file__).resolve().parents[2]


def start_kvserve(
    home: Path, args: list[str], env: dict[str, str] | None = None, timeout_s: float = 400
) -> tuple[subprocess.Popen, str]:
    """Start ``python -m kvserve.deployments.cli serve *args`` with ``HOME=home`` (so its Ray token is
    its own) and wait for its "Ctrl-C to stop." line; returns the process (its own session:
    stop it with :func:`stop_kvserve`) and its output so far. ``KVSERVE_CACHE`` stays this
    session's (:func:`kvserve.engine.model_loader.cache_dir`): a new ``HOME`` would otherwise build
    the C++ CPU kernels and convert models again (~35 s of compiling on 2 cores).

    Raises:
        AssertionError: it exited or did not get ready within ``timeout_s`` s (with its output).
    """
    full = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    full.update(
        HOME=str(home), PYTHONPATH=str(ROOT), RAY_worker_niceness="0", KVSERVE_CACHE=str(cache_dir()), **(env or {})
    )
    p = subprocess.Popen(
        [sys.executable, "-m", "kvserve.deployments.cli", "serve", *args],
        env=full,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    lines: list[str] = []
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        line = p.stdout.readline()
        if not line:
            break
        lines.append(line)
        if line.startswith("Ctrl-C to stop."):
            break
    out = "".join(lines)
    if "Ctrl-C to stop." not in out:
        stop_kvserve(p)
        raise AssertionError(f"kvserve serve did not start:\n{out[-4000:]}")
    return p, out


def stop_kvserve(p: subprocess.Popen, timeout_s: float = 120) -> None:
    """Ctrl-C (SIGINT to its process group), SIGKILL after ``timeout_s`` s."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGINT)
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
