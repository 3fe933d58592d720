"""Hand-built Serve contexts and a driver for the autoscaling policy tests of this folder (no Ray cluster).

The driver (:func:`drive`) plays Serve's role: it calls the policy every control tick with the
metrics of the current fleet, passes the returned policy state back, and applies the
decision at once (as Serve does with ``upscale_delay_s=0``).
"""

import json
from dataclasses import dataclass
from types import SimpleNamespace

from kvserve.autoscaling import signals as sig
from kvserve.autoscaling.decision import decide

CAP_D = 1000.0  # decode tokens/s per replica (replica-measured capacity)
CAP_P = 4000.0  # prefill tokens/s per replica


def replica_metrics(
    util=0.6,
    prefill_share=0.25,
    waiting=0.0,
    waiting_tok=0.0,
    running=20.0,
    kv=0.3,
    cap_d=CAP_D,
    cap_p=CAP_P,
    refused=0.0,
    served_prompt=0.0,
):
    """One replica's record_autoscaling_stats() dict with token load ``util`` (of capacity),
    ``refused`` requests turned away as full and the mean ``served_prompt`` (0: none served)."""
    return {
        sig.NUM_REFUSED_REQUESTS: refused,
        sig.SERVED_PROMPT_TOKENS: served_prompt,
        sig.NUM_WAITING_REQUESTS: waiting,
        sig.NUM_WAITING_PREFILL_TOKENS: waiting_tok,
        sig.NUM_RUNNING_REQUESTS: running,
        sig.GENERATION_TOKENS_PER_S: util * (1 - prefill_share) * cap_d,
        sig.PREFILL_TOKENS_PER_S: util * prefill_share * cap_p,
        sig.DECODE_CAPACITY_TOKENS_PER_S: cap_d,
        sig.PREFILL_CAPACITY_TOKENS_PER_S: cap_p,
        sig.KV_CACHE_USAGE: kv,
    }


def make_ctx(per_replica, target, now, state=None, current=None, raw=False, **extra):
    """A duck-typed Serve AutoscalingContext. ``per_replica``: {replica_id: metrics}."""
    names = sig.METRIC_NAMES
    table = {n: {rid: m[n] for rid, m in per_replica.items() if n in m} for n in names}
    ctx = SimpleNamespace(
        deployment_name="LLMServer",
        app_name="test",
        current_num_replicas=len(per_replica) if current is None else current,
        target_num_replicas=target,
        running_replicas=list(per_replica),
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=None if raw else table,
        raw_metrics={n: {rid: [(now - 1.0, v)] for rid, v in t.items()} for n, t in table.items()} if raw else None,
        capacity_adjusted_min_replicas=None,
        capacity_adjusted_max_replicas=None,
        policy_state=dict(state or {}),
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=now,
        config=None,
    )
    for k, v in extra.items():
        setattr(ctx, k, v)
    return ctx


def fleet(n, **kw):
    return {f"r{i}": replica_metrics(**kw) for i in range(n)}


@dataclass
class Run:
    target: int
    changes: list  # (t, old, new, reason)
    decisions: list


def drive(cfg, metrics_at, t_end, target0, dt=0.5, t0=1_000_000.0, sample_every=2.0, **ctx_extra):
    """Call the policy every ``dt`` s; metrics are sampled every ``sample_every`` s (held in
    between, like Serve's metric pushes); decisions are applied at once."""
    state, target = {}, target0
    changes, decisions = [], []
    held, next_sample = None, -1.0
    steps = int(round(t_end / dt))
    for i in range(steps):
        t = i * dt
        if t >= next_sample:
            held = metrics_at(t, target)
            next_sample = t + sample_every
        ctx = make_ctx(held, target, t0 + t, state, **ctx_extra)
        d, state = decide(ctx, cfg)
        json.dumps(state)  # the state must stay plain data
        decisions.append((t, d))
        if d.desired != target:
            changes.append((t, target, d.desired, d.reason))
            target = d.desired
    return Run(target, changes, decisions)
