"""Give committed results files the results schema (``summary`` / ``tables``) without measuring
anything again.

A file measured before the schema existed (or before its script's ``figures`` changed) gets the
``summary`` and ``tables`` its script's ``figures(result)`` derives from the measured values in the
file (:func:`benchmarks.common.figures_function`: the same derivation :meth:`Results.write` runs
after a measurement), and ``schema_migrated_by``: this command. Nothing else in the file changes:
its provenance (script, commit, machine, command, load average) still names the measurement, and
no value is typed in. ``tests/test_results_provenance.py`` checks that every file's schema is what
its script derives from it, so a changed ``figures`` means running this again with ``--rederive``.

Usage::

    python benchmarks/migrate_results.py              # every results file without the schema
    python benchmarks/migrate_results.py --rederive   # every results file, schema derived again
    python benchmarks/migrate_results.py benchmarks/results/quantization.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (  # noqa: E402
    MIGRATION_KEY,
    PROVENANCE_KEYS,
    RESULTS,
    ROOT,
    SCHEMA_KEYS,
    _command,
    check_schema,
    figures_function,
    measured_part,
    write_json,
)


def indent_of(text: str) -> int:
    """The indent a JSON file was written with (its second line's leading spaces; 2 if none)."""
    lines = text.splitlines()
    return (len(lines[1]) - len(lines[1].lstrip(" "))) if len(lines) > 1 and lines[1].startswith(" ") else 2


def migrate(path: Path, command: str, rederive: bool = False) -> bool:
    """Add (or with ``rederive``, derive again) ``path``'s schema; False if it had one and
    ``rederive`` is off, or the derivation gave what the file already holds. ValueError when the
    file names no script or the result does not follow the schema."""
    text = path.read_text()
    data = json.loads(text)
    if all(k in data for k in SCHEMA_KEYS) and not rederive:
        return False
    script = data.get("script")
    if not (isinstance(script, str) and (ROOT / script).is_file()):
        raise ValueError(f"{path}: names no benchmark script ({script!r}); run its benchmark instead")
    figs = json.loads(json.dumps(figures_function(ROOT / script)(measured_part(data)).as_dict()))
    problems = check_schema(figs)
    if problems:
        raise ValueError(f"{path}: {script}'s figures() gives {'; '.join(problems)}")
    if all(data.get(k) == figs[k] for k in SCHEMA_KEYS):
        return False
    out = {k: data[k] for k in PROVENANCE_KEYS if k in data}
    out[MIGRATION_KEY] = command
    out.update(measured_part(data))
    out.update(figs)
    write_json(path, out, indent=indent_of(text))
    return True


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="*", type=Path, help="results files (default: every one in benchmarks/results/)")
    ap.add_argument("--rederive", action="store_true", help="derive the schema again where a file has one")
    args = ap.parse_args(argv)
    command = _command()
    for path in args.files or sorted(RESULTS.rglob("*.json")):
        changed = migrate(path, command, args.rederive)
        print(f"{'migrated' if changed else 'unchanged'}: {path.resolve().relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
