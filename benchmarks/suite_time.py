#!/usr/bin/env python
"""How long the README's test command takes on a fresh clone: what CI runs, against the
15-minute target of ``make test``.

Each run clones the repository's committed ``HEAD`` into a new temporary folder
(``git clone``: nothing of the working tree's builds or caches comes along; the machine's pip
cache and ``~/.cache/kvserve`` do, as on a CI machine that keeps them) and runs ``.ci/run``
there (``make test``: the virtual environment and the C++ kernels are set up first), one run after
the other (``--repeats``), never two at once. For each run it records the wall time of the whole
command, pytest's own time and counts from its last line (``N passed, M skipped ... in S s``),
the set-up before pytest (the difference) and pytest's slowest tests (``--durations`` in the
Makefile). A run that fails is recorded with its exit status and the tail of its output. The
clone is removed afterwards (``--keep`` keeps it).

Results: ``benchmarks/results/suite_time.json`` (``--out``), written whole by
:class:`benchmarks.common.Results`.
"""
from __future__ import annotations

import argparse
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures  # noqa: E402

RESULT_KEYS = ("runs", "wall_s_median", "target_s")

#: ``make test``'s bound on a fresh clone, in seconds (issue 40).
TARGET_S = 15 * 60.0
#: pytest's last line: counts, then "in S s".
SUMMARY = re.compile(r"^=*\s*(?P<counts>(?:\d+ \w+(?:, )?)+).* in (?P<secs>[\d.]+)s")
DURATION = re.compile(r"^(?P<secs>[\d.]+)s (?P<phase>call|setup|teardown)\s+(?P<test>\S+)$")


def parse_output(text: str) -> dict:
    """pytest's counts (``{"passed": n, ...}``), its seconds and its slowest tests from a
    ``make test`` output; empty values where pytest did not get that far."""
    counts, secs, slowest = {}, None, []
    for line in text.splitlines():
        m = DURATION.match(line.strip())
        if m:
            slowest.append([m["test"], m["phase"], float(m["secs"])])
            continue
        m = SUMMARY.match(line.strip())
        if m:
            counts = {k: int(n) for n, k in re.findall(r"(\d+) (\w+)", m["counts"])}
            secs = float(m["secs"])
    return {"counts": counts, "pytest_s": secs, "slowest": slowest}


def one_run(keep: bool, timeout_s: float) -> dict:
    """Clone ``HEAD`` and run ``.ci/run`` in the clone; the run's record."""
    where = Path(tempfile.mkdtemp(prefix="kvserve-suite-"))
    clone = where / "kvserve"
    try:
        subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True)
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=clone, capture_output=True,
                                text=True, check=True).stdout.strip()
        t0 = time.monotonic()
        try:
            p = subprocess.run([str(clone / ".ci" / "run")], cwd=clone, capture_output=True, text=True,
                               timeout=timeout_s)
            rc, out = p.returncode, p.stdout + p.stderr
        except subprocess.TimeoutExpired as e:  # recorded with what it printed so far
            raw = e.stdout or ""
            rc, out = None, raw.decode(errors="replace") if isinstance(raw, bytes) else raw
        wall = time.monotonic() - t0
        parsed = parse_output(out)
        setup = wall - parsed["pytest_s"] if parsed["pytest_s"] is not None else None
        return {"commit": commit, "exit_status": rc, "wall_s": wall, "setup_s": setup, **parsed,
                "tail": None if rc == 0 else out[-3000:]}
    finally:
        if not keep:
            shutil.rmtree(where, ignore_errors=True)


def measure(args: argparse.Namespace) -> dict:
    runs = []
    for i in range(args.repeats):
        r = one_run(args.keep, args.timeout)
        runs.append(r)
        print(f"run {i + 1}: exit {r['exit_status']}, {r['wall_s']:.0f} s (pytest {r['pytest_s']}, "
              f"set-up {r['setup_s'] and round(r['setup_s'])}) {r['counts']}", flush=True)
    return {"runs": runs, "wall_s_median": statistics.median(r["wall_s"] for r in runs), "target_s": TARGET_S}


def figures(r: dict) -> Figures:
    """Summary: the median wall time against the target and whether every run passed; tables:
    each run, and the slowest tests of the last one."""
    green = all(run["exit_status"] == 0 for run in r["runs"])
    f = Figures().summary("fresh clone, `.ci/run` (make test), median wall time", r["wall_s_median"], "s",
                          target=f"<= {r['target_s']:.0f} s", met=green and r["wall_s_median"] <= r["target_s"],
                          headline=True)
    f.summary("every run green", green, met=green)
    f.table("Runs", ["run", "commit", "exit status", "wall (s)", "set-up (s)", "pytest (s)", "passed", "skipped",
                     "failed"],
            [[i + 1, run["commit"], run["exit_status"], run["wall_s"], run["setup_s"], run["pytest_s"],
              run["counts"].get("passed"), run["counts"].get("skipped"), run["counts"].get("failed", 0)]
             for i, run in enumerate(r["runs"])],
            note="one run after the other, each on a new clone of HEAD; set-up is the virtual environment, "
                 "the C++ kernels and the Debian test dependencies, before pytest starts")
    last = r["runs"][-1]
    f.table("Slowest tests (last run)", ["test", "phase", "seconds"], last["slowest"],
            note="pytest --durations, as make test prints them")
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="fresh-clone runs, one after the other")
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds one run may take")
    ap.add_argument("--keep", action="store_true", help="keep each clone (its .venv is large)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "suite_time.json")
    args = ap.parse_args(argv)
    from benchmarks.common import Results

    prov = Results(__file__, RESULT_KEYS)
    result = measure(args)
    prov.write(args.out, result)
    print(f"median {result['wall_s_median']:.0f} s over {args.repeats} fresh-clone runs; wrote {args.out}")
    return 0 if all(r["exit_status"] == 0 for r in result["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
