"""Serve glue: the kvserve policy as a Ray Serve ``AutoscalingConfig``, and as ``kvserve serve`` flags.

Serve 2.60 wraps every custom policy (``ray.serve.autoscaling_policy._apply_autoscaling_config``):
upscaling/downscaling factors, then ``upscale_delay_s``/``downscale_delay_s`` (the new target
must be asked for continuously that long), then ``min_replicas``/``max_replicas``.
:func:`serve_autoscaling_dict` sets the factors to 1 and the delays near 0, so the policy's
own smoothing, hysteresis and cool-downs decide, within seconds.

Ray is imported only by :func:`build_autoscaling_config` without ``as_dict``.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Mapping, Tuple, Union

from kvserve.autoscaling.schedule import schedule_floor
from kvserve.autoscaling.settings import POLICY_MODES, KVServeAutoscalingConfig

#: Import path Serve uses to load the policy class (``module:attr``); Serve instantiates
#: it with ``policy_kwargs`` (the knobs' ``to_dict()``).
POLICY_IMPORT_PATH = "kvserve.autoscaling.policy:KVServeAutoscalingPolicy"


def serve_autoscaling_dict(knobs: Union[None, KVServeAutoscalingConfig, Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The ``autoscaling_config`` dict for ``@serve.deployment`` / a Serve YAML file.

    Starts at the schedule floor when that is above ``min_replicas`` and no
    ``initial_replicas`` is set. Raises ValueError on invalid knobs."""
    cfg = KVServeAutoscalingConfig.coerce(knobs)
    initial = cfg.initial_replicas
    floor_now = schedule_floor(cfg, time.time())
    if initial is None and floor_now > cfg.min_replicas:
        initial = min(floor_now, cfg.max_replicas)
    d: Dict[str, Any] = {
        "min_replicas": cfg.min_replicas,
        "max_replicas": cfg.max_replicas,
        "upscale_delay_s": cfg.serve_upscale_delay_s,
        "downscale_delay_s": cfg.serve_downscale_delay_s,
        "look_back_period_s": cfg.serve_look_back_period_s,
        # Deprecated in Serve 2.60 but still the period at which replicas and handles
        # push metrics to the controller (and the record period's upper bound).
        "metrics_interval_s": cfg.serve_metrics_interval_s,
        "aggregation_function": "mean",
        "upscaling_factor": 1.0,
        "downscaling_factor": 1.0,
        "policy": {"policy_function": POLICY_IMPORT_PATH, "policy_kwargs": cfg.to_dict()},
    }
    if initial is not None:
        d["initial_replicas"] = initial
    if cfg.allow_scale_to_zero:
        d["downscale_to_zero_delay_s"] = cfg.serve_downscale_to_zero_delay_s
    return d


def build_autoscaling_config(
    knobs: Union[None, KVServeAutoscalingConfig, Mapping[str, Any]] = None, *, as_dict: bool = False
):
    """Build Ray Serve's ``AutoscalingConfig`` for the kvserve policy.

    ``knobs``: a :class:`KVServeAutoscalingConfig`, a dict of its fields, or None for
    defaults. ``as_dict=True`` returns the plain dict (for YAML / ``serve.deployment``)
    and does not import Ray.
    """
    d = serve_autoscaling_dict(knobs)
    if as_dict:
        return d
    import warnings

    from ray.serve.config import AutoscalingConfig, AutoscalingPolicy

    d = dict(d)
    policy = d.pop("policy")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*metrics_interval_s.*", category=DeprecationWarning)
        return AutoscalingConfig(policy=AutoscalingPolicy(**policy), **d)


_CLI_FLAGS: Tuple[Tuple[str, str, Any], ...] = (
    # (field, flag, type)
    ("policy_mode", "--autoscaling-policy", str),
    ("min_replicas", "--min-replicas", int),
    ("max_replicas", "--max-replicas", int),
    ("initial_replicas", "--initial-replicas", int),
    ("target_queue_per_replica", "--target-queue-per-replica", float),
    ("target_prefill_backlog_s", "--target-prefill-backlog-s", float),
    ("target_utilization", "--target-utilization", float),
    ("kv_cache_target", "--kv-cache-target", float),
    ("upscale_smoothing_s", "--upscale-smoothing-s", float),
    ("downscale_smoothing_s", "--downscale-smoothing-s", float),
    ("upscale_cooldown_s", "--upscale-cooldown-s", float),
    ("downscale_cooldown_s", "--downscale-cooldown-s", float),
    ("schedule", "--autoscaling-schedule", str),
    ("schedule_timezone", "--autoscaling-timezone", str),
    ("schedule_prewarm_s", "--autoscaling-prewarm-s", float),
)


def add_autoscaling_args(parser: Any) -> Any:
    """Add the autoscaling knobs as ``kvserve serve`` flags to an argparse parser.

    Unset flags stay ``None`` so :func:`config_from_args` can layer them over a
    deployment config's values."""
    group = parser.add_argument_group("autoscaling")
    defaults = KVServeAutoscalingConfig()
    for name, flag, typ in _CLI_FLAGS:
        default = getattr(defaults, name)
        if name == "schedule":
            help_ = "min replicas by local hour, e.g. '8-20:4,20-23:2' (time-based/hybrid modes)"
        else:
            help_ = f"default: {default}"
        kwargs: Dict[str, Any] = {"type": typ, "default": None, "dest": f"autoscaling_{name}", "help": help_}
        if name == "policy_mode":
            kwargs["choices"] = POLICY_MODES
        group.add_argument(flag, **kwargs)
    group.add_argument(
        "--allow-scale-to-zero",
        action="store_true",
        default=None,
        dest="autoscaling_allow_scale_to_zero",
        help="permit min_replicas=0",
    )
    return parser


def config_from_args(
    args: Any,
    base: Union[None, KVServeAutoscalingConfig, Mapping[str, Any]] = None,
) -> KVServeAutoscalingConfig:
    """Knobs from parsed ``add_autoscaling_args`` flags layered over ``base``; raises
    ValueError when the result is not a valid config."""
    data = KVServeAutoscalingConfig.coerce(base).to_dict()
    for name, _flag, _typ in _CLI_FLAGS + (("allow_scale_to_zero", "", bool),):
        v = getattr(args, f"autoscaling_{name}", None)
        if v is not None:
            data[name] = v
    return KVServeAutoscalingConfig.from_dict(data)
