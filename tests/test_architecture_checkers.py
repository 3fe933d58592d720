"""The checkers of architecture_checks.py on small synthetic trees: each must find the violation
planted for it, so a checker that finds nothing cannot pass unnoticed (tests/test_architecture.py runs
them on this repository)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from architecture_checks import (
    floor_violations,
    import_cycles,
    lazy_import_violations,
    long_method_violations,
    module_imports,
    one_class_violations,
    room_violations,
    unrooted_import_violations,
)
from architecture_rules import PACKAGES, ROOMS, TOP_MODULES


def _tree(root: Path, files: Mapping[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for pkg in PACKAGES:  # every package folder exists under kvserve/, with an __init__.py
        (root / "kvserve" / pkg).mkdir(parents=True, exist_ok=True)
        (root / "kvserve" / pkg / "__init__.py").touch()
    (root / "kvserve" / "__init__.py").touch()
    return root


def test_checker_import_resolution(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvserve/engine/sub/__init__.py": "from . import leaf\nfrom .. import config\n",
            "kvserve/engine/sub/leaf.py": "from ..config import X\nimport kvserve.engine.sub\nfrom kvserve.engine import LLM, sub\n",
            "kvserve/engine/config.py": "import os.path\n",
        },
    )
    got = {(i.src, i.name, i.target) for i in module_imports(root)}
    assert ("engine.sub", "engine.sub.leaf", "engine.sub.leaf") in got
    assert ("engine.sub", "engine.config", "engine.config") in got
    assert ("engine.sub.leaf", "engine.config", "engine.config") in got
    assert ("engine.sub.leaf", "engine.sub", "engine.sub") in got
    assert ("engine.sub.leaf", "engine", "engine") in got  # from engine import LLM: kvserve/engine/__init__.py
    assert ("engine.config", "os.path", None) in got


def test_checker_finds_a_type_only_cycle(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvserve/autoscaling/a.py": "from kvserve.autoscaling.b import B\n",
            "kvserve/autoscaling/b.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kvserve.autoscaling.a import A\n"
            ),
            "kvserve/autoscaling/c.py": "def f():\n    from kvserve.autoscaling import d\n",
            "kvserve/autoscaling/d.py": "import kvserve.autoscaling.c\n",
            "kvserve/autoscaling/e.py": "from kvserve.autoscaling import a\n",  # into a cycle, not on one
        },
    )
    violations = import_cycles(module_imports(root))
    assert len(violations) == 2, violations
    assert "autoscaling.a, autoscaling.b" in violations[0]
    assert "kvserve/autoscaling/b.py:3" in violations[0] and "kvserve/autoscaling/a.py:1" in violations[0]
    assert "kvserve/autoscaling/c.py:2" in violations[1] and "kvserve/autoscaling/d.py:1" in violations[1]
    assert not any("autoscaling.e" in v for v in violations)


def test_checker_finds_floor_violations(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvserve/engine/llm.py": "import kvserve.kernels.backend\ndef f():\n    from kvserve.deployments import app\n",
            "kvserve/engine/metrics.py": "from kvserve.telemetry.metrics import metric\n",
            "kvserve/engine/dist.py": "def f():\n    import ray.util.placement_group\n",
            "kvserve/kernels/ok.py": "import torch, triton, numpy, os\nfrom flash_attn import f\n",
            "kvserve/kernels/bad.py": "import yaml\n",
            "kvserve/autoscaling/policy.py": "from kvserve.telemetry.metrics import metric\nfrom kvserve.cluster import x\n",
            "kvserve/telemetry/metrics.py": "import prometheus_client\nfrom kvserve.engine import config\n",
            "kvserve/cluster/w.py": "from kvserve.engine.config import C\nimport ray\n",
            "kvserve/deployments/app.py": "from kvserve.engine import LLM\nfrom kvserve.autoscaling import policy\nimport ray\n",
        },
    )
    violations = floor_violations(module_imports(root))
    expected = [
        "kvserve/engine/dist.py:2",
        "kvserve/engine/llm.py:3",
        "kvserve/engine/metrics.py:1",
        "kvserve/kernels/bad.py:1",
        "kvserve/autoscaling/policy.py:2",
        "kvserve/telemetry/metrics.py:2",
    ]
    for where in expected:
        assert sum(v.startswith(where + ":") for v in violations) == 1, (where, violations)
    assert len(violations) == len(expected), violations


def test_checker_finds_long_methods(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvserve/engine/llm_engine.py": (
                "class LLMEngine:\n"
                "    def step(self):\n"
                "        '''A docstring\n\n        of several lines.\n        '''\n"
                + "        x = 1\n" * 24
                + "        return [\n            x,\n        ]\n"
            ),  # 24 + 3 = 27 body lines
        },
    )
    assert long_method_violations(root) == [
        "kvserve/engine/llm_engine.py:2: LLMEngine.step has 27 body lines (at most 25)"
    ]
    assert long_method_violations(root, max_lines=27) == []
    (root / "kvserve/engine/llm_engine.py").write_text("class LLMEngine:\n    def stop(self):\n        pass\n")
    assert long_method_violations(root) == ["kvserve/engine/llm_engine.py: no LLMEngine.step found"]


def _rooms_tree(tmp_path: Path, extra: Mapping[str, str]) -> Path:
    files = {f"kvserve/deployments/{room}/__init__.py": "" for room in ROOMS}
    files.update({f"kvserve/deployments/{m}.py": "" for m in TOP_MODULES})
    files.update(extra)
    return _tree(tmp_path, files)


def test_checker_finds_breaches_of_the_walls(tmp_path):
    root = _rooms_tree(
        tmp_path,
        {
            "kvserve/deployments/replica/server.py": (
                "from kvserve.deployments.contract.types import T\n"  # allowed
                "from kvserve.deployments.replica import other\n"  # own room
                "def f():\n    from kvserve.deployments.gateway import chat\n"
            ),  # through the wall, even lazily
            "kvserve/deployments/replica/other.py": "",
            "kvserve/deployments/contract/types.py": "from kvserve.deployments.routing.router import R\n",
            "kvserve/deployments/routing/router.py": "from kvserve.deployments.contract import types\n",
            "kvserve/deployments/gateway/chat.py": (
                "from kvserve.deployments.cache import c\nfrom kvserve.deployments.routing import router\n"
                "from kvserve.deployments.args import A\n"
            ),
            "kvserve/deployments/app.py": "from kvserve.deployments.replica.server import S\nfrom kvserve.deployments.gateway.chat import C\n",
            "kvserve/deployments/loose.py": "",
            "kvserve/deployments/attic/thing.py": "",
        },
    )
    violations = room_violations(root, module_imports(root))
    assert violations == [
        "kvserve/deployments/attic/: a folder that is not a room of ROOMS",
        "kvserve/deployments/loose.py: a top-level module not in TOP_MODULES (put it in a room)",
        "kvserve/deployments/contract/types.py:1: deployments.contract.types imports deployments.routing.router; "
        "contract/ imports no other room",
        "kvserve/deployments/gateway/chat.py:3: deployments.gateway.chat imports deployments.args; "
        "a room never imports a top-level module",
        "kvserve/deployments/replica/server.py:4: deployments.replica.server imports deployments.gateway.chat; "
        "replica/ imports contract",
    ], violations
    # names in the rules that do not exist are violations too
    (root / "kvserve/deployments/limits/__init__.py").unlink()
    (root / "kvserve/deployments/cli.py").unlink()
    violations = room_violations(root, module_imports(root))
    assert "kvserve/deployments/limits/: a room of ROOMS that does not exist" in violations
    assert "kvserve/deployments/cli.py: named in TOP_MODULES, does not exist" in violations


def test_checker_finds_lazy_imports_of_light_modules(tmp_path):
    root = _rooms_tree(
        tmp_path,
        {
            "kvserve/deployments/replica/server.py": (
                "def f():\n    from kvserve.engine.llm_engine import LLMEngine\n"  # heavy: allowed
                "def g():\n    from kvserve.deployments.contract import types\n"  # light: not allowed
                "def h():\n    import json\n"
            ),  # third party / stdlib: not checked
            "kvserve/deployments/cli.py": "def main():\n    from kvserve.deployments.app import build_app\n",  # allowed importer
            "kvserve/deployments/gateway/chat.py": "def f():\n    from kvserve.deployments.app import build_app\n",  # not this importer
            "kvserve/engine/__init__.py": "def __getattr__(name):\n    from kvserve.engine.llm import LLM\n",  # PEP 562 facade
            "kvserve/engine/llm.py": "def f():\n    from kvserve.engine.config import C\n",  # same package: no
            "kvserve/engine/config.py": "",
        },
    )
    violations = lazy_import_violations(module_imports(root))
    assert [v.split(": ")[0] for v in violations] == [
        "kvserve/deployments/gateway/chat.py:2",
        "kvserve/deployments/replica/server.py:4",
        "kvserve/engine/llm.py:2",
    ], violations


def test_checker_finds_modules_with_several_classes(tmp_path):
    root = _rooms_tree(
        tmp_path,
        {
            "kvserve/deployments/gateway/one.py": (
                "from dataclasses import dataclass\nfrom pydantic import BaseModel\n"
                "class Gateway:\n    pass\n"
                "class _Helper:\n    pass\n"
                "@dataclass\nclass Settings:\n    x: int = 0\n"
                "class Body(BaseModel):\n    pass\n"
                "class Child(Body):\n    pass\n"
                "class Refused(Exception):\n    pass\n"
            ),
            "kvserve/deployments/replica/two.py": "class Server:\n    pass\nclass Admission:\n    pass\n",
            "kvserve/deployments/cache/many.py": "class A:\n    pass\nclass B:\n    pass\n",  # not a one-class room
        },
    )
    assert one_class_violations(root) == [
        "kvserve/deployments/replica/two.py: 2 public classes (Server, Admission); one concern per module"
    ]


def test_checker_finds_imports_without_the_root(tmp_path):
    root = _tree(
        tmp_path,
        {
            "kvserve/engine/llm.py": "from kvserve.kernels import backend\nimport kernels\nfrom . import config\n",
            "kvserve/engine/config.py": "",
            "tests/test_x.py": "import os\nfrom engine.llm import LLM\ndef f():\n    import telemetry.metrics as m\n",
            "benchmarks/b.py": "from kvserve import engine\nimport kvserve.cluster\n",
        },
    )
    assert [v.split(": ")[0] for v in unrooted_import_violations(root)] == [
        "kvserve/engine/llm.py:2",
        "tests/test_x.py:2",
        "tests/test_x.py:4",
    ]


def test_checker_sees_imports_made_by_string(tmp_path):
    # the engine naming a cluster module for importlib is an engine -> cluster dependency (the floors
    # see it); two modules naming each other for Serve's importlib are no import cycle
    root = _tree(
        tmp_path,
        {
            "kvserve/engine/registry.py": (
                'import importlib\nBACKENDS = {"ray": "kvserve.cluster.group:Group"}\n'
                'def load():\n    return importlib.import_module("kvserve.deployments.app")\n'
            ),
            "kvserve/cluster/group.py": "class Group: ...\n",
            "kvserve/deployments/app.py": "",
            "kvserve/autoscaling/a.py": 'from kvserve.autoscaling.b import B\nPATH = "kvserve.autoscaling.a:A"\n',
            "kvserve/autoscaling/b.py": 'class B: ...\nPOLICY = "kvserve.autoscaling.a:A"\n',
        },
    )
    imports = module_imports(root)
    by_string = {(i.src, i.target) for i in imports if i.by_string}
    assert by_string == {
        ("engine.registry", "cluster.group"),
        ("engine.registry", "deployments.app"),
        ("autoscaling.b", "autoscaling.a"),
    }  # a module naming itself is no import
    floors = floor_violations(imports)
    assert any("engine.registry" in v and "cluster.group" in v for v in floors), floors
    assert any("engine.registry" in v and "deployments.app" in v for v in floors), floors
    assert import_cycles(imports) == []
    assert lazy_import_violations(imports) == []
