"""``benchmarks/gpu.py --smoke``: the GPU benchmark script runs end to end on CPU.

The script has no GPU to run on here, so this runs its smoke mode in a subprocess (the Triton
interpreter needs ``TRITON_INTERPRET=1`` before triton is imported, and an out-of-bounds load
can crash it): every part (attention kernels vs SDPA, engine batch-1 decode, engine vs HF
throughput) at tiny sizes in float32. Only CUDA events, the L2 flush and CUDA-graph capture
are left out. About 20 s on a 2-core host (the engine runs the Triton kernels interpreted).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# max|ours - SDPA| over the output, float32 (the script's own bound, SMOKE_MAX_ABS_DIFF;
# observed ~1e-6 for outputs of magnitude ~1).
MAX_ABS_DIFF = 1e-4

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _positive(row: dict, *keys: str) -> None:
    for k in keys:
        v = row.get(k)
        assert isinstance(v, (int, float)) and math.isfinite(v) and v > 0, (k, row)


def _run_smoke(out: Path, *args: str) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--smoke", "--out", str(out), *args],
        capture_output=True,
        text=True,
        cwd=str(ROOT),
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> dict:
    return _run_smoke(tmp_path_factory.mktemp("gpu_smoke") / "x.json")


def test_fp8_kv_cache_parts(tmp_path):
    """``--kv-cache-dtype fp8``: the kernels over float8 caches match SDPA over the dequantized
    values, and the engine runs with a float8 cache."""
    rep = _run_smoke(tmp_path / "fp8.json", "--kv-cache-dtype", "fp8", "--parts", "attention,engine-decode")
    assert rep["kv_cache_dtype"] == "fp8"
    for r in rep["decode_attention"] + rep["prefill_attention"]:
        assert r["kv_cache_dtype"] == "fp8" and 0 <= r["max_abs_diff_vs_sdpa"] < MAX_ABS_DIFF, r
    (eager,) = [r for r in rep["engine_decode"] if not r["cuda_graphs"]]
    assert eager["kv_cache_dtype"] == "fp8" and "error" not in eager, eager
    _positive(eager, "ms_per_token")


def test_report_header(smoke):
    assert smoke["smoke"] is True and smoke["device"] == "cpu" and smoke["dtype"] == "float32"
    _positive(smoke, "copy_bandwidth_gbps")


@pytest.mark.parametrize("part", ["decode_attention", "prefill_attention"])
def test_attention_matches_sdpa(smoke, part):
    rows = smoke[part]
    assert {r["ctx"] for r in rows} == {40, 70}
    for r in rows:
        _positive(
            r,
            "ms",
            "sdpa_ms",
            *(("gbps", "sdpa_gbps", "frac_of_copy_bw") if part == "decode_attention" else ("tflops", "sdpa_tflops")),
        )
        assert 0 <= r["max_abs_diff_vs_sdpa"] < MAX_ABS_DIFF, r


def test_engine_decode(smoke):
    rows = smoke["engine_decode"]
    eager = [r for r in rows if not r["cuda_graphs"]]
    graphs = [r for r in rows if r["cuda_graphs"]]
    assert len(eager) == 1 and len(graphs) == 1, rows
    assert "error" not in eager[0] and eager[0]["graphs_captured"] is False
    _positive(eager[0], "ms_per_token", "hbm_floor_ms", "floor_frac", "weight_gb")
    assert "CUDA" in graphs[0]["skipped"], graphs[0]  # skipped on CPU, reason recorded


def test_throughput(smoke):
    (row,) = smoke["throughput"]
    assert "error" not in row, row
    _positive(row, "engine_s", "engine_tok_s", "hf_s", "hf_tok_s", "speedup_vs_hf")
    assert row["engine_tokens"] == row["output_tokens"] > 0
    assert row["hf_requests"] == row["num_requests"] == 8


def test_w4a16_matmul(smoke):
    """The 4-bit part: the Triton kernel under the interpreter equals the widened weight's matmul."""
    rows = smoke["w4a16"]
    assert [r["rows"] for r in rows] == [1, 5]
    for r in rows:
        _positive(r, "ms", "weight_gbps", "dense_ms")
        assert 0 <= r["max_rel_diff"] < 1e-5, r
