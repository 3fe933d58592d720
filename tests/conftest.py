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
