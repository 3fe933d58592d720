"""Check a ``ray up`` cluster config (``kvserve/cluster/*.yaml``) offline, as ``ray up`` itself would.

``ray up`` first merges the provider's defaults into the file (Ray's ``prepare_config``), then
checks it against Ray's ``ray-schema.json`` (``validate_config``: unknown keys, types, a
``head_node_type`` that no node type defines, a global ``max_workers`` below the sum of the
types' ``min_workers``). Ray lets one mistake through: a node type whose ``max_workers`` is below
its ``min_workers`` is silently clamped to ``max_workers`` by the autoscaler; this module rejects
it too. No cloud API is called and no credentials are needed.

    python -m kvserve.cluster.launcher_config kvserve/cluster/aws-gpu.yaml kvserve/cluster/gcp-gpu.yaml kvserve/cluster/local.yaml
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any


def check_cluster_config(config: dict[str, Any]) -> dict[str, Any]:
    """The config as ``ray up`` would use it (defaults merged in), after Ray's own checks.

    Args:
        config: a cluster config as loaded from its YAML file (not modified).

    Returns:
        The prepared config (Ray's ``prepare_config``): provider defaults merged in, per-type
        ``min_workers`` / ``max_workers`` filled in, the local provider's single node type.

    Raises:
        jsonschema.ValidationError: Ray's schema rejects the config (e.g. an unknown key).
        ValueError: ``head_node_type`` names no defined node type, the global ``max_workers`` is
            below the sum of the types' ``min_workers`` (both Ray's checks), or a node type's
            ``max_workers`` is below its ``min_workers``.
        click.exceptions.ClickException: Ray's local provider refuses the config (e.g. node
            types in a local config, or no ``head_ip``).
    """
    from ray.autoscaler._private.util import prepare_config, validate_config

    if not isinstance(config, dict):
        raise ValueError(f"a cluster config is a mapping, got {type(config).__name__}")
    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    for name, node_type in prepared.get("available_node_types", {}).items():
        lo, hi = node_type.get("min_workers", 0), node_type.get("max_workers", 0)
        if lo > hi:
            raise ValueError(f"node type {name!r}: max_workers ({hi}) is below min_workers ({lo})")
    return prepared


def load_cluster_config(path: str | Path) -> dict[str, Any]:
    """Read a cluster YAML file and check it (:func:`check_cluster_config`); returns the prepared config."""
    import yaml

    with open(path) as f:
        return check_cluster_config(yaml.safe_load(f))


def main(argv: list[str] | None = None) -> int:
    """``python -m kvserve.cluster.launcher_config FILE...``: 0 when every file passes, else 1."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print(__doc__.strip().splitlines()[-1].strip(), file=sys.stderr)
        return 2
    bad = 0
    for p in paths:
        try:
            load_cluster_config(p)
            print(f"{p}: ok")
        except Exception as e:  # noqa: BLE001 - report every file, then fail
            bad += 1
            print(f"{p}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else e!r}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
