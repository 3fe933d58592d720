"""The repository's architecture, checked on its source with the stdlib ``ast`` only: no project
package is imported, so this file runs in about a second and needs neither torch nor Ray.

* No import cycle among the project's modules, counting every import statement: module level,
  inside functions and methods, and under ``if TYPE_CHECKING:`` (type-only imports included).
* Floors: a package imports only the project packages listed for it in
  ``ALLOWED_PROJECT_IMPORTS``, all on a lower floor (``FLOORS``); kernels/ imports nothing but the
  standard library and ``KERNELS_THIRD_PARTY``; engine/ and kernels/ never import ``ray``.
* No ``.py`` file in deployments/ over ``DEPLOYMENTS_MAX_LINES`` lines.
* ``LLMEngine.step`` (engine/llm_engine.py) has at most ``STEP_MAX_BODY_LINES`` body lines.
* The LLM replica imports nothing from the gateway side: deployments/llm_server.py and every
  deployments module it imports, transitively, stay clear of ``GATEWAY_SIDE``.

Each check is a function of a repository root that returns its violations as strings naming the
file, line and import; the ``test_checker_*`` tests at the bottom feed each one a small synthetic
tree with a violation in it, so a checker that finds nothing cannot pass unnoticed.

An import is an edge to the most specific project module it names: ``from engine import config``
is an edge to ``engine.config``; ``from engine.config import EngineConfig`` to ``engine.config``;
``from engine import LLM`` to ``engine`` (engine/__init__.py). The parent packages Python runs on
the way (``engine/__init__.py`` for ``import engine.config``) are not edges of the cycle check (every
package's ``__init__`` importing its own modules would otherwise be a cycle); the replica check,
which asks what the replica process loads, does follow them.
"""

from __future__ import annotations

import ast
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set

ROOT = Path(__file__).resolve().parents[1]

#: The project's packages (folders at the repository root); everything else is third party.
PACKAGES = ("engine", "kernels", "cluster", "deployments", "autoscaling", "telemetry")

#: Floor of each package: 0 imports no project package, a higher floor only lower ones.
FLOORS = {"kernels": 0, "telemetry": 0, "engine": 1, "cluster": 2, "autoscaling": 2, "deployments": 3}

#: The project packages each package may import (its own always). Stricter than the floors alone:
#: engine does not export metrics itself (telemetry is the deployments' business) and the policy
#: package needs only the metrics facade.
ALLOWED_PROJECT_IMPORTS: Dict[str, Set[str]] = {
    "kernels": set(),
    "telemetry": set(),
    "engine": {"kernels"},
    "cluster": {"engine", "kernels", "telemetry"},
    "autoscaling": {"telemetry"},
    "deployments": {"engine", "kernels", "cluster", "autoscaling", "telemetry"},
}

#: Third-party modules kernels/ may import, besides the standard library.
KERNELS_THIRD_PARTY = frozenset({"torch", "triton", "flash_attn", "numpy"})

#: Packages that must never import Ray (any submodule, at any level): they run without a cluster.
NO_RAY = ("engine", "kernels")

#: Longest allowed ``.py`` file in deployments/ (its subpackages included), in lines.
DEPLOYMENTS_MAX_LINES = 500

#: ``LLMEngine.step``: at most this many body lines, docstring excluded.
STEP_FILE = "engine/llm_engine.py"
STEP_CLASS, STEP_METHOD = "LLMEngine", "step"
STEP_MAX_BODY_LINES = 25

#: The LLM replica's entry module, and the modules of the gateway side (ingress, response cache,
#: limits, routing, tools, ...) that neither it nor any deployments module it imports may import.
#: A name covers its submodules too (``deployments.gateway`` covers ``deployments.gateway.x``).
#: ``deployments.prefix_report`` (what a replica reports to the prefix router) is not gateway side.
REPLICA_MODULE = "deployments.llm_server"
GATEWAY_SIDE = frozenset({
    "deployments.gateway",
    "deployments.cache",
    "deployments.limits",
    "deployments.model_routing",
    "deployments.prefix_router",
    "deployments.prefix_hasher",
    "deployments.gate",
    "deployments.tools",
    "deployments.ingress",
})


# ---------------------------------------------------------------------------------------------
# reading the source
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    """One imported name of one import statement."""

    src: str  # importing module, e.g. "engine.llm_engine"
    file: str  # its path relative to the root
    lineno: int
    name: str  # absolute dotted name as written (relative imports resolved)
    target: Optional[str]  # most specific project module it names; None for third party / stdlib

    def where(self) -> str:
        return f"{self.file}:{self.lineno}"


def project_modules(root: Path, packages: Sequence[str] = PACKAGES) -> Dict[str, Path]:
    """Module name -> file, for every ``.py`` file under the project's package folders."""
    modules: Dict[str, Path] = {}
    for pkg in packages:
        base = root / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _project_target(name: str, modules: Mapping[str, Path]) -> Optional[str]:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in modules:
            return candidate
    return None


def _imported_names(node: ast.AST, module: str, is_package: bool, modules: Mapping[str, Path]) -> List[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        keep = len(package) - (node.level - 1)
        if keep <= 0:  # beyond the top-level package: not a project import we can name
            return []
        base = ".".join(package[:keep] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    names = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        name = sub if alias.name != "*" and sub in modules else base
        if name not in names:
            names.append(name)
    return names


def module_imports(root: Path, packages: Sequence[str] = PACKAGES) -> List[Import]:
    """Every import statement of every project module (module level, in functions, under
    ``if TYPE_CHECKING:``), one :class:`Import` per imported name."""
    modules = project_modules(root, packages)
    found: List[Import] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(node, module, path.name == "__init__.py", modules):
                found.append(Import(module, rel, node.lineno, name, _project_target(name, modules)))
    return sorted(found, key=lambda i: (i.file, i.lineno, i.name))


def _graph(imports: Iterable[Import]) -> Dict[str, Dict[str, Import]]:
    """src -> {target: first import statement making that edge}; self-edges dropped."""
    graph: Dict[str, Dict[str, Import]] = {}
    for imp in imports:
        if imp.target is None or imp.target == imp.src:
            continue
        graph.setdefault(imp.src, {}).setdefault(imp.target, imp)
    return graph


# ---------------------------------------------------------------------------------------------
# checks: each returns its violations
# ---------------------------------------------------------------------------------------------
def _strongly_connected(graph: Mapping[str, Mapping[str, Import]]) -> List[List[str]]:
    """Tarjan's algorithm, iterative."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    on_stack: Set[str] = set()
    stack: List[str] = []
    components: List[List[str]] = []
    nodes = sorted(set(graph) | {t for edges in graph.values() for t in edges})
    counter = 0
    for start in nodes:
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            advanced = False
            for succ in successors:
                if succ not in index:
                    index[succ] = low[succ] = counter
                    counter += 1
                    stack.append(succ)
                    on_stack.add(succ)
                    work.append((succ, iter(sorted(graph.get(succ, {})))))
                    advanced = True
                    break
                if succ in on_stack:
                    low[node] = min(low[node], index[succ])
            if advanced:
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                components.append(sorted(component))
    return components


def _shortest_cycle(graph: Mapping[str, Mapping[str, Import]], start: str, within: Set[str]) -> List[Import]:
    """The edges of a shortest cycle through ``start`` inside the component ``within``."""
    previous: Dict[str, Import] = {}
    queue = deque([start])
    seen = {start}
    while queue:
        node = queue.popleft()
        for succ, imp in sorted(graph.get(node, {}).items()):
            if succ not in within:
                continue
            if succ == start:
                path = [imp]
                while path[0].src != start:
                    path.insert(0, previous[path[0].src])
                return path
            if succ not in seen:
                seen.add(succ)
                previous[succ] = imp
                queue.append(succ)
    raise AssertionError(f"no cycle through {start}")  # a component of 2+ modules always has one


def import_cycles(imports: Iterable[Import]) -> List[str]:
    """One message per group of mutually importing modules, with one cycle spelled out."""
    graph = _graph(imports)
    violations = []
    for component in _strongly_connected(graph):
        if len(component) < 2:
            continue
        cycle = _shortest_cycle(graph, component[0], set(component))
        steps = "; ".join(f"{e.src} -> {e.target} ({e.where()})" for e in cycle)
        violations.append(f"import cycle among {', '.join(component)}: {steps}")
    return sorted(violations)


def floor_violations(imports: Iterable[Import]) -> List[str]:
    """Imports of a project package not allowed for the importing package (a higher floor, or a
    neighbour on the same floor), kernels/ importing third party beyond KERNELS_THIRD_PARTY, and
    Ray in engine/ or kernels/."""
    stdlib = set(sys.stdlib_module_names)
    violations = []
    for imp in imports:
        src_pkg = imp.src.split(".")[0]
        top = imp.name.split(".")[0]
        if imp.target is not None:
            dst_pkg = imp.target.split(".")[0]
            if dst_pkg != src_pkg and dst_pkg not in ALLOWED_PROJECT_IMPORTS.get(src_pkg, set()):
                violations.append(
                    f"{imp.where()}: {imp.src} (floor {FLOORS.get(src_pkg)}) imports {imp.name} "
                    f"(package {dst_pkg}, floor {FLOORS.get(dst_pkg)}); {src_pkg} may import only "
                    f"{sorted(ALLOWED_PROJECT_IMPORTS.get(src_pkg, set())) or 'no project package'}")
            continue
        if src_pkg in NO_RAY and top == "ray":
            violations.append(f"{imp.where()}: {imp.src} imports {imp.name}; {src_pkg}/ never imports ray")
        elif src_pkg == "kernels" and top not in stdlib and top not in KERNELS_THIRD_PARTY:
            violations.append(f"{imp.where()}: {imp.src} imports {imp.name}; kernels/ imports only the "
                              f"standard library and {sorted(KERNELS_THIRD_PARTY)}")
    return violations


def oversized_files(root: Path, folder: str = "deployments", max_lines: int = DEPLOYMENTS_MAX_LINES) -> List[str]:
    violations = []
    for path in sorted((root / folder).rglob("*.py")):
        n = len(path.read_text(encoding="utf-8").splitlines())
        if n > max_lines:
            violations.append(f"{path.relative_to(root).as_posix()}: {n} lines (at most {max_lines})")
    return violations


def body_lines(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the last statement."""
    body = func.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)):
        body = body[1:]
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


def long_method_violations(root: Path, file: str = STEP_FILE, cls: str = STEP_CLASS, method: str = STEP_METHOD,
                           max_lines: int = STEP_MAX_BODY_LINES) -> List[str]:
    path = root / file
    if not path.exists():
        return [f"{file}: missing (looked for {cls}.{method})"]
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=file)
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name == method:
                    n = body_lines(item)
                    if n > max_lines:
                        return [f"{file}:{item.lineno}: {cls}.{method} has {n} body lines (at most {max_lines})"]
                    return []
    return [f"{file}: no {cls}.{method} found"]


def _forbidden(module: str, forbidden: Iterable[str]) -> Optional[str]:
    for f in forbidden:
        if module == f or module.startswith(f + "."):
            return f
    return None


def replica_violations(imports: Iterable[Import], start: str = REPLICA_MODULE,
                       forbidden: Iterable[str] = GATEWAY_SIDE) -> List[str]:
    """Import statements naming a ``forbidden`` module (as written, or as resolved) in ``start`` or
    in any module of its package that it reaches: import edges within ``start``'s top-level
    package, plus the parent packages' own ``__init__`` modules, which Python runs on the way."""
    imports = list(imports)
    package = start.split(".")[0]
    modules = {i.src for i in imports} | {i.target for i in imports if i.target}
    if start not in modules:
        return [f"{start}: not found"]
    by_src: Dict[str, List[Import]] = {}
    for imp in imports:
        by_src.setdefault(imp.src, []).append(imp)
    reached_by: Dict[str, Optional[str]] = {start: None}  # module -> the module that imported it
    queue = deque([start])
    violations = []

    def chain(module: str) -> str:
        names = [module]
        while reached_by[names[0]] is not None:
            names.insert(0, reached_by[names[0]])
        return " -> ".join(names)

    def reach(module: str, by: str) -> None:
        if module.split(".")[0] == package and module not in reached_by:
            reached_by[module] = by
            queue.append(module)

    while queue:
        module = queue.popleft()
        parts = module.split(".")
        for parent in (".".join(parts[:i]) for i in range(1, len(parts))):
            if parent in modules and _forbidden(parent, forbidden) is None:
                reach(parent, module)
        for imp in by_src.get(module, []):
            rule = _forbidden(imp.name, forbidden) or (imp.target and _forbidden(imp.target, forbidden))
            if rule:
                violations.append(f"{imp.where()}: {module} imports {imp.name} (gateway side: {rule}); "
                                  f"the replica reaches {module} as {chain(module)}")
            elif imp.target is not None:
                reach(imp.target, module)
    return violations


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


def test_deployments_files_are_short():
    violations = oversized_files(ROOT)
    assert not violations, _report(violations, "files in deployments/ too long")


def test_llm_engine_step_is_short():
    violations = long_method_violations(ROOT)
    assert not violations, _report(violations, "long methods")


def test_llm_replica_imports_nothing_from_the_gateway_side():
    violations = replica_violations(repo_imports())
    assert not violations, _report(violations, "gateway-side imports in the LLM replica")


def test_the_rules_themselves():
    # every allowed import points to a lower floor; the packages listed are the packages there are
    assert set(FLOORS) == set(ALLOWED_PROJECT_IMPORTS) == set(PACKAGES)
    for pkg, allowed in ALLOWED_PROJECT_IMPORTS.items():
        for dst in allowed:
            assert FLOORS[dst] < FLOORS[pkg], f"{pkg} (floor {FLOORS[pkg]}) may not import {dst} (floor {FLOORS[dst]})"
    assert all(name.startswith("deployments.") for name in GATEWAY_SIDE) and REPLICA_MODULE not in GATEWAY_SIDE
    # the checks read the real tree
    assert {i.src.split(".")[0] for i in repo_imports()} == set(PACKAGES)
    assert (ROOT / STEP_FILE).exists() and (ROOT / "deployments" / "llm_server.py").exists()


# ---------------------------------------------------------------------------------------------
# the checkers on synthetic trees: each must find the violation planted for it
# ---------------------------------------------------------------------------------------------
def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in PACKAGES:  # every package folder exists, with an __init__.py
        (root / pkg).mkdir(exist_ok=True)
        (root / pkg / "__init__.py").touch()
    return root


def test_checker_import_resolution(tmp_path):
    root = _tree(tmp_path, {
        "engine/sub/__init__.py": "from . import leaf\nfrom .. import config\n",
        "engine/sub/leaf.py": "from ..config import X\nimport engine.sub\nfrom engine import LLM, sub\n",
        "engine/config.py": "import os.path\n",
    })
    got = {(i.src, i.name, i.target) for i in module_imports(root)}
    assert ("engine.sub", "engine.sub.leaf", "engine.sub.leaf") in got
    assert ("engine.sub", "engine.config", "engine.config") in got
    assert ("engine.sub.leaf", "engine.config", "engine.config") in got
    assert ("engine.sub.leaf", "engine.sub", "engine.sub") in got
    assert ("engine.sub.leaf", "engine", "engine") in got  # from engine import LLM: engine/__init__.py
    assert ("engine.config", "os.path", None) in got


def test_checker_finds_a_type_only_cycle(tmp_path):
    root = _tree(tmp_path, {
        "autoscaling/a.py": "from autoscaling.b import B\n",
        "autoscaling/b.py": (
            "from typing import TYPE_CHECKING\n"
            "if TYPE_CHECKING:\n"
            "    from autoscaling.a import A\n"),
        "autoscaling/c.py": "def f():\n    from autoscaling import d\n",
        "autoscaling/d.py": "import autoscaling.c\n",
        "autoscaling/e.py": "from autoscaling import a\n",  # into a cycle, not on one
    })
    violations = import_cycles(module_imports(root))
    assert len(violations) == 2, violations
    assert "autoscaling.a, autoscaling.b" in violations[0]
    assert "autoscaling/b.py:3" in violations[0] and "autoscaling/a.py:1" in violations[0]
    assert "autoscaling/c.py:2" in violations[1] and "autoscaling/d.py:1" in violations[1]
    assert not any("autoscaling.e" in v for v in violations)


def test_checker_finds_floor_violations(tmp_path):
    root = _tree(tmp_path, {
        "engine/llm.py": "import kernels.backend\ndef f():\n    from deployments import app\n",
        "engine/metrics.py": "from telemetry.metrics import metric\n",
        "engine/dist.py": "def f():\n    import ray.util.placement_group\n",
        "kernels/ok.py": "import torch, triton, numpy, os\nfrom flash_attn import f\n",
        "kernels/bad.py": "import yaml\n",
        "autoscaling/policy.py": "from telemetry.metrics import metric\nfrom cluster import x\n",
        "telemetry/metrics.py": "import prometheus_client\nfrom engine import config\n",
        "cluster/w.py": "from engine.config import C\nimport ray\n",
        "deployments/app.py": "from engine import LLM\nfrom autoscaling import policy\nimport ray\n",
    })
    violations = floor_violations(module_imports(root))
    expected = ["engine/dist.py:2", "engine/llm.py:3", "engine/metrics.py:1", "kernels/bad.py:1",
                "autoscaling/policy.py:2", "telemetry/metrics.py:2"]
    for where in expected:
        assert sum(v.startswith(where + ":") for v in violations) == 1, (where, violations)
    assert len(violations) == len(expected), violations


def test_checker_finds_long_files_and_methods(tmp_path):
    root = _tree(tmp_path, {
        "deployments/short.py": "x = 1\n" * 500,
        "deployments/gateway/long.py": "x = 1\n" * 501,
        "engine/llm_engine.py": (
            "class LLMEngine:\n"
            "    def step(self):\n"
            "        '''A docstring\n\n        of several lines.\n        '''\n"
            + "        x = 1\n" * 24
            + "        return [\n            x,\n        ]\n"),  # 24 + 3 = 27 body lines
    })
    assert oversized_files(root) == ["deployments/gateway/long.py: 501 lines (at most 500)"]
    assert long_method_violations(root) == ["engine/llm_engine.py:2: LLMEngine.step has 27 body lines (at most 25)"]
    assert long_method_violations(root, max_lines=27) == []
    (root / "engine/llm_engine.py").write_text("class LLMEngine:\n    def stop(self):\n        pass\n")
    assert long_method_violations(root) == ["engine/llm_engine.py: no LLMEngine.step found"]


def test_checker_finds_gateway_imports_in_the_replica(tmp_path):
    root = _tree(tmp_path, {
        "deployments/llm_server.py": "from deployments.protocol import X\nfrom engine import LLM\n",
        "deployments/protocol.py": "def f():\n    from deployments.helpers import y\n",
        "deployments/helpers.py": "from deployments.gateway.cache import z\n",
        "deployments/gateway/__init__.py": "from deployments.ingress import app\n",
        "deployments/ingress.py": "from deployments.llm_server import LLMServer\n",  # gateway -> replica is fine
    })
    violations = replica_violations(module_imports(root))
    assert violations == [
        "deployments/helpers.py:1: deployments.helpers imports deployments.gateway.cache (gateway side: "
        "deployments.gateway); the replica reaches deployments.helpers as "
        "deployments.llm_server -> deployments.protocol -> deployments.helpers"], violations
    # the parent packages' __init__ modules run too: one of them importing the gateway side is caught
    (root / "deployments/llm_server.py").write_text("from deployments.sub.leaf import x\n")
    (root / "deployments/sub").mkdir()
    (root / "deployments/sub/__init__.py").write_text("from deployments import tools\n")
    (root / "deployments/sub/leaf.py").write_text("")
    (root / "deployments/tools.py").write_text("")
    violations = replica_violations(module_imports(root))
    assert violations == [
        "deployments/sub/__init__.py:1: deployments.sub imports deployments.tools (gateway side: deployments.tools); "
        "the replica reaches deployments.sub as deployments.llm_server -> deployments.sub.leaf -> deployments.sub"
    ], violations
    assert replica_violations(module_imports(root), start="deployments.nothing") == ["deployments.nothing: not found"]
