"""Does ``torch.compile`` (inductor, CPU) pay for the decoder's element-wise work here?

Compiles every decoder layer's MLP and both RMSNorms (``dynamic=True``, so the token count does
not recompile per step) and reports the median 64-request decode step against the same engine
uncompiled, and against the hand-fused C++ ops (``kvserve/kernels/csrc/fused_ops_cpu.cpp``).

Usage (one mode per process, so compiled state never leaks between them)::

    python benchmarks/compile_probe.py plain      # ATen element-wise ops, not compiled
    python benchmarks/compile_probe.py fused      # the default: hand-fused C++ ops
    python benchmarks/compile_probe.py compile    # MLP + norms through torch.compile
    KVSERVE_CPU_LINEAR=aten python benchmarks/compile_probe.py compile   # with ATen's F.linear

Each run writes its own file, whole: ``benchmarks/results/compile_probe_<mode>_<cpu_linear>.json``.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

import kvserve.engine.layers.linear as linear  # noqa: E402
from benchmarks.common import Figures, Results, greedy, random_token_ids  # noqa: E402
from kvserve.engine import LLM  # noqa: E402
from kvserve.engine.step_isolation import StepFailedError
from kvserve.engine.model_loader import resolve_model  # noqa: E402
from kvserve.kernels import cpu_backend  # noqa: E402

#: The top-level keys this script writes (besides common.PROVENANCE_KEYS).
RESULT_KEYS = ("mode", "cpu_linear", "error", "decode_step_ms_p50", "prefill_and_warmup_s")


def main(mode: str) -> None:
    if mode not in ("plain", "fused", "compile"):
        raise SystemExit("mode: plain | fused | compile")
    prov = Results(__file__, RESULT_KEYS)
    cpu_backend.FUSED_OPS = mode == "fused"
    llm = LLM(model=str(resolve_model(None)), max_num_seqs=64)
    eng = llm.engine
    result = {"mode": mode, "cpu_linear": linear.CPU_LINEAR}
    if mode == "compile":
        for layer in eng.executor.runner.model.layers:
            layer.mlp = torch.compile(layer.mlp, dynamic=True)
            layer.input_layernorm = torch.compile(layer.input_layernorm, dynamic=True)
            layer.post_attention_layernorm = torch.compile(layer.post_attention_layernorm, dynamic=True)
    rng, vocab = random.Random(0), eng.hf_config.vocab_size
    t = time.perf_counter()
    for i in range(64):
        eng.add_request(f"d{i}", random_token_ids(rng, rng.randint(100, 200), vocab), greedy(10_000))
    try:
        while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
            eng.step()
        for _ in range(3):
            eng.step()
    except StepFailedError as e:  # a compile failure is the result
        result["error"] = str(e).splitlines()[0][:300]
        print(json.dumps(result))
        return save(prov, result)
    warm = time.perf_counter() - t
    times = []
    for _ in range(10):
        s = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - s)
    times.sort()
    result.update(decode_step_ms_p50=1e3 * times[5], prefill_and_warmup_s=warm)
    print(json.dumps(result))
    save(prov, result)


def figures(r: dict) -> Figures:
    """The file's summary (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    what = f"{r['mode']}, cpu_linear={r['cpu_linear']}"
    if "error" in r:
        return f.summary(f"{what}: the engine step failed", r["error"])
    f.summary(f"{what}: decode step p50, 64 requests", r["decode_step_ms_p50"], "ms")
    return f.summary(f"{what}: prefill and warm-up", r["prefill_and_warmup_s"], "s")


def save(prov: Results, result: dict) -> None:
    """Write ``result`` to ``benchmarks/results/compile_probe_<mode>_<cpu_linear>.json``."""
    prov.write(
        Path(__file__).parent / "results" / f"compile_probe_{result['mode']}_{result['cpu_linear']}.json",
        result,
        indent=1,
    )


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "fused")
