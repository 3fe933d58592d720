"""What the benchmark scripts share: the model folder, the seeded request workload, greedy
sampling, the offline kvserve run (KV waste read from the scheduler's own counters), the
Hugging Face ``generate`` static-batch baseline, percentiles, the load average, JSON and
plot output, a local Ray Serve started as ``kvserve serve`` starts it (:func:`local_serve`),
and the one way a results file is written (:class:`Results`).

Every file in ``benchmarks/results/`` is written by its script, whole, through
:class:`Results`: the script declares the top-level keys it writes (a module-level
``RESULT_KEYS`` tuple of string literals), creates ``Results(__file__, RESULT_KEYS)`` when it
starts (load average before, the exact command, the commit) and calls ``.write(path, result)``
at the end, which adds :data:`PROVENANCE_KEYS` (the script, commit, machine, command, load
average before and after) and refuses a key the script did not declare.
``tests/test_results_provenance.py`` checks every committed file against its script's
declaration with :func:`check_results`.

Every results file also follows one schema (:data:`SCHEMA_KEYS`), which ``docs/hooks.py`` renders
with one generic renderer: ``summary``, rows of ``{metric, value, unit, target, met}`` (optionally
``headline: true``: the row also goes into the benchmarks page's headline table), and ``tables``,
each ``{title, columns, rows}`` (optionally ``note``). A script does not write them itself: it
defines a module-level ``figures(result) -> Figures`` that derives them from the measured values,
and :meth:`Results.write` runs it. ``figures`` may use only builtins and this module's names
(:func:`figures_function` compiles it alone from the script's source), so the migration of old
files (``benchmarks/migrate_results.py``) and the tests can derive a file's schema again without
the script's dependencies (torch, Ray), and a file whose schema differs from its script's
derivation fails the tests: no figure is typed by hand.

Each script in ``benchmarks/`` keeps only what is its own. They run as scripts
(``python benchmarks/throughput.py``) and put the repository root on ``sys.path`` before
importing this module.
"""

from __future__ import annotations

import __future__
import ast
import builtins
import contextlib
import itertools
import json
import math
import os
import random
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# The throughput / serving workload: lengths in tokens, uniform, both ends included.
PROMPT_LEN = (32, 256)
OUTPUT_LEN = (16, 128)
# Warm-up prompt: not a workload prompt, so warm-up leaves no prefix-cache hits behind.
WARMUP_PROMPT = list(range(1000, 1064))

_request_ids = itertools.count()


# ---- model and workload ---------------------------------------------------------------------
def add_model_arg(ap) -> None:
    ap.add_argument("--model", default=None, help="model folder or hub id (default SmolLM2-135M-Instruct)")


def resolve(model: str | None) -> tuple[str, int]:
    """The local model folder for ``model`` (``kvserve.engine.model_loader.resolve_model``; None is
    the default SmolLM2-135M-Instruct) and its vocabulary size."""
    from kvserve.engine.model_loader import load_config, resolve_model

    path = str(resolve_model(model))
    return path, load_config(path).vocab_size


def make_workload(n: int, seed: int, vocab: int, prompt_range=PROMPT_LEN, output_range=OUTPUT_LEN):
    """``n`` (prompt token ids, output length) pairs from a seeded RNG: random ids in
    100..vocab-100, lengths uniform in the ranges."""
    rng = random.Random(seed)
    work = []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        olen = rng.randint(*output_range)
        work.append(([rng.randint(100, vocab - 100) for _ in range(plen)], olen))
    return work


def workload_info(work, seed: int) -> dict:
    """The ``workload`` block of a result JSON for a :func:`make_workload` workload."""
    return {
        "num_requests": len(work),
        "seed": seed,
        "prompt_len": list(PROMPT_LEN),
        "output_len": list(OUTPUT_LEN),
        "prompt_tokens": sum(len(p) for p, _ in work),
        "output_tokens": sum(o for _, o in work),
        "greedy": True,
        "ignore_eos": True,
    }


def random_token_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    """``n`` random token ids in 100..min(vocab, 40000)-1 (prompts of the step-time benchmarks)."""
    return [rng.randint(100, min(vocab, 40000) - 1) for _ in range(n)]


def greedy(max_tokens: int, **kw):
    """Greedy sampling of exactly ``max_tokens`` tokens (``ignore_eos``)."""
    from kvserve.engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kw)


# ---- systems --------------------------------------------------------------------------------
def run_kvserve(llm, work, lora_requests: list | None = None) -> dict:
    """All of ``work`` at once on ``llm``'s engine (an ``engine.LLM``), after a warm-up
    outside the timed region (first-call allocations, thread pools); ``lora_requests``: each
    request's ``kvserve.engine.lora.LoRARequest`` (None: the base model), in workload order.

    Returns elapsed_s, output_tokens, output_tok_per_s, steps, the engine's
    max_running_batch, kv_waste, prefix_cache_hit_rate, num_preemptions, num_kv_blocks, and
    ``texts`` (each request's output text, in workload order). ``kv_waste`` is the share of
    allocated KV slots (whole blocks held by running requests) not holding a token, summed
    over steps from the scheduler's ``kv_allocated_slots`` / ``kv_used_slots``.
    """
    eng = llm.engine
    llm.generate([WARMUP_PROMPT], greedy(4), use_tqdm=False)
    ids = [f"bench-{next(_request_ids)}" for _ in work]
    texts: dict[str, str] = {}
    allocated = unused = 0
    produced = steps = 0
    t0 = time.perf_counter()
    for i, (rid, (prompt, olen, *_)) in enumerate(zip(ids, work)):
        eng.add_request(rid, prompt, greedy(olen), lora_request=lora_requests[i] if lora_requests else None)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                produced += len(out.outputs[0].token_ids)
                texts[out.request_id] = out.outputs[0].text
        steps += 1
        kv = eng.scheduler.stats()
        allocated += kv["kv_allocated_slots"]
        unused += kv["kv_allocated_slots"] - kv["kv_used_slots"]
    elapsed = time.perf_counter() - t0
    stats = eng.get_stats()
    return {
        "elapsed_s": elapsed,
        "output_tokens": produced,
        "output_tok_per_s": produced / elapsed,
        "steps": steps,
        "max_running_batch": stats["max_running_batch"],
        "kv_waste": unused / max(allocated, 1),
        "prefix_cache_hit_rate": stats["prefix_cache_hit_rate"],
        "num_preemptions": stats["num_preemptions"],
        "num_kv_blocks": stats["num_kv_blocks"],
        "texts": [texts.get(rid) for rid in ids],
    }


def load_hf_model(model_path: str):
    """The model folder in Hugging Face transformers, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def run_hf_static(model_path: str, work, batch_size: int = 16, pad_id: int = 2) -> dict:
    """HF ``generate`` in static batches of ``batch_size`` in workload order: left-padded,
    greedy, each batch runs to its longest output (``min_new_tokens`` = ``max_new_tokens``).
    Throughput counts only the tokens the requests asked for, so padding and overrun count
    as time, not as output."""
    import torch

    model = load_hf_model(model_path)
    useful = sum(o for _, o in work)
    t0 = time.perf_counter()
    with torch.inference_mode():
        for b in range(0, len(work), batch_size):
            batch = work[b : b + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(o for _, o in batch)
            model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_id,
            )
    elapsed = time.perf_counter() - t0
    return {
        "system": f"hf_generate_static_bs{batch_size}",
        "elapsed_s": elapsed,
        "output_tokens": useful,
        "output_tok_per_s": useful / elapsed,
    }


def decode_ms_per_token(generate_s, new_tokens: int, reps: int = 3) -> float:
    """Decode latency, ms per output token, with the prefill cancelled out:
    ``(generate_s(1 + new_tokens) - generate_s(1)) / new_tokens``, best of ``reps`` after a
    warm-up. ``generate_s(n)``: seconds to generate ``n`` tokens from the same prompt."""
    generate_s(2)
    return min((generate_s(1 + new_tokens) - generate_s(1)) / new_tokens for _ in range(reps)) * 1e3


# ---- numbers and output ---------------------------------------------------------------------
def percentile(xs: list[float], q: float, *, nearest_rank: bool = False) -> float | None:
    """The ``q``-th percentile (0..100) of ``xs``, None if empty: linear interpolation
    between the closest ranks (numpy's default), or with ``nearest_rank`` the nearest-rank
    percentile (always one of the samples)."""
    if not xs:
        return None
    s = sorted(xs)
    if nearest_rank:
        return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]
    k = (len(s) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def load_average() -> list[float] | None:
    """The 1 / 5 / 15-minute load average (on 2 cores, above 2 means a shared CPU)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


# ---- provenance: the one way a results file is written ------------------------------------------
#: Top-level keys :meth:`Results.write` adds to every results file.
PROVENANCE_KEYS = ("script", "commit", "machine", "command", "loadavg_before", "loadavg_after")
#: Keys of the ``machine`` record every results file carries (:func:`machine_info` may add more).
MACHINE_KEYS = ("cpu_model", "flags", "cores", "memory_gib")
#: The CPU flags that decide which kernels run (``amx_*`` are kept by prefix).
RELEVANT_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "fma")


def git_commit() -> str | None:
    """HEAD's short hash, with ``-dirty`` when tracked files differ from it; ``KVSERVE_COMMIT``
    instead where it is set: the commit a tree was sent from, for a copy run elsewhere (a lent GPU
    machine gets the working tree beside a ``.git`` of an older HEAD, whose ``rev-parse`` would name
    the wrong commit; ``benchmarks/gpu_lease.sh`` is run with it). None without either."""
    if os.environ.get("KVSERVE_COMMIT"):
        return os.environ["KVSERVE_COMMIT"]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30).stdout.strip()

    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        head, dirty = "", ""
    return (head + ("-dirty" if dirty else "")) or None


def machine_info() -> dict:
    """The machine a result came from: CPU model, the flags that pick kernels
    (:data:`RELEVANT_FLAGS`, ``amx_*``), logical cores, memory in GiB; the versions of Ray and
    torch, torch's thread count and vector ISA where they are already imported (this never
    imports them)."""
    import platform

    info: dict = {
        "cpu_model": platform.processor() or platform.machine(),
        "flags": [],
        "cores": os.cpu_count(),
        "memory_gib": None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            lines = f.read().splitlines()
        model = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), None)
        flags = next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), [])
        info["cpu_model"] = model or info["cpu_model"]
        info["flags"] = sorted(f for f in set(flags) if f in RELEVANT_FLAGS or f.startswith("amx_"))
    except OSError:
        pass
    try:
        with open("/proc/meminfo") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal"))
        info["memory_gib"] = round(kb / 2**20, 1)
    except (OSError, StopIteration, ValueError):
        pass
    info["python"] = platform.python_version()
    for name in ("ray", "vllm"):
        if name in sys.modules:
            info[name] = getattr(sys.modules[name], "__version__", None)
    torch = sys.modules.get("torch")
    if torch is not None:
        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        with contextlib.suppress(Exception):
            info["torch_isa"] = torch.backends.cpu.get_cpu_capability()
    return info


def _command() -> str:
    """This process's command line, as run: the Python executable (relative to the repository
    when inside it) and ``sys.argv``."""
    exe = Path(sys.executable)
    with contextlib.suppress(ValueError):
        exe = exe.relative_to(ROOT)
    argv = list(sys.argv)
    if argv and argv[0]:
        with contextlib.suppress(ValueError):
            argv[0] = Path(argv[0]).resolve().relative_to(ROOT).as_posix()
    return shlex.join([str(exe), *argv])


# ---- the schema: what every results file shows ------------------------------------------------------
#: Top-level keys every results file has beside provenance and its script's own keys; the
#: script's ``figures(result)`` derives them from the measured values (:class:`Figures`).
SCHEMA_KEYS = ("summary", "tables")
#: Keys of a ``summary`` row (``headline`` is optional).
SUMMARY_KEYS = ("metric", "value", "unit", "target", "met")
#: Keys of a table (``note`` is optional).
TABLE_KEYS = ("title", "columns", "rows")
#: Set by ``benchmarks/migrate_results.py`` on a file measured before the schema: the command
#: that added ``summary`` / ``tables`` (derived from the measured values, nothing re-measured).
MIGRATION_KEY = "schema_migrated_by"


class Figures:
    """A results file's ``summary`` rows and ``tables`` (:data:`SCHEMA_KEYS`), built by a script's
    ``figures(result)``. Values stay as measured (the page rounds them); a cell or value is a
    scalar (str, number, bool, None) or a list of numbers (a load average). A table without rows
    is left out, so an optional part of a run that did not happen adds nothing."""

    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.tables: list[dict] = []

    def summary(
        self,
        metric: str,
        value: Any,
        unit: str | None = None,
        *,
        target: str | None = None,
        met: bool | None = None,
        headline: bool = False,
    ) -> "Figures":
        """One figure: ``metric`` (what, in words), ``value`` in ``unit``, the ``target``
        it is held to (text, None: none) and whether it ``met`` it; ``headline``: also shown in
        the benchmarks page's headline table."""
        row = {
            "metric": metric,
            "value": value,
            "unit": unit,
            "target": target,
            "met": None if met is None else bool(met),
        }
        if headline:
            row["headline"] = True
        self.rows.append(row)
        return self

    def targets(self, targets: Any, done: Iterable[str] = ()) -> "Figures":
        """A row per entry of a result's ``targets`` record (``{what: met}``) not in ``done``
        (those a :meth:`summary` row already shows with its value)."""
        for name, met in (targets or {}).items():
            if name not in done and isinstance(met, (bool, type(None))):
                self.summary(name, met, met=met)
        return self

    def table(
        self, title: str, columns: Iterable[str], rows: Iterable[Iterable[Any]], *, note: str | None = None
    ) -> "Figures":
        """A table: ``columns`` (headers) and ``rows`` (one cell per column); ``note``: a line of
        prose shown under its title (the workload, how to read it)."""
        rows = [list(r) for r in rows]
        if rows:
            t = {"title": title, "columns": list(columns), "rows": rows}
            if note:
                t["note"] = note
            self.tables.append(t)
        return self

    def as_dict(self) -> dict:
        return {"summary": self.rows, "tables": self.tables}


def _is_cell(v: Any) -> bool:
    return (
        v is None
        or isinstance(v, (str, int, float, bool))
        or (isinstance(v, list) and all(isinstance(x, (int, float, str)) or x is None for x in v))
    )


def check_schema(data: Any) -> list[str]:
    """What is wrong with a results file's ``summary`` and ``tables`` (empty: nothing): missing,
    malformed, or both empty."""
    if not isinstance(data, dict):
        return [f"not a JSON object but {type(data).__name__}"]
    problems = [f"no {k!r} (the results schema: benchmarks.common.Figures)" for k in SCHEMA_KEYS if k not in data]
    summary, tables = data.get("summary", []), data.get("tables", [])
    if not isinstance(summary, list):
        return problems + ["summary is not a list"]
    if not isinstance(tables, list):
        return problems + ["tables is not a list"]
    for i, row in enumerate(summary):
        where = f"summary[{i}]"
        if not isinstance(row, dict):
            problems.append(f"{where} is not a record")
            continue
        keys = set(row) - {"headline"}
        if keys != set(SUMMARY_KEYS):
            problems.append(f"{where} has keys {sorted(row)}, not {list(SUMMARY_KEYS)} (+ headline)")
            continue
        if not (isinstance(row["metric"], str) and row["metric"]):
            problems.append(f"{where}: metric is {row['metric']!r}")
        if not _is_cell(row["value"]):
            problems.append(f"{where}: value {row['value']!r} is not a scalar")
        for k in ("unit", "target"):
            if row[k] is not None and not isinstance(row[k], str):
                problems.append(f"{where}: {k} is {row[k]!r}, not text or null")
        if row["met"] is not None and not isinstance(row["met"], bool):
            problems.append(f"{where}: met is {row['met']!r}, not true / false / null")
        if "headline" in row and not isinstance(row["headline"], bool):
            problems.append(f"{where}: headline is {row['headline']!r}")
    for i, t in enumerate(tables):
        where = f"tables[{i}]"
        if not isinstance(t, dict) or not set(TABLE_KEYS) <= set(t) or set(t) - set(TABLE_KEYS) - {"note"}:
            problems.append(f"{where} is not a record of {list(TABLE_KEYS)} (+ note)")
            continue
        if not isinstance(t["title"], str) or not isinstance(t.get("note", ""), str):
            problems.append(f"{where}: title or note is not text")
        cols = t["columns"]
        if not (isinstance(cols, list) and cols and all(isinstance(c, str) for c in cols)):
            problems.append(f"{where}: columns are not a list of names")
            continue
        if not (isinstance(t["rows"], list) and t["rows"]):
            problems.append(f"{where}: no rows")
            continue
        for j, r in enumerate(t["rows"]):
            if not (isinstance(r, list) and len(r) == len(cols) and all(_is_cell(c) for c in r)):
                problems.append(f"{where}.rows[{j}] is not {len(cols)} scalar cells")
                break
    if not problems and not summary and not tables:
        problems.append("summary and tables are both empty")
    return problems


def measured_part(data: dict) -> dict:
    """A results file's content without provenance, schema and migration keys: what its script's
    ``figures`` reads."""
    drop = set(PROVENANCE_KEYS) | set(SCHEMA_KEYS) | {MIGRATION_KEY}
    return {k: v for k, v in data.items() if k not in drop}


def figures_function(script: str | os.PathLike) -> Callable[[dict], Figures]:
    """The script's module-level ``figures(result) -> Figures``, compiled alone from its source:
    its globals are builtins and this module's names only (so it runs without the script's
    imports). ValueError if the script has none."""
    path = Path(script)
    tree = ast.parse(path.read_text(), str(path))
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "figures"), None)
    if fn is None:
        raise ValueError(f"{path.name} defines no module-level figures(result) (benchmarks.common.Figures)")
    code = compile(
        ast.Module(body=[fn], type_ignores=[]),
        str(path),
        "exec",
        flags=__future__.annotations.compiler_flag,
        dont_inherit=True,
    )
    namespace = {k: v for k, v in globals().items() if not k.startswith("__")}
    exec(code, namespace)
    return namespace["figures"]


def figures_free_names(script: str | os.PathLike) -> list[str]:
    """Names the script's ``figures`` reads that neither it binds nor builtins or this module
    define: each would be a NameError when :func:`figures_function` runs it."""
    tree = ast.parse(Path(script).read_text())
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "figures"), None)
    if fn is None:
        return []
    bound, loaded = set(), set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.FunctionDef) or (isinstance(node, ast.ExceptHandler) and node.name):
            bound.add(node.name)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    known = set(dir(builtins)) | set(globals())
    return sorted(loaded - bound - known)


def check_results(data, declared_keys: Iterable[str]) -> list[str]:
    """What is wrong with a results file's content ``data`` against its script's
    ``RESULT_KEYS`` (empty: nothing): a missing or malformed provenance key, a top-level key
    neither provenance, schema nor declared by the script, or a schema problem
    (:func:`check_schema`)."""
    if not isinstance(data, dict):
        return [f"not a JSON object but {type(data).__name__}"]
    problems = [f"no {k!r}" for k in PROVENANCE_KEYS if k not in data]
    if "commit" in data and not (isinstance(data["commit"], str) and data["commit"]):
        problems.append(f"commit is {data['commit']!r}")
    if "command" in data and not (isinstance(data["command"], str) and data["command"].strip()):
        problems.append(f"command is {data['command']!r}")
    if "script" in data and not (isinstance(data["script"], str) and data["script"].startswith("benchmarks/")):
        problems.append(f"script is {data['script']!r}")
    m = data.get("machine")
    if "machine" in data:
        if not isinstance(m, dict):
            problems.append("machine is not a record")
        else:
            problems += [f"machine has no {k!r}" for k in MACHINE_KEYS if m.get(k) is None]
    for k in ("loadavg_before", "loadavg_after"):
        v = data.get(k)
        if k in data and not (isinstance(v, list) and len(v) == 3 and all(isinstance(x, (int, float)) for x in v)):
            problems.append(f"{k} is {v!r}, not the 1/5/15-minute load average")
    if MIGRATION_KEY in data and not (isinstance(data[MIGRATION_KEY], str) and data[MIGRATION_KEY].strip()):
        problems.append(f"{MIGRATION_KEY} is {data[MIGRATION_KEY]!r}")
    extra = sorted(set(data) - set(PROVENANCE_KEYS) - set(SCHEMA_KEYS) - {MIGRATION_KEY} - set(declared_keys))
    if extra:
        problems.append(f"keys its script does not declare in RESULT_KEYS: {extra}")
    return problems + check_schema(data)


class Results:
    """One run's results file. ``Results(__file__, RESULT_KEYS)`` when the script starts records
    the load average before, the command and the commit; :meth:`write` adds the machine and the
    load average after, the script's ``figures`` (``summary`` and ``tables``), checks the keys and
    the schema (:func:`check_results`) and writes the file whole."""

    def __init__(self, script: str | os.PathLike, keys: Iterable[str]):
        path = Path(script).resolve()
        self.path = path
        self.script = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        self.keys = tuple(keys)
        clash = sorted(set(self.keys) & (set(PROVENANCE_KEYS) | set(SCHEMA_KEYS) | {MIGRATION_KEY}))
        if clash:
            raise ValueError(f"{self.script}: RESULT_KEYS must not contain provenance or schema keys {clash}")
        self.command = _command()
        self.commit = git_commit()
        self.loadavg_before = load_average()

    def stamp(self, result: dict) -> dict:
        """``result`` after the provenance keys (the load average after is taken now)."""
        clash = sorted(set(result) & (set(PROVENANCE_KEYS) | set(SCHEMA_KEYS) | {MIGRATION_KEY}))
        if clash:
            raise ValueError(
                f"{self.script}: the result sets provenance or schema keys {clash} "
                "(summary and tables come from the script's figures())"
            )
        return {
            "script": self.script,
            "commit": self.commit,
            "machine": machine_info(),
            "command": self.command,
            "loadavg_before": self.loadavg_before,
            "loadavg_after": load_average(),
            **result,
        }

    def figures(self, result: dict, default=None) -> dict:
        """The script's ``figures`` (:func:`figures_function`) of ``result`` as it reads back from
        JSON (so a later derivation from the file gives the same), as ``summary`` / ``tables``."""
        measured = json.loads(json.dumps(result, default=default))
        return figures_function(self.path)(measured).as_dict()

    def write(self, path: str | os.PathLike, result: dict, indent: int = 2, default=None) -> dict:
        """Write ``result`` with its provenance and its figures (:meth:`figures`) to ``path`` and
        return what was written. A key the script did not declare, missing provenance, a
        ``figures`` that fails or a schema problem is refused: the file then goes to a temporary
        path, named in the error, so a long run is not lost."""
        out = self.stamp(result)
        try:
            out.update(self.figures(result, default=default))
            problems = []
        except Exception as e:  # noqa: BLE001 - the run is kept, the error named
            problems = [f"figures() failed: {type(e).__name__}: {e}"]
        problems += check_results(out, self.keys)
        if problems:
            fd, tmp = tempfile.mkstemp(prefix=Path(path).stem + "-rejected-", suffix=".json")
            os.close(fd)
            write_json(tmp, out, indent=indent, default=default)
            raise ValueError(f"{self.script}: not writing {path}: {'; '.join(problems)} (the run is in {tmp})")
        write_json(path, out, indent=indent, default=default)
        return out


def write_json(path: str | os.PathLike, obj, indent: int = 2, default=None) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=indent, default=default) + "\n")


def pyplot():
    """``matplotlib.pyplot`` on the file-only Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (free when asked; another process may take it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_ray_token() -> str:
    """Turn Ray's token auth on for this process with a token of this run only (a fresh 0600 file
    in a new temp dir, as ``kvserve serve`` makes its own); returns that dir. Call it before
    anything imports ``ray``: Ray reads the auth variables when imported."""
    from kvserve.cluster.ray_auth import ensure_local_auth

    auth_dir = tempfile.mkdtemp(prefix="kvserve-bench-auth-")
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.pop("RAY_AUTH_TOKEN", None)
    os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(auth_dir, "auth_token")
    ensure_local_auth()
    return auth_dir


@contextlib.contextmanager
def local_serve(num_cpus: int):
    """A local Ray (``num_cpus`` logical CPUs, no dashboard) with token auth on and a token of
    this run only, as ``kvserve serve`` starts it, and Serve's HTTP proxy on a free loopback
    port; yields the port. Everything is shut down and the token removed on exit.

    Call it before anything imports ``ray``: Ray reads the auth variables when imported.
    """
    auth_dir = private_ray_token()
    from kvserve.cluster import set_local_ray_env

    set_local_ray_env()  # worker niceness, Serve's loop intervals: as `kvserve serve` does
    import ray
    from ray import serve

    try:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        try:
            port = free_port()
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            yield port
        finally:
            try:
                serve.shutdown()
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(auth_dir, ignore_errors=True)
