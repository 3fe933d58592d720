"""The checkers of architecture_checks.py on small synthetic trees: each must find the violation
planted for it, so a checker that finds nothing cannot pass unnoticed (tests/test_architecture.py runs
them on this repository)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from architecture_checks import (floor_violations, import_cycles, lazy_import_violations, long_method_violations,
                                 module_imports, one_class_violations, room_violations)
from architecture_rules import PACKAGES, ROOMS, TOP_MODULES


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
