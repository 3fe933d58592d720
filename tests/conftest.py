"""Shared pytest fixtures: the real default model and tiny random-weight models."""

import os

os.environ["RAY_AUTH_MODE"] = "token"  # Ray token auth on for every Ray of the session (token: tests/e2e/conftest.py)

import shutil  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from engine.model_loader import resolve_model  # noqa: E402
from helpers import PROFILE, free_port  # noqa: E402  (tests/ is on sys.path for this conftest)
from tiny_models import make_tiny_model  # noqa: E402


#: Test folders whose tests start or join a Ray instance (the session's, or a cluster of their
#: own): under pytest-xdist they all run, in order, in one worker (one Ray per session, as
#: without xdist).
RAY_FOLDERS = ("e2e", "cluster")
#: Files that share a session cache and so run in one worker: HF's SmolLM2 references.
SHARED_GROUPS = {"test_correctness.py": "hf-smollm2", "test_spec_decode.py": "hf-smollm2"}
#: Niceness of a worker running the in-process tests while the Ray worker runs (see below).
IN_PROCESS_NICENESS = 10


def xdist_group_of(nodeid: str) -> str:
    """The pytest-xdist work unit of a test (``nodeid`` as ``tests/<folder>/test_x.py::...``):
    ``"ray"`` for the Ray folders, a shared group for files that share a session cache, else
    the test's file."""
    parts = nodeid.split("::", 1)[0].split("/")
    if len(parts) > 2 and parts[1] in RAY_FOLDERS:
        return "ray"
    return SHARED_GROUPS.get(parts[-1], "/".join(parts))


@pytest.hookimpl(tryfirst=True)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest-xdist workers (``-n 2 --dist loadgroup``): one runs the Ray
    group (live Serve apps, whose time is largely waiting on Ray) in collection order, the other
    the in-process tests beside it, each file whole (module fixtures built once). Groups come
    from :func:`xdist_group_of`, not from ``xdist_group`` marks: pytest-xdist 3.8 marks a
    group by renaming the item's node id, which pytest 9 no longer allows, so its own
    ``loadgroup`` silently scatters a group's tests over the workers."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return ByGroup(config, log)


def pytest_runtest_setup(item):
    """In a pytest-xdist worker, before its first in-process test: every thread of this worker
    gets niceness :data:`IN_PROCESS_NICENESS` (threads made later inherit it), so the in-process
    tests use the cores the Ray worker leaves idle and do not stretch its Serve apps' timings
    (recovery limits, drains). Without xdist nothing changes."""
    global _niced
    if _niced or "PYTEST_XDIST_WORKER" not in os.environ or xdist_group_of(item.nodeid) == "ray":
        return
    _niced = True
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [0]:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), IN_PROCESS_NICENESS)
        except OSError:  # a thread that ended meanwhile, or no permission: best effort
            pass


_niced = False


def pytest_report_header(config):
    return (f"kvserve test profile: {PROFILE} (KVSERVE_TEST_PROFILE; `make test` runs the fast one without the "
            f"tests marked thorough, `make test-thorough` every test at full size)")


@pytest.fixture(autouse=True, scope="session")
def _assume_native_bf16():
    """``KVSERVE_TEST_ASSUME_NATIVE_BF16=1`` runs the in-process tests as on a CPU with native
    bf16 (``dtype="auto"`` -> bfloat16), to check on any box that the suite holds where bf16 is
    the default (the matmuls are emulated, so slower, without avx512_bf16)."""
    if os.environ.get("KVSERVE_TEST_ASSUME_NATIVE_BF16") != "1":
        yield
        return
    import engine.config as config
    real = config.cpu_native_bf16
    config.cpu_native_bf16 = lambda: (True, "assumed by KVSERVE_TEST_ASSUME_NATIVE_BF16")
    yield
    config.cpu_native_bf16 = real


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as a float32 safetensors folder (converted once into $KVSERVE_CACHE
    or ~/.cache/kvserve; about 30 s the first time, instant afterwards)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """Tiny Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, untied lm_head), SmolLM2 tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory):
    """Tiny Qwen3 (q/k RMSNorm), same shape as tiny_llama."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory):
    """Tiny Qwen2 (q/k/v biases), same shape as tiny_llama."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory):
    """A real redis-server (Debian's; `.ci/run` installs it) on a free loopback port, no
    persistence; yields its URL. Skips when redis-server is not installed."""
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server not installed (apt-get install redis-server)")
    port = free_port()
    proc = subprocess.Popen([exe, "--save", "", "--appendonly", "no", "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", str(tmp_path_factory.mktemp("redis"))],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
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
                pytest.fail("redis-server did not start")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
