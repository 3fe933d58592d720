"""Where a 4-bit batch-1 decode step's matmul time goes: the CPU GEMVs per weight shape, measured here.

For SmolLM2-135M's four decoder-layer weight shapes (qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536), one activation row (batch-1 decode), the microseconds per call and the bytes of weight read
per second of:

* ``w4a16_g32``, ``w4a16_g64``, ``w4a16_channel``: ``kvserve.kernels.cpu_backend.w4a16_linear`` (the 4-bit
  GEMV, ``kvserve/kernels/csrc/w4a16_linear_cpu.cpp``) on random 4-bit weights in asymmetric groups of 32, 64,
  or one scale per row;
* ``int8``: the int8 GEMV (``kvserve.kernels.cpu_backend.int8_linear``);
* ``float32``: oneDNN on the prepacked float32 weight, as the engine runs it (``kvserve.engine.layers.linear``);
* ``bf16_weights``: bf16 weights, where the CPU has no native bf16 the widening GEMV
  (``kvserve.kernels.cpu_backend.bf16_weight_linear``), else oneDNN on the prepacked bf16 weight.

Also the nanoseconds per 32 weights for the 4-bit kernel with the weights of all 30 layers (so they
come from memory, not from cache as in the per-shape loop), which says whether it is bound by
memory or by the widening's arithmetic. Median of 7 repetitions after 3 warm-ups.

Usage::

    python benchmarks/w4a16_gemv.py          # writes benchmarks/results/w4a16_gemv.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Figures, Results  # noqa: E402
from kvserve.engine.config import cpu_native_bf16  # noqa: E402
from kvserve.engine.layers.linear import linear, prepack_weight  # noqa: E402
from kvserve.engine.layers.w4a16 import build_w4  # noqa: E402
from kvserve.kernels import cpu_backend  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("shapes", "native_bf16", "per_shape", "streaming")

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
LAYERS = 30


def timed(fn, reps: int = 7, inner: int = 50) -> float:
    """Median seconds of one call of ``fn`` (``inner`` calls per repetition)."""
    for _ in range(3):
        fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t) / inner)
    return statistics.median(out)


def random_w4(n: int, k: int, gs: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return build_w4(
        torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8),
        torch.rand(n, k // gs, generator=g) * 0.02,
        torch.randint(0, 16, (n, k // gs), generator=g).float(),
        None,
    )


def per_shape() -> list[dict]:
    rows = []
    for name, (n, k) in SHAPES.items():
        x = torch.randn(1, k)
        dense = torch.randn(n, k)
        packed = prepack_weight(dense)
        q8, s8 = cpu_backend.quantize_int8(dense)
        wb = dense.bfloat16()
        xb = x.bfloat16()
        packed_b = prepack_weight(wb)
        kernels = {
            "float32": (lambda: linear(x, dense, None, packed), dense.numel() * 4),
            "bf16_weights": (lambda: linear(xb, wb, None, packed_b), wb.numel() * 2),
            "int8": (lambda: cpu_backend.int8_linear(x, q8, s8), q8.numel() + s8.numel() * 4),
        }
        for label, gs in (("w4a16_g32", 32), ("w4a16_g64", 64), ("w4a16_channel", k)):
            w = random_w4(n, k, gs, seed=n + gs)
            kernels[label] = (
                lambda w=w: cpu_backend.w4a16_linear(x, w.qweight, w.scales, w.szeros, w.group_size),
                w.nbytes(),
            )
        for label, (fn, nbytes) in kernels.items():
            s = timed(fn)
            rows.append(
                {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "kernel": label,
                    "us": s * 1e6,
                    "weight_bytes": nbytes,
                    "gbps": nbytes / s / 1e9,
                }
            )
    return rows


def streaming() -> list[dict]:
    """Every layer's four weights (30 layers: the model's bytes, beyond the caches) through the 4-bit
    GEMV once: ns per 32 weights and GB/s."""
    out = []
    for label, gs in (("w4a16_g32", 32), ("w4a16_channel", None)):
        ws = [
            (random_w4(n, k, gs or k, seed=i * 7 + j), torch.randn(1, k))
            for i in range(LAYERS)
            for j, (n, k) in enumerate(SHAPES.values())
        ]

        def step():
            for w, x in ws:
                cpu_backend.w4a16_linear(x, w.qweight, w.scales, w.szeros, w.group_size)

        s = timed(step, reps=5, inner=3)
        weights = sum(w.shape[0] * w.shape[1] for w, _ in ws)
        nbytes = sum(w.nbytes() for w, _ in ws)
        out.append(
            {
                "kernel": label,
                "calls": len(ws),
                "ms_per_pass": s * 1e3,
                "weights": weights,
                "weight_bytes": nbytes,
                "gbps": nbytes / s / 1e9,
                "ns_per_32_weights": s * 1e9 / (weights / 32),
                "threads": torch.get_num_threads(),
            }
        )
    return out


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    for x in r["streaming"]:
        f.summary(
            f"{x['kernel']}: every layer's weights once (batch-1 decode's linears)",
            x["ms_per_pass"],
            "ms",
            headline=x["kernel"] == "w4a16_g32",
        )
        f.summary(f"{x['kernel']}: time per 32 weights, {x['threads']} threads", x["ns_per_32_weights"], "ns")
    f.table(
        "One activation row per weight shape",
        ["shape", "kernel", "us per call", "weight bytes", "GB/s"],
        [[x["shape"], x["kernel"], x["us"], x["weight_bytes"], x["gbps"]] for x in r["per_shape"]],
        note="SmolLM2-135M's decoder-layer shapes; weights reused across calls (from cache).",
    )
    f.table(
        "The 4-bit GEMV over the whole model's linear weights",
        ["kernel", "calls", "ms per pass", "weight bytes", "GB/s", "ns per 32 weights"],
        [
            [x["kernel"], x["calls"], x["ms_per_pass"], x["weight_bytes"], x["gbps"], x["ns_per_32_weights"]]
            for x in r["streaming"]
        ],
    )
    return f


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="benchmarks/results/w4a16_gemv.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    if not cpu_backend.load_kernel():
        raise SystemExit(f"the CPU kernels are not built: {cpu_backend.kernel_error()}")
    torch.set_grad_enabled(False)
    result = {
        "shapes": {k: list(v) for k, v in SHAPES.items()},
        "native_bf16": cpu_native_bf16()[0],
        "per_shape": per_shape(),
        "streaming": streaming(),
    }
    for x in result["streaming"]:
        print(x)
    prov.write(args.out, result, indent=1)


if __name__ == "__main__":
    main()
