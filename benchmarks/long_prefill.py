"""A long prompt arrives while streams decode: their inter-token latency (ITL) during its
prefill, with the mixed-step prefill cap off (the old behaviour) and on, in the same run.

SmolLM2-135M-Instruct (default model) in float32 on this machine's default device, one
:class:`engine.LLMEngine` stepped in this thread (no serving stack), per mode:

1. ``--streams`` greedy requests (random ``--stream-prompt`` -token prompts, ``ignore_eos``)
   are prefilled and decode ``--warmup`` steps;
2. baseline: ``--baseline-steps`` more decode steps, no long prompt;
3. a random ``--prompt-tokens`` -token prompt arrives; steps run until its first token.

Every stream gets one token per step, so its ITL is the gap between consecutive tokens (each
step's wall time plus host work). Reported per mode, in seconds: ITL p50 / p99 / max of the
streams before the long prompt (baseline) and while it is prefilled (tokens that arrive
after it was added and up to its first token), the long prompt's TTFT, the steps it took,
and ``itl_p99_during / itl_p50_baseline`` (target: <= 4). Modes: ``off``
(``mixed_step_prefill_tokens=0``: prefill chunks fill ``max_num_batched_tokens``), ``auto``
(the default: a cap sized from measured step times, ``mixed_step_slowdown``), or a fixed
number of tokens. Prefix caching is off and prompts are random, so no mode reuses another's
KV. Each mode starts a fresh auto estimator.

Usage::

    python benchmarks/long_prefill.py            # idle box: ~8000-token prompt, 8 streams (a few minutes on CPU)
    python benchmarks/long_prefill.py --smoke    # quick check: ~2000-token prompt, 4 streams, few steps
    python benchmarks/long_prefill.py --modes off,auto,128 --plot benchmarks/results/long_prefill.png

Writes ``benchmarks/results/long_prefill.json`` (``--out``; ``long_prefill_smoke.json`` with
``--smoke``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.common import Figures, Results, add_model_arg, percentile, pyplot, random_token_ids  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "benchmark",
    "model",
    "device",
    "dtype",
    "torch_threads",
    "smoke",
    "streams",
    "stream_prompt_tokens",
    "long_prompt_tokens",
    "max_num_batched_tokens",
    "max_model_len",
    "mixed_step_slowdown",
    "target",
    "time",
    "results",
)
from kvserve.engine import EngineConfig, SamplingParams  # noqa: E402
from kvserve.engine.llm_engine import LLMEngine  # noqa: E402
from kvserve.engine.mixed_step_budget import MixedStepBudget  # noqa: E402
from kvserve.engine.model_loader import resolve_model  # noqa: E402


def set_mode(eng: LLMEngine, mode: str) -> None:
    """``off`` = no cap, ``auto`` = a fresh step-time estimator, a number = fixed cap (tokens)."""
    if mode == "auto":
        eng.mixed_budget = MixedStepBudget(eng.config.mixed_step_slowdown, eng.config.max_num_batched_tokens)
    else:
        eng.mixed_budget = None
        eng.scheduler.mixed_prefill_tokens = 0 if mode == "off" else int(mode)


def run_mode(eng: LLMEngine, mode: str, args, rng: random.Random) -> dict:
    set_mode(eng, mode)
    vocab = eng.hf_config.vocab_size
    stream_ids = [f"{mode}-s{i}" for i in range(args.streams)]
    times: dict[str, list[float]] = {rid: [] for rid in stream_ids}
    steps: list[dict] = []

    def step() -> list:
        cap = eng.scheduler.mixed_prefill_tokens if eng.mixed_budget is None else eng.mixed_budget.tokens
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        for o in outs:
            if o.request_id in times:
                times[o.request_id].append(t1)
        steps.append({"t": t1, "seconds": t1 - t0, "cap": cap})
        return outs

    params = SamplingParams(temperature=0, max_tokens=args.stream_max_tokens, ignore_eos=True, detokenize=False)
    for rid in stream_ids:
        eng.add_request(rid, random_token_ids(rng, args.stream_prompt, vocab), params)
    while any(not t for t in times.values()):
        step()
    for _ in range(args.warmup):
        step()
    base_start = len(steps)
    t_base0 = time.perf_counter()
    for _ in range(args.baseline_steps):
        step()
    baseline_itl = [b - a for t in times.values() for a, b in zip(t, t[1:]) if a >= t_base0]

    eng.add_request(
        f"{mode}-long",
        random_token_ids(rng, args.prompt_tokens, vocab),
        SamplingParams(temperature=0, max_tokens=1, detokenize=False),
    )
    arrival = time.perf_counter()
    first_token = None
    n_during = 0
    while first_token is None:
        outs = step()
        n_during += 1
        if any(o.request_id == f"{mode}-long" for o in outs):
            first_token = time.perf_counter()
    during_itl = [b - a for t in times.values() for a, b in zip(t, t[1:]) if arrival < b <= first_token]
    for rid in stream_ids:
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    eng.step()  # retire the aborted requests in the runner

    during_steps = steps[len(steps) - n_during :]
    base = {q: percentile(baseline_itl, q, nearest_rank=True) for q in (50, 99)}  # samples, not interpolated
    during = {q: percentile(during_itl, q, nearest_rank=True) for q in (50, 99)}
    p50_base, p99_during = base[50], during[99]
    return {
        "mode": mode,
        "itl_baseline_s": {"p50": p50_base, "p99": base[99], "n": len(baseline_itl)},
        "itl_during_s": {
            "p50": during[50],
            "p99": p99_during,
            "max": max(during_itl, default=None),
            "n": len(during_itl),
        },
        "itl_p99_during_over_p50_baseline": p99_during / p50_base if p50_base and p99_during else None,
        "ttft_long_s": first_token - arrival,
        "steps_to_first_token": n_during,
        "caps_during": [s["cap"] for s in during_steps],
        "step_seconds_during": [round(s["seconds"], 4) for s in during_steps],
        "step_seconds_baseline": [round(s["seconds"], 4) for s in steps[base_start : base_start + args.baseline_steps]],
        "decode_step_s_estimate": eng.mixed_budget.decode_s if eng.mixed_budget else None,
        "seconds_per_prefill_token_estimate": (
            eng.mixed_budget.seconds_per_prefill_token if eng.mixed_budget else None
        ),
        "timeline": [{"t": round(s["t"] - arrival, 4), "seconds": round(s["seconds"], 4)} for s in steps[base_start:]],
    }


def plot(results: list[dict], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4))
    for r in results:
        tl = r["timeline"]
        # each step's time held over the interval it ran (it ends at t)
        ax.plot([p["t"] for p in tl], [p["seconds"] for p in tl], drawstyle="steps-pre", label=f"cap {r['mode']}")
        ax.axvline(r["ttft_long_s"], ls=":", color=ax.lines[-1].get_color())
    ax.axvline(0, color="k", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the long prompt arrived (dotted: its first token)")
    ax.set_ylabel("step time = stream ITL (s)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    for x in r["results"]:
        ratio = x["itl_p99_during_over_p50_baseline"]
        f.summary(
            f"long prompt next to {r['streams']} streams: ITL p99 / ITL p50 without it (mixed-step cap {x['mode']})",
            ratio,
            "x",
            target="<= 4x",
            met=ratio <= 4,
            headline=x["mode"] == "auto",
        )
    f.table(
        "Mixed-step cap",
        [
            "mixed-step cap",
            "ITL p50 before (ms)",
            "ITL p99 during (ms)",
            "ITL max during (ms)",
            "p99 during / p50 before (x)",
            "long prompt's TTFT (s)",
            "steps to its first token",
        ],
        [
            [
                x["mode"],
                x["itl_baseline_s"]["p50"] * 1e3,
                x["itl_during_s"]["p99"] * 1e3,
                x["itl_during_s"]["max"] * 1e3,
                x["itl_p99_during_over_p50_baseline"],
                x["ttft_long_s"],
                x["steps_to_first_token"],
            ]
            for x in r["results"]
        ],
        note=f"{r['streams']} greedy streams while a {r['long_prompt_tokens']}-token prompt is prefilled; "
        f"`max_num_batched_tokens` {r['max_num_batched_tokens']}, `mixed_step_slowdown` "
        f"{r['mixed_step_slowdown']}; target: {r['target']}.",
    )
    return f


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--stream-prompt", type=int, default=32, help="tokens")
    ap.add_argument("--prompt-tokens", type=int, default=8000, help="the long prompt (tokens)")
    ap.add_argument("--warmup", type=int, default=5, help="decode steps before the baseline")
    ap.add_argument("--baseline-steps", type=int, default=30)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--modes", default="off,auto", help="comma-separated: off, auto, or a token count")
    ap.add_argument("--smoke", action="store_true", help="~2000-token prompt, 4 streams, few steps")
    ap.add_argument(
        "--out",
        default=None,
        help="default benchmarks/results/long_prefill.json (long_prefill_smoke.json with --smoke)",
    )
    ap.add_argument("--plot", default=None, help="PNG path for a step-time timeline (needs matplotlib)")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    if args.smoke:
        args.prompt_tokens, args.streams, args.warmup, args.baseline_steps = 2000, 4, 2, 8
    modes = args.modes.split(",")
    args.out = args.out or f"benchmarks/results/long_prefill{'_smoke' if args.smoke else ''}.json"

    model = str(resolve_model(args.model))
    # room for the long prompt and every stream's whole output, with max_model_len the model's 8192
    args.stream_max_tokens = 1024
    kv_tokens = args.prompt_tokens + args.streams * (args.stream_prompt + args.stream_max_tokens) + 256
    cfg = EngineConfig(
        model=model,
        max_model_len=min(8192, max(args.prompt_tokens + 64, 2048)),
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=max(16, args.streams + 1),
        enable_prefix_caching=False,
        num_kv_blocks=-(-kv_tokens // 16),
        block_size=16,
    )
    eng = LLMEngine(cfg)
    rng = random.Random(0)
    results = []
    for mode in modes:
        r = run_mode(eng, mode, args, rng)
        results.append(r)
        b, d = r["itl_baseline_s"], r["itl_during_s"]
        print(
            f"{mode:>5}: ITL baseline p50 {b['p50'] * 1e3:7.1f} ms p99 {b['p99'] * 1e3:7.1f} ms | during long "
            f"prefill p50 {d['p50'] * 1e3:7.1f} ms p99 {d['p99'] * 1e3:7.1f} ms max {d['max'] * 1e3:7.1f} ms "
            f"({d['p99'] / b['p50']:.1f}x baseline p50) | long TTFT {r['ttft_long_s']:6.2f} s "
            f"in {r['steps_to_first_token']} steps",
            flush=True,
        )
    eng.shutdown()
    out = {
        "benchmark": "long_prefill",
        "model": model,
        "device": str(cfg.torch_device),
        "dtype": str(cfg.torch_dtype),
        "torch_threads": torch.get_num_threads(),
        "smoke": args.smoke,
        "streams": args.streams,
        "stream_prompt_tokens": args.stream_prompt,
        "long_prompt_tokens": args.prompt_tokens,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "max_model_len": cfg.max_model_len,
        "mixed_step_slowdown": cfg.mixed_step_slowdown,
        "target": "itl_during_s.p99 <= 4 x itl_baseline_s.p50",
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "results": results,
    }
    prov.write(args.out, out, indent=1)
    print(f"wrote {args.out}")
    if args.plot:
        plot(results, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
