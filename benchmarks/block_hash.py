"""The cost of a prefix-cache block hash, per block: Python's builtin ``hash((parent, tokens))``
(kvserve's old block name, collidable: vLLM's CVE-2025-25183 class) against the SHA-256 chained
hash of ``kvserve/engine/kv_cache_manager.py`` (``hash_block``), for blocks of 16 tokens (the
engine's default ``block_size``) and of 32 and 64.

A micro-benchmark of one core: ``--blocks`` chained blocks hashed ``--repeats`` times, the
median per block in microseconds. Writes ``benchmarks/results/block_hash.json`` whole (commit,
machine, load average, command: ``benchmarks/common.py``'s ``Results``).

    .venv/bin/python benchmarks/block_hash.py            # ~10 s
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import Figures  # noqa: E402

RESULT_KEYS = ("blocks", "repeats", "rows")


def _builtin(parent: int, tokens: list[int]) -> int:
    return hash((parent, tuple(tokens)))


def _per_block_us(fn, blocks: list[list[int]], repeats: int) -> float:
    """Median over ``repeats`` of the seconds to chain ``blocks``, per block, microseconds."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        parent = 0
        for b in blocks:
            parent = fn(parent, b)
        times.append((time.perf_counter() - t0) / len(blocks))
    return statistics.median(times) * 1e6


def measure(n_blocks: int, repeats: int) -> dict:
    from kvserve.engine.kv_cache_manager import hash_block, root_hash

    rng = random.Random(0)
    root = root_hash("bench")
    rows = []
    for bs in (16, 32, 64):
        blocks = [[rng.randrange(150_000) for _ in range(bs)] for _ in range(n_blocks)]
        old = _per_block_us(_builtin, blocks, repeats)
        new = _per_block_us(lambda p, b: hash_block(p or root, b), blocks, repeats)
        rows.append(
            {"block_size": bs, "builtin_us": old, "sha256_us": new, "ratio": new / old, "sha256_us_per_token": new / bs}
        )
    return {"blocks": n_blocks, "repeats": repeats, "rows": rows}


def figures(r: dict) -> Figures:
    f = Figures()
    r16 = next(row for row in r["rows"] if row["block_size"] == 16)
    f.summary("SHA-256 block hash, 16 tokens", r16["sha256_us"], "us per block")
    f.summary("builtin hash, 16 tokens", r16["builtin_us"], "us per block")
    f.table(
        "Block hash cost per block",
        ["block_size", "builtin (us)", "sha256 (us)", "ratio", "sha256 us/token"],
        [
            [row["block_size"], row["builtin_us"], row["sha256_us"], row["ratio"], row["sha256_us_per_token"]]
            for row in r["rows"]
        ],
        note=f"median of {r['repeats']} chains of {r['blocks']} blocks, one core",
    )
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=20000, help="chained blocks per repeat")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "block_hash.json")
    args = ap.parse_args(argv)
    from benchmarks.common import Results

    prov = Results(__file__, RESULT_KEYS)
    result = measure(args.blocks, args.repeats)
    prov.write(args.out, result)
    for row in result["rows"]:
        print(
            f"block_size {row['block_size']:3d}: builtin {row['builtin_us']:.2f} us, sha256 {row['sha256_us']:.2f} us "
            f"per block ({row['ratio']:.1f}x)"
        )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
