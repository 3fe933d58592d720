"""The repository's import rules, as data: the project's packages and their floors, the project packages
each may import, what kvserve/kernels/ may import of third party, the rooms of kvserve/deployments/ and its top-level
modules, the imports that may wait inside a function, the one-class folders and the length limit of
``LLMEngine.step``. architecture_checks.py checks a source tree against them; tests/test_architecture.py
runs those checks on this repository and checks the rules themselves."""

from __future__ import annotations

from typing import Dict, Set

#: The import root: every project module is ``kvserve.<package>...`` (the folders under kvserve/). The
#: rules below name modules without it (``engine.llm_engine`` is ``kvserve.engine.llm_engine``).
ROOT_PACKAGE = "kvserve"

#: The project's packages (folders under kvserve/); everything else is third party.
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

#: Third-party modules kvserve/kernels/ may import, besides the standard library.
KERNELS_THIRD_PARTY = frozenset({"torch", "triton", "flash_attn", "numpy"})

#: Packages that must never import Ray (any submodule, at any level): they run without a cluster.
NO_RAY = ("engine", "kernels")

#: ``LLMEngine.step``: at most this many body lines, docstring excluded.
STEP_FILE = "kvserve/engine/llm_engine.py"
STEP_CLASS, STEP_METHOD = "LLMEngine", "step"
STEP_MAX_BODY_LINES = 25

#: The rooms of kvserve/deployments/ (folders) and the other rooms each may import (its own always). The
#: replica side imports only the contract; so do the caller-side routers and the gateway's caches
#: and limits; the gateway uses them all. Nothing but ``TOP_MODULES`` imports across otherwise.
ROOMS: Dict[str, Set[str]] = {
    "contract": set(),
    "replica": {"contract"},
    "routing": {"contract"},
    "cache": {"contract"},
    "limits": {"contract"},
    "gateway": {"contract", "routing", "cache", "limits"},
    "operator": {"contract"},
}
#: Top-level modules of kvserve/deployments/: they assemble the rooms (the Serve app, its arguments, the
#: command line), may import any room, and no room imports them.
TOP_MODULES = frozenset({"app", "args", "cli", "local"})

#: What a function body may import of the project, and why it is not imported at module level:
#: target module prefix -> (the importers allowed, as module prefixes; the reason).
LAZY_IMPORTS: Dict[str, tuple] = {
    "engine": (
        ("deployments", "cluster"),
        "torch: a gateway, a CLI or a Ray driver that runs no engine never loads it",
    ),
    "kernels": (("engine", "kernels"), "torch, Triton or the C++ build, loaded when a backend is picked"),
    "cluster": (("deployments",), "Ray actors and torch, for replicas that spread a model over ranks"),
    "deployments.app": (("deployments.cli",), "Ray Serve: `kvserve generate` runs without Ray"),
    "deployments.local": (
        ("deployments.cli",),
        "the engine and Ray Serve's classes: only `kvserve run-batch` needs them",
    ),
    "telemetry": (("autoscaling",), "prometheus_client: the policy imports only the standard library"),
    "autoscaling.metrics": (("autoscaling",), "prometheus_client: the policy imports only the standard library"),
}

#: Folders whose modules hold one public class each (data types aside).
ONE_CLASS_ROOMS = ("kvserve/deployments/replica", "kvserve/deployments/gateway")
