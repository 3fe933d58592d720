"""Engine step times: one 2048-token prefill step and one 64-request decode step.

Measures ``LLMEngine.step()`` wall time (seconds) on SmolLM2-135M-Instruct (default) in
float32 on this machine's default device:

* prefill: a single request of ``--prefill-tokens`` random token ids, so the step is one
  prefill chunk of that many tokens (the chunk's attention is causal over itself);
* decode: ``--batch`` requests with prompts uniform in 100..200 tokens, run past their
  prefill, then the median of ``--iters`` decode steps (every request generating).

With ``--profile`` it also prints torch's operator table for three decode steps.

Usage::

    python benchmarks/step_times.py                  # writes benchmarks/results/step_times.json
    python benchmarks/step_times.py --prefill-tokens 64 --batch 2 --iters 2 --out /tmp/st.json   # smoke
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

from benchmarks.common import add_model_arg, greedy, load_average, random_token_ids, write_json  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.model_loader import resolve_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--prefill-tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--out", default="benchmarks/results/step_times.json")
    args = ap.parse_args(argv)

    model = str(resolve_model(args.model))
    llm = LLM(model=model, max_num_seqs=args.batch, max_num_batched_tokens=max(2048, args.prefill_tokens))
    eng, rng = llm.engine, random.Random(0)
    vocab = eng.hf_config.vocab_size

    prefill = []
    for k in range(3):  # the first is a warm-up
        eng.add_request(f"p{k}", random_token_ids(rng, args.prefill_tokens, vocab),
                        SamplingParams(max_tokens=1, temperature=0))
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
    if args.profile:
        from torch.profiler import profile

        with profile() as prof:
            for _ in range(3):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))

    result = {
        "model": model,
        "threads": torch.get_num_threads(),
        "prefill_tokens": args.prefill_tokens,
        "prefill_step_s": sorted(prefill[1:])[0],
        "decode_batch": args.batch,
        "decode_context_tokens": [contexts[0], contexts[-1] + args.iters],  # min .. max over the timed steps
        "decode_step_s_p50": decode[len(decode) // 2],
        "load_average_after": load_average(),
    }
    print(json.dumps(result, indent=1))
    write_json(args.out, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
