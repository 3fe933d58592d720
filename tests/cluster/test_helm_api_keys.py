"""The Helm chart's API keys: never an open endpoint unless asked for. A generated key Secret the app
reads and the NOTES' command names, given keys or an existing Secret (none generated), a deliberate
opt-out with a loud warning, and a generated key that survives ``helm upgrade`` (``lookup`` against a
fake API server)."""

import base64
import copy
import json
import re
from pathlib import Path

import pytest
import yaml
from helm_chart import CHART, KUBE_VERSION, _app_args, _groups, _helm, _serve_config, _validate_crd

GENERATED = "kvserve.io/generated-api-key"


@pytest.fixture
def install_dry_run(helm, tmp_path):
    """install_dry_run(values) -> ({kind: [documents]}, NOTES) of one `helm install --dry-run=client`
    (the NOTES and the manifest of the same render: a generated key is the same in both)."""

    def _install(values: dict | None = None, *flags: str) -> tuple[dict[str, list[dict]], str]:
        r = _helm(
            helm,
            "install",
            "rel",
            str(CHART),
            "--namespace",
            "serving",
            "--dry-run=client",
            *flags,
            values=values,
            tmp_path=tmp_path,
        )
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
        mounted = [
            (m, vols[m["name"]]) for m in tpl["spec"]["containers"][0]["volumeMounts"] if "secret" in vols[m["name"]]
        ]
        if path is None:
            assert all(
                v["secret"]["secretName"] == rs["spec"]["rayClusterConfig"]["authOptions"]["secretName"]
                for _, v in mounted
            ), mounted  # no key file: no API key Secret mounted either
            continue
        (src,) = [
            (v["secret"]["secretName"], item["key"])
            for m, v in mounted
            for item in v["secret"]["items"]
            if f"{m['mountPath']}/{item['path']}" == path
        ]
        sources.add(src)
    if path is None:
        return None
    (src,) = sources  # the same Secret in every pod
    return src


def _notes_read_command(notes: str) -> tuple[str, str, str]:
    """(namespace, Secret, key) of the NOTES' `kubectl get secret ... -o jsonpath=... | base64 -d`
    that reads the API key (the jsonpath's escaped dots unescaped as kubectl does)."""
    m = re.search(
        r"kubectl get secret -n (\S+) (\S+) -o jsonpath='\{\.data\.((?:[^}\\]|\\.)+)\}' \| base64 -d\)", notes
    )
    assert m, notes
    return m.group(1), m.group(2), m.group(3).replace("\\.", ".")


def test_no_keys_generates_a_key_secret_the_app_reads(install_dry_run, monkeypatch, tmp_path):
    from kvserve.deployments.app import AppArgs

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
    assert "KEY=$(kubectl get secret" in notes and '-H "Authorization: Bearer $KEY"' in notes
    assert "generated" in notes and "WARNING" not in notes
    # random per install (helm template / a new release): not a key baked into the chart
    docs2, _ = install_dry_run()
    (secret2,) = [s for s in docs2["Secret"] if s["metadata"]["name"] == secret_name]
    assert secret2["data"][item] != secret["data"][item]


@pytest.mark.parametrize(
    "api_keys,secret_name",
    [
        ({"keys": ["sk-given-1 name=frontend", "sk-given-2"]}, "rel-kvserve-api-keys"),
        ({"existingSecret": "my-keys", "secretKey": "keys.txt"}, "my-keys"),
        ({"keys": ["sk-given-1"], "allowUnauthenticated": True}, "rel-kvserve-api-keys"),  # keys win over the opt-out
    ],
    ids=["keys", "existing-secret", "keys-and-opt-out"],
)
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
    from kvserve.deployments.app import AppArgs

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

    KINDS = {
        "/api/v1": ("v1", ["Secret", "Service", "ConfigMap"]),
        "/apis/policy/v1": ("policy/v1", ["PodDisruptionBudget"]),
        "/apis/networking.k8s.io/v1": ("networking.k8s.io/v1", ["NetworkPolicy"]),
        "/apis/ray.io/v1": ("ray.io/v1", ["RayService"]),
    }

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
                    return self._send(
                        200,
                        {
                            "kind": "APIGroupList",
                            "apiVersion": "v1",
                            "groups": [
                                {
                                    "name": g,
                                    "versions": [{"groupVersion": f"{g}/v1", "version": "v1"}],
                                    "preferredVersion": {"groupVersion": f"{g}/v1", "version": "v1"},
                                }
                                for g in ("policy", "networking.k8s.io", "ray.io")
                            ],
                        },
                    )
                if path in api.KINDS:
                    gv, kinds = api.KINDS[path]
                    return self._send(
                        200,
                        {
                            "kind": "APIResourceList",
                            "groupVersion": gv,
                            "resources": [
                                {
                                    "name": k.lower() + "s",
                                    "singularName": k.lower(),
                                    "namespaced": True,
                                    "kind": k,
                                    "verbs": ["get"],
                                }
                                for k in kinds
                            ],
                        },
                    )
                api.gets.append(path)
                parts = path.strip("/").split("/")
                if parts[:3] == ["api", "v1", "namespaces"] and len(parts) == 6 and parts[4] == "secrets":
                    if (parts[3], parts[5]) in api.secrets:
                        return self._send(200, api.secrets[(parts[3], parts[5])])
                self._send(
                    404, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
                )

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, path: Path) -> Path:
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "fake",
                    "clusters": [
                        {"name": "fake", "cluster": {"server": f"http://127.0.0.1:{self.server.server_address[1]}"}}
                    ],
                    "users": [{"name": "fake", "user": {"token": "x"}}],
                    "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
                }
            )
        )
        return path

    def store(self, doc: dict, namespace: str = "serving"):
        """A Secret as `helm install` of release `rel` left it (Helm's ownership label and annotations)."""
        doc = copy.deepcopy(doc)
        meta = doc["metadata"]
        meta["namespace"] = namespace
        meta.setdefault("labels", {})["app.kubernetes.io/managed-by"] = "Helm"
        meta.setdefault("annotations", {}).update(
            {"meta.helm.sh/release-name": "rel", "meta.helm.sh/release-namespace": namespace}
        )
        if "stringData" in doc:  # the API server stores stringData as data
            doc.setdefault("data", {}).update(
                {k: base64.b64encode(v.encode()).decode() for k, v in doc.pop("stringData").items()}
            )
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
            r = _helm(
                helm,
                "template",
                "rel",
                str(CHART),
                "--namespace",
                "serving",
                "--kube-version",
                KUBE_VERSION,
                "--dry-run=server",
                "--disable-openapi-validation",
                "--kubeconfig",
                str(kubeconfig),
                "--show-only",
                "templates/secret-api-keys.yaml",
                values=values,
                tmp_path=tmp_path,
            )
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
        (from_keys,) = [
            s
            for s in render({"apiKeys": {"keys": ["sk-old name=x"]}})["Secret"]
            if s["metadata"]["name"] == "rel-kvserve-api-keys"
        ]
        api.store(from_keys)
        key = generated_key()
        assert "sk-old" not in key and re.fullmatch(r"sk-[A-Za-z0-9]{48}", key), key
    finally:
        api.close()
