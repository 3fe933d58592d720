"""The manual builds and the README stays a front page.

* ``mkdocs build --strict`` of ``mkdocs.yml`` succeeds (broken links, anchors and nav entries are
  errors), and a copy of the docs with one broken link fails to build, so strict mode is really on.
* Every results JSON under ``benchmarks/results/`` has its section on the generated benchmarks page,
  with its summary and tables, and every committed plot is copied into the site. The one generic
  renderer of ``docs/hooks.py`` renders a results file in the schema (summary rows, tables, the
  headline table) and refuses one without it (:func:`test_generic_renderer_renders_the_schema`,
  :func:`test_a_results_file_without_the_schema_stops_the_build`).
* The architecture page's layout table lists every package and module of the project with its
  docstring's first sentence (:func:`test_layout_table_lists_every_module`).
* README.md has at most :data:`README_MAX_LINES` lines, and every relative link in it points at a
  file of the repository.
* The examples that ``tests/e2e/test_serve_handles.py`` runs are still in the README or the docs.

A build takes about two seconds and needs neither torch nor Ray.
"""

from __future__ import annotations

import html
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README_MAX_LINES = 150
#: Fenced blocks marked ``<!-- test: name -->`` that the live-app tests run.
TESTED_EXAMPLES = ("curl-chat", "curl-stream", "openai-sdk", "python-handle")


def mkdocs_build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout}\n{p.stderr}"
    return out


def test_docs_build_strict(site):
    assert (site / "index.html").exists()
    for page in (
        "architecture",
        "engine",
        "serving",
        "operations",
        "deployment",
        "autoscaling",
        "gpu",
        "known-limits",
        "benchmarks",
    ):
        assert (site / page / "index.html").exists(), page


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """The same config on a copy of the docs with one dead link must not build."""
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(ROOT / "docs", tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    with open(tmp_path / "docs" / "index.md", "a") as f:
        f.write("\n[a page that does not exist](no-such-page.md)\n")
    p = mkdocs_build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert p.returncode != 0, "a broken link built in strict mode"
    assert "no-such-page.md" in p.stdout + p.stderr


def test_every_result_is_on_the_benchmarks_page(site):
    html = (site / "benchmarks" / "index.html").read_text()
    results = sorted(RESULTS.rglob("*.json"))
    assert results, "no results files found"
    missing = [p.relative_to(ROOT).as_posix() for p in results if p.relative_to(ROOT).as_posix() not in html]
    assert not missing, f"results files without a section on the benchmarks page: {missing}"
    assert "renderer failed" not in html, "a results file's renderer failed (see the benchmarks page)"
    for png in RESULTS.rglob("*.png"):
        rel = png.relative_to(RESULTS).as_posix()
        assert (site / "results" / rel).exists(), f"plot not copied into the site: {rel}"
        assert f"results/{rel}" in html, f"plot not shown on the benchmarks page: {rel}"


def hooks_module():
    """``docs/hooks.py`` as a module of its own (a fresh one per call: tests patch its globals)."""
    spec = importlib.util.spec_from_file_location("kvserve_docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_summary_row_and_table_is_on_the_page(site):
    """The generic renderer shows each file's summary metrics and table titles."""
    text_of_page = html.unescape(re.sub(r"<[^>]+>", "", (site / "benchmarks" / "index.html").read_text()))
    for path in RESULTS.rglob("*.json"):
        data = json.loads(path.read_text())
        for text in [r["metric"] for r in data["summary"]] + [t["title"] for t in data["tables"]]:
            assert text.replace("`", "") in text_of_page, f"{path.name}: {text!r} is not on the benchmarks page"


def _fake_results(tmp_path: Path, hooks, data: dict) -> Path:
    """A repository root at ``tmp_path`` whose only results file holds ``data``; ``hooks`` reads it."""
    results = tmp_path / "benchmarks" / "results"
    results.mkdir(parents=True)
    (tmp_path / "benchmarks" / "fake.py").write_text('"""A fake benchmark: what it measures."""\n')
    path = results / "fake.json"
    path.write_text(json.dumps(data))
    hooks.ROOT, hooks.RESULTS, hooks.NOT_MEASURED = tmp_path, results, {}
    return path


def _schema_file() -> dict:
    return {
        "script": "benchmarks/fake.py",
        "commit": "abc1234",
        "command": ".venv/bin/python benchmarks/fake.py",
        "machine": {"cpu_model": "Some CPU", "flags": ["avx2"], "cores": 2, "memory_gib": 24.0},
        "loadavg_before": [0.1, 0.2, 0.3],
        "loadavg_after": [0.4, 0.5, 0.6],
        "measured": {"tok_s": 143.66},
        "summary": [
            {
                "metric": "offline tok/s",
                "value": 143.66,
                "unit": "tok/s",
                "target": ">= 100",
                "met": True,
                "headline": True,
            },
            {"metric": "kvserve / peer", "value": 1.2345, "unit": "x", "target": None, "met": None},
        ],
        "tables": [
            {
                "title": "Runs of the fake",
                "columns": ["run", "tok/s", "load"],
                "note": "Two runs.",
                "rows": [[1, 143.66, [0.1, 0.2, 0.3]], [2, 1234.5, None]],
            }
        ],
    }


def test_generic_renderer_renders_the_schema(tmp_path):
    """A results file in the schema: its provenance, summary rows (value with unit, target, met),
    tables (title, note, columns, every row) and headline row are on the generated page."""
    hooks = hooks_module()
    _fake_results(tmp_path, hooks, _schema_file())
    page = hooks.render_benchmarks()
    for text in (
        "## fake.json {#fake}",
        "A fake benchmark: what it measures.",
        "`abc1234`",
        "| offline tok/s | 143.7 tok/s | >= 100 | yes |",
        "| kvserve / peer | 1.234x | - | - |",
        "**Runs of the fake**",
        "Two runs.",
        "| run | tok/s | load |",
        "| 1 | 143.7 | 0.1 / 0.2 / 0.3 |",
        "| 2 | 1,234.5 | - |",
        "| offline tok/s | 143.7 tok/s | >= 100 | yes | [fake.json](#fake) |",
    ):
        assert text in page, f"{text!r} not in the generated page:\n{page}"


@pytest.mark.parametrize("change", ["no summary", "no tables", "a row without its unit", "a ragged table", "not JSON"])
def test_a_results_file_without_the_schema_stops_the_build(tmp_path, change):
    """A results file that does not follow the schema is an error of the page (so of ``mkdocs
    build``), never a section shown half right."""
    hooks = hooks_module()
    data = _schema_file()
    if change == "no summary":
        del data["summary"]
    elif change == "no tables":
        del data["tables"]
    elif change == "a row without its unit":
        del data["summary"][0]["unit"]
    elif change == "a ragged table":
        data["tables"][0]["rows"].append([3])
    path = _fake_results(tmp_path, hooks, data)
    if change == "not JSON":
        path.write_text("{not json")
    with pytest.raises(ValueError, match="fake.json"):
        hooks.render_benchmarks()


def project_modules() -> list[str]:
    """Every module of the project's packages and script folders, as the layout table names them."""
    hooks = hooks_module()
    tops = [p.parent.name for p in ROOT.glob("*/__init__.py")] + list(hooks.LAYOUT_SCRIPTS)
    out = []
    for top in tops:
        for py in (ROOT / top).rglob("*.py"):
            if "__pycache__" not in py.parts:
                rel = py.relative_to(ROOT).as_posix()
                out.append(rel[: -len("__init__.py")] if py.name == "__init__.py" else rel)
    return sorted(out)


def test_layout_table_lists_every_module(site):
    """Every package and module appears in the architecture page's generated layout table, with
    its docstring's first sentence; the marker is gone."""
    hooks = hooks_module()
    md = hooks.render_layout()
    modules = project_modules()
    assert len(modules) > 50
    missing = [m for m in modules if f"| `{m}` |" not in md]
    assert not missing, f"modules not in the layout table: {missing}"
    assert "| `kvserve/engine/llm_engine.py` | The synchronous engine" in md
    html = (site / "architecture" / "index.html").read_text()
    assert hooks.LAYOUT_MARKER not in html and "<code>kvserve/engine/llm_engine.py</code>" in html


def test_layout_first_sentence(tmp_path):
    """The first sentence of a docstring (abbreviations kept), Sphinx roles as code, long ones cut."""
    hooks = hooks_module()
    py = tmp_path / "m.py"
    py.write_text('"""Gemma 3 (Gemma Team et al. 2025), e.g. Gemma 3 270M, see :class:`~a.B`. More text\n\nRest."""\n')
    assert hooks.first_sentence(py) == "Gemma 3 (Gemma Team et al. 2025), e.g. Gemma 3 270M, see `a.B`."
    py.write_text('"""' + "word " * 100 + '"""\n')
    assert hooks.first_sentence(py, limit=40).endswith(" ...") and len(hooks.first_sentence(py, limit=40)) <= 40
    py.write_text("x = 1\n")
    assert hooks.first_sentence(py) == "(no docstring)"


def test_readme_is_short():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"


def test_readme_relative_links_exist():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text) + re.findall(r"<img[^>]+src=\"([^\"]+)\"", text)
    assert targets, "README.md has no links"
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # http(s), mailto, in-page anchors
        path = target.split("#", 1)[0]
        if not (ROOT / path).exists():
            broken.append(target)
    assert not broken, f"README.md links to missing files: {broken}"


def test_tested_examples_are_still_documented():
    found = set()
    for md in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        found |= set(re.findall(r"<!-- test: ([\w-]+) -->\s*```\w+\n", md.read_text()))
    missing = [name for name in TESTED_EXAMPLES if name not in found]
    assert not missing, f"examples run by tests/e2e/test_serve_handles.py are gone from the docs: {missing}"
