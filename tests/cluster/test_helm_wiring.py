"""The Helm chart's core kinds (Secret, Service, ConfigMap, PodDisruptionBudget, the pod templates) with
``kubernetes-validate`` in strict mode, and how the pieces point at each other: the OpenAI Service,
ServiceMonitor -> metrics Service -> every Ray pod, the PodDisruptionBudget, the Grafana dashboard,
no API key in the RayService, and every Ray pod's environment as ``kvserve serve`` starts its Ray."""

import copy
import json

import pytest
import yaml
from helm_chart import CHART, FULL, KUBE_VERSION, SERVICE_MONITOR_API, VARIANTS, _container, _groups, _serve_config


def _kv(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_core_kinds_validate_with_kubernetes_validate(render, variant):
    docs = render(VARIANTS[variant], "--api-versions", SERVICE_MONITOR_API)
    checked = 0
    for kind in ("Secret", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"):
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


def test_ray_pods_get_the_local_ray_environment(render):
    """The head and every worker group run Ray with ``cluster.LOCAL_RAY_ENV`` (worker niceness,
    Serve's control-loop and metrics intervals), the settings ``kvserve serve`` starts its Ray with."""
    from kvserve.cluster import LOCAL_RAY_ENV

    (rs,) = render(FULL)["RayService"]
    pods = [rs["spec"]["rayClusterConfig"]["headGroupSpec"]] + _groups(rs)
    assert len(pods) >= 2
    for group in pods:
        env = {e["name"]: e.get("value") for e in _container(group).get("env", [])}
        assert {k: env.get(k) for k in LOCAL_RAY_ENV} == LOCAL_RAY_ENV, env
