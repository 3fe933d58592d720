"""Serving pieces that need no running Ray: the Serve config file, the app builder and its
pydantic args, the CLI, the OpenAI protocol models, the step metrics, import rules."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

ROOT = Path(__file__).resolve().parents[2]


def test_serve_config_file_loads_with_serve_schema():
    from ray.serve.schema import ServeDeploySchema

    from kvserve.deployments.app import AppArgs, build_app

    data = yaml.safe_load((ROOT / "kvserve" / "deployments" / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(data)
    app = schema.applications[0]
    assert app.name == "kvserve" and app.import_path == "kvserve.deployments.app:build_app"
    args = AppArgs.model_validate(app.args)
    assert args.model_list()[0].name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert args.model_list()[0].autoscaling_knobs()["max_replicas"] == 8  # kvserve's policy, 1..8
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary
    from ray.serve.deployment import Application

    assert isinstance(call_user_app_builder_with_args_if_necessary(build_app, app.args), Application)
    with pytest.raises(ValidationError):
        call_user_app_builder_with_args_if_necessary(build_app, {"max_num_seqs": -1})


def test_pipeline_serve_config_asks_for_a_rank_per_bundle():
    """kvserve/deployments/serve_config_pipeline.yaml (two stages of four GPUs): Serve's schema takes it,
    and the replica asks for 8 one-GPU bundles, PACKed (stage 0 fills a node, stage 1 the next),
    the replica's own CPU in rank 0's bundle."""
    from ray.serve.schema import ServeDeploySchema

    from kvserve.deployments.app import AppArgs, llm_deployment_options

    data = yaml.safe_load((ROOT / "kvserve" / "deployments" / "serve_config_pipeline.yaml").read_text())
    app = ServeDeploySchema.model_validate(data).applications[0]
    m = AppArgs.model_validate(app.args).model_list()[0]
    assert (m.tensor_parallel_size, m.pipeline_parallel_size, m.num_ranks) == (4, 2, 8)
    opts = llm_deployment_options(m, "LLMServer")
    assert opts["placement_group_strategy"] == "PACK"
    assert opts["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}] + [{"CPU": 1.0, "GPU": 1.0}] * 7
    with pytest.raises(ValidationError, match="max_replicas_per_node"):
        AppArgs.model_validate({**app.args, "tensor_parallel_size": 1, "max_replicas_per_node": 1})


def test_replica_resources_tie_replicas_to_a_node_type():
    from kvserve.deployments.app import llm_deployment_options
    from kvserve.deployments.args import ModelArgs

    one = llm_deployment_options(ModelArgs(replica_resources={"node-type-a": 1}), "LLMServer")
    assert one["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0, "resources": {"node-type-a": 1}}
    tp = llm_deployment_options(ModelArgs(tensor_parallel_size=2, replica_resources={"node-type-a": 1}), "LLMServer")
    assert tp["placement_group_bundles"] == [{"CPU": 2.0, "node-type-a": 1}, {"CPU": 1.0}]  # the replica's bundle
    assert tp["ray_actor_options"]["resources"] == {"node-type-a": 1}


def test_app_args_and_deployment_options():
    from kvserve.deployments.app import AppArgs, llm_deployment_options

    with pytest.raises(ValidationError):
        AppArgs(num_replicas=2, max_replicas=4)
    with pytest.raises(ValidationError):
        AppArgs(unknown_field=1)
    with pytest.raises(ValidationError):
        AppArgs(models=[{"model": "a"}, {"model": "a"}])
    assert AppArgs(api_keys="k1, k2").gateway.api_keys == ["k1", "k2"]  # the flat form, into its section

    m = AppArgs(tensor_parallel_size=2).model_list()[0]
    o = llm_deployment_options(m, "LLMServer")
    assert o["placement_group_strategy"] == "STRICT_PACK"
    assert o["placement_group_bundles"] == [{"CPU": 2.0}, {"CPU": 1.0}]
    assert o["ray_actor_options"]["num_cpus"] == 1.0
    assert o["max_ongoing_requests"] >= 64

    gpu = llm_deployment_options(AppArgs(tensor_parallel_size=4, device="cuda").model_list()[0], "x")
    assert [b["GPU"] for b in gpu["placement_group_bundles"]] == [1.0] * 4
    one_gpu = llm_deployment_options(AppArgs(device="cuda").model_list()[0], "x")
    assert one_gpu["ray_actor_options"]["num_gpus"] == 1 and "placement_group_bundles" not in one_gpu

    from ray.serve.config import AutoscalingConfig

    # the default deployment autoscales with kvserve's policy, a warm pool of 1 up to 8
    default = llm_deployment_options(AppArgs().model_list()[0], "x")
    assert default["num_replicas"] == "auto"
    ac = AutoscalingConfig(**default["autoscaling_config"])
    assert ac.policy.policy_function == "kvserve.autoscaling.policy:KVServeAutoscalingPolicy"
    assert (ac.min_replicas, ac.max_replicas) == (1, 8)
    assert ac.policy.policy_kwargs["min_replicas"] == 1 and ac.policy.policy_kwargs["max_replicas"] == 8

    auto = llm_deployment_options(
        AppArgs(min_replicas=2, max_replicas=3, autoscaling={"target_utilization": 0.5}).model_list()[0], "x"
    )
    ac = AutoscalingConfig(**auto["autoscaling_config"])
    assert (ac.min_replicas, ac.max_replicas) == (2, 3)
    assert ac.policy.policy_kwargs["target_utilization"] == 0.5

    fixed = llm_deployment_options(AppArgs(num_replicas=2).model_list()[0], "x")
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed


def test_cli_flags_to_app_args(tmp_path):
    from kvserve.deployments.cli import app_args_from_cli, build_parser

    p = build_parser()
    a = app_args_from_cli(
        p.parse_args(
            [
                "serve",
                "--model",
                "/m",
                "--tensor-parallel-size",
                "2",
                "--num-replicas",
                "3",
                "--max-num-seqs",
                "16",
                "--port",
                "9000",
            ]
        )
    )
    assert a == {"model": "/m", "tensor_parallel_size": 2, "num_replicas": 3, "max_num_seqs": 16}
    a = app_args_from_cli(p.parse_args(["serve", "--min-replicas", "1", "--max-replicas", "4"]))
    assert a["min_replicas"] == 1 and a["max_replicas"] == 4 and "num_replicas" not in a
    a = app_args_from_cli(
        p.parse_args(
            [
                "serve",
                "--config",
                str(ROOT / "kvserve" / "deployments" / "serve_config.yaml"),
                "--max-num-seqs",
                "8",
                "--api-key",
                "k",
            ]
        )
    )
    assert a["max_num_seqs"] == 8 and a["tensor_parallel_size"] == 1 and a["api_keys"] == ["k"]
    plain = tmp_path / "args.yaml"
    plain.write_text("model: /x\nmax_replicas: 2\n")
    assert app_args_from_cli(p.parse_args(["serve", "--config", str(plain)])) == {"model": "/x", "max_replicas": 2}
    with pytest.raises(SystemExit):
        app_args_from_cli(p.parse_args(["serve", "--num-replicas", "2", "--max-replicas", "3"]))
    spec = '{"method": "ngram", "num_speculative_tokens": 3}'
    a = app_args_from_cli(p.parse_args(["serve", "--speculative-config", spec]))
    assert a["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    for bad in ("{not json", "[1, 2]"):
        with pytest.raises(SystemExit):
            p.parse_args(["serve", "--speculative-config", bad])


def test_cli_generate_runs_engine_without_ray(tiny_llama_path):
    code = (
        "import sys, json; from kvserve.deployments.cli import main; "
        f"main(['generate', '--prompt', 'hello', '--model', {str(tiny_llama_path)!r}, '--max-tokens', '5', "
        "'--json']); assert 'ray' not in sys.modules, 'kvserve generate imported ray'"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["token_ids"]) <= 5 and out["finish_reason"] in ("stop", "length")


def test_protocol_models():
    from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest
    from kvserve.deployments.contract.types import finish_reason

    r = ChatCompletionRequest.model_validate(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
            "max_tokens": 5,
            "max_completion_tokens": 7,
            "logprobs": True,
            "top_logprobs": 3,
            "top_k": 5,
            "user": "u",
            "some_future_field": 1,
        }
    )
    assert r.effective_max_tokens == 7 and r.num_logprobs == 3
    assert r.messages[0].to_template() == {"role": "user", "content": "ab"}
    params = r.to_sampling_params(r.effective_max_tokens, r.num_logprobs)  # the engine's own type
    from kvserve.engine.sampling_params import SamplingParams

    assert isinstance(params, SamplingParams)
    assert params.max_tokens == 7 and params.top_k == 5 and params.logprobs == 3 and params.temperature == 1.0
    for bad in (
        {"messages": []},
        {"messages": [{"role": "user", "content": "x"}], "n": 0},
        {"messages": [{"role": "user", "content": "x"}], "n": 129},
        {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"x": 1}},
        {"messages": [{"role": "user", "content": "x"}], "guided_regex": "a", "guided_choice": ["a"]},
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
        {"messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}},
    ):
        with pytest.raises(ValidationError):
            ChatCompletionRequest.model_validate(bad)
    msg = [{"role": "user", "content": "x"}]
    specs = {
        "json_object": {"response_format": {"type": "json_object"}},
        "guided_regex": {"guided_regex": "a+"},
        "flexible": {"structured_outputs": {"json": {"type": "object"}, "whitespace_flexible": True}},
    }
    got = {
        k: ChatCompletionRequest(messages=msg, **v).to_sampling_params(4, None).structured_outputs
        for k, v in specs.items()
    }
    assert got == {
        "json_object": {"json_object": True},
        "guided_regex": {"regex": "a+"},
        "flexible": {"json": {"type": "object"}, "whitespace_flexible": True},
    }
    for v in got.values():
        SamplingParams(**{"structured_outputs": v})  # the engine takes each as it is
    assert CompletionRequest(prompt=[1, 2, 3]).prompts() == [[1, 2, 3]]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == ["a", "b"]
    assert CompletionRequest(prompt="a").max_tokens == 16
    assert finish_reason("abort") == "stop" and finish_reason("length") == "length"


def test_step_stats_capacity_only_from_full_steps():
    from kvserve.deployments.replica.step_rates import StepRateTracker
    from kvserve.engine.stats import IterationStats

    def step(t0, t1, n_prefill, n_decode, n_sampled, batch):
        return IterationStats(t0, t1, n_prefill, n_decode, n_sampled, batch, num_waiting=0)

    s = StepRateTracker(max_num_seqs=8, max_num_batched_tokens=100)
    t = 1000.0
    s.created = t - 20
    # small decode batches: rates but no capacity yet
    for i in range(10):
        s.record(step(t + i * 0.1, t + i * 0.1 + 0.05, 0, 1, 1, 1))
    import time as _time

    real = _time.monotonic
    try:
        _time.monotonic = lambda: t + 1.0
        r = s.snapshot()
        assert r.decode_capacity_tokens_per_s == 0.0 and r.generation_tokens_per_s > 0
        # full decode steps (batch 8, back to back, 0.1 s each): 80 tok/s
        for i in range(5):
            s.record(step(t + 2 + i * 0.1, t + 2 + (i + 1) * 0.1, 0, 8, 8, 8))
        # a full prefill step: 100 tokens in 0.5 s
        s.record(step(t + 3, t + 3.5, 100, 0, 1, 1))
        _time.monotonic = lambda: t + 4.0
        r = s.snapshot()
        assert r.decode_capacity_tokens_per_s == pytest.approx(80, rel=0.05)
        assert r.prefill_capacity_tokens_per_s == pytest.approx(200, rel=0.05)
        _time.monotonic = lambda: t + 100.0  # nothing recent: keep the last measured capacity
        r = s.snapshot()
        assert r.decode_capacity_tokens_per_s == pytest.approx(80, rel=0.05)
        assert r.generation_tokens_per_s == 0.0
    finally:
        _time.monotonic = real


def test_step_stats_mean_prompt_of_the_requests_served():
    # the autoscaler prices a refused request (whose prompt nobody tokenized) at this mean
    from kvserve.deployments.replica.step_rates import CAPACITY_WINDOW_S, StepRateTracker
    from kvserve.engine.stats import IterationStats

    s = StepRateTracker(max_num_seqs=8, max_num_batched_tokens=512)
    t = 1000.0
    s.created = t - 40
    # a 300-token prompt in two chunks (first token in the second step), then two 100-token ones
    s.record(IterationStats(t, t + 0.1, 256, 0, 0, 1, num_waiting=0))
    s.record(
        IterationStats(t + 0.1, t + 0.2, 44, 0, 1, 1, num_waiting=0, num_prompt_tokens=300, time_to_first_tokens=[0.2])
    )
    s.record(
        IterationStats(
            t + 0.2, t + 0.3, 200, 1, 3, 3, num_waiting=0, num_prompt_tokens=200, time_to_first_tokens=[0.1, 0.1]
        )
    )
    import time as _time

    real = _time.monotonic
    try:
        _time.monotonic = lambda: t + 1.0
        assert s.snapshot().served_prompt_tokens == pytest.approx(500 / 3)
        _time.monotonic = lambda: t + 1.0 + CAPACITY_WINDOW_S  # nobody served recently
        assert s.snapshot().served_prompt_tokens == 0.0
    finally:
        _time.monotonic = real


def _imports(pkg: str) -> set[str]:
    """Top-level names ``kvserve/<pkg>/`` imports; a project package by its name under kvserve."""

    def top(name: str) -> str:
        parts = name.split(".")
        return parts[1] if parts[0] == "kvserve" and len(parts) > 1 else parts[0]

    mods = set()
    for f in (ROOT / "kvserve" / pkg).rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                mods.update(top(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods.add(top(node.module))
    return mods


def test_import_rules():
    assert "kernels" in _imports("engine")  # the names are read: a project import counts
    assert "ray" not in _imports("engine") and "deployments" not in _imports("engine")
    assert "deployments" not in _imports("cluster")


def test_fit_single_node_caps_only_the_default_bound():
    from kvserve.deployments.app import AppArgs, fit_single_node

    cpu = fit_single_node(AppArgs(device="cpu"), num_gpus=0).model_list()[0]
    assert cpu.autoscaling_knobs()["max_replicas"] == 1  # one CPU engine uses every core
    gpus = fit_single_node(AppArgs(tensor_parallel_size=2), num_gpus=8).model_list()[0]
    assert gpus.autoscaling_knobs()["max_replicas"] == 4  # device auto with GPUs: 8 // TP 2
    assert fit_single_node(AppArgs(max_replicas=6), num_gpus=0).model_list()[0].max_replicas == 6
    assert fit_single_node(AppArgs(num_replicas=3), num_gpus=0).model_list()[0].num_replicas == 3
    assert fit_single_node(AppArgs(min_replicas=2), num_gpus=0).model_list()[0].max_replicas == 2
    floor = fit_single_node(AppArgs(autoscaling={"min_replicas": 3}), num_gpus=0).model_list()[0]
    assert floor.autoscaling_knobs()["max_replicas"] == 3
    both = fit_single_node(
        AppArgs(models=[{"model": "a", "device": "cuda"}, {"model": "b", "max_replicas": 5}], api_keys=["k"]),
        num_gpus=3,
    )
    assert [m.autoscaling_knobs()["max_replicas"] for m in both.model_list()] == [3, 5]
    assert both.gateway.api_keys == ["k"]


def test_api_keys_from_env_or_file_and_masked_in_the_banner(tmp_path, monkeypatch):
    """Keys need never be on a command line (visible in `ps`): $KVSERVE_API_KEYS or a key
    file; the banner's curl line shows a masked key."""
    from kvserve.deployments.app import AppArgs
    from kvserve.deployments.cli import _curl_line
    from kvserve.deployments.gateway.gate import bearer_token
    from kvserve.deployments.limits import find_policy, policies_from_keys

    monkeypatch.setenv("KVSERVE_API_KEYS", "sk-env-one, sk-env-two")
    assert AppArgs.model_validate({}).gateway.api_keys == ["sk-env-one", "sk-env-two"]
    assert AppArgs.model_validate({"api_keys": ["sk-flag"]}).gateway.api_keys == ["sk-flag"]  # explicit wins
    monkeypatch.delenv("KVSERVE_API_KEYS")
    assert AppArgs.model_validate({}).gateway.api_keys is None
    f = tmp_path / "keys"
    f.write_text("# team keys\nsk-file-secret-1\n\nsk-file-secret-2\n")
    assert AppArgs.model_validate({"api_keys_file": str(f)}).gateway.api_keys == [
        "sk-file-secret-1",
        "sk-file-secret-2",
    ]
    with pytest.raises(ValidationError, match="api_keys_file"):
        AppArgs.model_validate({"api_keys_file": str(tmp_path / "missing")})
    line = _curl_line("http://127.0.0.1:8000/v1", "m", "sk-file-secret-1")
    assert "sk-file-secret-1" not in line and "Bearer sk-f..." in line
    policies = policies_from_keys(["sk-a", "sk-\u00e9"])

    def key_matches(header: bytes) -> bool:  # what the gate does with a header
        token = bearer_token(header)
        return bool(token) and find_policy(token, policies) is not None

    assert key_matches(b"Bearer sk-a") and key_matches(b"bearer  sk-a ")
    assert key_matches("Bearer sk-\u00e9".encode())
    assert not any(
        key_matches(h)
        for h in (b"", b"Bearer", b"Basic sk-a", b"Bearer sk-", b"sk-a", "Bearer \u043a".encode(), b"Bearer \xff\xfe")
    )


def test_engine_settings_have_one_source():
    """Every EngineConfig field is a ModelArgs field (same default unless SERVING_ENGINE_DEFAULTS
    says otherwise, with a reason) and a `kvserve serve` flag; nothing else claims to be one."""
    from dataclasses import fields

    from kvserve.deployments.args import ENGINE_FIELDS, SERVING_ENGINE_DEFAULTS, ModelArgs
    from kvserve.deployments.cli import build_parser
    from kvserve.engine.config import EngineConfig

    names = [f.name for f in fields(EngineConfig)]
    assert list(ENGINE_FIELDS) == names
    for f in fields(EngineConfig):
        want = SERVING_ENGINE_DEFAULTS[f.name][0] if f.name in SERVING_ENGINE_DEFAULTS else f.default
        assert ModelArgs.model_fields[f.name].default == want, f.name
        assert f.metadata["help"] and f.metadata["help"] in ModelArgs.model_fields[f.name].description
    assert all(why for _default, why in SERVING_ENGINE_DEFAULTS.values())
    serve = next(a for a in build_parser()._subparsers._group_actions[0].choices.values() if a.prog.endswith("serve"))
    dests = {a.dest for a in serve._actions}
    assert set(names) <= dests, set(names) - dests
    # a flag reaches the engine config unchanged
    args = serve.parse_args(
        [
            "--max-num-seqs",
            "7",
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--gpu-memory-utilization",
            "0.5",
        ]
    )
    from kvserve.deployments.cli import app_args_from_cli

    m = ModelArgs.model_validate({k: v for k, v in app_args_from_cli(args).items()})
    cfg = EngineConfig(**m.engine_args())
    assert (cfg.max_num_seqs, cfg.enable_prefix_caching, cfg.scheduling_policy, cfg.gpu_memory_utilization) == (
        7,
        False,
        "priority",
        0.5,
    )
    with pytest.raises(ValidationError, match="block_size"):  # the engine's own checks run at validation
        ModelArgs.model_validate({"block_size": 0})


def test_front_ends_load_no_torch():
    """The HTTP process (gateway), the args and the CLI parser import neither torch nor the model code."""
    code = (
        "import sys; import kvserve.deployments.gateway.deployment, kvserve.deployments.args, kvserve.engine.config, kvserve.engine, kvserve.cluster; "
        "from kvserve.deployments.cli import build_parser; build_parser(); "
        "bad = [m for m in ('torch', 'transformers', 'kvserve.engine.model_runner') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
