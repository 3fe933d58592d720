"""kvserve as a package (issue 62): the wheel carries the ``kvserve`` package whole (the C++ kernel
sources the CPU backend compiles on the user's machine, the configs it reads at run time, the
license) and nothing else (no tests, no benchmarks, no other top-level name); its metadata says
what the code needs; and an install of it, run from a directory outside the checkout, imports from
the install, builds its C++ kernels from the wheel's sources and generates."""

from __future__ import annotations

import email
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # the installed setuptools (from the lock), as `make` installs kvserve: no build isolation
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=out,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("kvserve-*.whl")
    return whl


def test_the_wheel_carries_the_package_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    info = next(t for t in tops if t.endswith(".dist-info"))
    assert tops == {"kvserve", info}, tops
    # every module of the package, and the files it reads at run time
    sources = {
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "kvserve").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert sources - set(names) == set(), sorted(sources - set(names))
    csrc = {n for n in names if n.startswith("kvserve/kernels/csrc/")}
    assert {"kvserve/kernels/csrc/paged_attention_cpu.cpp", "kvserve/kernels/csrc/cpu_vec.h"} <= csrc
    assert "kvserve/deployments/serve_config.yaml" in names and "kvserve/cluster/aws-gpu.yaml" in names
    assert f"{info}/licenses/LICENSE" in names
    assert not [n for n in names if "/tests/" in n or n.startswith(("tests/", "benchmarks/")) or "__pycache__" in n]
    assert zipfile.ZipFile(wheel).read(f"{info}/top_level.txt").decode().split() == ["kvserve"]


def test_the_wheel_metadata(wheel):
    z = zipfile.ZipFile(wheel)
    info = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    meta = email.message_from_bytes(z.read(info))
    assert meta["License-Expression"] == "Apache-2.0"
    requires = meta.get_all("Requires-Dist")
    assert "ray[serve]>=2.60" in requires and "httpx" in requires
    # no exact pin at run time: a pin fights any vLLM or SGLang installed beside kvserve
    runtime = [r for r in requires if "extra ==" not in r]
    assert not [r for r in runtime if "==" in r], runtime
    assert {"bundled", "embeddings", "redis", "otel", "serve", "test", "docs", "bench"} <= set(
        meta.get_all("Provides-Extra")
    )
    assert "kvserve = kvserve.deployments.cli:main" in z.read(info.replace("METADATA", "entry_points.txt")).decode()
    license_text = z.read(info.replace("METADATA", "licenses/LICENSE")).decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text


@pytest.mark.slow
def test_an_install_of_the_wheel_runs_from_anywhere(wheel, tmp_path, tiny_llama_path):
    """The wheel unpacked into a folder of its own (what pip's install of a pure wheel does),
    first on ``sys.path`` of an interpreter started outside the checkout: kvserve comes from
    there, not from the checkout, and its C++ kernels build from the wheel's own sources."""
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import json, sys, kvserve\n"
        "from kvserve.kernels import cpu_backend\n"
        "from kvserve.engine import LLM, SamplingParams\n"
        "built = cpu_backend.load_kernel()\n"
        "llm = LLM(sys.argv[1], dtype='float32', num_kv_blocks=16, max_model_len=64)\n"
        "out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0))[0].outputs[0].token_ids\n"
        "print('RESULT ' + json.dumps({'file': kvserve.__file__, 'csrc': str(cpu_backend.SOURCES[0]),\n"
        "      'built': built, 'tokens': len(out), 'version': kvserve.__version__}))\n"
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    r = subprocess.run(
        [sys.executable, "-c", code, str(tiny_llama_path)],
        cwd=elsewhere,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("RESULT "))[len("RESULT ") :])
    assert got["file"].startswith(str(site)) and got["csrc"].startswith(str(site)), got
    assert got["built"] and got["tokens"] == 3, got
