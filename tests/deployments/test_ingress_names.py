"""Serve's ``@serve.ingress(app)`` snapshots the FastAPI app while the ingress class body is
being defined: a module-level name the class uses but that is defined *below* the class does
not exist in the running server (the ``NameError: _strip`` 500 on every chat request with
``logprobs``). This static check makes that class of bug impossible to land: every
module-level name a Serve class of ``deployments/`` reads is bound above the class."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "deployments"


def _module_bindings(tree: ast.Module) -> dict[str, int]:
    """Module-level names and the line where each is first bound."""
    out: dict[str, int] = {}

    def bind(name: str, line: int):
        out.setdefault(name, line)

    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bind(node.name, node.lineno)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        bind(n.id, node.lineno)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                bind((a.asname or a.name).split(".")[0], node.lineno)
    return out


def _serve_classes(tree: ast.Module) -> list[ast.ClassDef]:
    def is_serve(dec: ast.expr) -> bool:
        text = ast.unparse(dec)
        return text.startswith(("serve.deployment", "serve.ingress"))

    return [n for n in tree.body if isinstance(n, ast.ClassDef) and any(is_serve(d) for d in n.decorator_list)]


@pytest.mark.parametrize("path", sorted(ROOT.glob("*.py")), ids=lambda p: p.name)
def test_serve_classes_use_only_names_bound_above_them(path):
    tree = ast.parse(path.read_text())
    bound = _module_bindings(tree)
    for cls in _serve_classes(tree):
        local = {n.id for n in ast.walk(cls) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        local |= {a.arg for n in ast.walk(cls) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for a in n.args.args + n.args.kwonlyargs + n.args.posonlyargs}
        late = sorted({n.id for n in ast.walk(cls) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)
                       and n.id in bound and n.id not in local and bound[n.id] > cls.lineno})
        assert not late, f"{path.name}: {cls.name} (line {cls.lineno}) uses {late}, bound below it"


def test_the_check_catches_a_late_helper():
    src = "from ray import serve\n@serve.ingress(app)\nclass C:\n    def f(self):\n        return _late()\n" \
          "def _late():\n    return 1\n"
    tree = ast.parse(src)
    bound, (cls,) = _module_bindings(tree), _serve_classes(tree)
    assert bound["_late"] > cls.lineno
