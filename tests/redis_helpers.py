"""A real redis-server on a free loopback port, no persistence (:func:`start_redis`): the
session's ``redis_server`` fixture (tests/conftest.py) starts one this way, and a test may have
a private one (the ``own_redis`` fixture) to pause (SIGSTOP: every command to it hangs, as in a
network partition or a stalled server) and resume (SIGCONT), :class:`OwnRedis`. Used by
tests/deployments/test_store_faults_redis.py and test_batch_resume_redis.py."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from helpers import free_port


class OwnRedis:
    """A redis-server of one test: ``url``, :meth:`pause`, :meth:`resume`, :meth:`stop`."""

    def __init__(self, proc: subprocess.Popen, url: str):
        self.proc, self.url = proc, url

    def _state(self) -> str:
        return Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def pause(self) -> None:
        """SIGSTOP the server; returns once the kernel shows it stopped (state ``T``)."""
        os.kill(self.proc.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while self._state() != "T":
            assert time.monotonic() < deadline, "redis-server did not stop"
            time.sleep(0.001)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        self.resume()
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_redis(folder: Path) -> OwnRedis:
    """A redis-server on a free loopback port, no persistence, its files in ``folder``.
    Skips the test when redis-server is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen(
        [exe, "--save", "", "--appendonly", "no", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("redis-server did not start")
        time.sleep(0.05)
    return OwnRedis(proc, f"redis://127.0.0.1:{port}/0")


@pytest.fixture
def own_redis(tmp_path):
    """A private redis-server this test may pause (see :class:`OwnRedis`)."""
    r = start_redis(tmp_path)
    try:
        yield r
    finally:
        r.stop()
