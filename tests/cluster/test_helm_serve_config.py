"""The Helm chart's ``serveConfigV2`` through Ray's ``ServeDeploySchema`` and kvserve's ``AppArgs`` (which
forbids unknown keys), room for every model's replica in a worker group, and app args that reach the
app without a chart change."""

import re

import pytest
from helm_chart import VARIANTS, _app_args, _container, _defaults, _groups, _serve_config


def _group_capacity(group) -> tuple[int, float | None]:
    """(GPUs, CPUs) one pod of a rendered worker group gives Ray."""
    c = _container(group)
    cpu = group["rayStartParams"].get("num-cpus") or c.get("resources", {}).get("limits", {}).get("cpu")
    if cpu is None:
        return int(c["resources"]["limits"].get("nvidia.com/gpu", 0)), None
    cpu = str(cpu)
    cpus = float(cpu[:-1]) / 1000 if cpu.endswith("m") else float(cpu)
    return int(c["resources"]["limits"].get("nvidia.com/gpu", 0)), cpus


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_serve_config_v2_parses_with_serve_and_app_args(render, tmp_path, variant, monkeypatch):
    from pydantic import ValidationError
    from ray.serve.schema import ServeDeploySchema

    from kvserve.deployments.app import AppArgs, llm_deployment_options

    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    assert AppArgs.model_config.get("extra") == "forbid"  # else this test would not catch typos
    values = VARIANTS[variant] or _defaults()
    docs = render(VARIANTS[variant])
    (rs,) = docs["RayService"]
    schema = ServeDeploySchema.model_validate(_serve_config(rs))
    (app,) = schema.applications
    assert app.import_path == "kvserve.deployments.app:build_app" and app.route_prefix == "/"
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
            {"CPU": opts["ray_actor_options"]["num_cpus"], "GPU": opts["ray_actor_options"]["num_gpus"]}
        ]
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
    from kvserve.deployments.app import AppArgs, ModelArgs

    app_field = next(f for f in ("max_request_body_bytes", "ingress_cpus") if f in AppArgs.flat_fields())
    model_field = next(f for f in ("request_timeout_s", "graceful_shutdown_timeout_s") if f in ModelArgs.model_fields)
    docs = render({"app": {"args": {app_field: 123}}, "models": [{"model": "m", model_field: 45}]})
    (app,) = _serve_config(docs["RayService"][0])["applications"]
    assert app["args"][app_field] == 123 and app["args"]["models"][0][model_field] == 45


def test_cost_values_price_each_model_replica(render, tmp_path, monkeypatch):
    """``cost.perGpuHour`` prices a GPU replica per rank, ``perCpuHour`` a CPU replica per logical
    CPU it asks for; a model's own ``cost_per_replica_hour`` wins; none given: no cost."""
    monkeypatch.delenv("KVSERVE_API_KEYS", raising=False)
    from kvserve.deployments.app import AppArgs

    values = {
        "cost": {"perGpuHour": 2.5, "perCpuHour": 0.04},
        "models": [
            {"model": "m-gpu", "tensor_parallel_size": 2},
            {"model": "m-own", "cost_per_replica_hour": 9.0},
            {"model": "m-cpu", "device": "cpu", "replica_cpus": 4},
            {"model": "m-cpu-tp", "device": "cpu", "tensor_parallel_size": 2, "replica_cpus": 1, "worker_cpus": 3},
        ],
        "workerGroups": [
            {
                "name": "gpu",
                "gpus": 2,
                "replicas": 1,
                "minReplicas": 0,
                "maxReplicas": 2,
                "resources": {"limits": {"cpu": "16", "memory": "32Gi"}},
            }
        ],
    }
    docs = render(values)
    (rs,) = docs["RayService"]
    args = AppArgs.model_validate(_app_args(rs, docs, tmp_path))
    assert [m.cost_per_replica_hour for m in args.model_list()] == [5.0, 9.0, 0.16, 0.28]
    docs = render({"models": [{"model": "m-gpu"}]})
    (rs,) = docs["RayService"]
    (m,) = AppArgs.model_validate(_app_args(rs, docs, tmp_path)).model_list()
    assert m.cost_per_replica_hour is None
