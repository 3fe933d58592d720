"""The autoscaling policy's API surface and configuration (no Ray cluster): metric names and defaults,
the policy module without Ray, its public names, config validation, scale-to-zero, the CLI flags, and
the config built for Ray Serve 2.60 (Ray's config classes imported; no cluster)."""

import importlib
import json
import subprocess
import sys
import warnings

import pytest
from policy_driver import replica_metrics

from kvserve.autoscaling import policy as P
from kvserve.autoscaling import schedule as sch
from kvserve.autoscaling import serve_config as sc
from kvserve.autoscaling import signals as sig
from kvserve.autoscaling.decision import decide
from kvserve.autoscaling.settings import KVServeAutoscalingConfig


def test_metric_names_and_defaults():
    assert sig.METRIC_NAMES == (
        "num_waiting_requests",
        "num_waiting_prefill_tokens",
        "num_running_requests",
        "generation_tokens_per_s",
        "prefill_tokens_per_s",
        "decode_capacity_tokens_per_s",
        "prefill_capacity_tokens_per_s",
        "kv_cache_usage",
        "num_refused_requests",
        "served_prompt_tokens",
    )
    cfg = KVServeAutoscalingConfig()
    assert cfg.min_replicas >= 1 and not cfg.allow_scale_to_zero  # warm pool by default
    assert cfg.policy_mode == "metrics"
    assert cfg.serve_upscale_delay_s == 0.0 and cfg.serve_downscale_delay_s <= 10.0
    d = cfg.to_dict()
    assert KVServeAutoscalingConfig.from_dict(json.loads(json.dumps(d))) == cfg


def test_policy_module_imports_without_ray():
    code = (
        "import sys; sys.modules['ray'] = None\n"
        "from kvserve.autoscaling import decision, demand, metrics, schedule, settings, signals\n"
        "from kvserve.autoscaling import policy as P, serve_config as sc\n"
        "from types import SimpleNamespace as NS\n"
        "ctx = NS(target_num_replicas=2, current_num_replicas=2, running_replicas=[], aggregated_metrics={},"
        " current_time=1.0, policy_state={})\n"
        "print(P.kvserve_autoscaling_policy(ctx)[0]); print(sc.build_autoscaling_config(as_dict=True)['min_replicas'])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "1"]


def test_policy_module_keeps_its_public_names():
    # kvserve/deployments/ and the docs import from kvserve.autoscaling.policy; the split by concern kept
    # every name of its public API there, and Serve's import path still resolves.
    for name in P.__all__:
        assert hasattr(P, name), name
    assert P.build_autoscaling_config is sc.build_autoscaling_config and P.decide is decide
    assert sc.POLICY_IMPORT_PATH == "kvserve.autoscaling.policy:KVServeAutoscalingPolicy"
    module, attr = sc.POLICY_IMPORT_PATH.split(":")
    assert getattr(importlib.import_module(module), attr) is P.KVServeAutoscalingPolicy


@pytest.mark.parametrize(
    "bad",
    [
        dict(min_replicas=0),
        dict(min_replicas=4, max_replicas=2),
        dict(target_utilization=0.0),
        dict(target_utilization=1.5),
        dict(policy_mode="hybrid"),  # needs a schedule
        dict(policy_mode="nope"),
        dict(schedule="8-20:99", max_replicas=8),
        dict(serve_look_back_period_s=2.0, serve_metrics_interval_s=2.0),
        dict(unknown_knob=1),
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError):
        KVServeAutoscalingConfig.from_dict(bad)


def test_scale_to_zero_is_opt_in():
    cfg = KVServeAutoscalingConfig(min_replicas=0, allow_scale_to_zero=True)
    d = sc.build_autoscaling_config(cfg, as_dict=True)
    assert d["min_replicas"] == 0 and d["downscale_to_zero_delay_s"] == cfg.serve_downscale_to_zero_delay_s


def test_cli_flags_round_trip():
    import argparse

    ap = sc.add_autoscaling_args(argparse.ArgumentParser())
    args = ap.parse_args(
        [
            "--max-replicas",
            "12",
            "--target-utilization",
            "0.6",
            "--autoscaling-policy",
            "hybrid",
            "--autoscaling-schedule",
            "8-20:3",
        ]
    )
    cfg = sc.config_from_args(args, base={"min_replicas": 2})
    assert (cfg.max_replicas, cfg.target_utilization, cfg.policy_mode, cfg.min_replicas) == (12, 0.6, "hybrid", 2)
    assert cfg.schedule == (sch.ScheduleEntry(8, 20, 3),)
    assert sc.config_from_args(ap.parse_args([])) == KVServeAutoscalingConfig()


# --------------------------------------------------------------------------------------
# Ray Serve 2.60 wiring (imports Ray's config classes; no cluster)
# --------------------------------------------------------------------------------------
def test_build_autoscaling_config_for_serve():
    pytest.importorskip("ray.serve")
    from ray.serve._private.autoscaling_state import _resolve_policy_callable
    from ray.serve._private.common import DeploymentID, ReplicaID, TimeStampedValue
    from ray.serve.autoscaling_policy import _apply_autoscaling_config
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    knobs = KVServeAutoscalingConfig(min_replicas=2, max_replicas=12, target_utilization=0.7, queue_drain_s=0)
    cfg = sc.build_autoscaling_config(knobs)
    assert isinstance(cfg, AutoscalingConfig)
    assert (cfg.min_replicas, cfg.max_replicas) == (2, 12)
    assert cfg.upscale_delay_s == 0.0 and cfg.downscale_delay_s == knobs.serve_downscale_delay_s
    assert cfg.metrics_interval_s == 2.0 and cfg.look_back_period_s == 10.0
    assert cfg.get_upscaling_factor() == 1.0 and cfg.get_downscaling_factor() == 1.0
    assert cfg.policy.policy_function == sc.POLICY_IMPORT_PATH
    # the plain-dict form validates to the same config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # metrics_interval_s, see the report
        assert AutoscalingConfig(**sc.build_autoscaling_config(knobs, as_dict=True)) == cfg

    # What the controller does: resolve (instantiate the class with policy_kwargs), wrap, call.
    inst = _resolve_policy_callable(cfg.policy)
    assert isinstance(inst, P.KVServeAutoscalingPolicy) and inst.config == knobs
    policy = _apply_autoscaling_config(inst)
    dep = DeploymentID(name="LLMServer", app_name="default")
    rids = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(2)]
    state = {}
    target = 2
    t0 = 1_000_000.0
    for i in range(20):
        now = t0 + i * 0.5
        per = replica_metrics(util=1.0, waiting=40, waiting_tok=4000)
        raw = {n: {rid: [TimeStampedValue(now - 1.0, per[n])] for rid in rids} for n in sig.METRIC_NAMES}
        agg = {n: {rid: per[n] for rid in rids} for n in sig.METRIC_NAMES}
        ctx = AutoscalingContext(
            deployment_id=dep,
            deployment_name="LLMServer",
            app_name="default",
            current_num_replicas=2,
            target_num_replicas=target,
            running_replicas=rids,
            total_num_requests=lambda: 200.0,
            total_queued_requests=lambda: 0.0,
            aggregated_metrics=lambda agg=agg: agg,
            raw_metrics=lambda raw=raw: raw,
            capacity_adjusted_min_replicas=2,
            capacity_adjusted_max_replicas=12,
            policy_state=state,
            last_scale_up_time=None,
            last_scale_down_time=None,
            current_time=now,
            config=cfg,
        )
        n, state = policy(ctx)
        assert isinstance(n, int)
        target = n
    assert target == 12
    assert any(k.startswith("kvserve.") for k in state)
