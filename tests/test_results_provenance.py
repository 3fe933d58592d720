"""Every file in ``benchmarks/results/`` was written by its script, whole, with its provenance.

A results file is written only through ``benchmarks.common.Results``, which stamps it with
``script`` (the writer), ``commit``, ``machine`` (CPU model, flags, cores, memory), ``command``
and the load average before and after. Each writing script declares the top-level keys it writes
in a module-level ``RESULT_KEYS`` tuple, read here from its source with ``ast`` (nothing is run
or imported but ``benchmarks/common.py``, which needs only the standard library). So:

* a results file without that provenance fails (:func:`test_every_results_file_has_provenance`);
* a top-level key its script does not declare fails: a block typed in by hand;
* a declared key that its script's code never names fails: a declaration cannot cover for a
  hand-typed block either;
* a plot or table must belong to a results file next to it;
* no script writes JSON past the helper.

The checker is :func:`benchmarks.common.check_results`, the same function ``Results.write`` runs
before it writes; :func:`test_checker_rejects` shows that it fails on what it must. Runs in well
under a second.
"""
from __future__ import annotations

import ast
import json
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.common import MACHINE_KEYS, PROVENANCE_KEYS, Results, check_results  # noqa: E402

#: Scripts that write JSON without being results writers (peer_vllm.py: its child's spec and
#: answer in a temporary folder).
NOT_RESULTS_WRITERS = {"common.py", "peer_vllm.py"}


@cache
def declared_keys(script: Path) -> tuple[str, ...]:
    """The script's module-level ``RESULT_KEYS`` tuple of string literals (AssertionError if it
    has none, or it is not made of literals)."""
    tree = ast.parse(script.read_text(), str(script))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "RESULT_KEYS"
                                                for t in node.targets):
            assert isinstance(node.value, ast.Tuple), f"{script.name}: RESULT_KEYS is not a tuple literal"
            keys = []
            for elt in node.value.elts:
                assert isinstance(elt, ast.Constant) and isinstance(elt.value, str), \
                    f"{script.name}: RESULT_KEYS holds a non-literal ({ast.dump(elt)})"
                keys.append(elt.value)
            return tuple(keys)
    raise AssertionError(f"{script.relative_to(ROOT)} declares no module-level RESULT_KEYS")


def names_in_code(script: Path) -> set[str]:
    """String constants and keyword-argument names of the script, outside its ``RESULT_KEYS``."""
    tree = ast.parse(script.read_text(), str(script))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "RESULT_KEYS"
                                                for t in node.targets):
            continue
        for sub in ast.walk(node):
            if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                out.add(sub.value)
            elif isinstance(sub, ast.keyword) and sub.arg:
                out.add(sub.arg)
    return out


def writing_scripts() -> list[Path]:
    return sorted(p for p in BENCHMARKS.glob("*.py") if p.name not in NOT_RESULTS_WRITERS)


def results_json() -> list[Path]:
    return sorted(RESULTS.rglob("*.json"))


def problems_of(path: Path) -> list[str]:
    """What is wrong with one committed results file (empty: nothing)."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:
        return [f"not JSON: {e}"]
    script_name = data.get("script") if isinstance(data, dict) else None
    if not isinstance(script_name, str):
        return ["no 'script': not written by benchmarks.common.Results"] + check_results(data, ())
    script = ROOT / script_name
    if script.parent != BENCHMARKS or not script.is_file():
        return [f"script {script_name!r} is not a script in benchmarks/"]
    return check_results(data, declared_keys(script))


# ---- the committed files -------------------------------------------------------------------------
def test_results_folder_is_not_empty():
    assert results_json(), "benchmarks/results/ holds no results file"


@pytest.mark.parametrize("path", results_json(), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_every_results_file_has_provenance(path):
    problems = problems_of(path)
    assert not problems, f"{path.relative_to(ROOT)}: {'; '.join(problems)}"


def test_every_other_file_belongs_to_a_results_file():
    """Plots and tables (``x.png``, ``x_latency.png``, ``x_table.md``) sit next to their JSON."""
    stems = {p.with_suffix("").as_posix() for p in results_json()}
    orphans = []
    for p in sorted(RESULTS.rglob("*")):
        if p.is_dir() or p.suffix == ".json":
            continue
        base = p.with_suffix("").as_posix()
        if not any(base == s or base.startswith(s + "_") for s in stems):
            orphans.append(p.relative_to(ROOT).as_posix())
    assert not orphans, f"files in benchmarks/results/ without their results JSON: {orphans}"


# ---- the scripts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("script", writing_scripts(), ids=lambda p: p.name)
def test_scripts_write_only_through_the_helper(script):
    """Each benchmark script declares its keys, creates ``Results`` and writes no JSON itself."""
    src = script.read_text()
    keys = declared_keys(script)
    assert "Results(__file__, RESULT_KEYS)" in src, f"{script.name} does not write through benchmarks.common.Results"
    for call in ("write_json(", "json.dump("):
        assert call not in src, f"{script.name} writes JSON with {call}...) instead of Results.write"
    clash = set(keys) & set(PROVENANCE_KEYS)
    assert not clash, f"{script.name}: RESULT_KEYS holds provenance keys {sorted(clash)}"
    unnamed = [k for k in keys if k not in names_in_code(script)]
    assert not unnamed, f"{script.name}: RESULT_KEYS declares keys its code never names: {unnamed}"


# ---- the checker fails where it must -------------------------------------------------------------
def _good() -> dict:
    return {"script": "benchmarks/throughput.py", "commit": "abc1234",
            "machine": {"cpu_model": "Some CPU", "flags": ["avx2"], "cores": 2, "memory_gib": 24.0},
            "command": ".venv/bin/python benchmarks/throughput.py", "loadavg_before": [0.1, 0.2, 0.3],
            "loadavg_after": [0.4, 0.5, 0.6], "workload": {"num_requests": 64}}


def test_checker_accepts_a_whole_file():
    assert check_results(_good(), declared_keys(BENCHMARKS / "throughput.py")) == []


@pytest.mark.parametrize("change", ["extra key", "no commit", "empty commit", "no machine", "machine without flags",
                                    "no command", "no loadavg_after", "loadavg not a triple"])
def test_checker_rejects(change):
    data = _good()
    if change == "extra key":
        data["before_shedding"] = {"completed": 1}
    elif change == "no commit":
        del data["commit"]
    elif change == "empty commit":
        data["commit"] = ""
    elif change == "no machine":
        del data["machine"]
    elif change == "machine without flags":
        del data["machine"]["flags"]
    elif change == "no command":
        del data["command"]
    elif change == "no loadavg_after":
        del data["loadavg_after"]
    else:
        data["loadavg_before"] = 0.5
    assert check_results(data, declared_keys(BENCHMARKS / "throughput.py")), f"{change}: accepted"


def test_helper_writes_provenance_and_refuses_an_undeclared_key(tmp_path):
    """``Results.write`` stamps what the checker asks for, and refuses a key not declared (the
    run then goes to a temporary file, named in the error, not to the results path)."""
    prov = Results(BENCHMARKS / "throughput.py", ("workload",))
    written = prov.write(tmp_path / "ok.json", {"workload": {"n": 1}})
    assert json.loads((tmp_path / "ok.json").read_text()) == written
    assert check_results(written, ("workload",)) == []
    assert set(MACHINE_KEYS) <= set(written["machine"]) and written["script"] == "benchmarks/throughput.py"
    with pytest.raises(ValueError, match="does not declare") as e:
        prov.write(tmp_path / "bad.json", {"workload": {}, "throughput_mode_pairs": []})
    assert not (tmp_path / "bad.json").exists()
    Path(str(e.value).rsplit("(the run is in ", 1)[1].rstrip(")")).unlink()
    with pytest.raises(ValueError, match="provenance"):
        prov.write(tmp_path / "clash.json", {"machine": {}})
