"""benchmarks/suite_time.py reads each pytest session's last line and its slowest tests from a
`.ci/run` output; a run that did not get that far has no counts (never a made-up time); a time is
"met" only when every run was green, on one commit, beside a clean working tree, and a dirty tree
is refused before anything runs."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import suite_time  # noqa: E402
from benchmarks.suite_time import figures, parse_output, verdict  # noqa: E402

OUTPUT = """\
........................ [ 98%]
============================= slowest 15 durations =============================
72.68s call     tests/cluster/test_autoscaling_nodes.py::test_scale_up_adds_a_node_and_scale_down_removes_it
45.11s setup    tests/kernels/test_triton_attention.py::test_triton_interpreter[split_heuristic]
0.15s teardown tests/e2e/test_faults.py::test_killed_replica_mid_stream
=========================== short test summary info ============================
SKIPPED [2] tests/kernels/test_triton_attention.py:33: needs a CUDA GPU
1361 passed, 15 skipped, 95 warnings, 17 subtests passed in 892.39s (0:14:52)
"""


def test_counts_time_and_slowest_are_read():
    r = parse_output(OUTPUT)
    assert r["pytest_s"] == 892.39
    assert r["counts"] == {"passed": 1361, "skipped": 15, "warnings": 95, "subtests": 17}
    assert r["slowest"][0] == [
        "tests/cluster/test_autoscaling_nodes.py::test_scale_up_adds_a_node_and_scale_down_removes_it",
        "call",
        72.68,
    ]
    assert [s[1] for s in r["slowest"]] == ["call", "setup", "teardown"]


def test_a_failed_run_is_read_as_such():
    r = parse_output("FAILED tests/x.py::test_y\n1 failed, 1360 passed, 15 skipped in 821.61s (0:13:41)\n")
    assert r["counts"] == {"failed": 1, "passed": 1360, "skipped": 15} and r["pytest_s"] == 821.61
    assert parse_output("make: *** [Makefile:17] Error 2\n") == {
        "counts": {},
        "pytest_s": None,
        "sessions": [],
        "pytest_total_s": None,
        "slowest": [],
    }


CI_OUTPUT = (
    OUTPUT
    + """\
.......... [100%]
============================= slowest 30 durations =============================
148.80s call     tests/engine/test_kv_fp8.py::test_tiny_model_fp8_equals_hf_with_fp8_rounding[triton]
10 passed, 1751 deselected in 210.65s (0:03:30)
"""
)


def test_both_sessions_of_ci_run_are_read():
    """`.ci/run` runs `make test`, then the thorough tests: two pytest sessions; the first is
    make test's, the seconds of both are summed, the slowest of both kept."""
    r = parse_output(CI_OUTPUT)
    assert r["pytest_s"] == 892.39 and r["counts"]["passed"] == 1361
    assert [x["pytest_s"] for x in r["sessions"]] == [892.39, 210.65]
    assert r["sessions"][1]["counts"] == {"passed": 10, "deselected": 1751}
    assert r["pytest_total_s"] == 892.39 + 210.65 and len(r["slowest"]) == 4


def _run(commit, dirty=False, rc=0, wall=1000.0):
    parsed = parse_output(CI_OUTPUT)
    setup = wall - parsed["pytest_total_s"]
    return {
        "commit": commit,
        "tree_dirty": dirty,
        "exit_status": rc,
        "wall_s": wall,
        "setup_s": setup,
        "make_test_s": setup + parsed["pytest_s"],
        **parsed,
        "tail": None,
    }


def _result(runs):
    return {
        "runs": runs,
        "wall_s_median": 1200.0,
        "target_s": 900.0,
        "make_test_s_median": 850.0,
        "ci_target_s": 5400.0,
        "commits": verdict(runs)["commits"],
        "clean_tree": verdict(runs)["clean_tree"],
    }


def _met(runs):
    return {
        row["metric"].split(",")[0].split(" (")[0]: row["met"] for row in figures(_result(runs)).as_dict()["summary"]
    }


def test_met_only_on_one_commit_and_a_clean_tree():
    good = [_run("a" * 40), _run("a" * 40), _run("a" * 40)]
    assert verdict(good) == {"commits": ["a" * 40], "one_commit": True, "clean_tree": True, "green": True}
    assert _met(good) == {
        "fresh clone": True,
        "every run green": True,
        "every run on one commit": True,
        "working tree clean at every run": True,
    }
    spans = [_run("a" * 40), _run("b" * 40), _run("b" * 40)]  # HEAD moved between runs
    assert verdict(spans)["commits"] == ["a" * 40, "b" * 40] and not verdict(spans)["one_commit"]
    m = _met(spans)
    assert m["fresh clone"] is False and m["every run on one commit"] is False  # both times, not met
    rows = figures(_result(spans)).as_dict()["summary"]
    assert [r["met"] for r in rows[:2]] == [False, False] and rows[0]["value"] == 850.0  # the time stays as measured
    dirty = [_run("a" * 40), _run("a" * 40, dirty=True), _run("a" * 40)]
    assert _met(dirty)["fresh clone"] is False and _met(dirty)["working tree clean at every run"] is False
    red = [_run("a" * 40), _run("a" * 40, rc=1), _run("a" * 40)]
    assert _met(red)["fresh clone"] is False and _met(red)["every run green"] is False


def test_a_file_from_before_the_check_is_not_met():
    """The committed file's runs recorded no tree state and span two commits: not met."""
    import json

    from benchmarks.common import figures_function, measured_part

    old = {
        "runs": [
            {
                "commit": "8d20439",
                "exit_status": 0,
                "wall_s": 844.7,
                "setup_s": 98.3,
                "counts": {"passed": 1},
                "pytest_s": 746.3,
                "slowest": [["t", "call", 1.0]],
            },
            {
                "commit": "2904433",
                "exit_status": 0,
                "wall_s": 807.2,
                "setup_s": 88.7,
                "counts": {"passed": 1},
                "pytest_s": 718.6,
                "slowest": [["t", "call", 1.0]],
            },
        ],
        "wall_s_median": 815.2,
        "target_s": 900.0,
    }
    rows = figures(old).as_dict()["summary"]
    assert rows[0]["value"] == 815.2 and rows[0]["met"] is False
    clean = next(r for r in rows if r["metric"].startswith("working tree"))
    assert clean["value"] is None and clean["met"] is False  # not recorded is not clean
    # and the committed file: "met" only where its runs were one commit, a clean tree, all green
    committed = json.loads((ROOT / "benchmarks" / "results" / "suite_time.json").read_text())
    headline = figures_function(ROOT / "benchmarks" / "suite_time.py")(measured_part(committed)).as_dict()["summary"][0]
    v = verdict(committed["runs"])
    assert not headline["met"] or (v["one_commit"] and v["clean_tree"] and v["green"]), v


def test_a_dirty_tree_is_refused_before_anything_runs(tmp_path, monkeypatch):
    """`suite_time.py` on a tree with uncommitted changes exits 2 and clones nothing."""
    monkeypatch.setattr(suite_time, "tree_dirty", lambda root=None: True)
    monkeypatch.setattr(suite_time, "one_run", lambda *a, **kw: pytest.fail("a run started on a dirty tree"))
    assert suite_time.main(["--repeats", "1", "--out", str(tmp_path / "x.json")]) == 2
    assert not (tmp_path / "x.json").exists()


def test_tree_dirty_reads_git(tmp_path):
    """A repository with a changed tracked file is dirty; an untracked file alone is not."""

    def git(*a):
        subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True)

    git("init", "-q")
    (tmp_path / "f").write_text("1")
    git("add", "f")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    assert suite_time.tree_dirty(tmp_path) is False
    (tmp_path / "new").write_text("untracked")
    assert suite_time.tree_dirty(tmp_path) is False
    (tmp_path / "f").write_text("2")
    assert suite_time.tree_dirty(tmp_path) is True
