"""The repository's architecture, checked on its source with the stdlib ``ast`` only: no project
package is imported, so this file runs in about a second and needs neither torch nor Ray.

* No import cycle among the project's modules, counting every import statement: module level,
  inside functions and methods, and under ``if TYPE_CHECKING:`` (type-only imports included).
* Floors: a package imports only the project packages listed for it in
  ``ALLOWED_PROJECT_IMPORTS``, all on a lower floor (``FLOORS``); kvserve/kernels/ imports nothing but the
  standard library and ``KERNELS_THIRD_PARTY``; kvserve/engine/ and kvserve/kernels/ never import ``ray``.
* Walls inside kvserve/deployments/: every module sits in a room (a folder named in ``ROOMS``) or is one
  of the few top-level modules that assemble the rooms (``TOP_MODULES``); a room imports only the
  rooms ``ROOMS`` lists for it, so the replica never loads gateway code and the contract between
  them imports neither side. A folder or module the rules do not name fails, and so does a name
  the rules give that does not exist.
* Imports inside functions are for heavy modules only: a project import in a function body must
  name a module of ``LAZY_IMPORTS`` (torch, Ray, sentence-transformers ... behind it), from an
  importer that entry allows; package ``__getattr__`` facades (PEP 562) are exempt.
* One public class per module in kvserve/deployments/replica/ and kvserve/deployments/gateway/, data types
  (dataclasses, pydantic models, exceptions, enums, named tuples) aside: a module is one concern.
* ``LLMEngine.step`` (kvserve/engine/llm_engine.py) has at most ``STEP_MAX_BODY_LINES`` body lines.
* The LLM replica imports nothing from the gateway side: kvserve/deployments/replica/llm_server.py and every
  deployments module it imports, transitively, stay clear of ``GATEWAY_SIDE``.

The rules are data in architecture_rules.py. Each check (architecture_checks.py) is a function of a
repository root that returns its violations as strings naming the file, line and import; the
``test_checker_*`` tests (test_architecture_checkers.py) feed each one a small synthetic tree with a
violation in it, so a checker that finds nothing cannot pass unnoticed.
"""

from __future__ import annotations

from pathlib import Path
from typing import List

from architecture_checks import (
    Import,
    _prefixed,
    floor_violations,
    import_cycles,
    lazy_import_violations,
    long_method_violations,
    module_imports,
    one_class_violations,
    room_violations,
    unrooted_import_violations,
)
from architecture_rules import ALLOWED_PROJECT_IMPORTS, FLOORS, LAZY_IMPORTS, PACKAGES, ROOMS, STEP_FILE

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------
# the repository
# ---------------------------------------------------------------------------------------------
_IMPORTS: List[Import] = []


def repo_imports() -> List[Import]:
    if not _IMPORTS:
        _IMPORTS.extend(module_imports(ROOT))
    return _IMPORTS


def _report(violations: List[str], what: str) -> str:
    return f"{len(violations)} {what}:\n  " + "\n  ".join(violations)


def test_no_import_cycle():
    violations = import_cycles(repo_imports())
    assert not violations, _report(violations, "import cycles (type-only and function-level imports count)")


def test_no_import_from_a_higher_floor():
    violations = floor_violations(repo_imports())
    assert not violations, _report(violations, "imports against the floors")


def test_deployments_walls():
    violations = room_violations(ROOT, repo_imports())
    assert not violations, _report(violations, "breaches of the walls inside kvserve/deployments/")


def test_imports_inside_functions_are_for_heavy_modules_only():
    violations = lazy_import_violations(repo_imports())
    assert not violations, _report(violations, "project imports inside functions")


def test_one_public_class_per_module_in_replica_and_gateway():
    violations = one_class_violations(ROOT)
    assert not violations, _report(violations, "modules with several public classes")


def test_one_import_root():
    """Nothing of the project imports itself by a bare package name (``engine``, ``kernels`` ...):
    only ``kvserve.*`` (tests/test_import_names.py checks the same from outside, in processes)."""
    violations = unrooted_import_violations(ROOT)
    assert not violations, _report(violations, "imports without the kvserve root")
    assert not [p.name for p in ROOT.iterdir() if p.name in PACKAGES], "a package folder at the repository root"


def test_llm_engine_step_is_short():
    violations = long_method_violations(ROOT)
    assert not violations, _report(violations, "long methods")


def test_the_rules_themselves():
    # every allowed import points to a lower floor; the packages listed are the packages there are
    assert set(FLOORS) == set(ALLOWED_PROJECT_IMPORTS) == set(PACKAGES)
    for pkg, allowed in ALLOWED_PROJECT_IMPORTS.items():
        for dst in allowed:
            assert FLOORS[dst] < FLOORS[pkg], f"{pkg} (floor {FLOORS[pkg]}) may not import {dst} (floor {FLOORS[dst]})"
    # the replica side and the routers see only the contract; the contract sees no other room
    assert ROOMS["replica"] == ROOMS["routing"] == {"contract"} and ROOMS["contract"] == set()
    assert all(_prefixed(k, PACKAGES) for k in LAZY_IMPORTS)
    # the checks read the real tree
    assert {i.src.split(".")[0] for i in repo_imports()} == set(PACKAGES)
    assert (ROOT / STEP_FILE).exists() and (ROOT / "kvserve" / "deployments" / "replica" / "llm_server.py").exists()


def test_the_replica_uses_only_the_engine_client_protocol():
    """``kvserve/deployments/`` holds the engine's front and never reaches through it
    (``<anything>.engine.engine``: an ``LLMEngine`` in this process, a proxy of the core process in
    the other), and every ``self.engine.<name>`` (or ``self._engine``) it reads is a member of
    :class:`kvserve.engine.protocol.EngineClient`, the interface both fronts satisfy (checked
    against both in tests/engine/test_engine_client.py)."""
    import ast

    from kvserve.engine.protocol import EngineClient

    members = {n for n in dir(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__)
    used, through = {}, []
    for path in sorted((ROOT / "kvserve" / "deployments").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)):
                continue
            where = f"{path.relative_to(ROOT)}:{node.lineno}"
            if node.attr == "engine" and node.value.attr == "engine":
                through.append(where)
            if node.value.attr in ("engine", "_engine") and isinstance(node.value.value, ast.Name):
                if node.value.value.id == "self":
                    used.setdefault(node.attr, where)
    assert not through, f"the replica reaches through the engine's front at {through}"
    outside = {name: where for name, where in used.items() if name not in members}
    assert not outside, f"the replica uses engine members outside EngineClient: {outside}"
    assert {"generate", "abort", "get_stats", "config"} <= set(used)  # the check reads what it should
