"""Runs Triton attention cases (attention_cases.CASES) in a child process and reports each as JSON.

Triton kernels (``kvserve/kernels/triton_attention.py``) run under ``TRITON_INTERPRET=1`` on CPU tensors,
in a *subprocess*: an out-of-bounds load can crash the interpreter. This file is its own
runner: ``python tests/kernels/triton_case_runner.py --device cpu CASE...`` prints one JSON line per case.
:func:`run_cases_in_subprocess` runs all the cases it is given in one child process (to pay the
torch/triton import once) and, if the child dies, records the case it was in as crashed and starts a
fresh child for the rest (test_triton_attention.py calls it once per module, and once per GPU test).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from attention_cases import CASES, DTYPES, ROOT, _compare, _meta, make_problem, quantize_fp8, ref_attention


def run_case(name: str, device: str = "cpu", dtype: str | None = None) -> dict:
    """Run one Triton case (interpreter on CPU, compiled on CUDA); returns a result dict."""
    from kvserve.kernels import triton_attention as ta

    spec = CASES[name]
    if spec["kind"] == "heuristic":
        return _run_heuristic()
    dtype = dtype or spec["dtype"]
    if spec["kind"] == "store":
        return _run_store(spec, device, dtype)
    p = make_problem(spec, device, dtype)
    ref_problem = p
    ws = dict(window=p["window"], softcap=p["softcap"])
    if spec.get("kv") == "fp8":
        ref_problem = quantize_fp8(p)
        ws.update(k_scale=p["k_scale"], v_scale=p["v_scale"])
    out = torch.full_like(p["q"], float("nan"))
    if spec["kind"] == "prefill":
        ta.varlen_prefill_attention(
            p["q"],
            p["k_cache"],
            p["v_cache"],
            p["block_tables"],
            p["seq_lens"],
            p["cu_seqlens_q"],
            max(p["qlens"]),
            p["scale"],
            out=out,
            **ws,
        )
    elif spec["kind"] == "decode":
        ta.paged_decode_attention(
            p["q"],
            p["k_cache"],
            p["v_cache"],
            p["block_tables"],
            p["seq_lens"],
            p["scale"],
            max(p["seqlens"]),
            out=out,
            num_splits=spec["splits"],
            **ws,
        )
    else:
        out = ta.paged_attention(p["q"], p["k_cache"], p["v_cache"], _meta(p), p["scale"], out=out, **ws)
    return _compare(out, ref_attention(ref_problem), dtype)


def _run_heuristic() -> dict:
    """Split-K choice (pure Python, but importing the module decorates the kernels, which
    fixes interpreter-or-not for the process: hence also in the child)."""
    from kvserve.kernels.triton_attention import choose_num_splits

    checks = [
        choose_num_splits(64, 8, 8192, 132) == 1,  # big batch fills the GPU: no split
        choose_num_splits(1, 8, 8192, 132) == 32,  # batch 1, long context: capped at 32
        choose_num_splits(1, 8, 300, 132) == 1,  # too few keys to split
        choose_num_splits(4, 8, 2048, 132) == 8,  # 256 keys per split
    ]
    for args in [(1, 1, 10**6, 1000), (3, 2, 1000, 8), (100, 1, 100, 4)]:
        n = choose_num_splits(*args)
        checks.append(1 <= n <= 32 and n & (n - 1) == 0)
    return dict(ok=all(checks), checks=checks)


def _run_store(spec: dict, device: str, dtype: str) -> dict:
    from kvserve.kernels import triton_attention as ta

    gen = torch.Generator().manual_seed(spec["seed"])
    Hkv, D, bs, T = spec["Hkv"], spec["D"], spec["bs"], spec["T"]
    num_blocks = (T + bs - 1) // bs + 2
    fp8 = spec.get("kv") == "fp8"
    dt = torch.float8_e4m3fn if fp8 else DTYPES[dtype]
    slots = torch.randperm(num_blocks * bs, generator=gen)[:T]
    slots[torch.rand(T, generator=gen) < 0.2] = -1
    # Views with a padded token stride (as when K/V are slices of a fused qkv projection).
    kv = torch.randn(T, 2, Hkv, D, generator=gen)
    scales = dict(k_scale=2.0**-4, v_scale=0.01) if fp8 else {}
    if fp8:  # values across e4m3's whole range (subnormals, some past 448 * scale) and, in K,
        # every exact tie between neighbouring e4m3 values (round to nearest even)
        kv *= torch.logspace(-5, 1.5, T * 2 * Hkv * D)[torch.randperm(T * 2 * Hkv * D, generator=gen)].view(kv.shape)
        grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        grid = grid[grid.isfinite()].unique()
        ties = torch.cat([(grid[1:] + grid[:-1]) / 2, grid]) * scales["k_scale"]
        rows = kv[:, 0].view(T, Hkv * D)  # a view (raises if it cannot be): writes land in kv
        i = torch.arange(ties.numel())
        rows[i // (Hkv * D), i % (Hkv * D)] = ties[torch.randperm(ties.numel(), generator=gen)]
    key, value = kv[:, 0], kv[:, 1]
    # The caches are the middle of NaN buffers with one guard block on each side: a write
    # through a negative (skipped) slot or past the end lands in a guard and is detected.
    k_buf = torch.full((num_blocks + 2, bs, Hkv, D), float("nan"), dtype=dt)
    v_buf = torch.full_like(k_buf, float("nan"))
    exp_k, exp_v = k_buf.clone(), v_buf.clone()
    keep = slots >= 0
    if fp8:  # torch's own float8 rounding (nearest even) of the clamped, scaled values
        key_q, value_q = ((x / s).clamp(-448, 448) for x, s in ((key, scales["k_scale"]), (value, scales["v_scale"])))
    else:
        key_q, value_q = key, value
    raw = (lambda t: t.view(torch.uint8)) if fp8 else (lambda t: t)  # no float8 indexing in ATen
    raw(exp_k)[1:-1].reshape(-1, Hkv, D)[slots[keep]] = raw(key_q[keep].to(dt))
    raw(exp_v)[1:-1].reshape(-1, Hkv, D)[slots[keep]] = raw(value_q[keep].to(dt))
    k_buf, v_buf = k_buf.to(device), v_buf.to(device)
    ta.store_kv(key.to(device), value.to(device), k_buf[1:-1], v_buf[1:-1], slots.to(device), **scales)

    def same(a, b):
        a = a.cpu()
        if fp8:  # bit patterns (NaN guards included)
            return torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        return bool(((a == b) | (a.isnan() & b.isnan())).all())

    ok = same(k_buf, exp_k) and same(v_buf, exp_v)
    return dict(
        ok=ok, max_abs_err=0.0 if ok else float("nan"), rel_err=0.0, bound=0.0, nonfinite=0, written=int(keep.sum())
    )


# ------------------------------------------------------------------------------------------
# Subprocess driver
# ------------------------------------------------------------------------------------------


def _child_env(interpret: bool) -> dict:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.setdefault("OMP_NUM_THREADS", "2")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def run_cases_in_subprocess(
    names: list[str], device: str, dtype: str | None = None, timeout: float = 600
) -> dict[str, dict]:
    """Run ``names`` in child processes; a crash marks the current case and restarts."""
    results: dict[str, dict] = {}
    todo = list(names)
    deadline = time.monotonic() + timeout
    while todo:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--device", device]
        if dtype:
            cmd += ["--dtype", dtype]
        try:
            proc = subprocess.run(
                cmd + todo,
                capture_output=True,
                text=True,
                cwd=str(ROOT),
                env=_child_env(device == "cpu"),
                timeout=max(1.0, deadline - time.monotonic()),
            )
            stdout, stderr, rc = proc.stdout, proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
            stderr, rc = "timeout", -1
        current = None
        for line in stdout.splitlines():
            if not line.startswith("{"):
                continue
            rec = json.loads(line)
            if rec.get("status") == "start":
                current = rec["case"]
            else:
                results[rec["case"]] = rec
                current = None
        todo = [n for n in todo if n not in results]
        if current is not None:  # the child died inside this case
            results[current] = dict(case=current, ok=False, error=f"child crashed (rc={rc}): {stderr[-2000:]}")
            todo.remove(current)
        elif todo:  # died before starting anything: give up on the rest
            for n in todo:
                results[n] = dict(case=n, ok=False, error=f"child failed (rc={rc}): {stderr[-2000:]}")
            break
        if stderr == "timeout":
            for n in todo:
                results[n] = dict(case=n, ok=False, error="timeout")
            break
    return results


def _main(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("cases", nargs="*")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        assert os.environ.get("TRITON_INTERPRET") == "1", "set TRITON_INTERPRET=1 for CPU runs"
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    for name in args.cases or list(CASES):
        print(json.dumps(dict(case=name, status="start")), flush=True)
        t0 = time.perf_counter()
        try:
            rec = run_case(name, args.device, args.dtype)
        except Exception as exc:  # noqa: BLE001 - reported per case
            rec = dict(ok=False, error=f"{type(exc).__name__}: {exc}")
        rec.update(case=name, seconds=round(time.perf_counter() - t0, 2))
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
