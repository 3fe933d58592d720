"""Quality, memory and speed of int8 weights and the float8 KV cache against float32, in one run.

For each configuration (float32; ``kv_cache_dtype="fp8"``; ``quantization="int8"``; both) on
SmolLM2-135M-Instruct:

* perplexity over ``benchmarks/data/public_domain.txt`` (six paragraphs: Lincoln, Austen,
  Dickens, the US Constitution's preamble, Melville, and one of our own), each paragraph one
  prompt, from the engine's own prompt log-probabilities, prefilled in chunks of
  ``PPL_CHUNK`` tokens: a chunk attends to itself with its exact K/V and to earlier chunks
  through the cache, so a one-chunk prefill would not see the float8 cache at all;
* greedy-token agreement with float32: 8 prompts (4 plain, 4 chat), 48 greedy tokens each; the
  share of generated tokens equal to float32's before the first divergence, and how many prompts
  match float32 exactly;
* "What is the capital of France?" (chat, greedy): the answer must say Paris;
* weight bytes (every parameter and buffer once; a tied embedding stays float32 next to the
  int8 LM head) and KV capacity: tokens that fit in a fixed ``kv_cache_memory_bytes`` (256 MiB);
* speed: batch-1 decode ms/token at a 512-token context, and the throughput benchmark's
  64-request workload (output tok/s).

Targets (issue 16): perplexity within +3 % of float32; Paris; int8 weights >= 1.3x float32's
batch-1 speed. Results:
``benchmarks/results/quantization.json``.

Usage::

    python benchmarks/quantization.py
    python benchmarks/quantization.py --quick --out /tmp/q.json    # quality only, fewer prompts
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    Figures,
    Results,
    add_model_arg,
    decode_ms_per_token,
    greedy,
    load_average,
    make_workload,
    resolve,
    run_kvserve,
)
from engine import LLM, SamplingParams  # noqa: E402

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "List three colors:"]
CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "Give me three tips for learning Python.", "What is 12 times 12?"]
KV_BYTES = 256 << 20
#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("model", "text", "quick", "configs", "targets")

#: Every configuration in float32, named (``dtype="auto"`` is bfloat16 on a CPU with native bf16,
#: and int8 weights run in float32 only): each is compared with the float32 one.
CONFIGS = {"float32": {"dtype": "float32"}, "fp8_kv": {"dtype": "float32", "kv_cache_dtype": "fp8"},
           "int8_weights": {"dtype": "float32", "quantization": "int8"},
           "int8_weights_fp8_kv": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "fp8"}}


#: Tokens per step of the perplexity run (``max_num_batched_tokens``): chunked prefill, so most
#: of each token's attention reads earlier chunks from the KV cache, as decode does.
PPL_CHUNK = 16


def perplexity(path: str, kw: dict) -> dict:
    """exp(mean negative log-likelihood) over every predicted token of every paragraph, on an
    engine of its own (``kw``: the configuration's engine arguments) that prefills in chunks of
    ``PPL_CHUNK`` tokens (see the module docstring)."""
    paragraphs = [p.strip() for p in TEXT.read_text().split("\n\n") if p.strip()]
    llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False,
              max_num_batched_tokens=PPL_CHUNK, **kw)
    outs = llm.generate(paragraphs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-getattr(x, "logprob", x) for x in (next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:])]
    del llm
    return {"perplexity": math.exp(sum(nll) / len(nll)), "tokens": len(nll), "paragraphs": len(paragraphs),
            "prefill_chunk_tokens": PPL_CHUNK}


def greedy_outputs(llm: LLM, new_tokens: int) -> list[list[int]]:
    ids = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    ids += [llm.engine.apply_chat_template([{"role": "user", "content": c}]) for c in CHATS]
    outs = llm.generate(ids, greedy(new_tokens), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def batch1_ms_per_token(llm: LLM, context: int, new_tokens: int, vocab: int) -> float:
    """Batch-1 decode ms/token at ``context`` tokens (``benchmarks.common.decode_ms_per_token``)."""
    prompt = [random.Random(0).randint(100, vocab - 100) for _ in range(context)]

    def run(n):
        t = time.perf_counter()
        llm.generate([prompt], greedy(n), use_tqdm=False)
        return time.perf_counter() - t

    return decode_ms_per_token(run, new_tokens)


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    c, t = r["configs"], r["targets"]
    fp8, i8 = c["fp8_kv"], c["int8_weights"]
    f = Figures()
    f.summary("fp8 KV: perplexity vs float32", fp8["perplexity_vs_float32"] * 100, "%", target="<= +3 %",
              met=t["fp8 KV perplexity within +3 %"])
    f.summary("int8 weights: perplexity vs float32", i8["perplexity_vs_float32"] * 100, "%", target="<= +3 %",
              met=t["int8 perplexity within +3 %"])
    if "batch1_speedup_vs_float32" in i8:
        f.summary("int8 weights, batch-1 decode speed / float32", i8["batch1_speedup_vs_float32"], "x",
                  target=">= 1.3x", met=t["int8 batch-1 >= 1.3x float32"], headline=True)
    f.targets(t, done=("fp8 KV perplexity within +3 %", "int8 perplexity within +3 %", "int8 batch-1 >= 1.3x float32"))
    tokens = next(iter(c.values())).get("tokens")
    f.table("Configurations", ["config", "perplexity", "vs float32 (%)", "greedy tokens before the first divergence (%)",
                               "prompts identical", "Paris", "weights (MB)", "KV capacity (tokens)",
                               "batch-1 ms/token", "64 requests tok/s"],
            [[name, x["perplexity"], x["perplexity_vs_float32"] * 100, x["greedy_prefix_agreement"] * 100,
              x["greedy_prompts_identical"], x["paris"], x["weight_bytes"] / 1e6, x["kv_capacity_tokens"],
              x.get("batch1_ms_per_token_ctx512"), x.get("throughput_64_requests_tok_per_s")] for name, x in c.items()],
            note=f"SmolLM2; perplexity over `{r['text']}` ({tokens} tokens); KV capacity in a fixed 256 MiB pool; "
                 "batch-1 decode at a 512-token context; the 64-request throughput workload in that pool.")
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="quality only (no speed runs)")
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    path, vocab = resolve(args.model)
    result = {"model": path, "text": str(TEXT.relative_to(TEXT.parents[2])), "quick": args.quick, "configs": {}}
    reference = None
    for name, kw in CONFIGS.items():
        r = {"engine_args": kw, **perplexity(path, kw)}
        llm = LLM(model=path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, **kw)
        runner = llm.engine.executor.runner
        outs = greedy_outputs(llm, args.new_tokens)
        if reference is None:
            reference = outs
        same = [next((j for j, (a, b) in enumerate(zip(o, ref)) if a != b), len(ref)) for o, ref in zip(outs, reference)]
        r["greedy_prefix_agreement"] = sum(same) / sum(len(x) for x in reference)
        r["greedy_prompts_identical"] = f"{sum(s == len(x) for s, x in zip(same, reference))}/{len(reference)}"
        paris = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                         SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0].text
        r["paris_answer"], r["paris"] = paris, "Paris" in paris
        tensors = {t.data_ptr(): t for t in runner.model.state_dict().values()}.values()
        r["weight_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
        r["kv_bytes_per_token"] = runner.bytes_per_block // runner.block_size
        r["kv_capacity_tokens"] = runner.num_blocks * runner.block_size
        if not args.quick:
            r["batch1_ms_per_token_ctx512"] = batch1_ms_per_token(llm, 512, 64, vocab)
            tp = run_kvserve(llm, make_workload(64, 0, vocab))
            r["throughput_64_requests_tok_per_s"] = tp["output_tok_per_s"]
        r["load_average_after"] = load_average()
        result["configs"][name] = r
        print(name, json.dumps(r), flush=True)
        del llm
    base = result["configs"]["float32"]
    for name, r in result["configs"].items():
        r["perplexity_vs_float32"] = r["perplexity"] / base["perplexity"] - 1
    fp8, i8 = result["configs"]["fp8_kv"], result["configs"]["int8_weights"]
    result["targets"] = {"fp8 KV perplexity within +3 %": fp8["perplexity_vs_float32"] <= 0.03,
                         "fp8 KV answers Paris": fp8["paris"],
                         "int8 perplexity within +3 %": i8["perplexity_vs_float32"] <= 0.03,
                         "int8 answers Paris": i8["paris"]}
    if not args.quick:
        i8["batch1_speedup_vs_float32"] = base["batch1_ms_per_token_ctx512"] / i8["batch1_ms_per_token_ctx512"]
        result["targets"]["int8 batch-1 >= 1.3x float32"] = i8["batch1_speedup_vs_float32"] >= 1.3
    print(json.dumps(result["targets"]))
    return prov.write(args.out, result, indent=1)


if __name__ == "__main__":
    main()
