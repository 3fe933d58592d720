"""Trace-driven autoscaling simulator: kvserve policy vs Ray Serve's request-based policy
vs a fixed fleet sized for the peak.

    python benchmarks/autoscaling_sim.py --out benchmarks/results/autoscaling [--gpu-profile]

A benchmark tool, not part of the policy package: it imports ``autoscaling`` (the policy under
test) and Ray Serve's private wrapper functions; nothing in ``kvserve/autoscaling/`` imports it.

Writes ``autoscaling.json`` (parameters, per-policy results, down-sampled time series; its
comparison table is its ``tables``, from :func:`figures`) and ``autoscaling.png`` (offered load,
replicas and queue over time) under ``--out``, and prints the comparison table.

Model (discrete time, ``--dt`` seconds per tick, default 0.5):

* Trace: Poisson arrivals with a time-varying rate: a compressed diurnal curve, a 5x
  spike, and a long-prompt phase in which the request rate follows the diurnal curve
  but prompts are 3x longer (so prefill tokens triple while request counts stay flat).
  Prompt and output lengths are log-normal. The same trace is replayed for every
  policy.
* Replica: a continuous-batching engine in fluid form. Each engine step runs every
  running sequence's decode token plus a chunk of waiting prefill (token budget
  ``max_num_batched_tokens``, at most ``max_num_seqs`` sequences); step time is
  ``t_min + b * c_decode + k * c_prefill`` where ``c_prefill = 1 / prefill_tokens_per_s``
  and ``c_decode`` makes a full batch of ``max_num_seqs`` decode at
  ``decode_tokens_per_s``. FCFS prefill; a request's TTFT ends when its prefill ends.
  Replicas take ``startup_s`` to become ready and drain for up to
  ``graceful_shutdown_s`` when removed (requests still waiting then fail).
* Routing: a handle queue in front of the replicas (Serve's ``max_ongoing_requests``);
  each request goes to the ready replica with the fewest ongoing requests.
* Metrics pipeline as in Serve 2.60: replicas record samples every
  ``min(0.2 * look_back_period_s, metrics_interval_s)`` and push them every
  ``metrics_interval_s``; the controller sees the window mean over
  ``look_back_period_s`` (``aggregated_metrics``) and the pushed samples
  (``raw_metrics``). The policy runs every tick and its answer goes through Serve's own
  wrapper functions (scaling factors, ``upscale_delay_s``/``downscale_delay_s``; imported
  from Ray 2.60, see :func:`serve_wrap`), then the bounds.
"""

from __future__ import annotations

import argparse
import heapq
import json
import logging
import math
import os
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: the policy package lives in the repository root
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from ray.serve.autoscaling_policy import _apply_delay_logic, _apply_scaling_factors  # noqa: E402

from kvserve.autoscaling import signals as sig  # noqa: E402
from kvserve.autoscaling.decision import logger as decision_logger  # noqa: E402
from kvserve.autoscaling.policy import KVServeAutoscalingPolicy  # noqa: E402
from kvserve.autoscaling.settings import KVServeAutoscalingConfig  # noqa: E402
from benchmarks.common import Figures, Results  # noqa: E402

#: The top-level keys this script writes (besides benchmarks.common.PROVENANCE_KEYS).
RESULT_KEYS = (
    "profile",
    "trace",
    "seeds",
    "requests",
    "base_rate_req_s",
    "dt_s",
    "max_replicas",
    "initial_replicas",
    "target_utilization",
    "ttft_slo_s",
    "kvserve_knobs",
    "results",
    "offered",
    "series_seed",
    "series",
    "scale_events_seed0",
    "wall_s",
)

# --------------------------------------------------------------------------------------
# Replica profiles
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReplicaProfile:
    name: str
    decode_tokens_per_s: float  # at a full batch of max_num_seqs
    prefill_tokens_per_s: float
    max_num_seqs: int
    startup_s: float
    min_step_s: float  # step time at batch 1 (fixed per-step cost)
    max_num_batched_tokens: int
    max_ongoing_requests: int
    kv_capacity_tokens: int
    graceful_shutdown_s: float
    # workload shape matched to the profile
    prompt_mean: float
    output_mean: float
    ttft_slo_s: float
    source: str = "defaults"

    @property
    def c_prefill(self) -> float:
        return 1.0 / self.prefill_tokens_per_s

    @property
    def c_decode(self) -> float:
        full = self.max_num_seqs / self.decode_tokens_per_s
        return max(1e-9, (full - self.min_step_s) / self.max_num_seqs)

    def work_per_request(self, prompt: float, output: float) -> float:
        """Replica-seconds per request at full efficiency (time-share model)."""
        return prompt / self.prefill_tokens_per_s + output / self.decode_tokens_per_s


CPU_PROFILE = ReplicaProfile(
    name="cpu-smollm2-135m",
    startup_s=30.0,
    graceful_shutdown_s=60.0,
    decode_tokens_per_s=250.0,
    prefill_tokens_per_s=800.0,
    min_step_s=0.03,
    max_num_seqs=64,
    max_num_batched_tokens=512,
    max_ongoing_requests=128,
    kv_capacity_tokens=64 * 1024,
    prompt_mean=256.0,
    output_mean=128.0,
    ttft_slo_s=5.0,
)

GPU_PROFILE = ReplicaProfile(
    name="h100-like",
    startup_s=60.0,
    graceful_shutdown_s=60.0,
    decode_tokens_per_s=12000.0,
    prefill_tokens_per_s=60000.0,
    min_step_s=0.008,
    max_num_seqs=256,
    max_num_batched_tokens=8192,
    max_ongoing_requests=512,
    kv_capacity_tokens=256 * 2048,
    prompt_mean=1024.0,
    output_mean=256.0,
    ttft_slo_s=1.0,
)

_THROUGHPUT_KEYS = {
    # our field -> accepted keys in benchmarks/results/throughput.json (first match wins)
    "decode_tokens_per_s": (
        "decode_tokens_per_s",
        "output_tokens_per_s",
        "decode_tok_s",
        "generation_tokens_per_s",
        "output_tok_per_s",
    ),
    "prefill_tokens_per_s": ("prefill_tokens_per_s", "prefill_tok_s", "input_tokens_per_s"),
    "max_num_seqs": ("max_num_seqs", "batch_size", "max_batch_size", "max_running_batch"),
    "startup_s": ("startup_s", "replica_startup_s", "load_time_s"),
    "min_step_s": ("min_step_s", "batch1_step_s", "itl_batch1_s"),
}


def load_profile(path: str, base: ReplicaProfile) -> ReplicaProfile:
    """Overlay measured replica numbers from kvserve's throughput benchmark, if present.

    Looks for the keys in ``_THROUGHPUT_KEYS`` under ``"replica_profile"`` /
    ``"autoscaling"``, in the ``"kvserve"`` entry of ``"dtypes"`` (float32 first: the format
    ``benchmarks/throughput.py`` writes now; its ``output_tok_per_s`` includes prefill time, so
    it is a lower bound of the decode capacity) or of an older file's ``"systems"`` list, or at
    the top level; anything missing keeps ``base``'s value.
    """
    if not path or not os.path.exists(path):
        return base
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return base
    if not isinstance(data, dict):
        return base
    dtypes = data.get("dtypes") if isinstance(data.get("dtypes"), dict) else {}
    by_dtype = [
        d.get("kvserve") for _, d in sorted(dtypes.items(), key=lambda kv: kv[0] != "float32") if isinstance(d, dict)
    ]
    systems = data.get("systems") if isinstance(data.get("systems"), list) else []
    kv_entry = next((x for x in [*by_dtype, *systems] if isinstance(x, dict) and x.get("system") == "kvserve"), None)
    scopes = [data.get("replica_profile"), data.get("autoscaling"), kv_entry, data]
    changes: Dict[str, Any] = {}
    for fname, keys in _THROUGHPUT_KEYS.items():
        for scope in scopes:
            if not isinstance(scope, dict):
                continue
            hit = next((scope[k] for k in keys if isinstance(scope.get(k), (int, float)) and scope[k] > 0), None)
            if hit is not None:
                changes[fname] = int(hit) if fname == "max_num_seqs" else float(hit)
                break
    if not changes:
        return base
    source = f"{path}: {sorted(changes)}"
    if "max_num_seqs" in changes:
        changes["max_ongoing_requests"] = 2 * changes["max_num_seqs"]
    return replace(base, source=source, **changes)


# --------------------------------------------------------------------------------------
# Trace
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceSpec:
    duration_s: float = 4200.0
    base_load_replicas: float = 4.0  # offered load at the diurnal peak, in full replicas
    diurnal_low: float = 0.6  # diurnal multiplier at both ends (peak 1.0 mid-trace)
    spike_start_s: float = 1200.0
    spike_duration_s: float = 300.0
    spike_factor: float = 5.0
    long_start_s: float = 2400.0
    long_duration_s: float = 900.0
    long_prompt_factor: float = 3.0
    length_sigma: float = 0.6
    seed: int = 0

    def diurnal(self, t):
        return self.diurnal_low + (1.0 - self.diurnal_low) * np.sin(np.pi * np.asarray(t) / self.duration_s)

    def in_spike(self, t):
        t = np.asarray(t)
        return (t >= self.spike_start_s) & (t < self.spike_start_s + self.spike_duration_s)

    def in_long(self, t):
        t = np.asarray(t)
        return (t >= self.long_start_s) & (t < self.long_start_s + self.long_duration_s)

    def phase_of(self, t) -> np.ndarray:
        """0 = diurnal, 1 = spike, 2 = long prompts (by arrival time)."""
        return np.where(self.in_spike(t), 1, np.where(self.in_long(t), 2, 0))


PHASES = ("diurnal", "spike", "long_prompt")


@dataclass
class Trace:
    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray
    phase: np.ndarray
    base_rate: float
    spec: TraceSpec


def make_trace(spec: TraceSpec, profile: ReplicaProfile) -> Trace:
    rng = np.random.default_rng(spec.seed)
    base_rate = spec.base_load_replicas / profile.work_per_request(profile.prompt_mean, profile.output_mean)
    step = 1.0
    ts = np.arange(0.0, spec.duration_s, step)
    rate = base_rate * spec.diurnal(ts) * np.where(spec.in_spike(ts), spec.spike_factor, 1.0)
    counts = rng.poisson(rate * step)
    arrival = np.repeat(ts, counts) + rng.random(counts.sum()) * step
    arrival.sort()
    n = arrival.size
    s = spec.length_sigma
    mu_shift = -0.5 * s * s  # log-normal with the requested mean

    def lengths(mean, lo, hi):
        x = mean * np.exp(mu_shift + s * rng.standard_normal(n))
        return np.clip(np.round(x), lo, hi).astype(np.int64)

    prompt = lengths(profile.prompt_mean, 16, 4 * profile.prompt_mean)
    output = lengths(profile.output_mean, 8, 4 * profile.output_mean)
    longp = spec.in_long(arrival)
    prompt = np.where(longp, prompt * int(spec.long_prompt_factor), prompt)
    return Trace(arrival, prompt, output, spec.phase_of(arrival), base_rate, spec)


# --------------------------------------------------------------------------------------
# Replica engine model
# --------------------------------------------------------------------------------------


class MetricsPath:
    """Serve 2.60's path from one metrics source (a replica, a handle) to the controller:
    a sample is recorded every ``record_interval_s`` and the recorded ones are pushed every
    ``metrics_interval_s``; the controller keeps the pushed ones of the last
    ``look_back_period_s`` (``visible``: ``(time s, sample)`` pairs, oldest first)."""

    __slots__ = ("samples", "visible", "next_record", "next_push")

    def __init__(self, start: float):
        self.samples: List[Tuple[float, Any]] = []  # recorded, not pushed yet
        self.visible: deque = deque()
        self.next_record = start
        self.next_push = start

    def advance(self, now: float, timing: "ServeTiming", sample: Callable[[], Any]) -> None:
        """Record (``sample()`` is called only then), push and expire up to ``now`` (s)."""
        if now >= self.next_record:
            self.samples.append((now, sample()))
            self.next_record = now + timing.record_interval_s
        if now >= self.next_push:
            self.visible.extend(self.samples)
            self.samples = []
            self.next_push = now + timing.metrics_interval_s
        while self.visible and self.visible[0][0] < now - timing.look_back_period_s:
            self.visible.popleft()


class Replica:
    __slots__ = (
        "rid",
        "profile",
        "ready_at",
        "stop_at",
        "draining",
        "waiting",
        "wait_tokens",
        "head_done",
        "running",
        "steps",
        "run_prompt_sum",
        "run_start_sum",
        "gen_ewma",
        "pre_ewma",
        "pushed",
        "rng",
        "retired",
    )

    def __init__(self, rid: int, profile: ReplicaProfile, ready_at: float, rng: np.random.Generator):
        self.rid = rid
        self.profile = profile
        self.ready_at = ready_at
        self.stop_at: Optional[float] = None
        self.draining = False
        self.waiting: deque = deque()  # request indices, FCFS
        self.wait_tokens = 0.0  # prompt tokens not computed yet (all waiting requests)
        self.head_done = 0.0  # prompt tokens already computed for waiting[0]
        self.running: List[Tuple[float, int]] = []  # heap of (finish step, request)
        self.steps = 0.0  # cumulative decode steps
        self.run_prompt_sum = 0.0
        self.run_start_sum = 0.0
        self.gen_ewma = 0.0
        self.pre_ewma = 0.0
        self.pushed = MetricsPath(start=ready_at)  # samples of metrics() on their way to Serve
        self.rng = rng
        self.retired = False

    def ongoing(self) -> int:
        return len(self.waiting) + len(self.running)

    def ready(self, now: float) -> bool:
        return now >= self.ready_at

    def step(self, now: float, dt: float, trace: Trace, ttft: np.ndarray, out_of: np.ndarray) -> None:
        p = self.profile
        b = len(self.running)
        base = p.min_step_s + b * p.c_decode
        prefilled = 0.0
        decode_steps = 0.0
        seats = p.max_num_seqs - b
        k = p.max_num_batched_tokens - b
        newly: List[int] = []
        if self.waiting and seats > 0 and k > 0:
            step_t = base + k * p.c_prefill
            budget = (dt / step_t) * k  # prefill tokens this tick at full chunks
            done_tokens = 0.0
            while self.waiting and len(newly) < seats:
                r = self.waiting[0]
                need = float(trace.prompt[r]) - self.head_done
                if done_tokens + need <= budget:
                    done_tokens += need
                    self.waiting.popleft()
                    self.head_done = 0.0
                    t_done = now + (done_tokens / k) * step_t
                    arr = trace.arrival[r]
                    if t_done < arr:  # arrived inside this tick: at least its own prefill
                        t_done = arr + p.min_step_s + trace.prompt[r] * p.c_prefill
                    ttft[r] = t_done - arr
                    newly.append(r)
                else:
                    part = budget - done_tokens
                    self.head_done += part
                    done_tokens = budget
                    break
            prefilled = done_tokens
            self.wait_tokens = max(0.0, self.wait_tokens - done_tokens)
            mixed_steps = done_tokens / k
            rest = dt - mixed_steps * step_t
            decode_steps = mixed_steps + (rest / base if b > 0 and rest > 0 else 0.0)
        elif b > 0:
            decode_steps = dt / base
        # decode
        generated = decode_steps * b
        self.steps += decode_steps
        run = self.running
        while run and run[0][0] <= self.steps:
            _, r = heapq.heappop(run)
            self.run_prompt_sum -= trace.prompt[r]
            self.run_start_sum -= out_of[r]
        for r in newly:
            # the first token came with the prefill; output - 1 decode steps remain
            heapq.heappush(run, (self.steps + float(trace.output[r] - 1), r))
            out_of[r] = self.steps
            self.run_prompt_sum += trace.prompt[r]
            self.run_start_sum += self.steps
        generated += len(newly)
        a = 1.0 - math.exp(-dt / 5.0)  # the replica's own 5 s throughput window
        self.gen_ewma += a * (generated / dt - self.gen_ewma)
        self.pre_ewma += a * (prefilled / dt - self.pre_ewma)

    def kv_usage(self) -> float:
        ctx = self.run_prompt_sum + len(self.running) * self.steps - self.run_start_sum
        return min(1.0, max(0.0, ctx / self.profile.kv_capacity_tokens))

    def metrics(self) -> Dict[str, float]:
        p = self.profile
        noise = self.rng.normal(1.0, 0.03, 2)
        return {
            sig.NUM_WAITING_REQUESTS: float(len(self.waiting)),
            sig.NUM_WAITING_PREFILL_TOKENS: float(self.wait_tokens),
            sig.NUM_RUNNING_REQUESTS: float(len(self.running)),
            sig.GENERATION_TOKENS_PER_S: self.gen_ewma,
            sig.PREFILL_TOKENS_PER_S: self.pre_ewma,
            sig.DECODE_CAPACITY_TOKENS_PER_S: p.decode_tokens_per_s * float(noise[0]),
            sig.PREFILL_CAPACITY_TOKENS_PER_S: p.prefill_tokens_per_s * float(noise[1]),
            sig.KV_CACHE_USAGE: self.kv_usage(),
            "_ongoing": float(self.ongoing()),
        }


# --------------------------------------------------------------------------------------
# Serve's wrapper around a custom policy (ray.serve.autoscaling_policy 2.60, simulated time)
# --------------------------------------------------------------------------------------


@dataclass
class ServeTiming:
    """The simulated Serve's autoscaling settings (seconds, replicas). It stands in for
    ``ray.serve.config.AutoscalingConfig`` where Ray's wrapper functions read one."""

    upscale_delay_s: float
    downscale_delay_s: float
    look_back_period_s: float
    metrics_interval_s: float
    min_replicas: int
    max_replicas: int
    upscaling_factor: float = 1.0
    downscaling_factor: float = 1.0
    downscale_to_zero_delay_s: Optional[float] = None

    @property
    def record_interval_s(self) -> float:
        return min(0.2 * self.look_back_period_s, self.metrics_interval_s)

    def get_upscaling_factor(self) -> float:
        return self.upscaling_factor

    def get_downscaling_factor(self) -> float:
        return self.downscaling_factor


SERVE_DEFAULT_TIMING = dict(
    upscale_delay_s=30.0, downscale_delay_s=600.0, look_back_period_s=30.0, metrics_interval_s=10.0
)


def serve_wrap(desired: float, current: int, target: int, cfg: ServeTiming, state: Dict[str, Any], now: float) -> int:
    """What Serve 2.60 makes of a policy's ``desired`` replicas, on simulated time ``now`` (s).

    Ray's own ``_apply_scaling_factors`` and ``_apply_delay_logic`` (imported, pinned by
    ``tests/autoscaling/test_autoscaling_simulator.py::test_ray_serve_wrapper_is_pinned``), composed as
    ``ray.serve.autoscaling_policy._apply_default_params`` composes them, then the
    ``min_replicas``/``max_replicas`` clamp. ``_apply_default_params`` itself cannot be
    called: it reads the wall clock (``time.time()``) for the delays, where the simulator
    needs its own clock (``_apply_delay_logic(..., _now=)``). ``cfg`` stands in for Serve's
    ``AutoscalingConfig`` (the factor getters and delay fields are all these read);
    ``state`` holds Serve's delay counter and timestamp between calls.
    """
    d = _apply_scaling_factors(desired, current, cfg)
    if not (current == 0 and d > 0):  # from zero replicas Serve skips the delays
        d, _ = _apply_delay_logic(max(0, d), target, cfg, state, _now=now)
    return max(cfg.min_replicas, min(cfg.max_replicas, d))


# --------------------------------------------------------------------------------------
# Policies
# --------------------------------------------------------------------------------------


class SimCtx:
    """Duck-typed ``ray.serve.config.AutoscalingContext`` over simulator state."""

    def __init__(self, sim: "Simulation", now: float, policy_state: Dict[str, Any]):
        self._sim = sim
        self.deployment_name = "LLMServer"
        self.app_name = "sim"
        self.current_time = now
        ready = [r for r in sim.replicas if r.ready(now) and not r.draining]
        self.running_replicas = [r.rid for r in ready]
        self._ready = ready
        self.current_num_replicas = len(ready)
        self.target_num_replicas = sim.target
        self.capacity_adjusted_min_replicas = sim.timing.min_replicas
        self.capacity_adjusted_max_replicas = sim.timing.max_replicas
        self.policy_state = policy_state
        self.last_scale_up_time = sim.last_scale_up
        self.last_scale_down_time = sim.last_scale_down
        self.config = sim.timing

    @property
    def raw_metrics(self) -> Dict[str, Dict[int, list]]:
        out: Dict[str, Dict[int, list]] = {name: {} for name in sig.METRIC_NAMES}
        for r in self._ready:
            if r.pushed.visible:
                t, m = r.pushed.visible[-1]
                for name in sig.METRIC_NAMES:
                    out[name][r.rid] = [(t, m[name])]
        return out

    @property
    def aggregated_metrics(self) -> Dict[str, Dict[int, float]]:
        out: Dict[str, Dict[int, float]] = {name: {} for name in sig.METRIC_NAMES}
        for r in self._ready:
            if r.pushed.visible:
                n = len(r.pushed.visible)
                for name in sig.METRIC_NAMES:
                    out[name][r.rid] = sum(m[name] for _, m in r.pushed.visible) / n
        return out

    @property
    def total_queued_requests(self) -> float:
        return self._sim.visible_handle_queue_mean()

    @property
    def total_num_requests(self) -> float:
        total = self.total_queued_requests
        for r in self._ready:
            if r.pushed.visible:
                total += sum(m["_ongoing"] for _, m in r.pushed.visible) / len(r.pushed.visible)
        return total


@dataclass
class PolicySpec:
    """One simulated autoscaler: ``kind`` "fixed" (``fixed_replicas``), "request" (Serve's
    default policy: ongoing requests / ``target_ongoing_requests``) or "kvserve" (``knobs``);
    ``timing`` overrides ``SERVE_DEFAULT_TIMING`` (seconds)."""

    name: str
    label: str
    kind: Literal["fixed", "request", "kvserve"]
    timing: Dict[str, float] = field(default_factory=dict)
    fixed_replicas: int = 0
    target_ongoing_requests: float = 2.0
    knobs: Dict[str, Any] = field(default_factory=dict)


class Simulation:
    def __init__(
        self,
        trace: Trace,
        profile: ReplicaProfile,
        spec: PolicySpec,
        *,
        dt: float,
        min_replicas: int,
        max_replicas: int,
        initial_replicas: int,
        seed: int = 1,
    ):
        self.trace = trace
        self.profile = profile
        self.spec = spec
        self.dt = dt
        self.rng = np.random.default_rng(seed)
        t = dict(SERVE_DEFAULT_TIMING)
        t.update(spec.timing)
        self.timing = ServeTiming(min_replicas=min_replicas, max_replicas=max_replicas, **t)
        self.replicas: List[Replica] = []
        self.next_rid = 0
        self.target = spec.fixed_replicas if spec.kind == "fixed" else initial_replicas
        for _ in range(self.target):
            self._add_replica(ready_at=0.0)
        self.handle_queue: deque = deque()
        self.handle_pushed = MetricsPath(start=0.0)  # handle queue length on its way to Serve
        self.serve_state: Dict[str, Any] = {}
        self.policy_state: Dict[str, Any] = {}
        self.last_scale_up: Optional[float] = None
        self.last_scale_down: Optional[float] = None
        self.kv_policy = None
        if spec.kind == "kvserve":
            tm = self.timing  # the policy's Serve knobs match the simulated Serve's
            defaults = dict(
                min_replicas=min_replicas,
                max_replicas=max_replicas,
                export_metrics=False,
                serve_upscale_delay_s=tm.upscale_delay_s,
                serve_downscale_delay_s=tm.downscale_delay_s,
                serve_look_back_period_s=tm.look_back_period_s,
                serve_metrics_interval_s=tm.metrics_interval_s,
            )
            self.kv_policy = KVServeAutoscalingPolicy(**{**defaults, **spec.knobs})
        n = trace.arrival.size
        self.ttft = np.full(n, np.nan)
        self.failed = np.zeros(n, dtype=bool)
        self.out_of = np.zeros(n)
        self.series: Dict[str, List[float]] = {
            k: [] for k in ("t", "target", "ready", "live", "queue", "waiting_tokens")
        }
        self.scale_events = 0
        self.events: List[Tuple[float, int, int]] = []
        self.reversals = 0
        self._last_dir = 0
        self.replica_seconds = 0.0
        self.replica_seconds_by_phase = np.zeros(3)

    # -- fleet --------------------------------------------------------------------------
    def _add_replica(self, ready_at: float) -> None:
        r = Replica(self.next_rid, self.profile, ready_at, np.random.default_rng(1000 + self.next_rid))
        self.next_rid += 1
        self.replicas.append(r)

    def _apply_target(self, new_target: int, now: float) -> None:
        if new_target != self.target:
            direction = 1 if new_target > self.target else -1
            self.scale_events += 1
            if self._last_dir and direction != self._last_dir:
                self.reversals += 1
            self._last_dir = direction
            self.events.append((round(now, 1), self.target, new_target))
            if direction > 0:
                self.last_scale_up = now
            else:
                self.last_scale_down = now
        self.target = new_target
        live = [r for r in self.replicas if not r.draining]
        if len(live) < new_target:
            for _ in range(new_target - len(live)):
                self._add_replica(now + self.profile.startup_s)
        elif len(live) > new_target:
            excess = len(live) - new_target
            starting = sorted((r for r in live if not r.ready(now)), key=lambda r: -r.ready_at)
            for r in starting[:excess]:
                r.retired = True
            excess -= min(excess, len(starting))
            if excess:
                ready = sorted((r for r in live if r.ready(now)), key=lambda r: r.ongoing())
                for r in ready[:excess]:
                    r.draining = True
                    r.stop_at = now + self.profile.graceful_shutdown_s
            self.replicas = [r for r in self.replicas if not r.retired]

    # -- metrics pipeline -----------------------------------------------------------------
    def _record_and_push(self, now: float) -> None:
        tm = self.timing
        for r in self.replicas:
            if not r.ready(now) or r.draining:
                continue
            r.pushed.advance(now, tm, r.metrics)
        self.handle_pushed.advance(now, tm, lambda: float(len(self.handle_queue)))

    def visible_handle_queue_mean(self) -> float:
        visible = self.handle_pushed.visible
        if not visible:
            return 0.0
        return sum(v for _, v in visible) / len(visible)

    # -- control --------------------------------------------------------------------------
    def _decide(self, now: float) -> int:
        spec = self.spec
        if spec.kind == "fixed":
            return spec.fixed_replicas
        ctx = SimCtx(self, now, dict(self.policy_state))
        if spec.kind == "request":
            if ctx.current_num_replicas == 0:
                desired: float = ctx.target_num_replicas
            else:
                desired = ctx.total_num_requests / spec.target_ongoing_requests
        else:
            desired, state = self.kv_policy(ctx)
            self.policy_state = state
        return serve_wrap(desired, ctx.current_num_replicas, self.target, self.timing, self.serve_state, now)

    # -- main loop ------------------------------------------------------------------------
    def run(self, duration: float, series_every_s: float = 5.0) -> "Simulation":
        tr = self.trace
        dt = self.dt
        n = tr.arrival.size
        nxt = 0
        now = 0.0
        next_series = 0.0
        while True:
            if now >= duration + 600.0:  # safety: drain at most 10 more minutes
                break
            end = now + dt
            while nxt < n and tr.arrival[nxt] < end:
                self.handle_queue.append(nxt)
                nxt += 1
            # dispatch: least-ongoing ready replica with room
            ready = [r for r in self.replicas if r.ready(now) and not r.draining]
            if ready and self.handle_queue:
                cap = self.profile.max_ongoing_requests
                heap = [(r.ongoing(), i) for i, r in enumerate(ready)]
                heapq.heapify(heap)
                hq = self.handle_queue
                while hq and heap:
                    ongo, i = heap[0]
                    if ongo >= cap:
                        break
                    rq = hq.popleft()
                    rep = ready[i]
                    rep.waiting.append(rq)
                    rep.wait_tokens += float(tr.prompt[rq])
                    heapq.heapreplace(heap, (ongo + 1, i))
            # engine steps
            for r in self.replicas:
                if r.ready(now):
                    r.step(now, dt, tr, self.ttft, self.out_of)
            # retire drained replicas
            keep = []
            for r in self.replicas:
                if r.draining and (r.ongoing() == 0 or now >= (r.stop_at or now)):
                    for q in r.waiting:
                        self.failed[q] = True
                    continue
                keep.append(r)
            self.replicas = keep
            # cost
            live = len(self.replicas)
            self.replica_seconds += live * dt
            if now < duration:
                ph = int(tr_phase(now, self))
                self.replica_seconds_by_phase[ph] += live * dt
            # metrics + control
            self._record_and_push(end)
            self._apply_target(self._decide(end), end)
            if now >= next_series:
                s = self.series
                s["t"].append(round(now, 2))
                s["target"].append(self.target)
                s["ready"].append(sum(1 for r in self.replicas if r.ready(now) and not r.draining))
                s["live"].append(live)
                s["queue"].append(len(self.handle_queue) + sum(len(r.waiting) for r in self.replicas))
                s["waiting_tokens"].append(float(sum(r.wait_tokens for r in self.replicas)))
                next_series = now + series_every_s
            now = end
            if now >= duration and nxt >= n and not self.handle_queue and all(not r.waiting for r in self.replicas):
                break
        # whatever never got a first token fails the SLO
        for q in self.handle_queue:
            self.failed[q] = True
        return self


def tr_phase(now: float, sim: Simulation) -> int:
    return int(sim.trace.spec.phase_of(now))


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


def _ttft_stats(ttft: np.ndarray, ok: np.ndarray, slo: float) -> Dict[str, Any]:
    n = int(ttft.size)
    if n == 0:
        return {"requests": 0}
    t = np.where(ok, ttft, np.inf)
    p99 = float(np.percentile(t, 99))
    p50 = float(np.percentile(t, 50))
    return {
        "requests": n,
        "slo_attainment": round(float((t <= slo).mean()), 4),
        "ttft_p50_s": round(p50, 3) if math.isfinite(p50) else float("inf"),
        "ttft_p99_s": round(p99, 3) if math.isfinite(p99) else float("inf"),
    }


def summarize(sim: Simulation, slo: float) -> Dict[str, Any]:
    """Per-run summary: cost, scale events and TTFT/SLO overall and per phase."""
    tr = sim.trace
    ok = np.isfinite(sim.ttft) & ~sim.failed
    out: Dict[str, Any] = {
        "policy": sim.spec.name,
        "label": sim.spec.label,
        "replica_seconds": round(sim.replica_seconds, 1),
        "replica_seconds_by_phase": {p: round(float(v), 1) for p, v in zip(PHASES, sim.replica_seconds_by_phase)},
        "mean_replicas": round(sim.replica_seconds / max(1e-9, tr_duration(sim)), 2),
        "max_target": int(max(sim.series["target"])) if sim.series["target"] else sim.target,
        "scale_events": sim.scale_events,
        "direction_reversals": sim.reversals,
        "failed_requests": int((~ok).sum()),
    }
    out["overall"] = _ttft_stats(sim.ttft, ok, slo)
    for i, p in enumerate(PHASES):
        m = tr.phase == i
        out[p] = _ttft_stats(sim.ttft[m], ok[m], slo)
    return out


def pool(runs: List[Tuple[Simulation, Dict[str, Any]]], slo: float) -> Dict[str, Any]:
    """Combine runs of one policy over several trace seeds: costs and event counts are
    averaged, TTFT percentiles and SLO attainment are computed over all requests."""
    first = runs[0][1]
    out: Dict[str, Any] = {"policy": first["policy"], "label": first["label"], "seeds": len(runs)}
    for key in ("replica_seconds", "mean_replicas", "scale_events", "direction_reversals", "failed_requests"):
        out[key] = round(float(np.mean([r[key] for _, r in runs])), 2)
    out["max_target"] = max(r["max_target"] for _, r in runs)
    out["replica_seconds_by_phase"] = {
        p: round(float(np.mean([r["replica_seconds_by_phase"][p] for _, r in runs])), 1) for p in PHASES
    }
    ttft = np.concatenate([sim.ttft for sim, _ in runs])
    ok = np.concatenate([np.isfinite(sim.ttft) & ~sim.failed for sim, _ in runs])
    phase = np.concatenate([sim.trace.phase for sim, _ in runs])
    out["overall"] = _ttft_stats(ttft, ok, slo)
    for i, p in enumerate(PHASES):
        out[p] = _ttft_stats(ttft[phase == i], ok[phase == i], slo)
    out["per_seed"] = [r for _, r in runs]
    return out


def tr_duration(sim: Simulation) -> float:
    return sim.trace.spec.duration_s


def calibrate_target_ongoing(profile: ReplicaProfile, utilization: float, dt: float, seed: int = 7) -> float:
    """Ongoing requests per replica when a fixed fleet runs the normal mix at ``utilization``
    of its token capacity: what an operator would set ``target_ongoing_requests`` to."""
    n_rep = 4
    spec = TraceSpec(
        duration_s=900.0,
        base_load_replicas=utilization * n_rep,
        diurnal_low=1.0,
        spike_factor=1.0,
        long_prompt_factor=1.0,
        seed=seed,
    )
    trace = make_trace(spec, profile)
    sim = Simulation(
        trace,
        profile,
        PolicySpec("cal", "cal", "fixed", fixed_replicas=n_rep),
        dt=dt,
        min_replicas=n_rep,
        max_replicas=n_rep,
        initial_replicas=n_rep,
    )
    samples: List[float] = []
    orig = sim._record_and_push

    def probe(now: float) -> None:
        orig(now)
        if now > 120.0:
            samples.append((len(sim.handle_queue) + sum(r.ongoing() for r in sim.replicas)) / n_rep)

    sim._record_and_push = probe  # type: ignore[method-assign]
    sim.run(spec.duration_s)
    return float(np.mean(samples))


def peak_fleet(spec: TraceSpec, utilization: float) -> int:
    t = np.arange(0.0, spec.duration_s, 1.0)
    load = spec.base_load_replicas * spec.diurnal(t) * np.where(spec.in_spike(t), spec.spike_factor, 1.0)
    return int(math.ceil(load.max() / utilization))


def run_all(
    profile: ReplicaProfile,
    spec: TraceSpec,
    *,
    dt: float,
    max_replicas: int,
    knobs: Dict[str, Any],
    utilization: float = 0.75,
    seeds: Sequence[int] = (0,),
    equal_cost_utilization: Optional[float] = 0.5,
) -> Dict[str, Any]:
    t0 = time.time()
    target_ongoing = calibrate_target_ongoing(profile, utilization, dt)
    fast_timing = dict(upscale_delay_s=0.0, downscale_delay_s=5.0, look_back_period_s=10.0, metrics_interval_s=2.0)
    n_peak = min(max_replicas, peak_fleet(spec, utilization))
    initial = max(1, int(math.ceil(spec.base_load_replicas * spec.diurnal_low / utilization)))
    policies = [
        PolicySpec("fixed_peak", f"fixed fleet sized for peak ({n_peak})", "fixed", fixed_replicas=n_peak),
        PolicySpec(
            "request_default",
            "Serve request-based, Serve default delays",
            "request",
            target_ongoing_requests=target_ongoing,
        ),
        PolicySpec(
            "request_fast",
            "Serve request-based, fast Serve delays",
            "request",
            timing=dict(fast_timing, downscale_delay_s=60.0),
            target_ongoing_requests=target_ongoing,
        ),
        PolicySpec(
            "kvserve",
            "kvserve (queue + token throughput)",
            "kvserve",
            timing=fast_timing,
            knobs=dict(knobs, target_utilization=utilization),
        ),
    ]
    if equal_cost_utilization:
        policies.append(
            PolicySpec(
                "kvserve_headroom",
                f"kvserve, target_utilization={equal_cost_utilization:g}",
                "kvserve",
                timing=fast_timing,
                knobs=dict(knobs, target_utilization=equal_cost_utilization),
            )
        )
    runs: Dict[str, List[Tuple[Simulation, Dict[str, Any]]]] = {ps.name: [] for ps in policies}
    series: Dict[str, Any] = {}
    events: Dict[str, Any] = {}
    requests = 0
    first_trace: Optional[Trace] = None
    for seed in seeds:
        sspec = replace(spec, seed=seed)
        trace = make_trace(sspec, profile)
        requests += int(trace.arrival.size)
        first_trace = first_trace or trace
        for ps in policies:
            ts = time.time()
            sim = Simulation(
                trace, profile, ps, dt=dt, min_replicas=1, max_replicas=max_replicas, initial_replicas=initial
            )
            sim.run(sspec.duration_s)
            res = summarize(sim, profile.ttft_slo_s)
            res["seed"] = seed
            res["sim_wall_s"] = round(time.time() - ts, 2)
            runs[ps.name].append((sim, res))
            if seed == seeds[0]:
                series[ps.name] = sim.series
                events[ps.name] = sim.events
    results = []
    for ps in policies:
        res = pool(runs[ps.name], profile.ttft_slo_s)
        sim0 = runs[ps.name][0][0]
        if ps.kind == "request":
            res["target_ongoing_requests"] = round(target_ongoing, 2)
        if ps.kind != "fixed":
            res["serve_timing"] = {
                k: v
                for k, v in asdict(sim0.timing).items()
                if k in ("upscale_delay_s", "downscale_delay_s", "look_back_period_s", "metrics_interval_s")
            }
        results.append(res)
        for _, r in runs[ps.name]:
            r.pop("label", None)
    runs.clear()
    t = np.arange(0.0, spec.duration_s, 5.0)
    mult = spec.diurnal(t) * np.where(spec.in_spike(t), spec.spike_factor, 1.0)
    work_mult = np.where(
        spec.in_long(t),
        profile.work_per_request(profile.prompt_mean * spec.long_prompt_factor, profile.output_mean)
        / profile.work_per_request(profile.prompt_mean, profile.output_mean),
        1.0,
    )
    assert first_trace is not None
    offered = {
        "t": t.tolist(),
        "requests_per_s": (first_trace.base_rate * mult).round(3).tolist(),
        "load_replicas": (spec.base_load_replicas * mult * work_mult).round(3).tolist(),
    }
    return {
        "profile": asdict(profile),
        "trace": asdict(spec),
        "seeds": list(seeds),
        "requests": requests,
        "base_rate_req_s": round(first_trace.base_rate, 3),
        "dt_s": dt,
        "max_replicas": max_replicas,
        "initial_replicas": initial,
        "target_utilization": utilization,
        "ttft_slo_s": profile.ttft_slo_s,
        "kvserve_knobs": KVServeAutoscalingConfig.from_dict(
            dict(knobs, target_utilization=utilization, min_replicas=1, max_replicas=max_replicas, export_metrics=False)
        ).to_dict(),
        "results": results,
        "offered": offered,
        "series_seed": seeds[0],
        "series": series,
        "scale_events_seed0": events,
        "wall_s": round(time.time() - t0, 2),
    }


def figures(r: dict) -> Figures:
    """The file's summary and comparison table (``benchmarks.common.Figures``), from its results."""
    f = Figures()
    res = {x["policy"]: x for x in r["results"]}
    ours, serve = res.get("kvserve"), res.get("request_default")
    if ours and serve:
        f.summary(
            f"autoscaling (simulated, profile {r['profile']['name']}): replica-seconds, kvserve / Serve's "
            "request-based policy with default delays",
            ours["replica_seconds"] / serve["replica_seconds"],
            "x",
            headline=True,
        )
        f.summary("SLO attainment, kvserve", ours["overall"]["slo_attainment"] * 100, "%")
        f.summary(
            "SLO attainment, Serve's request-based policy with default delays",
            serve["overall"]["slo_attainment"] * 100,
            "%",
        )

    def pct(x):
        return None if x is None else x * 100

    phases = ("overall", "diurnal", "spike", "long_prompt")
    f.table(
        "Policies",
        ["policy", "replica-s", "mean replicas", "scale events"]
        + [f"SLO {p.replace('_', '-')} (%)" for p in phases]
        + [f"TTFT p99 {p.replace('_', '-')} (s)" for p in phases[1:]],
        [
            [x["label"], x["replica_seconds"], x["mean_replicas"], x["scale_events"]]
            + [pct(x[p].get("slo_attainment")) for p in phases]
            + [x[p].get("ttft_p99_s") for p in phases[1:]]
            for x in r["results"]
        ],
        note=f"Profile `{r['profile']['name']}`; TTFT SLO {r['ttft_slo_s']} s; {len(r['seeds'])} trace seeds, "
        f"{r['requests']} requests in all. Replica-seconds (start-up and draining included), mean replicas "
        "and scale events are per trace (mean over seeds); SLO attainment and TTFT p99 pool all requests. "
        "Replica profile: " + ", ".join(f"{k} {v}" for k, v in r["profile"].items() if k != "name") + ".",
    )
    return f


def markdown_table(report: Dict[str, Any]) -> str:
    slo = report["ttft_slo_s"]
    lines = [
        f"Profile `{report['profile']['name']}`; TTFT SLO {slo:g} s; {len(report['seeds'])} trace seeds, "
        f"{report['requests']} requests in all. Replica-seconds (start-up and draining included), mean replicas "
        f"and scale events are per trace (mean over seeds); SLO attainment and TTFT p99 pool all requests.",
        "",
        "| policy | replica-s | mean replicas | scale events | SLO all | SLO diurnal | SLO spike | "
        "SLO long-prompt | TTFT p99 diurnal (s) | TTFT p99 spike (s) | TTFT p99 long-prompt (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def pct(x):
        return f"{100 * x:.1f}%" if x is not None else "-"

    def sec(x):
        return "inf" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.2f}"

    for r in report["results"]:
        lines.append(
            f"| {r['label']} | {r['replica_seconds']:.0f} | {r['mean_replicas']:.2f} | {r['scale_events']:.0f} | "
            f"{pct(r['overall'].get('slo_attainment'))} | {pct(r['diurnal'].get('slo_attainment'))} | "
            f"{pct(r['spike'].get('slo_attainment'))} | {pct(r['long_prompt'].get('slo_attainment'))} | "
            f"{sec(r['diurnal'].get('ttft_p99_s'))} | {sec(r['spike'].get('ttft_p99_s'))} | "
            f"{sec(r['long_prompt'].get('ttft_p99_s'))} |"
        )
    return "\n".join(lines) + "\n"


def plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spec = report["trace"]
    fig, axes = plt.subplots(3, 1, figsize=(12, 9.5), sharex=True)
    off = report["offered"]
    tmin = np.asarray(off["t"]) / 60.0
    ax = axes[0]
    ax.plot(tmin, off["load_replicas"], color="black", lw=1.2, label="offered load (replicas at 100%)")
    ax.set_ylabel("offered load\n(full replicas)")
    ax2 = ax.twinx()
    ax2.plot(tmin, off["requests_per_s"], color="grey", lw=0.8, ls="--", label="requests/s")
    ax2.set_ylabel("requests/s")
    colors = {
        "fixed_peak": "tab:gray",
        "request_default": "tab:red",
        "request_fast": "tab:orange",
        "kvserve": "tab:blue",
        "kvserve_headroom": "tab:cyan",
    }
    labels = {r["policy"]: r["label"] for r in report["results"]}
    for name, s in report["series"].items():
        t = np.asarray(s["t"]) / 60.0
        axes[1].step(t, s["ready"], where="post", color=colors.get(name), lw=1.3, label=labels[name])
        q = np.maximum(np.asarray(s["queue"], dtype=float), 0.0)
        axes[2].plot(t, q, color=colors.get(name), lw=1.0, label=labels[name])
    axes[1].set_ylabel("ready replicas")
    axes[2].set_ylabel("waiting requests\n(handle + engine)")
    axes[2].set_yscale("symlog", linthresh=10)
    axes[2].set_xlabel("time (min)")
    for a in axes:
        a.axvspan(
            spec["spike_start_s"] / 60,
            (spec["spike_start_s"] + spec["spike_duration_s"]) / 60,
            color="tab:red",
            alpha=0.08,
        )
        a.axvspan(
            spec["long_start_s"] / 60,
            (spec["long_start_s"] + spec["long_duration_s"]) / 60,
            color="tab:green",
            alpha=0.08,
        )
        a.grid(alpha=0.3)
    axes[0].text(spec["spike_start_s"] / 60, 0.92, " 5x spike", transform=axes[0].get_xaxis_transform(), fontsize=9)
    axes[0].text(spec["long_start_s"] / 60, 0.92, " 3x prompts", transform=axes[0].get_xaxis_transform(), fontsize=9)
    axes[1].legend(loc="upper right", fontsize=8)
    axes[0].set_title(
        f"kvserve autoscaling simulation ({report['profile']['name']}, "
        f"start-up {report['profile']['startup_s']:g} s, TTFT SLO {report['ttft_slo_s']:g} s)"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="benchmarks/results/autoscaling")
    ap.add_argument("--gpu-profile", action="store_true", help="H100-like replica numbers instead of CPU SmolLM2")
    ap.add_argument(
        "--throughput-json",
        default="benchmarks/results/throughput.json",
        help="measured replica numbers (used for the CPU profile when present)",
    )
    ap.add_argument("--dt", type=float, default=0.5)
    ap.add_argument("--max-replicas", type=int, default=32)
    ap.add_argument("--base-load", type=float, default=4.0, help="offered load at diurnal peak, full replicas")
    ap.add_argument(
        "--seeds",
        default=None,
        help="comma-separated trace seeds, results pooled (default 0,1,2; 0 with --gpu-profile)",
    )
    ap.add_argument(
        "--equal-cost-utilization",
        type=float,
        default=0.5,
        help="also run kvserve at this target_utilization (0 to skip)",
    )
    ap.add_argument("--startup-s", type=float, default=None, help="override replica start-up time")
    ap.add_argument(
        "--knob", action="append", default=[], metavar="NAME=VALUE", help="kvserve policy knob override (repeatable)"
    )
    args = ap.parse_args(argv)
    prov = Results(__file__, RESULT_KEYS)
    # Importing Ray Serve gives its "ray.serve" logger a stderr handler at INFO; the policy's
    # decision lines (a child logger) are for a live controller, not thousands of replayed ticks.
    logging.getLogger(decision_logger.name).setLevel(logging.WARNING)

    profile = GPU_PROFILE if args.gpu_profile else load_profile(args.throughput_json, CPU_PROFILE)
    if args.startup_s is not None:
        profile = replace(profile, startup_s=args.startup_s)
    knobs: Dict[str, Any] = {}
    for kv in args.knob:
        k, v = kv.split("=", 1)
        knobs[k] = json.loads(v) if v[:1] in "0123456789-[{tf" else v
    spec = TraceSpec(base_load_replicas=args.base_load)
    seeds_arg = args.seeds if args.seeds is not None else ("0" if args.gpu_profile else "0,1,2")
    seeds = [int(x) for x in seeds_arg.split(",") if x.strip()]
    report = run_all(
        profile,
        spec,
        dt=args.dt,
        max_replicas=args.max_replicas,
        knobs=knobs,
        seeds=seeds,
        equal_cost_utilization=args.equal_cost_utilization or None,
    )
    os.makedirs(args.out, exist_ok=True)
    suffix = "_gpu" if args.gpu_profile else ""
    prov.write(os.path.join(args.out, f"autoscaling{suffix}.json"), report, indent=1, default=float)
    plot(report, os.path.join(args.out, f"autoscaling{suffix}.png"))
    print(markdown_table(report))
    print(f"wall {report['wall_s']} s; wrote {args.out}/autoscaling{suffix}.{{json,png}}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
