"""The repository's architecture, checked on its source with the stdlib ``ast`` only: no project
package is imported, so this file runs in about a second and needs neither torch nor Ray.

* No import cycle among the project's modules, counting every import statement: module level,
  inside functions and methods, and under ``if TYPE_CHECKING:`` (type-only imports included).
* Floors: a package imports only the project packages listed for it in
  ``ALLOWED_PROJECT_IMPORTS``, all on a lower floor (``FLOORS``); kernels/ imports nothing but the
  standard library and ``KERNELS_THIRD_PARTY``; engine/ and kernels/ never import ``ray``.
* Walls inside deployments/: every module sits in a room (a folder named in ``ROOMS``) or is one
  of the few top-level modules that assemble the rooms (``TOP_MODULES``); a room imports only the
  rooms ``ROOMS`` lists for it, so the replica never loads gateway code and the contract between
  them imports neither side. A folder or module the rules do not name fails, and so does a name
  the rules give that does not exist.
* Imports inside functions are for heavy modules only: a project import in a function body must
  name a module of ``LAZY_IMPORTS`` (torch, Ray, sentence-transformers ... behind it), from an
  importer that entry allows; package ``__getattr__`` facades (PEP 562) are exempt.
* One public class per module in deployments/replica/ and deployments/gateway/, data types
  (dataclasses, pydantic models, exceptions, enums, named tuples) aside: a module is one concern.
* ``LLMEngine.step`` (engine/llm_engine.py) has at most ``STEP_MAX_BODY_LINES`` body lines.
* The LLM replica imports nothing from the gateway side: deployments/replica/llm_server.py and every
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

#: ``LLMEngine.step``: at most this many body lines, docstring excluded.
STEP_FILE = "engine/llm_engine.py"
STEP_CLASS, STEP_METHOD = "LLMEngine", "step"
STEP_MAX_BODY_LINES = 25

#: The rooms of deployments/ (folders) and the other rooms each may import (its own always). The
#: replica side imports only the contract; so do the caller-side routers and the gateway's caches
#: and limits; the gateway uses them all. Nothing but ``TOP_MODULES`` imports across otherwise.
ROOMS: Dict[str, Set[str]] = {
    "contract": set(),
    "replica": {"contract"},
    "routing": {"contract"},
    "cache": {"contract"},
    "limits": {"contract"},
    "gateway": {"contract", "routing", "cache", "limits"},
}
#: Top-level modules of deployments/: they assemble the rooms (the Serve app, its arguments, the
#: command line), may import any room, and no room imports them.
TOP_MODULES = frozenset({"app", "args", "cli"})

#: What a function body may import of the project, and why it is not imported at module level:
#: target module prefix -> (the importers allowed, as module prefixes; the reason).
LAZY_IMPORTS: Dict[str, tuple] = {
    "engine": (("deployments", "cluster"), "torch: a gateway, a CLI or a Ray driver that runs no engine never loads it"),
    "kernels": (("engine", "kernels"), "torch, Triton or the C++ build, loaded when a backend is picked"),
    "cluster": (("deployments",), "Ray actors and torch, for replicas that spread a model over ranks"),
    "deployments.app": (("deployments.cli",), "Ray Serve: `kvserve generate` runs without Ray"),
    "telemetry": (("autoscaling",), "prometheus_client: the policy imports only the standard library"),
    "autoscaling.metrics": (("autoscaling",), "prometheus_client: the policy imports only the standard library"),
}

#: Folders whose modules hold one public class each (data types aside).
ONE_CLASS_ROOMS = ("deployments/replica", "deployments/gateway")


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
    function: Optional[str] = None  # the innermost function whose body holds it; None at module level

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


def _walk(node: ast.AST, function: Optional[str]):
    """``(node, innermost enclosing function name or None)`` for every node under ``node``."""
    for child in ast.iter_child_nodes(node):
        yield child, function
        inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
        yield from _walk(child, inner)


def module_imports(root: Path, packages: Sequence[str] = PACKAGES) -> List[Import]:
    """Every import statement of every project module (module level, in functions, under
    ``if TYPE_CHECKING:``), one :class:`Import` per imported name."""
    modules = project_modules(root, packages)
    found: List[Import] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node, function in _walk(tree, None):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported_names(node, module, path.name == "__init__.py", modules):
                found.append(Import(module, rel, node.lineno, name, _project_target(name, modules), function))
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


def _room_of(module: str) -> Optional[str]:
    """The room (``ROOMS``) or top-level module (``TOP_MODULES``) of a deployments module; None
    for deployments/__init__ and anything outside deployments/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "deployments" and len(parts) > 1 else None


def room_violations(root: Path, imports: Iterable[Import]) -> List[str]:
    """Folders and modules of deployments/ the rules do not name, rules naming what does not exist,
    and imports through a wall: from a room to a room ``ROOMS`` does not list for it, or from a
    room to a top-level module."""
    violations = []
    base = root / "deployments"
    folders = {p.name for p in base.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    tops = {p.stem for p in base.glob("*.py") if p.name != "__init__.py"}
    for name in sorted(folders - set(ROOMS)):
        violations.append(f"deployments/{name}/: a folder that is not a room of ROOMS")
    for name in sorted(set(ROOMS) - folders):
        violations.append(f"deployments/{name}/: a room of ROOMS that does not exist")
    for name in sorted(set().union(*ROOMS.values()) - set(ROOMS)):
        violations.append(f"ROOMS allows importing {name}, which is not a room")
    for name in sorted(tops - TOP_MODULES):
        violations.append(f"deployments/{name}.py: a top-level module not in TOP_MODULES (put it in a room)")
    for name in sorted(TOP_MODULES - tops):
        violations.append(f"deployments/{name}.py: named in TOP_MODULES, does not exist")
    for imp in imports:
        src, dst = _room_of(imp.src), imp.target and _room_of(imp.target)
        if src not in ROOMS or dst is None or dst == src:
            continue
        if dst in TOP_MODULES:
            violations.append(f"{imp.where()}: {imp.src} imports {imp.name}; a room never imports a top-level module")
        elif dst not in ROOMS[src]:
            allowed = ", ".join(sorted(ROOMS[src])) or "no other room"
            violations.append(f"{imp.where()}: {imp.src} imports {imp.name}; {src}/ imports {allowed}")
    return violations


def _prefixed(name: str, prefixes: Iterable[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def lazy_import_violations(imports: Iterable[Import]) -> List[str]:
    """Project imports inside a function body that ``LAZY_IMPORTS`` does not allow (the target's
    most specific entry decides). A package's ``__getattr__`` (PEP 562 lazy names) is exempt."""
    violations = []
    for imp in imports:
        if imp.function is None or imp.target is None:
            continue
        if imp.function == "__getattr__" and imp.file.endswith("__init__.py"):
            continue
        entries = [k for k in LAZY_IMPORTS if _prefixed(imp.target, [k])]
        if entries:
            importers, _ = LAZY_IMPORTS[max(entries, key=len)]
            if _prefixed(imp.src, importers):
                continue
        violations.append(f"{imp.where()}: {imp.src}.{imp.function} imports {imp.name} inside a function; "
                          "import it at module level (LAZY_IMPORTS lists the heavy modules that may wait)")
    return violations


#: Base classes that make a class a data type (not counted by :func:`one_class_violations`).
DATA_BASES = frozenset({"BaseModel", "Exception", "ValueError", "RuntimeError", "TypeError", "KeyError",
                        "LookupError", "Enum", "IntEnum", "StrEnum", "NamedTuple", "TypedDict", "Protocol"})


def _is_data_type(node: ast.ClassDef, data_classes: Set[str]) -> bool:
    for dec in node.decorator_list:
        d = dec.func if isinstance(dec, ast.Call) else dec
        if (d.attr if isinstance(d, ast.Attribute) else getattr(d, "id", "")) == "dataclass":
            return True
    for base in node.bases:
        name = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
        if name in DATA_BASES or name in data_classes or name.endswith(("Error", "Exception")):
            return True
    return False


def one_class_violations(root: Path, folders: Sequence[str] = ONE_CLASS_ROOMS) -> List[str]:
    """Modules in ``folders`` defining more than one public class (name without a leading
    underscore) that is not a data type."""
    violations = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            data: Set[str] = set()
            public = []
            for node in tree.body:
                if isinstance(node, ast.ClassDef):
                    if _is_data_type(node, data):
                        data.add(node.name)
                    elif not node.name.startswith("_"):
                        public.append(node.name)
            if len(public) > 1:
                violations.append(f"{path.relative_to(root).as_posix()}: {len(public)} public classes "
                                  f"({', '.join(public)}); one concern per module")
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
    assert not violations, _report(violations, "breaches of the walls inside deployments/")


def test_imports_inside_functions_are_for_heavy_modules_only():
    violations = lazy_import_violations(repo_imports())
    assert not violations, _report(violations, "project imports inside functions")


def test_one_public_class_per_module_in_replica_and_gateway():
    violations = one_class_violations(ROOT)
    assert not violations, _report(violations, "modules with several public classes")


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
    assert (ROOT / STEP_FILE).exists() and (ROOT / "deployments" / "replica" / "llm_server.py").exists()


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


def test_checker_finds_long_methods(tmp_path):
    root = _tree(tmp_path, {
        "engine/llm_engine.py": (
            "class LLMEngine:\n"
            "    def step(self):\n"
            "        '''A docstring\n\n        of several lines.\n        '''\n"
            + "        x = 1\n" * 24
            + "        return [\n            x,\n        ]\n"),  # 24 + 3 = 27 body lines
    })
    assert long_method_violations(root) == ["engine/llm_engine.py:2: LLMEngine.step has 27 body lines (at most 25)"]
    assert long_method_violations(root, max_lines=27) == []
    (root / "engine/llm_engine.py").write_text("class LLMEngine:\n    def stop(self):\n        pass\n")
    assert long_method_violations(root) == ["engine/llm_engine.py: no LLMEngine.step found"]


def _rooms_tree(tmp_path: Path, extra: Mapping[str, str]) -> Path:
    files = {f"deployments/{room}/__init__.py": "" for room in ROOMS}
    files.update({f"deployments/{m}.py": "" for m in TOP_MODULES})
    files.update(extra)
    return _tree(tmp_path, files)


def test_checker_finds_breaches_of_the_walls(tmp_path):
    root = _rooms_tree(tmp_path, {
        "deployments/replica/server.py": (
            "from deployments.contract.types import T\n"      # allowed
            "from deployments.replica import other\n"         # own room
            "def f():\n    from deployments.gateway import chat\n"),  # through the wall, even lazily
        "deployments/replica/other.py": "",
        "deployments/contract/types.py": "from deployments.routing.router import R\n",
        "deployments/routing/router.py": "from deployments.contract import types\n",
        "deployments/gateway/chat.py": ("from deployments.cache import c\nfrom deployments.routing import router\n"
                                        "from deployments.args import A\n"),
        "deployments/app.py": "from deployments.replica.server import S\nfrom deployments.gateway.chat import C\n",
        "deployments/loose.py": "",
        "deployments/attic/thing.py": "",
    })
    violations = room_violations(root, module_imports(root))
    assert violations == [
        "deployments/attic/: a folder that is not a room of ROOMS",
        "deployments/loose.py: a top-level module not in TOP_MODULES (put it in a room)",
        "deployments/contract/types.py:1: deployments.contract.types imports deployments.routing.router; "
        "contract/ imports no other room",
        "deployments/gateway/chat.py:3: deployments.gateway.chat imports deployments.args; "
        "a room never imports a top-level module",
        "deployments/replica/server.py:4: deployments.replica.server imports deployments.gateway.chat; "
        "replica/ imports contract",
    ], violations
    # names in the rules that do not exist are violations too
    (root / "deployments/limits/__init__.py").unlink()
    (root / "deployments/cli.py").unlink()
    violations = room_violations(root, module_imports(root))
    assert "deployments/limits/: a room of ROOMS that does not exist" in violations
    assert "deployments/cli.py: named in TOP_MODULES, does not exist" in violations


def test_checker_finds_lazy_imports_of_light_modules(tmp_path):
    root = _rooms_tree(tmp_path, {
        "deployments/replica/server.py": (
            "def f():\n    from engine.llm_engine import LLMEngine\n"      # heavy: allowed
            "def g():\n    from deployments.contract import types\n"       # light: not allowed
            "def h():\n    import json\n"),                                # third party / stdlib: not checked
        "deployments/cli.py": "def main():\n    from deployments.app import build_app\n",  # allowed importer
        "deployments/gateway/chat.py": "def f():\n    from deployments.app import build_app\n",  # not this importer
        "engine/__init__.py": "def __getattr__(name):\n    from engine.llm import LLM\n",  # PEP 562 facade
        "engine/llm.py": "def f():\n    from engine.config import C\n",               # same package: no
        "engine/config.py": "",
    })
    violations = lazy_import_violations(module_imports(root))
    assert [v.split(": ")[0] for v in violations] == [
        "deployments/gateway/chat.py:2", "deployments/replica/server.py:4", "engine/llm.py:2"], violations


def test_checker_finds_modules_with_several_classes(tmp_path):
    root = _rooms_tree(tmp_path, {
        "deployments/gateway/one.py": (
            "from dataclasses import dataclass\nfrom pydantic import BaseModel\n"
            "class Gateway:\n    pass\n"
            "class _Helper:\n    pass\n"
            "@dataclass\nclass Settings:\n    x: int = 0\n"
            "class Body(BaseModel):\n    pass\n"
            "class Child(Body):\n    pass\n"
            "class Refused(Exception):\n    pass\n"),
        "deployments/replica/two.py": "class Server:\n    pass\nclass Admission:\n    pass\n",
        "deployments/cache/many.py": "class A:\n    pass\nclass B:\n    pass\n",  # not a one-class room
    })
    assert one_class_violations(root) == [
        "deployments/replica/two.py: 2 public classes (Server, Admission); one concern per module"]
