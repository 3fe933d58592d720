"""Engine step times and where they go: the CPU path before and after issue 15, in one run.

Measures ``LLMEngine.step()`` wall time (seconds) on SmolLM2-135M-Instruct (default) in
float32 on this machine's default device, for two configurations of the same engine:

* ``before``: the plain path (torch attention backend, which gathers K/V through the block
  tables; ATen ops; ``F.linear``, i.e. MKL sgemm);
* ``after``: the default path (the C++ paged-attention kernel, fused element-wise ops, oneDNN
  linears).

Per configuration:

* prefill: a single request of ``--prefill-tokens`` random token ids, so the step is one
  prefill chunk of that many tokens (the chunk's attention is causal over itself);
* decode: ``--batch`` requests with prompts uniform in 100..200 tokens, run past their
  prefill, then the median of ``--iters`` decode steps (every request generating);
* breakdown of the decode step (ms per step, from ``torch.profiler`` over ``--iters`` steps):
  ``matmul`` (linears and the LM head), ``attention`` (K/V store, gather, attention kernels),
  ``other`` (every other op: norms, RoPE, activations, sampling, embedding), and ``host``
  (the step's wall time not spent in any op: scheduling, input preparation, detokenization).

With ``--host-only``: the engine's **host time per decode step** (everything but the forward:
scheduling, input preparation, sampling, output processing and detokenization) at decode
batches of 1, 64 and 256, measured with a zero-cost forward (the model returns a preallocated
hidden state and fixed logits, so a step costs only the engine's own work), split by phase:
``schedule`` (``Scheduler.schedule``), ``prepare`` (the model runner's per-request state and
flat input tensors), ``sample`` (the sampler on ``[batch, vocab]`` float32 logits: device work
on a GPU, counted apart), ``update`` (the rest of ``LLMEngine.step``: the scheduler's
per-request update, stop checks, detokenization, outputs). This is the engine's share of a
step that a GPU does not hide: on the H100 batch-1 decode took 3.6 ms/token against a 0.4 ms
HBM floor (``benchmarks/results/gpu_nvidia-h100-80gb-hbm3.json``).

Usage::

    python benchmarks/step_times.py                  # writes benchmarks/results/step_times.json
    python benchmarks/step_times.py --prefill-tokens 64 --batch 2 --iters 2 --out /tmp/st.json   # smoke
    python benchmarks/step_times.py --host-only      # writes benchmarks/results/host_times.json
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvserve.engine.layers.linear as linear  # noqa: E402
from benchmarks.common import Figures, Results, add_model_arg, greedy, random_token_ids  # noqa: E402
from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.model_loader import resolve_model  # noqa: E402
from kvserve.kernels import cpu_backend  # noqa: E402

#: Profiler op names per category (anything else is "other").
MATMUL = ("mkldnn::_linear_pointwise", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
ATTENTION = (
    "kvserve_cpu::paged_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::index_select",
    "aten::index_copy_",
    "aten::_efficient_attention_forward",
)

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS): step_times.json's, then
#: host_times.json's (``--host-only``).
RESULT_KEYS = (
    "model",
    "threads",
    "prefill_tokens",
    "decode_batch",
    "before",
    "after",
    "decode_speedup",
    "prefill_speedup",
    "host_time_per_decode_step",
)
CONFIGS = {
    "before": {"attention_backend": "torch", "cpu_linear": "aten", "fused_ops": False},
    "after": {"attention_backend": None, "cpu_linear": linear.CPU_LINEAR, "fused_ops": cpu_backend.FUSED_OPS},
}


def breakdown(eng, steps: int, step_ms: float) -> dict:
    """ms per step of matmul / attention / other ops over ``steps`` profiled engine steps, and
    ``host``: ``step_ms`` (the unprofiled median step) minus those (the profiler's own overhead
    would inflate a host share taken from the profiled wall time)."""
    from torch.profiler import profile

    t = time.perf_counter()
    with profile() as prof:
        for _ in range(steps):
            eng.step()
    wall = (time.perf_counter() - t) * 1e3 / steps
    cats = {"matmul": 0.0, "attention": 0.0, "other": 0.0}
    for ev in prof.key_averages():
        if ev.key.startswith("ProfilerStep"):
            continue
        cat = "matmul" if ev.key in MATMUL else "attention" if ev.key in ATTENTION else "other"
        cats[cat] += ev.self_cpu_time_total / 1e3 / steps
    cats["host"] = max(0.0, step_ms - sum(cats.values()))
    cats["wall_under_profiler"] = wall
    return {k: round(v, 2) for k, v in cats.items()}


def measure(model: str, args, cfg: dict) -> dict:
    linear.CPU_LINEAR, cpu_backend.FUSED_OPS = cfg["cpu_linear"], cfg["fused_ops"]
    llm = LLM(
        model=model,
        max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.prefill_tokens),
        attention_backend=cfg["attention_backend"],
    )
    eng, rng = llm.engine, random.Random(0)
    vocab = eng.hf_config.vocab_size

    prefill = []
    for k in range(3):  # the first is a warm-up
        eng.add_request(
            f"p{k}", random_token_ids(rng, args.prefill_tokens, vocab), SamplingParams(max_tokens=1, temperature=0)
        )
        t = time.perf_counter()
        eng.step()
        prefill.append(time.perf_counter() - t)
        while eng.has_unfinished_requests():
            eng.step()

    for i in range(args.batch):
        eng.add_request(f"d{i}", random_token_ids(rng, rng.randint(100, 200), vocab), greedy(10_000))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    contexts = sorted(r.num_computed_tokens for r in eng.scheduler.requests.values())
    decode = []
    for _ in range(args.iters):
        t = time.perf_counter()
        eng.step()
        decode.append(time.perf_counter() - t)
    decode.sort()
    result = {
        "config": cfg,
        "prefill_step_s": sorted(prefill[1:])[0],
        "decode_context_tokens": [contexts[0], contexts[-1] + args.iters],  # min .. max over the timed steps
        "decode_step_s_p50": decode[len(decode) // 2],
        "decode_breakdown_ms": breakdown(eng, args.iters, 1e3 * decode[len(decode) // 2]),
    }
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(3):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
    for rid in list(eng.scheduler.requests):
        eng.abort_request(rid)
    return result


class _Timed:
    """Wraps a callable and adds its wall time (seconds) to ``totals[name]``."""

    def __init__(self, fn, totals: dict, name: str):
        self.fn, self.totals, self.name = fn, totals, name

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self.fn(*a, **kw)
        finally:
            self.totals[self.name] += time.perf_counter() - t


def host_times(model: str, batches=(1, 64, 256), iters: int = 30, prompt_tokens: int = 100) -> dict:
    """ms per decode step, median over ``iters`` steps, per batch size, with a zero-cost forward
    (module docstring), and the mean split by phase (ms)."""
    llm = LLM(model=model, max_num_seqs=max(batches), enable_prefix_caching=False)
    eng, rng = llm.engine, random.Random(0)
    runner = eng.executor.runner
    vocab, hidden = eng.hf_config.vocab_size, eng.hf_config.hidden_size
    width = max(batches) * 2 + 2048
    hidden_buf = torch.zeros(width, hidden)
    logits_buf = torch.randn(width, vocab, generator=torch.Generator().manual_seed(0))
    runner.model.forward = lambda ids, pos, meta: hidden_buf[: ids.shape[0]]
    runner.model.compute_logits = lambda h: logits_buf[: h.shape[0]]
    totals = {"schedule": 0.0, "prepare": 0.0, "sample": 0.0}
    eng.scheduler.schedule = _Timed(eng.scheduler.schedule, totals, "schedule")
    runner._prepare = _Timed(runner._prepare, totals, "prepare")
    runner._update_states = _Timed(runner._update_states, totals, "prepare")
    runner.sampler = _Timed(runner.sampler, totals, "sample")
    out = {}
    for b in batches:
        for i in range(b):
            eng.add_request(f"h{b}-{i}", random_token_ids(rng, prompt_tokens, vocab), greedy(10_000))
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
            eng.step()
        for _ in range(3):
            eng.step()
        for k in totals:
            totals[k] = 0.0
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - t)
        split = {k: round(v / iters * 1e3, 3) for k, v in totals.items()}
        split["update"] = round(sum(times) / iters * 1e3 - sum(split.values()), 3)
        out[str(b)] = {
            "step_ms_p50": round(sorted(times)[iters // 2] * 1e3, 3),
            "host_ms_excluding_sample": round((sum(times) / iters - totals["sample"] / iters) * 1e3, 3),
            "mean_split_ms": split,
        }
        print(b, json.dumps(out[str(b)]), flush=True)
        for rid in list(eng.scheduler.requests):
            eng.abort_request(rid)
        while eng.has_unfinished_requests():
            eng.step()
    return out


def figures(r: dict) -> Figures:
    """The summary and table of step_times.json, or of host_times.json (``--host-only``), from the
    measured values (``benchmarks.common.Figures``)."""
    f = Figures()
    if "host_time_per_decode_step" in r:
        rows = []
        for batch, x in r["host_time_per_decode_step"].items():
            s = x["mean_split_ms"]
            f.summary(
                f"host time per decode step without the sampler, batch {batch}", x["host_ms_excluding_sample"], "ms"
            )
            rows.append(
                [
                    batch,
                    x["step_ms_p50"],
                    x["host_ms_excluding_sample"],
                    s.get("schedule"),
                    s.get("prepare"),
                    s.get("sample"),
                    s.get("update"),
                ]
            )
        return f.table(
            "Host time per decode step",
            [
                "batch",
                "step p50 (ms)",
                "without the sampler (ms)",
                "schedule",
                "prepare inputs",
                "sample",
                "update + stops + detokenize + outputs",
            ],
            rows,
            note="The model returns fixed hidden states and logits, so the step is host work only; the "
            "sampler works on `[batch, vocabulary]` float32 logits.",
        )
    f.summary("decode step speed-up, after / before", r["decode_speedup"], "x")
    f.summary("prefill step speed-up, after / before", r["prefill_speedup"], "x")
    rows = []
    for name in ("before", "after"):
        x = r[name]
        b = x["decode_breakdown_ms"]
        rows.append(
            [
                name,
                ", ".join(f"{k}={v}" for k, v in x["config"].items()),
                x["prefill_step_s"],
                x["decode_step_s_p50"] * 1e3,
                b["matmul"],
                b["attention"],
                b["other"],
                b["host"],
            ]
        )
    return f.table(
        "Steps",
        [
            "path",
            "config",
            "prefill step (s)",
            "decode step p50 (ms)",
            "matmul (ms)",
            "attention (ms)",
            "other ops (ms)",
            "host (ms)",
        ],
        rows,
        note=f"A {r['prefill_tokens']}-token single-request prefill step and a {r['decode_batch']}-request "
        "decode step; the decode step's split from `torch.profiler` (host = the unprofiled median "
        "step minus op times under the profiler: approximate).",
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--profile", action="store_true", help="also print torch's operator table per configuration")
    ap.add_argument("--host-only", action="store_true", help="host time per step with a zero-cost forward")
    ap.add_argument("--out", default=None, help="default benchmarks/results/step_times.json (host_times.json)")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)

    model = str(resolve_model(args.model))
    if args.host_only:
        result = {"model": model, "host_time_per_decode_step": host_times(model)}
        prov.write(args.out or "benchmarks/results/host_times.json", result, indent=1)
        return 0
    result = {
        "model": model,
        "threads": torch.get_num_threads(),
        "prefill_tokens": args.prefill_tokens,
        "decode_batch": args.batch,
    }
    for name, cfg in CONFIGS.items():
        result[name] = measure(model, args, cfg)
        print(name, json.dumps(result[name]), flush=True)
    result["decode_speedup"] = result["before"]["decode_step_s_p50"] / result["after"]["decode_step_s_p50"]
    result["prefill_speedup"] = result["before"]["prefill_step_s"] / result["after"]["prefill_step_s"]
    print(json.dumps(result, indent=1))
    prov.write(args.out or "benchmarks/results/step_times.json", result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
