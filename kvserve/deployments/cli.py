"""The ``kvserve`` command.

``kvserve generate --prompt ...``  runs the engine in this process (no Ray) and prints the text.
``kvserve serve [flags]``           starts (or joins) Ray, deploys the kvserve Serve application,
                                    prints the base URL and a curl line, serves until Ctrl-C.
``kvserve experiment report NAME``  compares an A/B test's variants (``set-weights``, ``list`` too).
``kvserve warm --log DIR``          warms the caches from the request log (off-peak with ``--schedule``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
import types
import typing
import warnings

from kvserve.autoscaling.policy import KVServeAutoscalingConfig, add_autoscaling_args
from kvserve.autoscaling.schedule import low_traffic_now, parse_schedule, seconds_until_low_traffic
from kvserve.cluster import set_local_ray_env
from kvserve.deployments.args import APP_NAME, AppArgs, ModelArgs, app_args_from_config
from kvserve.deployments.contract.adapters import parse_lora_module
from kvserve.deployments.contract.config import RENAMED_MODEL_KEYS
from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.gate import mask_key
from kvserve.deployments.operator import experiment_report as xr
from kvserve.deployments.operator import warm
from kvserve.deployments.operator.startup import StartupFailed, deploy_and_wait


# ---- generate (engine only) ------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    from kvserve.engine import LLM, SamplingParams

    llm = LLM(model=args.model, max_num_seqs=8)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    if args.chat:
        outs = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(args.prompt, params, use_tqdm=False)
    out = outs[0].outputs[0]
    if args.json:
        print(json.dumps({"text": out.text, "finish_reason": out.finish_reason, "token_ids": out.token_ids}))
    else:
        print(out.text)
    return 0


# ---- serve --------------------------------------------------------------------------------
#: ModelArgs fields that are not plain flags (the autoscaling section has flags of its own).
_NOT_FLAGS = {"autoscaling", "min_replicas", "max_replicas"}
#: AppArgs fields that are plain flags too (the response caches, kvserve/deployments/cache/; the embedding model).
_APP_FLAGS = (
    "response_cache",
    "cache_backend",
    "cache_ttl_s",
    "cache_max_entries",
    "cache_max_bytes",
    "cache_shared_across_keys",
    "semantic_cache",
    "semantic_cache_threshold",
    "semantic_cache_max_entries",
    "redis_url",
    "embedding_model",
    "embedding_served_name",
    "replica_channels",
    "otlp_traces_endpoint",
    "otlp_traces_protocol",
    "otlp_traces_sample_ratio",
    "request_log_dir",
    "request_log_prompts",
    "request_log_max_bytes",
    "request_log_backups",
)


def _flag(name: str) -> str:
    """The flag of a setting, without its dashes (``max_waiting_requests``: ``max-waiting-requests``)."""
    return name.replace("_", "-")


def _json_object(text: str) -> dict:
    """argparse type of a dict flag (e.g. ``--speculative-config '{"method": "ngram", ...}'``)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {type(value).__name__}")
    return value


def _model_flags() -> list[tuple[str, str, dict]]:
    """``(flag, dest, argparse kwargs)`` for every field of :class:`kvserve.deployments.args.ModelArgs`:
    the engine's settings (generated from ``engine.EngineConfig``) and the deployment's.
    ``--x`` / ``--no-x`` for booleans, choices for literals; default None = "not given" (the
    args model's own default applies)."""
    out = []
    flat = AppArgs.flat_fields()
    fields = list(ModelArgs.model_fields.items()) + [(n, flat[n]) for n in _APP_FLAGS]
    for name, f in fields:
        if name in _NOT_FLAGS:
            continue
        typ = f.annotation
        args = (
            [a for a in typing.get_args(typ) if a is not type(None)]
            if typing.get_origin(typ) in (typing.Union, types.UnionType)
            else [typ]
        )
        typ = args[0]
        kw: dict = {"default": None, "help": f"{f.description or ''} (default: {f.default})".strip()}
        if typ is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(typ) is typing.Literal:
            kw["choices"] = list(typing.get_args(typ))
        elif name == "lora_modules":  # vLLM's form: --lora-modules name=path [name=path ...]
            kw.update(type=parse_lora_module, nargs="+", metavar="NAME=PATH")
        elif typ is dict or typing.get_origin(typ) is dict:
            kw["type"], kw["metavar"] = _json_object, "JSON"
        else:
            kw["type"] = typ
        out.append(("--" + name.replace("_", "-"), name, kw))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kvserve", description="kvserve: an LLM serving cluster on Ray Serve")
    sub = ap.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate with the engine in this process (no Ray)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--chat", action="store_true", help="apply the chat template to the prompt (one user turn)")
    g.add_argument("--json", action="store_true", help="print a JSON object instead of the text")
    g.set_defaults(func=cmd_generate)

    s = sub.add_parser("serve", help="serve the OpenAI API on Ray Serve until Ctrl-C")
    s.add_argument(
        "--config",
        default=None,
        help="Serve config YAML (e.g. kvserve/deployments/serve_config.yaml) or a YAML of app args; "
        "flags override its args",
    )
    s.add_argument(
        "--address",
        default=None,
        help="join a Ray cluster ('auto', 'ray://host:10001', host:port) instead of starting one "
        "(without it, a new instance starts even where RAY_ADDRESS is set); "
        "needs the cluster's Ray auth token here (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH or "
        "~/.ray/auth_token; `ray get-auth-token` on the head prints it)",
    )
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--name", default=None, help="Serve application name (default kvserve)")
    s.add_argument("--route-prefix", default="/")
    s.add_argument("--num-cpus", type=int, default=None, help="logical CPUs of a local Ray instance")
    s.add_argument(
        "--deploy-timeout-s",
        type=float,
        default=1800.0,
        help="seconds for every model to load and its replicas to start; past it, or as soon "
        "as Serve gives up on a replica that cannot start, kvserve exits non-zero with the "
        "replica's error (0: wait as long as Serve retries; default %(default)g)",
    )
    s.add_argument(
        "--api-key",
        action="append",
        default=None,
        dest="api_keys",
        help="require 'Authorization: Bearer <key>' (repeatable; a flag shows in `ps`: "
        "prefer $KVSERVE_API_KEYS or --api-keys-file)",
    )
    s.add_argument(
        "--api-key-file",
        "--api-keys-file",
        default=None,
        dest="api_keys_file",
        help="file with one API key per line (owner-only permissions recommended)",
    )
    s.add_argument(
        "--admin-api-key",
        action="append",
        default=None,
        dest="admin_api_keys",
        help="a key of the admin endpoints: DELETE /v1/cache, POST /v1/load_lora_adapter and "
        "/v1/unload_lora_adapter (repeatable; a flag shows in `ps`: prefer $KVSERVE_ADMIN_API_KEYS)",
    )
    s.add_argument(
        "--lora-allowed-root",
        action="append",
        default=None,
        dest="lora_allowed_roots",
        metavar="DIR",
        help="POST /v1/load_lora_adapter may read adapters under DIR (repeatable; "
        "symlinks and '..' resolved); without one, loading at run time is off",
    )
    s.add_argument(
        "--upstream-url",
        default=None,
        help="OpenAI-compatible base URL (e.g. https://host/v1) that takes requests every local replica "
        "refuses (capacity, failure); its key from $KVSERVE_UPSTREAM_API_KEY. Model routing "
        "(model 'auto') and upstream model names: --config (docs/serving.md, 'Model routing')",
    )
    s.add_argument(
        "--allowed-origins",
        default=None,
        help="CORS: comma-separated origins whose browser pages may call the API (default: '*' with "
        "API keys, none without; '' turns CORS off)",
    )
    flags = _model_flags()
    for flag, dest, kw in flags:  # engine and deployment settings, from ModelArgs
        s.add_argument(flag, dest=dest, **kw)
    for old, new in RENAMED_MODEL_KEYS.items():  # the old names of renamed settings still work (with a warning)
        kw = next(dict(k) for _, d, k in flags if d == new)
        s.add_argument("--" + old.replace("_", "-"), dest=old, **{**kw, "help": f"deprecated: --{_flag(new)}"})
    add_autoscaling_args(s)  # --min-replicas, --max-replicas and the policy's knobs
    s.set_defaults(func=cmd_serve)

    b = sub.add_parser(
        "run-batch", help="run an OpenAI batch file offline with the engine in this process (vLLM's run-batch; no Ray)"
    )
    b.add_argument("-i", "--input-file", required=True, help="OpenAI batch JSONL: custom_id, method, url, body")
    b.add_argument("-o", "--output-file", required=True, help="where the output lines go (- for stdout)")
    b.add_argument("--config", default=None, help="Serve config or app args YAML, as for serve (flags override)")
    b.add_argument("--name", default=None, help=argparse.SUPPRESS)
    b.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default 16)")
    for flag, dest, kw in flags:
        b.add_argument(flag, dest=dest, **kw)
    b.set_defaults(
        func=cmd_run_batch,
        api_keys=None,
        api_keys_file=None,
        admin_api_keys=None,
        lora_allowed_roots=None,
        upstream_url=None,
        allowed_origins=None,
        num_replicas=None,
    )

    x = sub.add_parser("experiment", help="A/B tests of configurations: report, set weights, list")
    xs = x.add_subparsers(dest="experiment_command", required=True)
    for verb, helptext in (
        ("report", "compare an experiment's variants (bootstrap intervals and verdicts)"),
        ("set-weights", "change an experiment's traffic weights (no restart)"),
        ("list", "the experiments and their live weights"),
    ):
        p = xs.add_parser(verb, help=helptext)
        if verb != "list":
            p.add_argument("name", help="the experiment's name")
        if verb == "set-weights":
            p.add_argument("weights", nargs="+", metavar="VARIANT=WEIGHT", help="e.g. control=90 batch16=10")
        p.add_argument(
            "--url",
            default=os.environ.get("KVSERVE_URL", "http://127.0.0.1:8000"),
            help="the gateway's base URL (default $KVSERVE_URL or http://127.0.0.1:8000)",
        )
        p.add_argument(
            "--admin-key",
            default=None,
            help="an admin key (default $KVSERVE_ADMIN_API_KEY, or the first of $KVSERVE_ADMIN_API_KEYS)",
        )
        if verb == "report":
            p.add_argument(
                "--since",
                type=float,
                default=None,
                help="only requests that ended in the last SINCE seconds (default: all the gateway kept)",
            )
            p.add_argument(
                "--confidence",
                type=float,
                default=0.95,
                help="family-wise confidence of the verdicts (Bonferroni; default 0.95)",
            )
            p.add_argument(
                "--min-effect",
                type=float,
                default=0.05,
                help="smallest difference reported (relative, or absolute for rates; default 0.05)",
            )
            p.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
            p.add_argument("--json", action="store_true", help="print the report as JSON")
            p.add_argument(
                "--input",
                default=None,
                help="read the experiment's samples from this JSON file (what GET /v1/experiments/NAME "
                "gave) instead of the gateway",
            )
        p.set_defaults(func=cmd_experiment)
    add_warm_parser(sub)
    return ap


def add_warm_parser(sub) -> None:
    """``kvserve warm``'s flags (kvserve/deployments/operator/warm.py)."""
    w = sub.add_parser("warm", help="warm the response caches (and prefix caches) from the request log, off-peak")
    w.add_argument("--log", required=True, metavar="DIR", help="the request log's folder (request_log_dir)")
    w.add_argument(
        "--url",
        default=os.environ.get("KVSERVE_URL", "http://127.0.0.1:8000"),
        help="the gateway's base URL (default $KVSERVE_URL or http://127.0.0.1:8000)",
    )
    w.add_argument(
        "--admin-key",
        default=None,
        help="an admin key (default $KVSERVE_ADMIN_API_KEY, or the first of $KVSERVE_ADMIN_API_KEYS)",
    )
    w.add_argument("--since-hours", type=float, default=24.0, help="requests of the last this many hours (default 24)")
    w.add_argument("--top", type=int, default=100, help="most frequent cacheable requests replayed (default 100)")
    w.add_argument("--min-count", type=int, default=2, help="seen at least this often (default 2)")
    w.add_argument(
        "--top-system",
        type=int,
        default=10,
        help="most frequent shared system prompts prefilled into a replica's prefix cache (default 10)",
    )
    w.add_argument("--model", action="append", default=None, help="only this served model (repeatable)")
    w.add_argument("--rate", type=float, default=2.0, help="requests per second at most (default 2)")
    w.add_argument("--concurrency", type=int, default=1, help="requests at once (default 1)")
    w.add_argument("--retries", type=int, default=5, help="tries of a request deferred by live traffic (default 5)")
    w.add_argument("--dry-run", action="store_true", help="print the plan, send nothing")
    w.add_argument(
        "--schedule",
        default=None,
        metavar="SPEC",
        help="run in this schedule's low-traffic windows (the autoscaling schedule's syntax, e.g. "
        "'8-20:4,22-6:1': the hours with the lowest floor), once per window, until stopped",
    )
    w.add_argument("--timezone", default="UTC", help="the schedule's time zone (default UTC)")
    w.set_defaults(func=cmd_warm)


def cmd_warm(args: argparse.Namespace) -> int:
    """``kvserve warm`` (kvserve/deployments/operator/warm.py)."""
    import asyncio

    key = _admin_key(args.admin_key)
    if not key and not args.dry_run:
        print("kvserve warm: an admin key is needed (--admin-key or $KVSERVE_ADMIN_API_KEY)", file=sys.stderr)
        return 2
    schedule = parse_schedule(args.schedule) if args.schedule else ()
    if args.schedule and not schedule:
        print("kvserve warm: --schedule has no entry", file=sys.stderr)
        return 2

    def once() -> int:
        try:
            lines = warm.read_log(args.log, time.time() - args.since_hours * 3600.0)
        except FileNotFoundError as e:
            print(f"kvserve warm: {e}", file=sys.stderr)
            return 1
        p = warm.plan(lines, args.top, args.min_count, args.top_system, set(args.model) if args.model else None)
        if p.lines and not p.stored:
            print(
                "kvserve warm: the request log holds fingerprints only (request_log_prompts: hash); set "
                "request_log_prompts: store to warm from it",
                file=sys.stderr,
            )
            return 1
        summary = {
            "log_lines": p.lines,
            "distinct_requests": p.distinct,
            "requests": len(p.requests),
            "system_prompts": len(p.prefixes),
        }
        if not args.dry_run:
            summary.update(asyncio.run(warm.replay(p, args.url, key, args.rate, args.concurrency, args.retries)))
        print(json.dumps(summary))
        return 0

    if not schedule:
        return once()
    while True:  # one run per low-traffic window
        wait = seconds_until_low_traffic(schedule, time.time(), args.timezone)
        if wait:
            time.sleep(wait)
        once()
        while low_traffic_now(schedule, time.time(), args.timezone):
            time.sleep(60)


def _admin_key(given: str | None) -> str | None:
    if given:
        return given
    if os.environ.get("KVSERVE_ADMIN_API_KEY"):
        return os.environ["KVSERVE_ADMIN_API_KEY"]
    keys = [k.strip() for k in os.environ.get("KVSERVE_ADMIN_API_KEYS", "").split(",") if k.strip()]
    return keys[0] if keys else None


def cmd_experiment(args: argparse.Namespace) -> int:
    """``kvserve experiment report | set-weights | list`` (kvserve/deployments/operator/experiment_report.py)."""
    import httpx

    key = _admin_key(args.admin_key)
    try:
        if args.experiment_command == "list":
            for e in xr.list_experiments(args.url, key):
                print(
                    f"{e['name']}: model {e['model']}, sticky {e['sticky']}, weights {e['weights']}, "
                    f"differences {e['differences']}"
                )
            return 0
        if args.experiment_command == "set-weights":
            weights = {}
            for item in args.weights:
                name, sep, value = item.partition("=")
                if not sep:
                    raise SystemExit(f"kvserve experiment set-weights: expected VARIANT=WEIGHT, got {item!r}")
                weights[name] = float(value)
            out = xr.set_weights(args.url, args.name, weights, key)
            print(f"{out['name']}: weights now {out['weights']}")
            return 0
        if args.input:
            with open(args.input) as f:
                data = json.load(f)
        else:
            since = None if args.since is None else time.time() - args.since
            data = xr.fetch(args.url, args.name, key, since)
        report = xr.analyse(data, confidence=args.confidence, min_effect=args.min_effect, n_boot=args.bootstrap)
        print(json.dumps(report, indent=2) if args.json else xr.render(report))
        return 0
    except (RuntimeError, httpx.HTTPError, ValueError) as e:
        print(f"kvserve experiment {args.experiment_command}: {e}", file=sys.stderr)
        return 1


def cmd_run_batch(args: argparse.Namespace) -> int:
    """``kvserve run-batch``: every request of ``--input-file`` through the gateway over the
    engine in this process; the counts go to stderr. Exit 1 for an invalid input file."""
    from kvserve.deployments.local import run_batch

    app_args = AppArgs.model_validate(app_args_from_cli(args))
    try:
        counts = asyncio.run(run_batch(app_args, args.input_file, args.output_file, args.concurrency))
    except OpenAIError as e:
        print(f"kvserve run-batch: {e.message}", file=sys.stderr)
        for err in getattr(e, "errors", [])[1:]:
            print(f"  line {err['line']}: {err['message']}", file=sys.stderr)
        return 1
    print(
        f"kvserve run-batch: {counts['completed']} of {counts['total']} requests answered, {counts['failed']} "
        f"failed, in {counts['seconds']} s",
        file=sys.stderr,
    )
    return 0


def app_args_from_cli(args: argparse.Namespace) -> dict:
    """AppArgs (as a dict) from ``--config`` and the flags (flags win)."""
    app_args: dict = {}
    if args.config:
        app_args = app_args_from_config(args.config, args.name or APP_NAME)
    for _f, dest, _kw in _model_flags():
        v = getattr(args, dest, None)
        if v is not None:
            app_args[dest] = dict(v) if dest == "lora_modules" else v
    for old, new in RENAMED_MODEL_KEYS.items():
        v = getattr(args, old, None)
        if v is not None and getattr(args, new, None) is None:
            warnings.warn(f"--{_flag(old)} is deprecated, it is now --{_flag(new)}", FutureWarning, stacklevel=2)
            app_args.pop(old, None)
            app_args[new] = v
    if args.api_keys:
        app_args["api_keys"] = args.api_keys
    if args.api_keys_file:
        app_args["api_keys_file"] = args.api_keys_file
    if args.admin_api_keys:
        app_args["admin_api_keys"] = args.admin_api_keys
    if args.lora_allowed_roots:
        app_args["lora_allowed_roots"] = [os.path.abspath(r) for r in args.lora_allowed_roots]
    if args.upstream_url:
        app_args["upstream"] = {**(app_args.get("upstream") or {}), "base_url": args.upstream_url}
    if args.allowed_origins is not None:
        app_args["allowed_origins"] = [o.strip() for o in args.allowed_origins.split(",") if o.strip()]
    knobs = {
        k[len("autoscaling_") :]: v for k, v in vars(args).items() if k.startswith("autoscaling_") and v is not None
    }
    if knobs:
        if "num_replicas" in app_args and args.num_replicas is not None:
            raise SystemExit("kvserve serve: give either --num-replicas or autoscaling flags, not both")
        app_args.pop("num_replicas", None)
        auto = dict(app_args.get("autoscaling") or {})
        for bound in ("min_replicas", "max_replicas"):
            if bound in knobs:
                app_args[bound] = knobs.pop(bound)
        auto.update(knobs)
        if auto:
            app_args["autoscaling"] = auto
    return app_args


def _curl_line(base_url: str, model: str, api_key: str | None) -> str:
    """The banner's example request; a key shows masked (banners end up in logs)."""
    auth = f" -H 'Authorization: Bearer {mask_key(api_key)}'" if api_key else ""
    body = json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32,
            "temperature": 0,
        }
    )
    return f"curl {base_url}/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'"


def _ray_access_line(auth, started_ray: bool) -> str:
    """How this Ray instance is protected, and how another driver on this machine joins it."""
    import ray

    from kvserve.cluster.ray_auth import default_token_path

    line = f"Ray: {auth.describe()}"
    if started_ray:
        gcs = ray.get_runtime_context().gcs_address
        where = "127.0.0.1 only" if auth.loopback else "all interfaces"
        line += f"; GCS {gcs}, control-plane ports on {where}.\nother Ray drivers on this machine join with: "
        env = [f"RAY_ADDRESS={gcs}"]
        if auth.loopback:
            env.insert(0, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0")
        if auth.mode == "token":
            env.insert(0, "RAY_AUTH_MODE=token")
            if auth.token_source not in (None, "RAY_AUTH_TOKEN", str(default_token_path())):
                env.insert(1, f"RAY_AUTH_TOKEN_PATH={auth.token_source}")
        line += " ".join(env) + " python your_driver.py"
    return line


def cmd_serve(args: argparse.Namespace) -> int:
    from kvserve.cluster.ray_auth import ensure_join_auth, ensure_local_auth, join_failure_message

    started_ray = args.address is None
    # Before anything imports ray (kvserve.deployments.app does): Ray reads these variables on import.
    if started_ray:
        # Ray's token auth on (RAY_AUTH_TOKEN, or a 0600 token file at RAY_AUTH_TOKEN_PATH /
        # ~/.ray/auth_token, created if missing) and the instance's ports on 127.0.0.1; an explicit
        # RAY_AUTH_MODE=disabled is kept, with a loud warning.
        auth = ensure_local_auth()
        # worker niceness 0 (Ray's default is 15), Serve's control loop and metrics flushes
        # slowed for an idle app that costs little (cluster.LOCAL_RAY_ENV)
        set_local_ray_env()
    else:
        auth = ensure_join_auth(address=args.address)  # SystemExit with what to do if no token is here
    from kvserve.deployments.app import APP_NAME, AppArgs, build_app, fit_single_node, logical_cpus_needed

    app_args = AppArgs.model_validate(app_args_from_cli(args))
    name = args.name or APP_NAME
    import ray
    from ray import serve

    init_kw = {"include_dashboard": False} if started_ray else {}
    if started_ray:
        # Logical CPUs are a scheduling budget (torch threads are set per engine process):
        # give a local instance at least what the app reserves, so e.g. TP=2 fits on 2 cores.
        need = int(logical_cpus_needed(app_args) + 0.999)
        init_kw["num_cpus"] = args.num_cpus or max(os.cpu_count() or 1, need)
    try:
        # without --address, always a new instance ("local"): not one that RAY_ADDRESS or the
        # last `ray start` names (Ray refuses a CPU count for those; --address joins a cluster)
        ray.init(address=args.address or "local", **init_kw)
    except Exception as e:  # ConnectionError, ray.exceptions.AuthenticationError, ...
        if started_ray:
            raise
        raise SystemExit(join_failure_message(args.address, auth, e)) from e
    if started_ray:  # no cluster to grow into: autoscale only as far as this machine holds
        app_args = fit_single_node(app_args, int(ray.cluster_resources().get("GPU", 0)))
    stopping = {"count": 0}
    failed = 0

    def _stop(signum, frame):
        stopping["count"] += 1
        if stopping["count"] == 2:  # a second Ctrl-C while draining: stop now
            print("kvserve: stopping now (in-flight requests are cut) ...", flush=True)
            raise KeyboardInterrupt
        if stopping["count"] > 2:
            return
        raise KeyboardInterrupt

    # Explicit handlers: Ctrl-C must work even where SIGINT was ignored at start (e.g. a
    # background job of a non-interactive shell), and SIGTERM must shut down the same way.
    signal.signal(signal.SIGINT, _stop)
    signal.signal(signal.SIGTERM, _stop)
    try:
        if args.host not in ("127.0.0.1", "localhost", "::1") and not app_args.gateway.api_keys:
            print(
                f"kvserve: WARNING: HTTP listens on {args.host} with no API key: anyone who reaches this "
                f"port can use the model (set KVSERVE_API_KEYS or --api-key-file)",
                file=sys.stderr,
                flush=True,
            )
        elif not app_args.gateway.api_keys:
            print(
                "kvserve: NOTE: no API key configured: open access for every process that reaches "
                f"{args.host}:{args.port} (set KVSERVE_API_KEYS or --api-key-file to require one)",
                file=sys.stderr,
                flush=True,
            )
        serve.start(http_options={"host": args.host, "port": args.port})
        route = args.route_prefix
        print(
            f"kvserve: deploying {', '.join(m.name for m in app_args.model_list())} (application {name!r}) ...",
            flush=True,
        )
        try:
            deploy_and_wait(build_app(app_args), name, route, args.deploy_timeout_s)
        except StartupFailed as e:
            print(f"kvserve: {e}\nkvserve: the replicas' logs: {SERVE_LOG_DIR}", file=sys.stderr, flush=True)
            failed = 1
            return 1
        host = "127.0.0.1" if args.host in ("0.0.0.0", "::") else args.host
        base_url = f"http://{host}:{args.port}{route.rstrip('/')}/v1"
        first = app_args.model_list()[0].name
        key = app_args.gateway.api_keys[0] if app_args.gateway.api_keys else None
        print("", flush=True)
        print(f"kvserve is serving {first} at {base_url}", flush=True)
        print("try:", flush=True)
        print(f"  {_curl_line(base_url, first, key)}", flush=True)
        for m in app_args.model_list():
            knobs = m.autoscaling_knobs()
            if knobs is None:
                print(f"{m.name}: {m.num_replicas} replica(s), fixed", flush=True)
            else:
                cfg = KVServeAutoscalingConfig.from_dict(knobs)
                print(
                    f"{m.name}: autoscaling {cfg.min_replicas}..{cfg.max_replicas} replicas (kvserve policy)",
                    flush=True,
                )
        print(_ray_access_line(auth, started_ray), flush=True)
        print("Ctrl-C to stop.", flush=True)
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        _drain_and_stop(name, app_args, started_ray, quick=bool(failed))
    print("kvserve: stopped.", flush=True)
    return 0


#: Where a local Ray session's Serve logs are (the replicas' full tracebacks; on a cluster, the head
#: node's).
SERVE_LOG_DIR = "/tmp/ray/session_latest/logs/serve"

#: Seconds between ``/ready`` turning 503 ("draining") and the application refusing requests.
DRAIN_NOTICE_S = 2.0


def _mark_draining(name: str) -> None:
    """Make every ingress replica of the application answer ``/ready`` with 503 (best effort:
    Serve's router spreads the calls, so a few rounds reach every replica)."""
    from ray import serve

    try:
        st = serve.status().applications.get(name)
        dep = st.deployments.get("OpenAIIngress") if st else None
        n = int((dep.replica_states or {}).get("RUNNING", 1)) if dep else 1
        handle = serve.get_app_handle(name)
        seen: set[str] = set()
        for _ in range(10 * n):
            seen.add(handle.drain.remote().result(timeout_s=5))
            if len(seen) >= n:
                break
    except Exception as e:  # never block the shutdown on it
        print(f"kvserve: could not mark the application as draining: {e}", file=sys.stderr, flush=True)


def _drain_and_stop(name: str, app_args, started_ray: bool, quick: bool = False) -> None:
    """Graceful shutdown: delete the application first, which drains it (Serve stops routing
    new requests to its replicas; each finishes its in-flight streams for up to the model's
    ``graceful_shutdown_timeout_s``, and a stream cut at that deadline still gets its SSE
    error event and ``[DONE]`` from the ingress, which outlives the models' drain), and only
    then stop Serve's proxy and Ray. A second Ctrl-C stops at once. ``quick``: the application
    never started (nothing to drain): stop Serve and Ray at once."""
    from ray import serve

    drain_s = max(m.graceful_shutdown_timeout_s for m in app_args.model_list())
    if quick:
        try:
            serve.shutdown() if started_ray else serve.delete(name)
        except Exception as e:
            print(f"kvserve: serve shutdown failed: {e}", file=sys.stderr)
        finally:
            import ray

            ray.shutdown()
        return
    print(
        f"\nkvserve: draining: /ready says 503, new requests are refused after {DRAIN_NOTICE_S:g} s, in-flight "
        f"ones finish (up to {drain_s:g} s; Ctrl-C again to stop now) ...",
        flush=True,
    )
    try:
        try:
            _mark_draining(name)
            time.sleep(DRAIN_NOTICE_S)  # load balancers polling /ready stop sending here
            serve.delete(name)  # blocks until every replica has drained and stopped
        except KeyboardInterrupt:
            pass
        if started_ray:
            serve.shutdown()
    except Exception as e:
        print(f"kvserve: serve shutdown failed: {e}", file=sys.stderr)
    finally:
        import ray

        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
