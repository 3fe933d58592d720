"""`.ci/run`, with a stand-in `make` on PATH: it runs `make test`, then the thorough tests (the
tests `make test` deselects), both even when the first fails; it fails when either fails, and a
pytest that collected nothing (exit 5) is a failure, never a pass."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ci_run(tmp_path: Path, fast_rc: int, thorough_rc: int) -> tuple[int, list[str]]:
    """Run a copy of `.ci/run` whose `make` records its arguments and exits with ``fast_rc`` for
    `make test` and ``thorough_rc`` for `make test PYTEST_ARGS=...`."""
    (tmp_path / ".ci").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "make.log"
    make = bin_dir / "make"
    make.write_text(f"""#!/usr/bin/env bash
echo "$*" >> {log}
case "$*" in *PYTEST_ARGS=*) exit {thorough_rc};; *) exit {fast_rc};; esac
""")
    make.chmod(0o755)
    p = subprocess.run(
        [str(tmp_path / ".ci" / "run")],
        env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return p.returncode, log.read_text().splitlines()


@pytest.mark.parametrize(
    "fast_rc, thorough_rc, fails", [(0, 0, False), (1, 0, True), (0, 1, True), (5, 0, True), (0, 5, True), (2, 2, True)]
)
def test_ci_runs_make_test_then_the_thorough_tests(tmp_path, fast_rc, thorough_rc, fails):
    rc, calls = ci_run(tmp_path, fast_rc, thorough_rc)
    assert calls == ["test", "test PYTEST_ARGS=-m thorough --durations=30"]  # both, in order, nothing deselected
    assert (rc != 0) == fails
