"""Where the CPU time goes, op by op, in kvserve and in its peers on the same work (issue 46: a per-op
profile of both engines): one stream against llama.cpp, the 64-request workload against vLLM.

Every side is sampled the same way: ``perf record -a -e cpu-clock -F 999`` (the kernel's software
clock, which needs no hardware counters, so it works in a VM) over the whole machine while that side
alone runs its work, after its warm-up; the box is otherwise idle (the load average before and after
is in the file). Samples are grouped by symbol (function), then into a few op classes by the
symbol's and the library's name (:data:`CLASSES`): the matmuls (kvserve's GEMVs, oneDNN's JIT code,
ggml's dot products), attention, element-wise ops, thread synchronisation and spinning (OpenMP,
ggml's barrier), host work (Python, the framework, the allocator, the OS) and idle (no process on
the core). A share is of all the samples of the window: both cores' time.

* ``batch1``: llama.cpp ``llama-bench -t 2 -p 0 -n 512 -r 3`` (decode from an empty context; the
  run's short model load and warm-up included) against kvserve's engine decoding 512 tokens after a
  16-token prompt, request after request, for ``--seconds``; each dtype. Same weights (the GGUF that
  ``benchmarks/batch1.py`` converts), 2 threads.
* ``many``: ``benchmarks/throughput.py``'s 64-request workload (fresh token ids per pass) run over
  and over for ``--seconds``, kvserve's ``LLM`` against vLLM's CPU build
  (``benchmarks/peer_vllm.py``: its settings, every core); each dtype.

Not picked: ``torch.profiler`` (it sees torch ops only: not llama.cpp, and not vLLM's engine-core
process without its own profiler set-up, whose tables differ from ours); ``perf`` with hardware
counters (none in this VM).

Usage::

    python benchmarks/op_profile.py --out benchmarks/results/op_profile_avx512-bf16.json
    python benchmarks/op_profile.py --parts batch1 --dtypes bfloat16 --seconds 5 --out /tmp/p.json   # smoke
"""

from __future__ import annotations

import argparse
import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import RESULTS, Figures, Results, resolve  # noqa: E402

RESULT_KEYS = ("model", "threads", "seconds", "sampling", "parts")
#: Op classes, first match wins, on "<library> <symbol>" (``perf report``'s dso and symbol). Without call
#: graphs a BLAS kernel that attention calls (torch's SDPA on MKL) counts as a matmul.
CLASSES = (
    ("attention", r"attention|attn|Item<|soft_max|softmax|sdpa|scaled_dot"),
    (
        "matmul",
        r"gemv|gemm|dp_rows|rows_m1|_linear_cpu|mkldnn|dnnl|onednn|\[JIT\]|//anon|ggml_vec_dot|mul_mat|"
        r"mkl_blas|sgemm|xgemm|tinyBLAS|llamafile|fp32_to_bf16",
    ),
    (
        "element-wise",
        r"rms_norm|rotary|rope|silu|gelu|glu|swiglu|add_rms|index_copy|store_rows|copy_kernel|"
        r"ggml_compute_forward_(add|mul|norm|cpy|dup|get_rows|scale|cont|set_rows)|"
        r"\.main\.so ",
    ),  # torch.compile's generated kernels (vLLM's fused norms and activations)
    ("thread sync and spin", r"libgomp|libiomp|ggml_barrier|sched_yield|__kmp|GOMP_"),
    ("sampling", r"argmax|sampler|topk|top_k|sort"),
    (
        "host (Python, framework, allocator, OS)",
        r"python|pybind|_Py|libtorch|libc10|libc\.so|libstdc|ld-linux|"
        r"\[kernel|tokenizers|zmq|libm\.so|llama|ggml",
    ),
)
IDLE = "idle"
LLAMA_BENCH_ARGS = ["-t", "2", "-p", "0", "-n", "512", "-r", "3"]


def classify(dso: str, symbol: str, comm: str) -> str:
    """The op class of one ``perf report`` row (:data:`CLASSES`; ``idle`` for the idle task)."""
    if comm == "swapper":
        return IDLE
    text = f"{dso} {symbol}"
    return next((name for name, pat in CLASSES if re.search(pat, text)), "other")


def perf_rows(data: Path) -> list[tuple[float, str, str, str]]:
    """``(share %, comm, dso, symbol)`` rows of ``perf report`` on ``data``, largest first; the
    addresses of code without symbols are summed per library (``(no symbol)``)."""
    out = subprocess.run(
        [
            "perf",
            "report",
            "-i",
            str(data),
            "--stdio",
            "--no-children",
            "-g",
            "none",
            "--sort",
            "comm,dso,sym",
            "--percent-limit",
            "0",
            "-F",
            "overhead,comm,dso,sym",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    acc: dict[tuple[str, str, str], float] = defaultdict(float)
    for line in out.splitlines():
        m = re.match(r"\s*([\d.]+)%\s+(\S+)\s+(\[JIT\] tid \d+|\S+)\s+\[[.k]\]\s+(.*\S)", line)
        if m:  # code without symbols (JIT code, a stripped library) counts as one row per library
            sym = "(no symbol)" if re.fullmatch(r"0x[0-9a-f]+", m[4]) else m[4]
            dso = "[JIT]" if m[3].startswith("[JIT]") else m[3]
            acc[(m[2], dso, sym)] += float(m[1])
    return sorted(((v, *k) for k, v in acc.items()), reverse=True)


def summarize(rows: list[tuple[float, str, str, str]], top: int = 12) -> dict:
    """Op-class shares (%) and the ``top`` symbols of one profile (the classes sum to 100 but for
    perf's rounding of each row to 0.01 %; JIT code is thousands of rows of a few samples each)."""
    classes: dict[str, float] = defaultdict(float)
    for share, comm, dso, sym in rows:
        classes[classify(dso, sym, comm)] += share
    busy = [r for r in rows if r[1] != "swapper"]
    return {
        "classes": {k: round(v, 2) for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
        "top": [[round(s, 2), c, Path(d).name, sym[:120]] for s, c, d, sym in busy[:top]],
    }


def record(seconds: float | None, data: Path, cmd: list[str] | None = None) -> str:
    """``perf record -a -e cpu-clock -F 999`` into ``data``: for ``seconds`` (``sleep``), or for
    the run of ``cmd`` (its stdout is returned)."""
    return subprocess.run(
        [
            "perf",
            "record",
            "-q",
            "-a",
            "-e",
            "cpu-clock",
            "-F",
            "999",
            "-o",
            str(data),
            "--",
            *(cmd or ["sleep", str(seconds)]),
        ],
        check=True,
        capture_output=True,
        text=True,
    ).stdout


def wait_for(ready: Path, alive, timeout_s: float = 900) -> bool:
    """Poll until the file ``ready`` exists (True: the profiled side's warm-up is done), or until
    ``alive()`` turns false or ``timeout_s`` seconds pass without it (False)."""
    end = time.monotonic() + timeout_s
    while not ready.exists():
        if not alive() or time.monotonic() > end:
            return ready.exists()
        time.sleep(0.5)
    return True


def wait_ready(ready: Path, proc: subprocess.Popen, timeout_s: float = 900) -> None:
    """Until the side running in ``proc`` wrote ``ready`` (its warm-up done).

    Raises:
        RuntimeError: it exited or timed out first."""
    if not wait_for(ready, lambda: proc.poll() is None, timeout_s):
        proc.kill()
        raise RuntimeError(
            f"the profiled side exited ({proc.returncode}) or timed out before its warm-up ended: "
            f"{(proc.stderr.read() if proc.stderr else '')[-2000:]}"
        )


def child(part: str, dtype: str, seconds: float, ready: str, out: str, threads: int) -> None:
    """The kvserve side, in a process of its own: warm up, write ``ready``, run ``part``'s work
    over and over for ``seconds``, write its output tokens per second to ``out``."""
    import torch

    from benchmarks.common import make_workload, run_kvserve
    from benchmarks.throughput import reshuffled
    from kvserve.engine import LLM, SamplingParams

    torch.set_num_threads(threads)
    path, vocab = resolve(None)
    rng = random.Random(46)
    if part == "batch1":
        llm = LLM(model=path, dtype=dtype, enable_prefix_caching=False, max_num_seqs=1, max_model_len=1024)
        eng = llm.engine

        def once(n: int) -> int:
            eng.add_request(
                f"p-{rng.random()}",
                [rng.randrange(100, vocab) for _ in range(16)],
                SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0),
            )
            while eng.has_unfinished_requests():
                eng.step()
            return n

        once(8)
    else:
        llm = LLM(model=path, dtype=dtype, max_num_batched_tokens=2048)
        base = make_workload(64, 0, vocab)

        def once(n: int) -> int:
            return run_kvserve(llm, reshuffled(base, rng.randrange(1 << 30), vocab))["output_tokens"]

        once(0)
    Path(ready).write_text("ready")
    tokens, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        tokens += once(512)
    Path(out).write_text(json.dumps({"output_tok_per_s": tokens / (time.perf_counter() - t0)}))


def profile_kvserve(part: str, dtype: str, seconds: float, threads: int, tmp: Path) -> dict:
    ready, out, data = tmp / f"ready-{part}-{dtype}", tmp / f"out-{part}-{dtype}.json", tmp / "kvserve.data"
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            part,
            "--dtype",
            dtype,
            "--seconds",
            str(seconds + 5),
            "--ready",
            str(ready),
            "--child-out",
            str(out),
            "--threads",
            str(threads),
        ],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    wait_ready(ready, proc)
    record(seconds, data)
    proc.wait(timeout=3600)
    return {**summarize(perf_rows(data)), **json.loads(out.read_text())}


def profile_vllm(path: str, dtype: str, seconds: float, tmp: Path) -> dict:
    """vLLM on the 64-request workload, over and over (peer_vllm's worker with ``loop``)."""
    import threading

    from benchmarks.common import make_workload
    from benchmarks.peer_vllm import run_vllm
    from benchmarks.throughput import reshuffled

    _, vocab = resolve(None)
    base = make_workload(64, 0, vocab)
    works = [reshuffled(base, 7000 + i, vocab) for i in range(40)]
    ready, data, box = tmp / f"ready-vllm-{dtype}", tmp / "vllm.data", {}

    def run():
        try:
            box["result"] = run_vllm(path, dtype, works, loop={"ready": str(ready), "seconds": seconds + 5})
        except Exception as e:  # noqa: BLE001 - reported below
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    if not wait_for(ready, t.is_alive):
        t.join(timeout=60)
        raise RuntimeError(f"vLLM did not start: {box.get('error')}")
    record(seconds, data)
    t.join()
    if "error" in box:
        raise box["error"]
    r = box["result"]
    runs = r["runs"]
    return {
        **summarize(perf_rows(data)),
        "version": r["version"],
        "output_tok_per_s": sum(x["output_tokens"] for x in runs) / sum(x["elapsed_s"] for x in runs),
    }


def profile_llama(dtype: str, model_path: str, tmp: Path) -> dict:
    from benchmarks.batch1 import LLAMA_CPP_VERSION, gguf, llama_cpp

    src = llama_cpp()
    data = tmp / "llama.data"
    cmd = [
        str(src / "build" / "bin" / "llama-bench"),
        "-m",
        str(gguf(src, model_path, dtype)),
        *LLAMA_BENCH_ARGS,
        "-o",
        "json",
    ]
    t0 = time.perf_counter()
    bench = json.loads(record(None, data, cmd))
    return {
        **summarize(perf_rows(data)),
        "version": LLAMA_CPP_VERSION,
        "seconds": time.perf_counter() - t0,
        "output_tok_per_s": next(b["avg_ts"] for b in bench if b["n_gen"] > 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default="batch1,many")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--seconds", type=float, default=20, help="sampled seconds of each kvserve and vLLM side")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(RESULTS / "op_profile.json"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--dtype", help=argparse.SUPPRESS)
    ap.add_argument("--ready", help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.dtype, args.seconds, args.ready, args.child_out, args.threads)
        return
    prov = Results(__file__, RESULT_KEYS)
    model_path, _ = resolve(None)
    parts: dict = {}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for part in args.parts.split(","):
            for dt in args.dtypes.split(","):
                sides = {}
                peer = "llama.cpp" if part == "batch1" else "vLLM"
                for side in ("kvserve", peer):
                    try:
                        if side == "kvserve":
                            sides[side] = profile_kvserve(part, dt, args.seconds, args.threads, tmp)
                        elif side == "llama.cpp":
                            sides[side] = profile_llama(dt, model_path, tmp)
                        else:
                            sides[side] = profile_vllm(model_path, dt, args.seconds, tmp)
                    except Exception as e:  # noqa: BLE001 - a side that failed is reported, not hidden
                        sides[side] = {"error": f"{type(e).__name__}: {e}"}
                    print(part, dt, side, json.dumps(sides[side])[:400], flush=True)
                parts.setdefault(part, {})[dt] = sides
    prov.write(
        args.out,
        {
            "model": model_path,
            "threads": args.threads,
            "seconds": args.seconds,
            "sampling": "perf record -a -e cpu-clock -F 999 (whole machine, while one side runs)",
            "parts": parts,
        },
    )


def figures(r: dict) -> Figures:
    """The file's tables (``benchmarks.common.Figures``): op-class shares side by side, top symbols."""
    f = Figures()
    titles = {
        "batch1": "one stream (batch-1 decode), kvserve and llama.cpp",
        "many": "the 64-request workload, kvserve and vLLM",
    }
    for part, by_dtype in r["parts"].items():
        for dt, sides in by_dtype.items():
            names = [n for n in sides if "classes" in sides[n]]
            classes = []
            for s in names:
                classes += [c for c in sides[s]["classes"] if c not in classes]
            rows = [[c] + [round(sides[s]["classes"].get(c, 0.0), 1) for s in names] for c in classes]
            rows.append(["output tok/s while sampled"] + [sides[s].get("output_tok_per_s") for s in names])
            errors = {s: sides[s]["error"] for s in sides if "error" in sides[s]}
            f.table(
                f"Where the time goes: {titles.get(part, part)}, {dt} (% of both cores' time)",
                ["op class"] + names,
                rows,
                note="perf record -a -e cpu-clock -F 999; classes by symbol and library name "
                "(benchmarks/op_profile.py CLASSES)" + (f"; failed: {errors}" if errors else ""),
            )
            for s in names:
                f.table(
                    f"Top symbols: {s}, {titles.get(part, part)}, {dt}",
                    ["%", "process", "library", "symbol"],
                    sides[s]["top"],
                )
    return f


if __name__ == "__main__":  # vLLM (the many part) spawns processes: the script runs only under this guard
    main()
