"""The Helm chart's secrets and hardening (helm/kvserve): admin keys and the Redis URL (its password)
reach every Ray container from Secrets (secretKeyRef), never as plain values in the RayService, and
the app reads them there; plain ones under app.args are refused; every Ray pod runs restricted
(non-root, RuntimeDefault seccomp, no privilege escalation, no capabilities, read-only root with a
writable /tmp); the unauthenticated metrics port is reachable only from the release's pods and the
configured scrapers (a NetworkPolicy), every other port as before. Rendered by a real helm binary,
checked with kubernetes-validate and KubeRay's CRD."""

import pytest
import yaml
from helm_chart import KUBE_VERSION, _container, _groups, _serve_config, _validate_crd

ADMIN = "sk-admin-secret-1"
REDIS = "redis://:hunter2-redis-password@redis.serving:6379/0"
SECRETS = {"adminApiKeys": {"keys": [ADMIN, "sk-admin-secret-2"]}, "redis": {"url": REDIS}}


def _kv(doc):
    import kubernetes_validate

    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def _pods(rs):
    return [rs["spec"]["rayClusterConfig"]["headGroupSpec"]] + _groups(rs)


def _secret_value(docs, name, key):
    (s,) = [d for d in docs["Secret"] if d["metadata"]["name"] == name]
    _kv(s)
    return s["stringData"][key]


def test_admin_keys_and_redis_url_come_from_secrets_and_the_app_reads_them(render, rayservice_schema, monkeypatch):
    docs = render(SECRETS)
    (rs,) = docs["RayService"]
    _validate_crd(rayservice_schema, rs)
    text = yaml.safe_dump(rs)
    assert ADMIN not in text and "hunter2" not in text  # never in the RayService spec
    assert _secret_value(docs, "rel-kvserve-admin-keys", "admin-api-keys") == f"{ADMIN},sk-admin-secret-2"
    assert _secret_value(docs, "rel-kvserve-redis", "redis-url") == REDIS
    for group in _pods(rs):
        env = {e["name"]: e for e in _container(group)["env"]}
        assert env["KVSERVE_ADMIN_API_KEYS"]["valueFrom"] == {
            "secretKeyRef": {"name": "rel-kvserve-admin-keys", "key": "admin-api-keys"}
        }
        assert env["KVSERVE_REDIS_URL"]["valueFrom"] == {
            "secretKeyRef": {"name": "rel-kvserve-redis", "key": "redis-url"}
        }
    # the application, built with the pods' environment, has both
    from kvserve.deployments.args import AppArgs

    (app,) = _serve_config(rs)["applications"]
    monkeypatch.setenv("KVSERVE_ADMIN_API_KEYS", f"{ADMIN},sk-admin-secret-2")
    monkeypatch.setenv("KVSERVE_REDIS_URL", REDIS)
    args = AppArgs.model_validate({k: v for k, v in app["args"].items() if k != "api_keys_file"})
    assert args.gateway.admin_api_keys == [ADMIN, "sk-admin-secret-2"] and args.limits.redis_url == REDIS
    # existing Secrets: referenced, none made
    docs = render(
        {"adminApiKeys": {"existingSecret": "ops-admin", "secretKey": "k"}, "redis": {"existingSecret": "ops-redis"}}
    )
    assert not {"rel-kvserve-admin-keys", "rel-kvserve-redis"} & {s["metadata"]["name"] for s in docs["Secret"]}
    env = {e["name"]: e for e in _container(_groups(docs["RayService"][0])[0])["env"]}
    assert env["KVSERVE_ADMIN_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": "ops-admin", "key": "k"}
    assert env["KVSERVE_REDIS_URL"]["valueFrom"]["secretKeyRef"] == {"name": "ops-redis", "key": "redis-url"}
    # none given: no such variables
    env = {e["name"] for e in _container(_groups(render()["RayService"][0])[0])["env"]}
    assert not {"KVSERVE_ADMIN_API_KEYS", "KVSERVE_REDIS_URL"} & env


@pytest.mark.parametrize("arg", [{"admin_api_keys": [ADMIN]}, {"redis_url": REDIS}])
def test_plain_admin_keys_or_redis_url_in_app_args_are_refused(render_error, arg):
    err = render_error({"app": {"args": arg}})
    assert "never in the RayService spec" in err and next(iter(arg)) in err


def test_every_ray_pod_runs_restricted(render, rayservice_schema):
    (rs,) = render()["RayService"]
    _validate_crd(rayservice_schema, rs)
    for group in _pods(rs):
        spec = group["template"]["spec"]
        _kv({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "x"}, "template": group["template"]})
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["seccompProfile"] == {"type": "RuntimeDefault"}
        c = _container(group)["securityContext"]
        assert c == {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        }
        (tmp,) = [m for m in _container(group)["volumeMounts"] if m["mountPath"] == "/tmp"]
        assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == tmp["name"])


def test_the_metrics_port_is_reachable_only_from_the_release_and_the_scrapers(render):
    docs = render({"metrics": {"port": 9100}})
    (np,) = docs["NetworkPolicy"]
    _kv(np)
    (rs,) = docs["RayService"]
    assert all(
        np["spec"]["podSelector"]["matchLabels"].items() <= g["template"]["metadata"]["labels"].items()
        for g in _pods(rs)
    )
    assert np["spec"]["policyTypes"] == ["Ingress"]
    anyone, scrapers = np["spec"]["ingress"]
    assert "from" not in anyone  # every port but the metrics one: open as before
    tcp = [(p["port"], p["endPort"]) for p in anyone["ports"] if p["protocol"] == "TCP"]
    assert tcp == [(1, 9099), (9101, 65535)]
    assert scrapers["ports"] == [{"protocol": "TCP", "port": 9100}]
    assert scrapers["from"][1] == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    assert "NetworkPolicy" not in render({"metrics": {"networkPolicy": {"enabled": False}}})
