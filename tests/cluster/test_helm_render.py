"""The Helm chart (helm/kvserve) through ``helm lint --strict`` and ``helm template``: lint passes for the
default, full and open-API values, and the kinds rendered with and without the optional parts."""

from helm_chart import CHART, FULL, SERVICE_MONITOR_API, VARIANTS, _helm


def test_helm_lint_strict(helm, tmp_path):
    for values in [*VARIANTS.values(), {"apiKeys": {"allowUnauthenticated": True}}]:
        r = _helm(helm, "lint", "--strict", str(CHART), values=values, tmp_path=tmp_path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "0 chart(s) failed" in r.stdout


def test_rendered_kinds(render):
    docs = render()
    assert sorted(docs) == ["ConfigMap", "NetworkPolicy", "PodDisruptionBudget", "RayService", "Secret", "Service"]
    # no API keys given: a generated one (never an open API by default)
    assert sorted(s["metadata"]["name"] for s in docs["Secret"]) == ["rel-kvserve-api-keys", "rel-kvserve-ray-token"]
    # with Prometheus Operator's API in the cluster, the ServiceMonitor too
    with_monitor = render(None, "--api-versions", SERVICE_MONITOR_API)
    assert len(with_monitor["ServiceMonitor"]) == 1
    off = render(
        {
            "grafanaDashboard": {"enabled": False},
            "podDisruptionBudget": {"enabled": False},
            "metrics": {"networkPolicy": {"enabled": False}, "serviceMonitor": {"enabled": False}},
        },
        "--api-versions",
        SERVICE_MONITOR_API,
    )
    assert sorted(off) == ["RayService", "Secret", "Service"]
    full = render(FULL)
    assert sorted(s["metadata"]["name"] for s in full["Secret"]) == ["rel-kvserve-api-keys", "rel-kvserve-ray-token"]
    existing = render({"apiKeys": {"existingSecret": "my-keys"}, "rayAuth": {"existingSecret": "my-token"}})
    assert "Secret" not in existing  # both referenced, none made
    opted_out = render({"apiKeys": {"allowUnauthenticated": True}})
    assert [s["metadata"]["name"] for s in opted_out["Secret"]] == ["rel-kvserve-ray-token"]  # open, deliberately
