"""Shared pytest fixtures: the real default model and tiny random-weight models."""

import os

os.environ["RAY_AUTH_MODE"] = "token"  # Ray token auth on for every Ray of the session (token: tests/e2e/conftest.py)

import shutil  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402

from kvserve.engine.model_loader import resolve_model  # noqa: E402
from helpers import PROFILE  # noqa: E402  (tests/ is on sys.path for this conftest)
from redis_helpers import start_redis  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402


#: Test folders whose tests start or join a Ray instance (the session's, or a cluster of their
#: own): under pytest-xdist they all run, in order, in one worker (one Ray per session, as
#: without xdist).
RAY_FOLDERS = ("e2e", "cluster")
#: Files that share a session cache and so run in one worker: HF's SmolLM2 references.
SHARED_GROUPS = {"test_correctness.py": "hf-smollm2", "test_spec_decode_equals_hf.py": "hf-smollm2"}
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


def pytest_configure(config):
    """The pytest-xdist controller makes a folder its workers share (``KVSERVE_TEST_RUN_DIR``,
    inherited): the Ray worker flags there that it is running Ray tests."""
    if not hasattr(config, "workerinput") and "KVSERVE_TEST_RUN_DIR" not in os.environ:
        os.environ["KVSERVE_TEST_RUN_DIR"] = tempfile.mkdtemp(prefix="kvserve-tests-")
        config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("KVSERVE_TEST_RUN_DIR"), ignore_errors=True))


def _ray_flag() -> str | None:
    """The file that is there while a pytest-xdist worker runs the Ray tests (None: no xdist)."""
    run_dir = os.environ.get("KVSERVE_TEST_RUN_DIR")
    return os.path.join(run_dir, "ray-tests-running") if run_dir and "PYTEST_XDIST_WORKER" in os.environ else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    """Under pytest-xdist, the worker running the in-process tests gives way to the one running
    Ray's: every thread of this worker runs at niceness :data:`IN_PROCESS_NICENESS` (threads made
    later inherit it; set again after each test's fixtures, since an in-process ``LLMServer``
    asks for niceness 0 as a Serve replica does), and while the Ray worker's flag
    (:func:`_ray_flag`) is up each in-process test runs torch on one thread (two OpenMP threads
    on a contended 2-core box wait for each other at every op: a test took 7x its time). So the
    in-process tests use what the Ray tests leave idle and do not stretch their Serve apps'
    timings (recovery limits, drains). Without xdist nothing changes."""
    global _niced, _threads, _wrote_flag
    flag = _ray_flag()
    if flag is None:
        yield
        return
    if xdist_group_of(item.nodeid) == "ray":
        open(flag, "w").close()
        _wrote_flag = True
        yield
        return
    if _wrote_flag:  # this worker ran the Ray tests, which are over
        _wrote_flag = False
        os.remove(flag)
    import torch

    if not _niced:
        _niced, _threads = True, torch.get_num_threads()
    _renice()
    torch.set_num_threads(1 if os.path.exists(flag) else _threads)
    yield
    _renice()


def _renice() -> None:
    """Every thread of this process at :data:`IN_PROCESS_NICENESS` (best effort)."""
    for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else [os.getpid()]:
        try:
            os.setpriority(os.PRIO_PROCESS, int(tid), IN_PROCESS_NICENESS)
        except OSError:  # a thread that ended meanwhile, or no permission: best effort
            pass


def pytest_sessionfinish(session):
    """The Ray worker lowers its flag when it is done."""
    flag = _ray_flag()
    if flag is not None and _wrote_flag and os.path.exists(flag):
        os.remove(flag)


_niced, _threads, _wrote_flag = False, None, False


def pytest_report_header(config):
    return (
        f"kvserve test profile: {PROFILE} (KVSERVE_TEST_PROFILE; `make test` runs the fast one without the "
        f"tests marked thorough, `make test-thorough` every test at full size)"
    )


@pytest.fixture(autouse=True, scope="session")
def _assume_native_bf16():
    """``KVSERVE_TEST_ASSUME_NATIVE_BF16=1`` runs the in-process tests as on a CPU with native
    bf16 (``dtype="auto"`` -> bfloat16), to check on any box that the suite holds where bf16 is
    the default (the matmuls are emulated, so slower, without avx512_bf16)."""
    if os.environ.get("KVSERVE_TEST_ASSUME_NATIVE_BF16") != "1":
        yield
        return
    import kvserve.engine.config as config

    real, probe = config.cpu_native_bf16, os.environ.get("KVSERVE_DTYPE_PROBE")
    config.cpu_native_bf16 = lambda: (True, "assumed by KVSERVE_TEST_ASSUME_NATIVE_BF16")
    os.environ["KVSERVE_DTYPE_PROBE"] = "0"  # auto is then bfloat16, as where the probe finds bf16 faster
    yield
    config.cpu_native_bf16 = real
    if probe is None:
        os.environ.pop("KVSERVE_DTYPE_PROBE")
    else:
        os.environ["KVSERVE_DTYPE_PROBE"] = probe


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
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server.url
    finally:
        server.stop()
