"""The Helm chart's RayService against KubeRay v1.7.0's CRD ``openAPIV3Schema`` (tests/data/kuberay/), with
unknown or misplaced fields rejected, and the Ray cluster it describes: token auth, the autoscaler,
the head and the GPU worker groups, the image."""

import base64
import copy
import json

import pytest
from helm_chart import VARIANTS, _container, _defaults, _groups, _validate_crd


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
