"""Demand: the replicas the fleet's current load needs, per signal, before any smoothing.

All quantities are in replicas (busy replica-equivalents) unless the name says otherwise.
Per tick, from the metrics of the replicas that reported (``kvserve/autoscaling/signals.py``):

* ``load = sum_r gen_tps_r / decode_cap_r + prefill_tps_r / prefill_cap_r``: each replica
  against the capacity (tokens/s) it measured itself;
* ``throughput = (load + backlog growth) / target_utilization``: the growth rate of the work
  backlog is demand not served yet (a replica cannot report more throughput than it has,
  so overload first shows as work piling up: batches filling, then a queue). It counts
  only as the fleet nears saturation (:func:`replica_demand`);
* ``queue = waiting requests / target_queue_per_replica`` (waiting in the engines, queued at
  Serve handles, and refused as full over the replicas' rate window: with admission bounded,
  overload shows as 429s rather than as a queue) and
  ``prefill_backlog = waiting prefill tokens / (prefill_cap * target_prefill_backlog_s)``,
  both capped at ``throughput + queued work (replica-seconds) / queue_drain_s``;
* ``kv_cache = sum_r kv_cache_usage_r / kv_cache_target`` (secondary);
* ``requests_fallback = (running + waiting) / fallback_ongoing_per_replica`` replaces the
  token signals while no replica has reported a capacity.

``raw = max(signals)`` and the dominating signal is the reason; an idle fleet needs 0.

A tick does each step once: :func:`measure_fleet` (pure over the metrics and the memory the
tick started with), :func:`update_fleet_memory` (advances the request-mix averages, the
backlog-growth EWMA and the remembered capacities), :func:`replica_demand` (the signals).
:func:`compute_demand` is the first and last of these for callers outside a tick.

Pure: standard library only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

from kvserve.autoscaling.settings import KVServeAutoscalingConfig
from kvserve.autoscaling.signals import (
    DECODE_CAPACITY_TOKENS_PER_S,
    GENERATION_TOKENS_PER_S,
    KV_CACHE_USAGE,
    NUM_REFUSED_REQUESTS,
    NUM_RUNNING_REQUESTS,
    NUM_WAITING_PREFILL_TOKENS,
    NUM_WAITING_REQUESTS,
    PREFILL_CAPACITY_TOKENS_PER_S,
    PREFILL_TOKENS_PER_S,
    SERVED_PROMPT_TOKENS,
    finite,
    state_key,
)

# Signals, and the decision reasons they become (a closed set: they are a metric label).
REASON_THROUGHPUT = "throughput"  # token throughput vs measured capacity
REASON_QUEUE = "queue"  # waiting requests above target per replica
REASON_PREFILL_BACKLOG = "prefill_backlog"  # waiting prefill tokens above target seconds
REASON_KV_CACHE = "kv_cache"  # KV cache usage above target
REASON_REQUESTS_FALLBACK = "requests_fallback"  # no capacity reported yet: request count
REASON_IDLE = "idle"  # no load at all
SIGNAL_REASONS: Tuple[str, ...] = (
    REASON_THROUGHPUT,
    REASON_QUEUE,
    REASON_PREFILL_BACKLOG,
    REASON_KV_CACHE,
    REASON_REQUESTS_FALLBACK,
    REASON_IDLE,
)

#: Time constant (s) of the long averages of the request mix (prompt length, decode work).
MIX_TAU_S = 60.0


@dataclass(frozen=True)
class FleetLoad:
    """One tick's fleet totals over the replicas that reported (requests, tokens, tokens/s,
    replicas; ``*_s`` in replica-seconds). None where it needs a capacity nobody knows."""

    num_replicas_reporting: int
    waiting_requests: float  # in the engines
    handle_queued_requests: float  # at Serve handles, not given to a replica yet
    refused_requests: float  # turned away as full over the replicas' rate window
    replica_waiting_prefill_tokens: float  # in the engines
    waiting_prefill_tokens: float  # engines + (handle queue + refused) x avg_prompt_tokens
    running_requests: float
    generation_tokens_per_s: float
    prefill_tokens_per_s: float
    decode_capacity_tokens_per_s: Optional[float]  # median per replica (or remembered)
    prefill_capacity_tokens_per_s: Optional[float]
    kv_cache_usages: Tuple[float, ...]
    load_replicas: Optional[float]
    prefill_load_replicas: Optional[float]
    avg_prompt_tokens: Optional[float]  # mean prompt of a request not in an engine (handle queue, refused)
    decode_work_per_request_s: Optional[float]
    queued_work_s: Optional[float]  # waiting prefill + decode work of waiting requests
    work_backlog_s: Optional[float]  # queued work + decode work of running requests

    @property
    def waiting_total(self) -> float:
        return self.waiting_requests + self.handle_queued_requests + self.refused_requests

    @property
    def have_capacity(self) -> bool:
        return bool(self.decode_capacity_tokens_per_s) and bool(self.prefill_capacity_tokens_per_s)

    @property
    def idle(self) -> bool:
        return (
            self.waiting_total <= 0
            and self.running_requests <= 0
            and self.generation_tokens_per_s <= 0
            and self.prefill_tokens_per_s <= 0
        )


def measure_fleet(
    replicas: Mapping[Any, Mapping[str, float]], state: Mapping[str, Any], handle_queued: float = 0.0
) -> FleetLoad:
    """Fleet totals from ``{replica_id: metrics}`` (see ``read_replica_metrics``).

    ``state`` (read only) supplies the last known capacities when no replica reports one,
    and the long averages of the request mix (:func:`update_fleet_memory`). A request whose
    prompt no engine has seen (``handle_queued`` at Serve's handles, and those refused as
    full) is priced at the mean prompt of the requests served (the replicas'
    ``served_prompt_tokens``, weighted by their prefill throughput), or, before any reports
    one, at the long average of the waiting prompts. The decode work per request
    (replica-seconds) is the mean decode load over the request rate (prefill throughput /
    mean prompt).
    """
    reporting = [m for m in replicas.values() if m]

    def total(name: str) -> float:
        return sum(max(0.0, m.get(name, 0.0)) for m in reporting)

    cap_d_list = [m[DECODE_CAPACITY_TOKENS_PER_S] for m in reporting if m.get(DECODE_CAPACITY_TOKENS_PER_S, 0.0) > 0]
    cap_p_list = [m[PREFILL_CAPACITY_TOKENS_PER_S] for m in reporting if m.get(PREFILL_CAPACITY_TOKENS_PER_S, 0.0) > 0]
    cap_d = _median(cap_d_list) if cap_d_list else finite(state.get(state_key("cap_decode")))
    cap_p = _median(cap_p_list) if cap_p_list else finite(state.get(state_key("cap_prefill")))
    waiting, waiting_tok, running = (
        total(NUM_WAITING_REQUESTS),
        total(NUM_WAITING_PREFILL_TOKENS),
        total(NUM_RUNNING_REQUESTS),
    )
    gen_tps, pre_tps = total(GENERATION_TOKENS_PER_S), total(PREFILL_TOKENS_PER_S)
    kv = tuple(min(1.0, max(0.0, m[KV_CACHE_USAGE])) for m in reporting if KV_CACHE_USAGE in m)

    handle_queued = max(0.0, finite(handle_queued) or 0.0)
    refused = total(NUM_REFUSED_REQUESTS)
    avg_prompt = _served_prompt(reporting)
    ew_wtok, ew_wreq = finite(state.get(state_key("mix_wtok"))), finite(state.get(state_key("mix_wreq")))
    if avg_prompt is None and ew_wtok and ew_wreq:
        avg_prompt = ew_wtok / ew_wreq  # ratio of long averages: robust
    elif avg_prompt is None and waiting >= 1.0:
        avg_prompt = waiting_tok / waiting
    waiting_total = waiting + handle_queued + refused
    waiting_tok_total = waiting_tok + (handle_queued + refused) * (avg_prompt or 0.0)

    load = prefill_load = None
    if cap_d and cap_p:
        load = prefill_load = 0.0
        for m in reporting:
            cd = m.get(DECODE_CAPACITY_TOKENS_PER_S, 0.0)
            cp = m.get(PREFILL_CAPACITY_TOKENS_PER_S, 0.0)
            pl = max(0.0, m.get(PREFILL_TOKENS_PER_S, 0.0)) / (cp if cp > 0 else cap_p)
            load += max(0.0, m.get(GENERATION_TOKENS_PER_S, 0.0)) / (cd if cd > 0 else cap_d) + pl
            prefill_load += pl

    decode_work = None
    ew_dload, ew_ptps = finite(state.get(state_key("mix_dload"))), finite(state.get(state_key("mix_ptps")))
    if avg_prompt and ew_dload is not None and ew_ptps and ew_ptps > 0:
        decode_work = ew_dload * avg_prompt / ew_ptps
    elif load is not None and avg_prompt and pre_tps > 0:
        decode_work = (load - prefill_load) * avg_prompt / pre_tps
    queued_work = work_backlog = None
    if load is not None:
        queued_work = waiting_tok_total / cap_p + waiting_total * (decode_work or 0.0)
        work_backlog = queued_work + running * (decode_work or 0.0)

    return FleetLoad(
        num_replicas_reporting=len(reporting),
        waiting_requests=waiting,
        handle_queued_requests=handle_queued,
        refused_requests=refused,
        replica_waiting_prefill_tokens=waiting_tok,
        waiting_prefill_tokens=waiting_tok_total,
        running_requests=running,
        generation_tokens_per_s=gen_tps,
        prefill_tokens_per_s=pre_tps,
        decode_capacity_tokens_per_s=cap_d,
        prefill_capacity_tokens_per_s=cap_p,
        kv_cache_usages=kv,
        load_replicas=load,
        prefill_load_replicas=prefill_load,
        avg_prompt_tokens=avg_prompt,
        decode_work_per_request_s=decode_work,
        queued_work_s=queued_work,
        work_backlog_s=work_backlog,
    )


def replica_demand(
    fleet: FleetLoad, config: KVServeAutoscalingConfig, backlog_growth_replicas: float = 0.0
) -> Dict[str, Any]:
    """Raw demand (replicas, float) from one tick's fleet totals: no smoothing, no bounds.

    Returns ``raw``, ``reason`` (the dominating signal), the rounded ``signals`` and every
    input, as the decision logs them. ``backlog_growth_replicas`` is the smoothed growth
    rate of ``work_backlog_s``. A replica with throughput to spare serves new work at once
    (it shows up in its measured throughput within seconds), so the growth counts only as
    the fleet saturates: not at all up to ``target_utilization``, fully at 100 % or when
    requests wait beyond the queue target, and not while no replica reports. This keeps
    the noise of a derivative out of the steady state.
    """
    f, cfg = fleet, config
    n = f.num_replicas_reporting
    signals: Dict[str, float] = {}
    growth_load = 0.0
    if f.have_capacity:
        gate = 0.0
        if n:
            gate = (f.load_replicas / n - cfg.target_utilization) / max(1e-6, 1.0 - cfg.target_utilization)
            if f.waiting_total > cfg.target_queue_per_replica * n:
                gate = 1.0
        growth_load = max(0.0, finite(backlog_growth_replicas) or 0.0) * min(1.0, max(0.0, gate))
        signals[REASON_THROUGHPUT] = (f.load_replicas + growth_load) / cfg.target_utilization
        signals[REASON_PREFILL_BACKLOG] = (
            f.waiting_prefill_tokens / f.prefill_capacity_tokens_per_s / cfg.target_prefill_backlog_s
        )
    else:
        signals[REASON_REQUESTS_FALLBACK] = (f.running_requests + f.waiting_total) / cfg.fallback_ongoing_per_replica
    signals[REASON_QUEUE] = f.waiting_total / cfg.target_queue_per_replica
    if f.have_capacity and cfg.queue_drain_s > 0:
        # Queue targets are per replica, so they keep asking for more while new replicas
        # start (the queue still grows then): cap them at what serves the offered load and
        # drains the queued work within ``queue_drain_s``.
        cap = signals[REASON_THROUGHPUT] + f.queued_work_s / cfg.queue_drain_s
        for key in (REASON_QUEUE, REASON_PREFILL_BACKLOG):
            signals[key] = min(signals[key], cap)
    if f.kv_cache_usages:
        signals[REASON_KV_CACHE] = sum(f.kv_cache_usages) / cfg.kv_cache_target

    reason, raw = max(signals.items(), key=lambda kv: kv[1])
    if f.idle:
        reason, raw = REASON_IDLE, 0.0
    kv = f.kv_cache_usages
    return {
        "raw": raw,
        "reason": reason,
        "signals": {k: round(v, 3) for k, v in signals.items()},
        "num_replicas_reporting": n,
        "waiting_requests": f.waiting_requests,
        "handle_queued_requests": f.handle_queued_requests,
        "refused_requests": f.refused_requests,
        "waiting_total": f.waiting_total,  # engines + handle queues + refused
        "waiting_prefill_tokens": f.waiting_prefill_tokens,
        "running_requests": f.running_requests,
        "generation_tokens_per_s": f.generation_tokens_per_s,
        "prefill_tokens_per_s": f.prefill_tokens_per_s,
        "decode_capacity_tokens_per_s": f.decode_capacity_tokens_per_s,
        "prefill_capacity_tokens_per_s": f.prefill_capacity_tokens_per_s,
        "kv_cache_usage_mean": (sum(kv) / len(kv)) if kv else None,
        "load_replicas": f.load_replicas,
        "prefill_load_replicas": f.prefill_load_replicas,
        "decode_work_per_request_s": f.decode_work_per_request_s,
        "work_backlog_s": f.work_backlog_s,
        "queued_work_s": f.queued_work_s,
        "backlog_growth_replicas": growth_load,
        "avg_prompt_tokens": f.avg_prompt_tokens,
        "idle": f.idle,
    }


def compute_demand(
    replicas: Mapping[Any, Mapping[str, float]],
    config: KVServeAutoscalingConfig,
    state: Mapping[str, Any],
    handle_queued: float = 0.0,
    backlog_growth_replicas: float = 0.0,
) -> Dict[str, Any]:
    """:func:`replica_demand` of :func:`measure_fleet`: raw demand in replicas from
    per-replica metrics, with the memory in ``state`` (read only)."""
    return replica_demand(measure_fleet(replicas, state, handle_queued), config, backlog_growth_replicas)


def update_fleet_memory(
    state: Dict[str, Any], fleet: FleetLoad, now: float, dt: float, config: KVServeAutoscalingConfig
) -> float:
    """Advance the policy's memory of the fleet after a tick's measurement (in ``state``):
    the request-mix averages, the backlog-growth EWMA and the last known capacities.

    ``now`` and ``dt`` (time since the previous tick) are in seconds. Returns the smoothed
    growth rate of the work backlog, in replicas (replica-seconds per second, >= 0)."""
    _update_mix(state, fleet, dt)
    growth = _update_backlog_growth(state, fleet.work_backlog_s, now, config)
    if fleet.decode_capacity_tokens_per_s:
        state[state_key("cap_decode")] = fleet.decode_capacity_tokens_per_s
    if fleet.prefill_capacity_tokens_per_s:
        state[state_key("cap_prefill")] = fleet.prefill_capacity_tokens_per_s
    return growth


def _update_mix(state: Dict[str, Any], fleet: FleetLoad, dt: float) -> None:
    """Long (``MIX_TAU_S``) averages of the request mix: waiting prompt tokens and waiting
    requests (their ratio is the mean waiting prompt), decode load and prefill throughput
    (for the decode work per request)."""
    if fleet.waiting_requests >= 1.0:
        _ewma_into(state, "mix_wtok", fleet.replica_waiting_prefill_tokens, dt, MIX_TAU_S)
        _ewma_into(state, "mix_wreq", fleet.waiting_requests, dt, MIX_TAU_S)
    load, pl = fleet.load_replicas, fleet.prefill_load_replicas
    if load is not None and pl is not None and fleet.prefill_tokens_per_s > 0:
        _ewma_into(state, "mix_dload", max(0.0, load - pl), dt, MIX_TAU_S)
        _ewma_into(state, "mix_ptps", fleet.prefill_tokens_per_s, dt, MIX_TAU_S)


def _update_backlog_growth(
    state: Dict[str, Any], backlog: Optional[float], now: float, config: KVServeAutoscalingConfig
) -> float:
    """Smoothed d(work backlog)/dt in replicas, sampled at most once per second, EWMA with
    time constant ``backlog_growth_smoothing_s`` (0 disables: returns 0)."""
    tau = config.backlog_growth_smoothing_s
    if tau <= 0 or backlog is None:
        return 0.0
    slope = finite(state.get(state_key("growth"))) or 0.0
    last_v = finite(state.get(state_key("growth_v")))
    last_t = finite(state.get(state_key("growth_t")))
    if last_v is None or last_t is None or now < last_t:
        state[state_key("growth_v")], state[state_key("growth_t")] = backlog, now
        return max(0.0, slope)
    span = now - last_t
    if span >= 1.0:
        inst = (backlog - last_v) / span
        slope += (1.0 - math.exp(-span / tau)) * (inst - slope)
        state[state_key("growth")] = slope
        state[state_key("growth_v")], state[state_key("growth_t")] = backlog, now
    return max(0.0, slope)


def _ewma_into(state: Dict[str, Any], key: str, value: float, dt: float, tau: float) -> None:
    """EWMA step of ``state[kvserve.<key>]`` toward ``value`` over ``dt`` s, time constant ``tau`` s."""
    prev = finite(state.get(state_key(key)))
    if prev is None:
        state[state_key(key)] = value
    else:
        state[state_key(key)] = prev + (1.0 - math.exp(-dt / tau)) * (value - prev)


def _served_prompt(reporting: Sequence[Mapping[str, float]]) -> Optional[float]:
    """Mean prompt (tokens) of the requests the replicas served recently: their
    ``served_prompt_tokens`` weighted by prefill throughput (plain mean where none has any);
    None when no replica reports one."""
    rows = [
        (m[SERVED_PROMPT_TOKENS], max(0.0, m.get(PREFILL_TOKENS_PER_S, 0.0)))
        for m in reporting
        if m.get(SERVED_PROMPT_TOKENS, 0.0) > 0
    ]
    if not rows:
        return None
    weight = sum(w for _, w in rows)
    if weight <= 0:
        return sum(p for p, _ in rows) / len(rows)
    return sum(p * w for p, w in rows) / weight


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])
