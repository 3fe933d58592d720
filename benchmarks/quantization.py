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

Also bfloat16 and two 4-bit (W4A16) checkpoints that llmcompressor makes of the same model
(``benchmarks/quant_checkpoints.py``: GPTQ and AWQ, asymmetric groups of 32), with the weights' bytes (the whole
model and the linear layers alone), each configuration's peak RSS in a process of its own, and
(``--peer vllm``) vLLM's CPU build on the same 4-bit checkpoints.

Targets (issue 16): perplexity within +3 % of float32; Paris; int8 weights >= 1.3x float32's
batch-1 speed. Issue 43 (4-bit): perplexity within +3 %; batch-1 decode time <= 0.45x bf16's on a
CPU with native bf16, <= 0.35x float32's on one without (the other is not measured on a box);
64-request throughput >= int8's; weights <= 0.3x bf16's. Results:
``benchmarks/results/quantization.json``.

Usage::

    python benchmarks/quantization.py
    python benchmarks/quantization.py --quick --out /tmp/q.json    # quality only, fewer prompts
    python benchmarks/quantization.py --peer vllm                  # and vLLM on the 4-bit checkpoints
"""

from __future__ import annotations

import argparse
import json
import math
import random
import subprocess
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
from kvserve.engine import LLM, SamplingParams  # noqa: E402
from kvserve.engine.config import cpu_native_bf16  # noqa: E402

TEXT = Path(__file__).parent / "data" / "public_domain.txt"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "List three colors:",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Give me three tips for learning Python.",
    "What is 12 times 12?",
]
KV_BYTES = 256 << 20
#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("model", "text", "quick", "configs", "targets", "native_bf16")

#: Every configuration in float32, named (``dtype="auto"`` is bfloat16 on a CPU with native bf16,
#: and int8 weights run in float32 only): each is compared with the float32 one.
CONFIGS = {
    "float32": {"dtype": "float32"},
    "fp8_kv": {"dtype": "float32", "kv_cache_dtype": "fp8"},
    "int8_weights": {"dtype": "float32", "quantization": "int8"},
    "int8_weights_fp8_kv": {"dtype": "float32", "quantization": "int8", "kv_cache_dtype": "fp8"},
    "bfloat16": {"dtype": "bfloat16"},
    "w4a16_gptq": {"dtype": "float32", "checkpoint": "gptq-g32"},
    "w4a16_awq": {"dtype": "float32", "checkpoint": "awq-g32"},
}
#: The 4-bit configurations: llmcompressor's checkpoints (``benchmarks/quant_checkpoints.py``).
W4_CONFIGS = ("w4a16_gptq", "w4a16_awq")


def config_model(path: str, kw: dict) -> tuple[str, dict]:
    """The model folder and engine arguments of a configuration: a 4-bit one names its
    checkpoint (made once by ``benchmarks/quant_checkpoints.py``), the others run ``path``."""
    kw = dict(kw)
    name = kw.pop("checkpoint", None)
    if name is None:
        return path, kw
    from benchmarks.quant_checkpoints import checkpoint

    return str(checkpoint(name)), kw


def peak_rss(path: str, kw: dict) -> int:
    """Peak resident bytes of a fresh process that loads the configuration and answers one
    request (``ru_maxrss``; the CPU kernels already built)."""
    code = (
        "import json, resource, sys; from kvserve.engine import LLM, SamplingParams; a = json.loads(sys.argv[1]); "
        "llm = LLM(model=a['path'], kv_cache_memory_bytes=a['kv'], enable_prefix_caching=False, **a['kw']); "
        "llm.generate(['Hello'], SamplingParams(max_tokens=8), use_tqdm=False); "
        "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps({"path": path, "kv": KV_BYTES, "kw": kw})],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[1],
        check=True,
    )
    return int(r.stdout.strip().splitlines()[-1])


def linear_weight_bytes(model) -> int:
    """Bytes of the linear layers' weights (float, int8 or 4-bit with their scales): what
    quantization shrinks; the embedding, LM head and norms are not counted."""
    total = 0
    for m in model.modules():
        if not hasattr(m, "w4_config"):
            continue
        if m.w4 is not None:
            total += m.w4.nbytes()
        elif m.qweight is not None:
            total += m.qweight.numel() * m.qweight.element_size() + m.wscale.numel() * m.wscale.element_size()
        else:
            total += m.weight.numel() * m.weight.element_size()
    return total


#: Tokens per step of the perplexity run (``max_num_batched_tokens``): chunked prefill, so most
#: of each token's attention reads earlier chunks from the KV cache, as decode does.
PPL_CHUNK = 16


def perplexity(path: str, kw: dict) -> dict:
    """exp(mean negative log-likelihood) over every predicted token of every paragraph, on an
    engine of its own (``kw``: the configuration's engine arguments) that prefills in chunks of
    ``PPL_CHUNK`` tokens (see the module docstring)."""
    paragraphs = [p.strip() for p in TEXT.read_text().split("\n\n") if p.strip()]
    llm = LLM(
        model=path, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, max_num_batched_tokens=PPL_CHUNK, **kw
    )
    outs = llm.generate(paragraphs, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll = [-getattr(x, "logprob", x) for x in (next(iter(d.values())) for o in outs for d in o.prompt_logprobs[1:])]
    del llm
    return {
        "perplexity": math.exp(sum(nll) / len(nll)),
        "tokens": len(nll),
        "paragraphs": len(paragraphs),
        "prefill_chunk_tokens": PPL_CHUNK,
    }


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


def vllm_on(model: str, vocab: int, dtype: str) -> dict:
    """vLLM's CPU build on a 4-bit checkpoint (``benchmarks/peer_vllm.py``): the same batch-1 probe
    and 64-request workload, or why it did not load."""
    from benchmarks.peer_vllm import run_vllm

    prompt = [random.Random(0).randint(100, vocab - 100) for _ in range(512)]
    try:
        out = run_vllm(
            model,
            dtype,
            works=[make_workload(64, 0, vocab)],
            batch1={"prompt": prompt, "new_tokens": 64},
            timeout_s=1800,
        )
    except RuntimeError as e:
        return {"loaded": False, "dtype": dtype, "error": str(e).strip().splitlines()[1][:400]}  # the root cause
    return {
        "loaded": True,
        "dtype": dtype,
        "version": out.get("version"),
        "batch1_ms_per_token_ctx512": out.get("batch1_ms_per_token"),
        "throughput_64_requests_tok_per_s": out["runs"][0]["output_tok_per_s"],
    }


def figures(r: dict) -> Figures:
    """The file's summary and table (``benchmarks.common.Figures``), from its measured values."""
    c, t = r["configs"], r["targets"]
    f = Figures()
    if "fp8_kv" in c:
        f.summary(
            "fp8 KV: perplexity vs float32",
            c["fp8_kv"]["perplexity_vs_float32"] * 100,
            "%",
            target="<= +3 %",
            met=t["fp8 KV perplexity within +3 %"],
        )
    i8 = c.get("int8_weights")
    if i8:
        f.summary(
            "int8 weights: perplexity vs float32",
            i8["perplexity_vs_float32"] * 100,
            "%",
            target="<= +3 %",
            met=t["int8 perplexity within +3 %"],
        )
    if i8 and "batch1_speedup_vs_float32" in i8:
        f.summary(
            "int8 weights, batch-1 decode speed / float32",
            i8["batch1_speedup_vs_float32"],
            "x",
            target=">= 1.3x",
            met=t["int8 batch-1 >= 1.3x float32"],
            headline=True,
        )
    for name in [n for n in c if n.startswith("w4a16")]:  # the 4-bit configurations
        w = c[name]
        f.summary(
            f"{name}: perplexity vs float32",
            w["perplexity_vs_float32"] * 100,
            "%",
            target="<= +3 %",
            met=t[f"{name} perplexity within +3 %"],
        )
        key = next((k for k in t if k.startswith(f"{name} batch-1")), None)
        if key:
            native = "0.45x" in key  # the native-bf16 CPU's bar (against bf16); else against float32
            f.summary(
                f"{name}: batch-1 decode time / {'bfloat16' if native else 'float32'}",
                w["batch1_time_vs_bfloat16" if native else "batch1_time_vs_float32"],
                "x",
                target="<= 0.45x" if native else "<= 0.35x",
                met=t[key],
                headline=True,
            )
        if f"{name} 64-request tok/s >= int8's" in t:
            f.summary(
                f"{name}: 64-request tok/s / int8's",
                w["throughput_vs_int8"],
                "x",
                target=">= 1.0x",
                met=t[f"{name} 64-request tok/s >= int8's"],
            )
        if "weight_bytes_vs_bfloat16" in w:
            f.summary(
                f"{name}: weight bytes / bfloat16 (whole model)",
                w["weight_bytes_vs_bfloat16"],
                "x",
                target="<= 0.3x",
                met=t[f"{name} weights <= 0.3x bf16 (whole model)"],
            )
            f.summary(
                f"{name}: linear-layer weight bytes / bfloat16",
                w["linear_weight_bytes_vs_bfloat16"],
                "x",
                target="<= 0.3x",
                met=t[f"{name} linear-layer weights <= 0.3x bf16"],
            )
    f.targets(t, done=[k for k in t if "Paris" not in k])  # the rest have a summary row of their own
    tokens = next(iter(c.values())).get("tokens")
    f.table(
        "Configurations",
        [
            "config",
            "perplexity",
            "HF's perplexity, same checkpoint",
            "vs float32 (%)",
            "greedy tokens before the first divergence (%)",
            "prompts identical",
            "Paris",
            "weights (MB)",
            "linear layers (MB)",
            "peak RSS (MB)",
            "KV capacity (tokens)",
            "batch-1 ms/token",
            "64 requests tok/s",
        ],
        [
            [
                name,
                x["perplexity"],
                x.get("hf_perplexity_same_checkpoint"),
                x["perplexity_vs_float32"] * 100,
                x["greedy_prefix_agreement"] * 100,
                x["greedy_prompts_identical"],
                x["paris"],
                x["weight_bytes"] / 1e6,
                x.get("linear_weight_bytes", 0) / 1e6,
                x.get("peak_rss_bytes", 0) / 1e6,
                x["kv_capacity_tokens"],
                x.get("batch1_ms_per_token_ctx512"),
                x.get("throughput_64_requests_tok_per_s"),
            ]
            for name, x in c.items()
        ],
        note=f"SmolLM2; perplexity over `{r['text']}` ({tokens} tokens); KV capacity in a fixed 256 MiB pool; "
        "batch-1 decode at a 512-token context; the 64-request throughput workload in that pool. "
        "The 4-bit rows are llmcompressor's GPTQ and AWQ W4A16 checkpoints (asymmetric groups of 32, LM head "
        "float, tied to the embedding); HF's perplexity is transformers on the same folder, whole "
        "paragraphs at once.",
    )
    peers = [
        [
            name,
            x["vllm"].get("loaded"),
            x["vllm"].get("dtype"),
            x["vllm"].get("batch1_ms_per_token_ctx512"),
            x["vllm"].get("throughput_64_requests_tok_per_s"),
            x["vllm"].get("error", ""),
        ]
        for name, x in c.items()
        if "vllm" in x
    ]
    if peers:
        f.table(
            "vLLM's CPU build on the same 4-bit checkpoints",
            ["config", "loaded", "dtype", "batch-1 ms/token", "64 requests tok/s", "error"],
            peers,
        )
    return f


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arg(ap)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--quick", action="store_true", help="quality only (no speed runs)")
    ap.add_argument("--out", default="benchmarks/results/quantization.json")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=list(CONFIGS),
        choices=list(CONFIGS),
        help="configurations to run (default: all; float32 is always run first, the reference)",
    )
    ap.add_argument(
        "--peer",
        choices=("none", "vllm"),
        default="none",
        help="vllm: vLLM's CPU build on the 4-bit checkpoints too (its cached environment)",
    )
    ap.add_argument("--vllm-dtype", default="bfloat16", help="the dtype vLLM runs the 4-bit checkpoints in")
    args = ap.parse_args(argv)
    args.configs = ["float32"] + [n for n in args.configs if n != "float32"]
    prov = Results(__file__, RESULT_KEYS)
    path, vocab = resolve(args.model)
    result = {"model": path, "text": str(TEXT.relative_to(TEXT.parents[2])), "quick": args.quick, "configs": {}}
    reference = None
    for name in args.configs:
        model, kw = config_model(path, CONFIGS[name])
        r = {"engine_args": CONFIGS[name], "model": model, **perplexity(model, kw)}
        if "checkpoint" in CONFIGS[name]:  # HF transformers on the same checkpoint (benchmarks/quant_checkpoints.py)
            r["hf_perplexity_same_checkpoint"] = json.loads((Path(model) / "reference.json").read_text())["perplexity"]
        llm = LLM(model=model, kv_cache_memory_bytes=KV_BYTES, enable_prefix_caching=False, **kw)
        runner = llm.engine.executor.runner
        outs = greedy_outputs(llm, args.new_tokens)
        if reference is None:
            reference = outs
        same = [
            next((j for j, (a, b) in enumerate(zip(o, ref)) if a != b), len(ref)) for o, ref in zip(outs, reference)
        ]
        r["greedy_prefix_agreement"] = sum(same) / sum(len(x) for x in reference)
        r["greedy_prompts_identical"] = f"{sum(s == len(x) for s, x in zip(same, reference))}/{len(reference)}"
        paris = (
            llm.chat(
                [{"role": "user", "content": "What is the capital of France?"}],
                SamplingParams(max_tokens=24, temperature=0),
                use_tqdm=False,
            )[0]
            .outputs[0]
            .text
        )
        r["paris_answer"], r["paris"] = paris, "Paris" in paris
        tensors = {t.data_ptr(): t for t in runner.model.state_dict().values()}.values()
        r["weight_bytes"] = sum(t.numel() * t.element_size() for t in tensors)
        r["linear_weight_bytes"] = linear_weight_bytes(runner.model)
        r["quantization"] = llm.engine.config.quantization
        r["kv_bytes_per_token"] = runner.bytes_per_block // runner.block_size
        r["kv_capacity_tokens"] = runner.num_blocks * runner.block_size
        if not args.quick:
            r["batch1_ms_per_token_ctx512"] = batch1_ms_per_token(llm, 512, 64, vocab)
            tp = run_kvserve(llm, make_workload(64, 0, vocab))
            r["throughput_64_requests_tok_per_s"] = tp["output_tok_per_s"]
            r["peak_rss_bytes"] = peak_rss(model, kw)
            if args.peer == "vllm" and name in W4_CONFIGS:
                r["vllm"] = vllm_on(model, vocab, args.vllm_dtype)
        r["load_average_after"] = load_average()
        result["configs"][name] = r
        print(name, json.dumps(r), flush=True)
        del llm
    c = result["configs"]
    base = c["float32"]
    for name, r in c.items():
        r["perplexity_vs_float32"] = r["perplexity"] / base["perplexity"] - 1
    t = result["targets"] = {}
    if "fp8_kv" in c:
        t["fp8 KV perplexity within +3 %"] = c["fp8_kv"]["perplexity_vs_float32"] <= 0.03
        t["fp8 KV answers Paris"] = c["fp8_kv"]["paris"]
    i8 = c.get("int8_weights")
    if i8:
        t["int8 perplexity within +3 %"] = i8["perplexity_vs_float32"] <= 0.03
        t["int8 answers Paris"] = i8["paris"]
    if not args.quick and i8:
        i8["batch1_speedup_vs_float32"] = base["batch1_ms_per_token_ctx512"] / i8["batch1_ms_per_token_ctx512"]
        t["int8 batch-1 >= 1.3x float32"] = i8["batch1_speedup_vs_float32"] >= 1.3
    native = cpu_native_bf16()[0]
    result["native_bf16"] = native
    for name in W4_CONFIGS:
        w, bf = c.get(name), c.get("bfloat16")
        if not w:
            continue
        t[f"{name} perplexity within +3 %"] = w["perplexity_vs_float32"] <= 0.03
        if bf:
            w["weight_bytes_vs_bfloat16"] = w["weight_bytes"] / bf["weight_bytes"]
            w["linear_weight_bytes_vs_bfloat16"] = w["linear_weight_bytes"] / bf["linear_weight_bytes"]
            t[f"{name} weights <= 0.3x bf16 (whole model)"] = w["weight_bytes_vs_bfloat16"] <= 0.3
            t[f"{name} linear-layer weights <= 0.3x bf16"] = w["linear_weight_bytes_vs_bfloat16"] <= 0.3
        if args.quick:
            continue
        w["batch1_time_vs_float32"] = w["batch1_ms_per_token_ctx512"] / base["batch1_ms_per_token_ctx512"]
        if bf:
            w["batch1_time_vs_bfloat16"] = w["batch1_ms_per_token_ctx512"] / bf["batch1_ms_per_token_ctx512"]
        # the bar by CPU kind: <= 0.45x bf16 with native bf16, <= 0.35x float32 without
        if native and bf:
            t[f"{name} batch-1 <= 0.45x bf16 (native bf16 CPU)"] = w["batch1_time_vs_bfloat16"] <= 0.45
        elif not native:
            t[f"{name} batch-1 <= 0.35x float32 (CPU without native bf16)"] = w["batch1_time_vs_float32"] <= 0.35
        if i8:
            w["throughput_vs_int8"] = w["throughput_64_requests_tok_per_s"] / i8["throughput_64_requests_tok_per_s"]
            t[f"{name} 64-request tok/s >= int8's"] = w["throughput_vs_int8"] >= 1.0
    print(json.dumps(result["targets"]))
    return prov.write(args.out, result, indent=1)


if __name__ == "__main__":
    main()
