"""Pipeline parallelism's cost on one machine: PP=2 against PP=1 (and TP=2) on the same cores.

Offline, SmolLM2-135M-Instruct in float32, the throughput workload of ``benchmarks/common.py``
(``--requests`` requests, prompts 32..256 tokens, outputs 16..128, greedy, ``ignore_eos``), all
submitted at once. Configurations, each a fresh engine, ``--runs`` runs each (median reported):

* ``pp1``: the engine alone in this process, 2 torch threads (the baseline);
* ``pp2``: two pipeline stages (15 layers each) as Ray actors of 1 thread each, activations sent
  by gloo over loopback, each step's batch cut into two micro-batches;
* ``tp2``: two tensor-parallel ranks as Ray actors of 1 thread each (for comparison).

On one 2-core machine a pipeline cannot be faster than one process using both cores: its stages
split the same cores, and it adds what a pipeline costs (each step's batch cut into micro-batches
that are smaller matmuls, the activations' sends and receives, the pipeline filling and draining
at every step, and a Ray call per step). The figure measures that overhead honestly; pipeline
parallelism pays off when a model does not fit one node's memory, which one machine cannot show.
Every configuration's texts must equal ``pp1``'s (checked).

Usage::

    python benchmarks/pipeline.py            # -> benchmarks/results/pipeline.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
RESULTS = ROOT / "benchmarks" / "results"

from benchmarks.common import Figures  # noqa: E402

#: The top-level keys this script writes (besides benchmarks.common.PROVENANCE_KEYS).
RESULT_KEYS = ("workload", "configs", "note")

#: configuration -> (pipeline_parallel_size, tensor_parallel_size)
CONFIGS = {"pp1": (1, 1), "pp2": (2, 1), "tp2": (1, 2)}


def one_run(name: str, model: str, work, kv_blocks: int) -> dict:
    """A fresh engine of configuration ``name`` over ``work``; ``benchmarks.common.run_kvserve``'s
    figures (texts kept for the equality check)."""
    import torch

    from benchmarks.common import run_kvserve
    from kvserve.engine import LLM

    pp, tp = CONFIGS[name]
    kw = dict(dtype="float32", max_num_seqs=64, num_kv_blocks=kv_blocks)
    if pp * tp == 1:
        torch.set_num_threads(2)
        llm = LLM(model, **kw)
    else:
        from kvserve.cluster.worker_group import RayWorkerGroup

        def factory(config, path):
            return RayWorkerGroup(config, path, num_cpus=1, torch_num_threads=1, timeout_s=120)

        llm = LLM(model, pipeline_parallel_size=pp, tensor_parallel_size=tp, executor_factory=factory, **kw)
    try:
        return run_kvserve(llm, work)
    finally:
        llm.engine.shutdown()


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    f, c, w = Figures(), r["configs"], r["workload"]
    if "pp2" in c:
        f.summary(
            "pipeline parallelism on one machine: PP=2 / the engine alone on the same cores, offline (the "
            "pipeline's cost, not a speed-up)",
            c["pp2"]["vs_pp1"],
            "x",
            headline=True,
        )
    if "tp2" in c:
        f.summary(
            "tensor parallelism on one machine: TP=2 / the engine alone on the same cores", c["tp2"]["vs_pp1"], "x"
        )
    f.table(
        "Configurations",
        [
            "config",
            "pipeline stages",
            "tensor ranks",
            "output tok/s (runs)",
            "median",
            "vs the engine alone (x)",
            "texts equal the engine alone's",
        ],
        [
            [
                name,
                x["pipeline_parallel_size"],
                x["tensor_parallel_size"],
                [y["output_tok_per_s"] for y in x["runs"]],
                x["output_tok_per_s_median"],
                x["vs_pp1"],
                x["texts_equal_pp1"],
            ]
            for name, x in c.items()
        ],
        note=f"{w['model']} in {w['dtype']}, {w['num_requests']} requests ({w['prompt_tokens']} prompt and "
        f"{w['output_tokens']} output tokens), all at once, offline. {r['note']}.",
    )
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(RESULTS / "pipeline.json"))
    a = ap.parse_args(argv)
    from benchmarks.common import Results, make_workload, private_ray_token, resolve, workload_info

    prov = Results(__file__, RESULT_KEYS)

    private_ray_token()
    import ray

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    model, vocab = resolve(None)
    work = make_workload(a.requests, a.seed, vocab)
    rows, texts = {}, {}
    try:
        for _ in range(a.runs):  # interleaved: drift of the machine hits every configuration alike
            for name in CONFIGS:
                r = one_run(name, model, work, kv_blocks=1024)
                texts.setdefault(name, r.pop("texts"))
                rows.setdefault(name, []).append({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()})
                print(name, round(r["output_tok_per_s"], 1), "tok/s", flush=True)
    finally:
        ray.shutdown()
    med = {n: statistics.median(r["output_tok_per_s"] for r in rs) for n, rs in rows.items()}
    result = {
        "workload": {**workload_info(work, a.seed), "model": "SmolLM2-135M-Instruct", "dtype": "float32"},
        "configs": {
            n: {
                "pipeline_parallel_size": CONFIGS[n][0],
                "tensor_parallel_size": CONFIGS[n][1],
                "runs": rows[n],
                "output_tok_per_s_median": round(med[n], 1),
                "vs_pp1": round(med[n] / med["pp1"], 3),
                "texts_equal_pp1": texts[n] == texts["pp1"],
            }
            for n in rows
        },
        "note": "one 2-core machine: the stages share the cores the baseline uses alone, so this is the "
        "pipeline's overhead, not a speed-up (see the module docstring)",
    }
    result = prov.write(a.out, result)
    print(json.dumps({n: {k: v for k, v in c.items() if k != "runs"} for n, c in result["configs"].items()}, indent=1))
    return result


if __name__ == "__main__":
    main()
