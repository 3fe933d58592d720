"""The configuration's sections (``kvserve/deployments/contract/config.py``) as the deployments get them:
pydantic objects, never dicts re-validated on the other side of a wall; and the replica's
admission bound under its new name, ``max_waiting_requests``, with the old key
``max_queued_requests`` still accepted (a ``FutureWarning``) in a config, in the flat form, in a
model's section and as a flag, while Serve's own ``max_queued_requests`` keeps its name."""

import pickle

import pytest
import yaml
from pydantic import ValidationError

from kvserve.deployments.app import build_app, gateway_options, llm_deployment_options
from kvserve.deployments.args import AppArgs, app_args_from_config
from kvserve.deployments.cli import app_args_from_cli, build_parser
from kvserve.deployments.contract.config import CacheArgs, GatewayArgs, LimitArgs, ModelArgs, TracingArgs
from kvserve.deployments.contract.routing_config import RoutingArgs
from kvserve.deployments.contract.facts import ModelCard
from kvserve.deployments.contract.types import ServerInfo


def test_the_old_key_of_the_admission_bound_still_works_with_a_warning(tmp_path):
    with pytest.warns(FutureWarning, match="max_queued_requests is deprecated.*max_waiting_requests"):
        flat = AppArgs.model_validate({"max_num_seqs": 8, "max_queued_requests": 3})
    with pytest.warns(FutureWarning):
        listed = AppArgs.model_validate({"models": [{"max_num_seqs": 8, "max_queued_requests": 3}]})
    config = tmp_path / "serve.yaml"  # a Serve config written before the rename
    config.write_text(
        yaml.safe_dump(
            {
                "applications": [
                    {
                        "name": "kvserve",
                        "import_path": "kvserve.deployments.app:build_app",
                        "args": {"max_num_seqs": 8, "max_queued_requests": 3},
                    }
                ]
            }
        )
    )
    with pytest.warns(FutureWarning):
        from_file = AppArgs.model_validate(app_args_from_config(str(config)))
    with pytest.warns(FutureWarning, match="--max-queued-requests is deprecated"):
        flag = app_args_from_cli(
            build_parser().parse_args(["serve", "--max-num-seqs", "8", "--max-queued-requests", "3"])
        )
    for args in (flat, listed, from_file, AppArgs.model_validate(flag)):
        (m,) = args.model_list()
        assert m.max_waiting_requests == 3 and m.waiting_requests_bound() == 3
        # two queues, two names: Serve's handle queue keeps Serve's name; the replica's bound is ours
        opts = llm_deployment_options(m, "LLMServer")
        # Serve lets through the batch, the queue, as many being refused, and batch work's share (8 // 2)
        assert opts["max_queued_requests"] == 8 + 3 and opts["max_ongoing_requests"] == 8 + 2 * 3 + 4
    assert flat.flat_value("max_queued_requests") == flat.flat_value("max_waiting_requests") == 3
    assert ModelArgs(max_waiting_requests=3).max_waiting_requests == 3
    with pytest.raises(ValidationError, match="old name of max_waiting_requests"):
        ModelArgs(max_queued_requests=2, max_waiting_requests=3)
    assert ServerInfo(name="m", max_model_len=8, max_waiting_requests=3).max_queued_requests == 3


def test_build_app_passes_the_sections_as_objects():
    """``LLMServer(model: ModelArgs)``; the gateway: the models' handles, their cards and the
    configuration's sections. Nothing crosses as a dict to be validated again."""
    args = AppArgs.model_validate(
        {
            "models": [
                {"served_model_name": "a", "max_model_len": 64, "max_num_seqs": 4},
                {"served_model_name": "b", "tool_call_parser": "mistral"},
            ],
            "api_keys": ["sk-config-key-1"],
            "rate_limit_rpm": 60,
            "cache_ttl_s": 9,
            "model_routing": {"rules": [{"model": "b", "max_tokens": 8}]},
        }
    )
    app = build_app(args)
    ingress = app._bound_deployment
    (models,) = ingress.init_args
    kw = ingress.init_kwargs
    assert list(models) == ["a", "b"]
    for name, child in models.items():
        model, tracing = child._bound_deployment.init_args
        assert isinstance(model, ModelArgs) and model.name == name and not child._bound_deployment.init_kwargs
        assert isinstance(tracing, TracingArgs) and tracing.otlp_traces_endpoint is None
    assert isinstance(kw["gateway"], GatewayArgs) and kw["gateway"].api_keys == ["sk-config-key-1"]
    assert isinstance(kw["limits"], LimitArgs) and kw["limits"].rate_limit_rpm == 60
    assert isinstance(kw["cache"], CacheArgs) and kw["cache"].cache_ttl_s == 9
    assert isinstance(kw["routing"], RoutingArgs) and kw["routing"].model_routing.rules[0].model == "b"
    cards = {c.name: c for c in kw["cards"]}
    assert cards["a"].max_model_len == 64 and cards["b"].max_model_len is None  # b: its KV pool decides at load
    assert cards["b"].tool_call_parser == "mistral"
    assert kw == {**gateway_options(args), "encoders": {}, "variants": {}}
    # what crosses pickles (Serve ships init arguments so), and the card's digest survives it
    a = pickle.loads(pickle.dumps(args.models[0]))
    assert a == args.models[0] and ModelCard.of(a).digest == cards["a"].digest
    # the digest follows what the loaded facts depend on, not the replica count
    assert ModelCard.of(a.model_copy(update={"num_replicas": 5})).digest == cards["a"].digest
    assert ModelCard.of(a.model_copy(update={"max_model_len": 32})).digest != cards["a"].digest


def test_checks_that_need_another_room_run_where_the_app_is_assembled():
    with pytest.raises(ValidationError, match="unknown tool_call_parser"):
        AppArgs.model_validate({"tool_call_parser": "no-such-parser"})
    with pytest.raises(ValidationError):
        AppArgs.model_validate({"api_keys": ["sk-key-1 rpm=many"]})


def test_a_replica_runs_its_ranks_as_ray_actors_not_local_processes():
    # the offline LLM may pick local processes ("mp"); a Serve replica's ranks live in its placement group
    with pytest.raises(ValidationError, match="'mp'.*offline LLM"):
        ModelArgs(tensor_parallel_size=2, distributed_executor_backend="mp")
    assert ModelArgs(tensor_parallel_size=2, distributed_executor_backend="ray").distributed_executor_backend == "ray"
    assert ModelArgs(tensor_parallel_size=2).distributed_executor_backend is None


def test_build_app_makes_a_deployment_per_variant_of_an_experiment():
    """A model in an A/B test: one ``LLMServer`` deployment per variant (named after it), each
    with the model's settings and its own; the gateway gets the first variant's handle as the
    model's, every variant's handle, the experiments and the control's card."""
    args = AppArgs.model_validate(
        {
            "models": [
                {"served_model_name": "a", "max_num_seqs": 4, "cost_per_replica_hour": 2.0},
                {"served_model_name": "b"},
            ],
            "experiments": [
                {
                    "name": "x",
                    "model": "a",
                    "variants": [{"name": "ctl"}, {"name": "big", "weight": 3, "settings": {"max_num_seqs": 16}}],
                }
            ],
            "otlp_traces_endpoint": "http://127.0.0.1:4318/v1/traces",
            "otlp_traces_protocol": "http/protobuf",
        }
    )
    app = build_app(args)
    ingress = app._bound_deployment
    (models,) = ingress.init_args
    kw = ingress.init_kwargs
    assert list(models) == ["a", "b"] and set(kw["variants"]) == {"a"}
    by_variant = {v: h._bound_deployment for v, h in kw["variants"]["a"].items()}
    assert {v: d.name for v, d in by_variant.items()} == {"ctl": "LLMServer-ctl", "big": "LLMServer-big"}
    assert models["a"]._bound_deployment is by_variant["ctl"]
    for v, seqs in (("ctl", 4), ("big", 16)):
        m, tracing = by_variant[v].init_args
        assert (m.name, m.variant, m.max_num_seqs, m.cost_per_replica_hour) == ("a", v, seqs, 2.0)
        assert tracing.otlp_traces_protocol == "http/protobuf"
    assert models["b"]._bound_deployment.name == "LLMServer-b"
    assert [e.name for e in kw["experiments"]] == ["x"] and kw["tracing"] == args.tracing
    card = {c.name: c for c in kw["cards"]}["a"]
    assert card.facts_key == "a@ctl" and card.digest == ModelCard.of(args.deployments()[0]).digest
