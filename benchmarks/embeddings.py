"""Embedding throughput: kvserve against vLLM's pooling runner on the same inputs, in the same run.

Two models, each offline (no HTTP), float32:

- **decoder**: SmolLM2-135M-Instruct's final hidden states, last-token pooled and normalised.
  kvserve: the engine (``LLM.embed``, ``kvserve/engine/pooling.py``). vLLM: ``LLM(runner="pooling",
  convert="embed").embed`` (its default pooler for a converted causal LM).
- **encoder**: all-MiniLM-L6-v2 (the bundled model of ``--embedding-model bundled``). kvserve:
  ``EmbeddingServer``'s forward pass (sentence-transformers; batches of 256, what its
  ``serve.batch`` takes at most, sorted by length into padded groups), without Serve around it. vLLM: ``LLM(runner="pooling").embed``.

Workload: ``--num-inputs`` (default 256) inputs of random token ids, all submitted at once:
16..256 tokens for the decoder, [CLS] + 14..198 ids + [SEP] for the encoder (its limit is 256).
``--repeats`` timed runs (default 3), each with fresh inputs (no run hits another's prefix
cache), medians compared. Agreement check: the cosine of kvserve's and vLLM's vectors on the
first 8 inputs of the first run. vLLM runs in its own cached virtual environment
(``benchmarks/peer_vllm.py``) with both cores, right after kvserve.

Usage::

    python benchmarks/embeddings.py                 # the committed result
    python benchmarks/embeddings.py --no-peer --num-inputs 64 --repeats 1 --out /tmp/emb.json
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Figures, Results, load_average, pyplot, resolve  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("dtype", "workload", "models", "vllm_version", "agreement_min_cosine", "vllm_error", "runs")


def inputs(n: int, seed: int, lengths: tuple[int, int], vocab: int, frame: tuple[int, int] | None = None):
    """``n`` inputs of random ids in 1000..vocab-100 (lengths uniform in ``lengths``), each
    framed as ``[first] + ids + [last]`` when ``frame`` is given."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        ids = [rng.randint(1000, vocab - 100) for _ in range(rng.randint(*lengths))]
        out.append([frame[0], *ids, frame[1]] if frame else ids)
    return out


def cosine(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def run_decoder(path: str, works: list[list[list[int]]]) -> dict:
    """kvserve's engine: ``LLM.embed`` (last-token pooling) on each workload."""
    from kvserve.engine import LLM

    llm = LLM(path, dtype="float32")
    llm.embed([list(range(1000, 1064))])  # warm-up
    runs, vectors = [], None
    for i, work in enumerate(works):
        t0 = time.perf_counter()
        vecs = llm.embed(work)
        runs.append({"elapsed_s": time.perf_counter() - t0, "inputs": len(work), "tokens": sum(map(len, work))})
        vectors = vectors or vecs[:8]
    settings = {k: getattr(llm.config, k) for k in ("max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching")}
    del llm
    return {"runs": runs, "vectors": vectors, "settings": settings}


def run_encoder(works: list[list[list[int]]], batch: int = 256) -> dict:
    """``EmbeddingServer``'s forward pass (sentence-transformers) in batches of ``batch`` (its
    ``serve.batch`` size: the inputs of one request reach one call)."""
    import torch

    from kvserve.deployments.replica.embedding_server import EmbeddingServer

    threads = torch.get_num_threads()
    srv = EmbeddingServer.func_or_class(torch_num_threads=threads)  # both cores, as vLLM has
    srv._forward([[101, 7592, 102]])  # warm-up
    runs, vectors = [], None
    for work in works:
        t0 = time.perf_counter()
        vecs = [v for k in range(0, len(work), batch) for v in srv._forward(work[k : k + batch])]
        runs.append({"elapsed_s": time.perf_counter() - t0, "inputs": len(work), "tokens": sum(map(len, work))})
        vectors = vectors or vecs[:8]
    return {"runs": runs, "vectors": vectors, "settings": {"batch": batch, "torch_threads": threads}}


def summarise(system: str, model: str, r: dict) -> dict:
    per_s = [x["inputs"] / x["elapsed_s"] for x in r["runs"]]
    tok_s = [x["tokens"] / x["elapsed_s"] for x in r["runs"]]
    return {
        "system": system,
        "model": model,
        "inputs_per_s": round(statistics.median(per_s), 2),
        "runs_inputs_per_s": [round(x, 2) for x in per_s],
        "tokens_per_s": round(statistics.median(tok_s), 1),
        "settings": r.get("settings"),
        "load_average_after": load_average(),
    }


def plot(rows: list[dict], path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.2))
    labels = [f"{r['model']}\n{r['system']}" for r in rows]
    ax.bar(
        range(len(rows)),
        [r["inputs_per_s"] for r in rows],
        color=["#1f77b4" if r["system"] == "kvserve" else "#ff7f0e" for r in rows],
    )
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("inputs / s (median)")
    ax.set_title("Embedding throughput, float32, offline (higher is better)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    what = {
        "decoder": "embeddings of SmolLM2 (last-token pooling), inputs/s, kvserve engine / vLLM pooling runner",
        "encoder": "embeddings of all-MiniLM-L6-v2, inputs/s, sentence-transformers / vLLM pooling runner",
    }
    for x in r["runs"]:
        if x["system"] == "kvserve" and "kvserve_over_vllm" in x:
            f.summary(what.get(x["model"], x["model"]), x["kvserve_over_vllm"], "x", headline=True)
    for m, c in (r.get("agreement_min_cosine") or {}).items():
        f.summary(f"agreement with vLLM, {m}: the smallest cosine of the vectors over the first 8 inputs", c)
    w = r["workload"]
    note = (
        f"{w['num_inputs']} inputs of random token ids per run (decoder {w['decoder_lengths'][0]}.."
        f"{w['decoder_lengths'][1]} tokens, encoder {w['encoder_lengths'][0]}..{w['encoder_lengths'][1]}), "
        f"all at once, offline, {r['dtype']}; median of {w['repeats']} runs, each with fresh inputs."
    )
    if r.get("vllm_version"):
        note += f" vLLM {r['vllm_version']}."
    if r.get("vllm_error"):
        note += f" vLLM failed: {r['vllm_error']}"
    f.table(
        "Runs",
        ["system", "model", "inputs/s", "runs", "tokens/s", "kvserve / vLLM (x)", "load after"],
        [
            [
                x["system"],
                r["models"][x["model"]],
                x["inputs_per_s"],
                x["runs_inputs_per_s"],
                x["tokens_per_s"],
                x.get("kvserve_over_vllm"),
                x.get("load_average_after"),
            ]
            for x in r["runs"]
        ],
        note=note,
    )
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-inputs", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-peer", action="store_true", help="kvserve only (no vLLM)")
    ap.add_argument("--out", default=str(RESULTS / "embeddings.json"))
    a = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)

    from kvserve.deployments.contract.encoder import bundled_encoder_path

    dec_path, vocab = resolve(None)
    enc_path = str(bundled_encoder_path())
    n, reps = a.num_inputs, a.repeats
    dec_works = [inputs(n, a.seed + i, (16, 256), vocab) for i in range(reps)]
    enc_works = [inputs(n, a.seed + 100 + i, (14, 198), 30522, frame=(101, 102)) for i in range(reps)]

    ours = {"decoder": run_decoder(dec_path, dec_works), "encoder": run_encoder(enc_works)}
    rows = [summarise("kvserve", m, ours[m]) for m in ("decoder", "encoder")]
    result: dict = {
        "dtype": "float32",
        "workload": {
            "num_inputs": n,
            "repeats": reps,
            "seed": a.seed,
            "decoder_lengths": [16, 256],
            "encoder_lengths": [16, 200],
            "decoder_tokens_per_run": [sum(map(len, w)) for w in dec_works],
            "encoder_tokens_per_run": [sum(map(len, w)) for w in enc_works],
        },
        "models": {
            "decoder": "HuggingFaceTB/SmolLM2-135M-Instruct (last-token pooling)",
            "encoder": "sentence-transformers/all-MiniLM-L6-v2 (mean pooling)",
        },
    }
    if not a.no_peer:
        from benchmarks.peer_vllm import run_vllm_embed

        try:
            theirs = {
                "decoder": run_vllm_embed(dec_path, "float32", dec_works, convert="embed"),
                "encoder": run_vllm_embed(enc_path, "float32", enc_works),
            }
            result["vllm_version"] = theirs["decoder"]["version"]
            for m in ("decoder", "encoder"):
                row = summarise("vllm", m, theirs[m])
                rows.append(row)
                mine = next(r for r in rows if r["system"] == "kvserve" and r["model"] == m)
                mine["kvserve_over_vllm"] = round(mine["inputs_per_s"] / row["inputs_per_s"], 3)
                result.setdefault("agreement_min_cosine", {})[m] = round(
                    min(cosine(x, y) for x, y in zip(ours[m]["vectors"], theirs[m]["vectors"])), 6
                )
        except Exception as e:  # the figures of kvserve stand; say why vLLM's are missing
            result["vllm_error"] = f"{type(e).__name__}: {e}"[:500]
    result["runs"] = rows
    result = prov.write(a.out, result)
    plot(rows, Path(a.out).with_suffix(".png"))
    for r in rows:
        print(r["system"], r["model"], r["inputs_per_s"], "inputs/s", r.get("kvserve_over_vllm", ""))
    return result


if __name__ == "__main__":  # vLLM spawns processes
    main()
