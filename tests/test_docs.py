"""The manual builds and the README stays a front page.

* ``mkdocs build --strict`` of ``mkdocs.yml`` succeeds (broken links, anchors and nav entries are
  errors), and a copy of the docs with one broken link fails to build, so strict mode is really on.
* Every results JSON under ``benchmarks/results/`` has its section on the generated benchmarks page,
  and every committed plot is copied into the site.
* README.md has at most :data:`README_MAX_LINES` lines, and every relative link in it points at a
  file of the repository.
* The examples that ``tests/e2e/test_serve_handles.py`` runs are still in the README or the docs.

A build takes about two seconds and needs neither torch nor Ray.
"""
from __future__ import annotations

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
    return subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
                          cwd=config.parent, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    p = mkdocs_build(ROOT / "mkdocs.yml", out)
    assert p.returncode == 0, f"mkdocs build --strict failed:\n{p.stdout}\n{p.stderr}"
    return out


def test_docs_build_strict(site):
    assert (site / "index.html").exists()
    for page in ("architecture", "engine", "serving", "operations", "deployment", "autoscaling", "gpu",
                 "known-limits", "benchmarks"):
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
