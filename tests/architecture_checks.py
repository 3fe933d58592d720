"""The checkers of the import rules (architecture_rules.py), on a repository's source with the stdlib
``ast`` only (no project package is imported). Each check is a function of a repository root (or of its
imports) that returns its violations as strings naming the file, line and import.

An import is an edge to the most specific project module it names: ``from kvserve.engine import config``
is an edge to ``kvserve.engine.config``; ``from kvserve.engine.config import EngineConfig`` to ``kvserve.engine.config``;
``from kvserve.engine import LLM`` to ``engine`` (kvserve/engine/__init__.py). The parent packages Python runs on
the way (``kvserve/engine/__init__.py`` for ``import kvserve.engine.config``) are not edges of the cycle check (every
package's ``__init__`` importing its own modules would otherwise be a cycle); the replica check,
which asks what the replica process loads, does follow them.
"""

from __future__ import annotations

import ast
import re
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Sequence, Set

from architecture_rules import (
    ALLOWED_PROJECT_IMPORTS,
    FLOORS,
    KERNELS_THIRD_PARTY,
    LAZY_IMPORTS,
    NO_RAY,
    ONE_CLASS_ROOMS,
    PACKAGES,
    ROOT_PACKAGE,
    ROOMS,
    STEP_CLASS,
    STEP_FILE,
    STEP_MAX_BODY_LINES,
    STEP_METHOD,
    TOP_MODULES,
)


# ---------------------------------------------------------------------------------------------
# reading the source
# ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Import:
    """One imported name of one import statement."""

    src: str  # importing module, e.g. "kvserve.engine.llm_engine"
    file: str  # its path relative to the root
    lineno: int
    name: str  # absolute dotted name as written (relative imports resolved)
    target: Optional[str]  # most specific project module it names; None for third party / stdlib
    function: Optional[str] = None  # the innermost function whose body holds it; None at module level
    by_string: bool = False  # named by string (IMPORT_PATH), for importlib at run time

    def where(self) -> str:
        return f"{self.file}:{self.lineno}"


def project_modules(root: Path, packages: Sequence[str] = PACKAGES) -> Dict[str, Path]:
    """Module name (without the ``kvserve.`` root) -> file, for every ``.py`` file under the
    project's package folders (``root/kvserve/<package>/``)."""
    modules: Dict[str, Path] = {}
    for pkg in packages:
        base = root / ROOT_PACKAGE / pkg
        if not base.is_dir():
            continue
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(root / ROOT_PACKAGE).with_suffix("").parts
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


def _unrooted(name: str) -> str:
    """``kvserve.engine.llm`` -> ``engine.llm`` (the rules' names); ``kvserve`` -> ``""``; a third-party
    name as it is."""
    if name == ROOT_PACKAGE:
        return ""
    return name[len(ROOT_PACKAGE) + 1 :] if name.startswith(ROOT_PACKAGE + ".") else name


def _imported_names(node: ast.AST, module: str, is_package: bool, modules: Mapping[str, Path]) -> List[str]:
    if isinstance(node, ast.Import):
        return [_unrooted(alias.name) or ROOT_PACKAGE for alias in node.names]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        keep = len(package) - (node.level - 1)
        if keep <= 0:  # beyond the top-level package: not a project import we can name
            return []
        base = ".".join(package[:keep] + ([node.module] if node.module else []))
    else:
        base = _unrooted(node.module or "")
    names = []
    for alias in node.names:
        sub = f"{base}.{alias.name}" if base else alias.name
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


#: An import made by string: ``"kvserve.<module>:<attribute>"`` (Serve's and the executor registry's
#: import paths, resolved by ``importlib`` at run time) or ``importlib.import_module("kvserve.<module>")``.
IMPORT_PATH = re.compile(r"^kvserve(\.[A-Za-z_]\w*)+:[A-Za-z_]\w*$")


def _string_import(node: ast.AST) -> Optional[str]:
    """The dotted module a string names as an import (see :data:`IMPORT_PATH`), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and IMPORT_PATH.match(node.value):
        return node.value.split(":")[0]
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, (ast.Attribute, ast.Name))
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id) == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and node.args[0].value.startswith(ROOT_PACKAGE + ".")
    ):
        return node.args[0].value
    return None


def module_imports(root: Path, packages: Sequence[str] = PACKAGES) -> List[Import]:
    """Every import statement of every project module (module level, in functions, under
    ``if TYPE_CHECKING:``), one :class:`Import` per imported name, and every import made by
    string (:data:`IMPORT_PATH`, ``by_string``): a dependency however it is written, so the floors
    and the rooms see it; the cycle and lazy-import checks, which are about what Python runs when
    a module is imported, do not (a string is resolved by whoever calls ``importlib``, later)."""
    modules = project_modules(root, packages)
    found: List[Import] = []
    for module, path in modules.items():
        rel = path.relative_to(root).as_posix()
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
        for node, function in _walk(tree, None):
            by_string = _string_import(node)
            if by_string is not None and by_string != ROOT_PACKAGE + "." + module:  # naming itself is no import
                name = _unrooted(by_string)
                found.append(Import(module, rel, node.lineno, name, _project_target(name, modules), function, True))
                continue
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
    graph = _graph(i for i in imports if not i.by_string)
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
    neighbour on the same floor), kvserve/kernels/ importing third party beyond KERNELS_THIRD_PARTY, and
    Ray in kvserve/engine/ or kvserve/kernels/."""
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
                    f"{sorted(ALLOWED_PROJECT_IMPORTS.get(src_pkg, set())) or 'no project package'}"
                )
            continue
        if src_pkg in NO_RAY and top == "ray":
            violations.append(f"{imp.where()}: {imp.src} imports {imp.name}; {src_pkg}/ never imports ray")
        elif src_pkg == "kernels" and top not in stdlib and top not in KERNELS_THIRD_PARTY:
            violations.append(
                f"{imp.where()}: {imp.src} imports {imp.name}; kvserve/kernels/ imports only the "
                f"standard library and {sorted(KERNELS_THIRD_PARTY)}"
            )
    return violations


def _room_of(module: str) -> Optional[str]:
    """The room (``ROOMS``) or top-level module (``TOP_MODULES``) of a deployments module; None
    for kvserve/deployments/__init__ and anything outside kvserve/deployments/."""
    parts = module.split(".")
    return parts[1] if parts[0] == "deployments" and len(parts) > 1 else None


def room_violations(root: Path, imports: Iterable[Import]) -> List[str]:
    """Folders and modules of kvserve/deployments/ the rules do not name, rules naming what does not exist,
    and imports through a wall: from a room to a room ``ROOMS`` does not list for it, or from a
    room to a top-level module."""
    violations = []
    base = root / ROOT_PACKAGE / "deployments"
    folders = {p.name for p in base.iterdir() if p.is_dir() and any(p.rglob("*.py"))}
    tops = {p.stem for p in base.glob("*.py") if p.name != "__init__.py"}
    for name in sorted(folders - set(ROOMS)):
        violations.append(f"kvserve/deployments/{name}/: a folder that is not a room of ROOMS")
    for name in sorted(set(ROOMS) - folders):
        violations.append(f"kvserve/deployments/{name}/: a room of ROOMS that does not exist")
    for name in sorted(set().union(*ROOMS.values()) - set(ROOMS)):
        violations.append(f"ROOMS allows importing {name}, which is not a room")
    for name in sorted(tops - TOP_MODULES):
        violations.append(f"kvserve/deployments/{name}.py: a top-level module not in TOP_MODULES (put it in a room)")
    for name in sorted(TOP_MODULES - tops):
        violations.append(f"kvserve/deployments/{name}.py: named in TOP_MODULES, does not exist")
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
        if imp.function is None or imp.target is None or imp.by_string:
            continue
        if imp.function == "__getattr__" and imp.file.endswith("__init__.py"):
            continue
        entries = [k for k in LAZY_IMPORTS if _prefixed(imp.target, [k])]
        if entries:
            importers, _ = LAZY_IMPORTS[max(entries, key=len)]
            if _prefixed(imp.src, importers):
                continue
        violations.append(
            f"{imp.where()}: {imp.src}.{imp.function} imports {imp.name} inside a function; "
            "import it at module level (LAZY_IMPORTS lists the heavy modules that may wait)"
        )
    return violations


#: Base classes that make a class a data type (not counted by :func:`one_class_violations`).
DATA_BASES = frozenset(
    {
        "BaseModel",
        "Exception",
        "ValueError",
        "RuntimeError",
        "TypeError",
        "KeyError",
        "LookupError",
        "Enum",
        "IntEnum",
        "StrEnum",
        "NamedTuple",
        "TypedDict",
        "Protocol",
    }
)


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
                violations.append(
                    f"{path.relative_to(root).as_posix()}: {len(public)} public classes "
                    f"({', '.join(public)}); one concern per module"
                )
    return violations


def body_lines(func: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines from the first statement after the docstring to the end of the last statement."""
    body = func.body
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    if not body:
        return 0
    return body[-1].end_lineno - body[0].lineno + 1


def long_method_violations(
    root: Path,
    file: str = STEP_FILE,
    cls: str = STEP_CLASS,
    method: str = STEP_METHOD,
    max_lines: int = STEP_MAX_BODY_LINES,
) -> List[str]:
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


def unrooted_import_violations(
    root: Path, folders: Sequence[str] = ("kvserve", "tests", "benchmarks"), packages: Sequence[str] = PACKAGES
) -> List[str]:
    """Absolute imports that name a project package without the ``kvserve.`` root (``import
    kernels``, ``from engine.llm import LLM``), in every ``.py`` file under ``folders``. Such a name
    is another distribution's (Hugging Face's ``kernels``, PyPI's ``cluster`` and ``telemetry``), or
    nothing: the project is importable only as ``kvserve.*`` (ROOT_PACKAGE)."""
    violations = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and not node.level:
                    names = [node.module or ""]
                else:
                    continue
                for name in names:
                    if name.split(".")[0] in packages:
                        violations.append(
                            f"{rel}:{node.lineno}: imports {name}; the project's is "
                            f"{ROOT_PACKAGE}.{name} (one import root, docs/architecture.md)"
                        )
    return violations
