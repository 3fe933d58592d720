"""benchmarks/suite_time.py reads pytest's last line and its slowest tests from a `make test`
output; a run that did not get that far has no counts (never a made-up time)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.suite_time import parse_output  # noqa: E402

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
    assert r["slowest"][0] == ["tests/cluster/test_autoscaling_nodes.py::test_scale_up_adds_a_node_and_scale_down_"
                               "removes_it", "call", 72.68]
    assert [s[1] for s in r["slowest"]] == ["call", "setup", "teardown"]


def test_a_failed_run_is_read_as_such():
    r = parse_output("FAILED tests/x.py::test_y\n1 failed, 1360 passed, 15 skipped in 821.61s (0:13:41)\n")
    assert r["counts"] == {"failed": 1, "passed": 1360, "skipped": 15} and r["pytest_s"] == 821.61
    assert parse_output("make: *** [Makefile:17] Error 2\n") == {"counts": {}, "pytest_s": None, "slowest": []}
