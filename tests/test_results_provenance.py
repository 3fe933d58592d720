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
* no script writes JSON past the helper;
* every file follows the results schema (``summary`` rows and ``tables``, which ``docs/hooks.py``
  renders), and its schema is exactly what its script's ``figures(result)`` derives from the
  measured values in the file (:func:`test_schema_is_derived_from_the_measured_values`): a figure
  typed into ``summary`` or ``tables`` by hand fails too. ``figures`` is compiled alone from the
  script's source, with ``benchmarks/common.py``'s names only, so this needs no torch or Ray.

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

from benchmarks.common import (  # noqa: E402
    MACHINE_KEYS,
    PROVENANCE_KEYS,
    SCHEMA_KEYS,
    Results,
    check_results,
    check_schema,
    figures_free_names,
    figures_function,
    measured_part,
)

#: Scripts that write JSON without being results writers (peer_vllm.py: its child's spec and
#: answer in a temporary folder; migrate_results.py: adds the schema that the files' own scripts
#: derive, through ``figures_function``, to committed files; quant_checkpoints.py: model folders and
#: their HF reference outputs in the cache, never in benchmarks/results).
NOT_RESULTS_WRITERS = {"common.py", "peer_vllm.py", "migrate_results.py", "quant_checkpoints.py"}


@cache
def declared_keys(script: Path) -> tuple[str, ...]:
    """The script's module-level ``RESULT_KEYS`` tuple of string literals (AssertionError if it
    has none, or it is not made of literals)."""
    tree = ast.parse(script.read_text(), str(script))
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "RESULT_KEYS" for t in node.targets
        ):
            assert isinstance(node.value, ast.Tuple), f"{script.name}: RESULT_KEYS is not a tuple literal"
            keys = []
            for elt in node.value.elts:
                assert isinstance(elt, ast.Constant) and isinstance(elt.value, str), (
                    f"{script.name}: RESULT_KEYS holds a non-literal ({ast.dump(elt)})"
                )
                keys.append(elt.value)
            return tuple(keys)
    raise AssertionError(f"{script.relative_to(ROOT)} declares no module-level RESULT_KEYS")


def names_in_code(script: Path) -> set[str]:
    """String constants and keyword-argument names of the script, outside its ``RESULT_KEYS``."""
    tree = ast.parse(script.read_text(), str(script))
    out: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "RESULT_KEYS" for t in node.targets
        ):
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


@pytest.mark.parametrize("path", results_json(), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_schema_is_derived_from_the_measured_values(path):
    """``summary`` and ``tables`` are what the file's script derives from the file's measured
    values: nothing in them was typed by hand (after a change to a script's ``figures``, run
    ``python benchmarks/migrate_results.py --rederive``)."""
    data = json.loads(path.read_text())
    derived = json.loads(json.dumps(figures_function(ROOT / data["script"])(measured_part(data)).as_dict()))
    for key in SCHEMA_KEYS:
        assert data[key] == derived[key], (
            f"{path.relative_to(ROOT)}: its {key!r} differs from what {data['script']}'s figures() derives from it"
        )


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
    figures_function(script)  # ValueError: no module-level figures(result)
    free = figures_free_names(script)
    assert not free, (
        f"{script.name}: figures() reads {free}, neither builtins nor benchmarks.common names "
        "(it runs compiled alone: benchmarks.common.figures_function)"
    )


# ---- the checker fails where it must -------------------------------------------------------------
def _good() -> dict:
    return {
        "script": "benchmarks/throughput.py",
        "commit": "abc1234",
        "machine": {"cpu_model": "Some CPU", "flags": ["avx2"], "cores": 2, "memory_gib": 24.0},
        "command": ".venv/bin/python benchmarks/throughput.py",
        "loadavg_before": [0.1, 0.2, 0.3],
        "loadavg_after": [0.4, 0.5, 0.6],
        "workload": {"num_requests": 64},
        "summary": [{"metric": "output tok/s", "value": 143.7, "unit": "tok/s", "target": ">= 100", "met": True}],
        "tables": [{"title": "runs", "columns": ["run", "tok/s"], "rows": [[1, 143.7], [2, 141.0]]}],
    }


def test_checker_accepts_a_whole_file():
    assert check_results(_good(), declared_keys(BENCHMARKS / "throughput.py")) == []


@pytest.mark.parametrize(
    "change",
    [
        "extra key",
        "no commit",
        "empty commit",
        "no machine",
        "machine without flags",
        "no command",
        "no loadavg_after",
        "loadavg not a triple",
        "no summary",
        "no tables",
        "both empty",
        "summary row without met",
        "met not a bool",
        "value a record",
        "table row too short",
        "table without columns",
    ],
)
def test_checker_rejects(change):
    data = _good()
    row, table = data["summary"][0], data["tables"][0]
    if change == "no summary":
        del data["summary"]
    elif change == "no tables":
        del data["tables"]
    elif change == "both empty":
        data["summary"], data["tables"] = [], []
    elif change == "summary row without met":
        del row["met"]
    elif change == "met not a bool":
        row["met"] = "yes"
    elif change == "value a record":
        row["value"] = {"p50": 1.0}
    elif change == "table row too short":
        table["rows"].append([3])
    elif change == "table without columns":
        table["columns"] = []
    elif change == "extra key":
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
    """``Results.write`` stamps what the checker asks for and the script's figures (the measured
    values of a committed file written again give the file's own summary and tables), and refuses
    a key not declared (the run then goes to a temporary file, named in the error, not to the
    results path)."""
    script = BENCHMARKS / "quantization.py"
    committed = json.loads((RESULTS / "quantization.json").read_text())
    prov = Results(script, declared_keys(script))
    written = prov.write(tmp_path / "ok.json", measured_part(committed))
    assert json.loads((tmp_path / "ok.json").read_text()) == written
    assert check_results(written, declared_keys(script)) == []
    assert set(MACHINE_KEYS) <= set(written["machine"]) and written["script"] == "benchmarks/quantization.py"
    assert {k: written[k] for k in SCHEMA_KEYS} == {k: committed[k] for k in SCHEMA_KEYS}
    with pytest.raises(ValueError, match="does not declare") as e:
        prov.write(tmp_path / "bad.json", {**measured_part(committed), "throughput_mode_pairs": []})
    assert not (tmp_path / "bad.json").exists()
    Path(str(e.value).rsplit("(the run is in ", 1)[1].rstrip(")")).unlink()
    for clash in ({"machine": {}}, {"summary": []}):
        with pytest.raises(ValueError, match="provenance or schema"):
            prov.write(tmp_path / "clash.json", clash)


def test_a_failing_figures_keeps_the_run(tmp_path):
    """A script's ``figures`` that raises at the end of a run: the file is not written, the run is
    kept in a temporary file named in the error."""
    broken = tmp_path / "broken.py"
    broken.write_text("def figures(r):\n    return Figures().summary('x', r['missing'])\n")
    prov = Results(BENCHMARKS / "quantization.py", ("configs",))
    prov.path = broken
    with pytest.raises(ValueError, match="figures\\(\\) failed: KeyError") as e:
        prov.write(tmp_path / "out.json", {"configs": {}})
    assert not (tmp_path / "out.json").exists()
    kept = Path(str(e.value).rsplit("(the run is in ", 1)[1].rstrip(")"))
    assert json.loads(kept.read_text())["configs"] == {}
    kept.unlink()


def test_free_names_of_figures_are_found(tmp_path):
    """``figures_free_names`` finds a script global that ``figures`` reads (it would be a
    NameError when compiled alone) and accepts builtins, its own names and benchmarks.common's."""
    script = tmp_path / "s.py"
    script.write_text(
        "LIMIT = 3\n\ndef figures(r):\n    f = Figures()\n    for k, v in r.items():\n"
        "        f.summary(k, percentile(v, 50), met=len(v) > LIMIT)\n    return f\n"
    )
    assert figures_free_names(script) == ["LIMIT"]
    with pytest.raises(NameError, match="LIMIT"):
        figures_function(script)({"a": [1.0, 2.0]})
    script.write_text(script.read_text().replace("> LIMIT", "> 3"))
    assert figures_free_names(script) == []
    assert check_schema(figures_function(script)({"a": [1.0, 2.0]}).as_dict()) == []
