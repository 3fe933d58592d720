"""What must fail at ``helm install`` / ``helm template`` time: bad value types (values.schema.json), ranks
on one node beyond any worker's GPUs, a GPU replica that fits no worker group, API keys outside the
Secret; and pipeline stages spread over pods that do fit."""

import re

import pytest
import yaml


@pytest.mark.parametrize(
    "values,pattern",
    [
        ({"workerGroups": [{"name": "gpu", "gpus": "four", "minReplicas": 0, "maxReplicas": 2}]}, r"gpus"),
        ({"models": [{"model": "m", "tensor_parallel_size": "2"}]}, r"tensor_parallel_size"),
        ({"models": [{"model": "m", "device": "auto"}]}, r"device"),
        ({"image": {"repository": "kvserve", "tags": "1"}}, r"tags"),
        ({"autoscaler": {"enabled": "yes"}}, r"enabled"),
        ({"models": []}, r"models"),
    ],
)
def test_bad_value_types_fail_the_schema(render_error, values, pattern):
    err = render_error(values)
    assert "values don't meet the specifications of the schema" in err, err  # values.schema.json, at install time
    assert re.search(pattern, err), err


@pytest.mark.parametrize(
    "model",
    [{"tensor_parallel_size": 8}, {"tensor_parallel_size": 2, "pipeline_parallel_size": 4}],  # STRICT_PACK: 8 on a pod
    ids=["tp8", "tp2xpp4"],
)
def test_ranks_on_one_node_beyond_any_workers_gpus_fail(render_error, model):
    err = render_error(
        {
            "models": [{"model": "big", **model}],
            "workerGroups": [{"name": "l4x4", "gpus": 4, "minReplicas": 0, "maxReplicas": 2}],
        }
    )
    assert "8 ranks per node" in err and '"l4x4", has 4' in err, err


def test_pipeline_stages_spread_over_pods_fit(render):
    """PP=4 x TP=2 with SPREAD: a stage's two ranks per 4-GPU pod is enough (no error)."""
    docs = render(
        {
            "models": [
                {
                    "model": "big",
                    "tensor_parallel_size": 2,
                    "pipeline_parallel_size": 4,
                    "placement_group_strategy": "SPREAD",
                }
            ],
            "workerGroups": [{"name": "l4x4", "gpus": 4, "minReplicas": 0, "maxReplicas": 2}],
        }
    )
    serve_config = yaml.safe_load(docs["RayService"][0]["spec"]["serveConfigV2"])
    model = serve_config["applications"][0]["args"]["models"][0]
    assert model["pipeline_parallel_size"] == 4 and model["placement_group_strategy"] == "SPREAD"


@pytest.mark.parametrize(
    "groups",
    [
        [{"name": "cpu", "gpus": 0, "minReplicas": 0, "maxReplicas": 4}],  # no GPUs at all
        [{"name": "gpu", "gpus": 2, "minReplicas": 0, "maxReplicas": 0}],  # a group that never has pods
        [
            {
                "name": "gpu",
                "gpus": 4,
                "minReplicas": 0,
                "maxReplicas": 2,  # GPUs, but too few CPUs
                "resources": {"limits": {"cpu": "2500m"}},
            }
        ],
    ],
)
def test_gpu_replica_that_fits_no_worker_group_fails(render_error, groups):
    err = render_error({"models": [{"model": "m", "tensor_parallel_size": 2}], "workerGroups": groups})
    assert "fits no worker group" in err, err


def test_keys_outside_the_secret_fail(render_error):
    err = render_error({"app": {"args": {"api_keys": ["sk-x"]}}})
    assert "never in the RayService spec" in err
    assert "app.args.models" in render_error({"app": {"args": {"models": []}}})
