"""CPU matmul libraries per shape: what ``engine/layers/linear.py`` chooses from, measured here.

For a model's four decoder-layer weight shapes (default SmolLM2-135M: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) and the LM head, at 1..2048 activation rows, GFLOP/s of:

* ``aten``: ``F.linear`` (MKL sgemm for float32);
* ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the plain weight;
* ``onednn_prepacked``: the same on the weight reordered once for 64-row batches
  (``torch.ops.mkldnn._reorder_linear_weight``), as the engine keeps it.

Layer shapes are summed (one decoder layer's matmuls); the LM head is reported alone (up to 256
rows: the engine computes logits only for the rows that sample). Median of 5 timed repetitions
after 2 warm-ups, in float32 and bfloat16 (on a CPU without native bf16 only 1, 16 and 64 rows:
there it is emulated, and slow).

Usage::

    python benchmarks/cpu_linear.py                 # writes benchmarks/results/cpu_linear.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Figures, Results, add_model_arg  # noqa: E402
from engine.config import cpu_native_bf16  # noqa: E402
from engine.model_loader import load_config, resolve_model  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("layer_shapes", "lm_head", "native_bf16", "gflops")

ROWS = (1, 4, 16, 64, 128, 256, 512, 2048)


def shapes(cfg) -> dict[str, tuple[int, int]]:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, kv, q = cfg.hidden_size, cfg.num_key_value_heads * hd, cfg.num_attention_heads * hd
    return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * cfg.intermediate_size, h),
            "down": (h, cfg.intermediate_size)}


def gflops(fns, flop: float, budget_flop: float = 2e9) -> float:
    reps = max(1, int(budget_flop / flop))

    def run():
        for f in fns:
            f()

    run()
    run()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            run()
        times.append((time.perf_counter() - t) / reps)
    return flop / statistics.median(times) / 1e9


def measure(named: dict[str, tuple[int, int]], dtype: torch.dtype, rows=ROWS) -> dict:
    g = torch.Generator().manual_seed(0)
    w = {n: (torch.randn(N, K, generator=g) * 0.02).to(dtype) for n, (N, K) in named.items()}
    try:
        packed = {n: torch.ops.mkldnn._reorder_linear_weight(x, 64) for n, x in w.items()}
    except RuntimeError as e:
        packed = None
        print(f"{dtype}: no prepacked oneDNN weights on this CPU ({str(e).splitlines()[0][:100]})")
    out = {}
    for m in rows:
        x = {n: torch.randn(m, K, generator=g).to(dtype) for n, (N, K) in named.items()}
        flop = sum(2 * m * N * K for N, K in named.values())
        row = {"aten": gflops([lambda n=n: torch.nn.functional.linear(x[n], w[n]) for n in named], flop)}
        try:
            row["onednn"] = gflops([lambda n=n: torch.ops.mkldnn._linear_pointwise(x[n], w[n], None, "none", [], "")
                                    for n in named], flop)
        except RuntimeError:
            pass
        if packed:
            row["onednn_prepacked"] = gflops(
                [lambda n=n: torch.ops.mkldnn._linear_pointwise(x[n], packed[n], None, "none", [], "") for n in named],
                flop)
        out[str(m)] = {k: round(v, 1) for k, v in row.items()}
        print(dtype, m, out[str(m)], flush=True)
    return out


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f = Figures().summary("native bfloat16 on this CPU", r.get("native_bf16"))
    shapes = ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in r["layer_shapes"].items())
    for dtype, parts in r["gflops"].items():
        for part, per_rows in parts.items():
            libs = []
            for rec in per_rows.values():
                libs += [lib for lib in rec if lib not in libs]
            title = "decoder layer (its four matmuls summed)" if part == "decoder_layer" else part
            f.table(f"{dtype}, {title}, GFLOP/s", ["rows"] + libs,
                    [[n] + [rec.get(lib) for lib in libs] for n, rec in per_rows.items()],
                    note=f"Shapes (out x in): {shapes}, LM head {r['lm_head'][0]}x{r['lm_head'][1]}.")
    return f


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--out", default="benchmarks/results/cpu_linear.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    cfg = load_config(resolve_model(args.model))
    layer = shapes(cfg)
    result = {"layer_shapes": layer, "lm_head": [cfg.vocab_size, cfg.hidden_size],
              "native_bf16": cpu_native_bf16()[0], "gflops": {}}
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).removeprefix("torch.")
            emulated = dt == torch.bfloat16 and not result["native_bf16"]
            rows = (1, 16, 64) if emulated else ROWS  # emulated bf16 is slow: a few sizes show it
            result["gflops"][name] = {
                "decoder_layer": measure(layer, dt, rows),
                "lm_head": measure({"lm_head": (cfg.vocab_size, cfg.hidden_size)}, dt,
                                   [r for r in rows if r <= 256])}
    prov.write(args.out, result)


if __name__ == "__main__":
    main()
