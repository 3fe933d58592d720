"""What the autoscaling policy reads from Serve's context and keeps in it (no Ray cluster): missing metrics
and no replicas, the newest raw sample over the window mean, and its state only in ``policy_state``."""

import json
import math
from types import SimpleNamespace

from policy_driver import drive, fleet, make_ctx

from kvserve.autoscaling import policy as P
from kvserve.autoscaling import signals as sig
from kvserve.autoscaling.decision import REASON_NO_METRICS, decide
from kvserve.autoscaling.demand import REASON_REQUESTS_FALLBACK
from kvserve.autoscaling.settings import KVServeAutoscalingConfig


def test_missing_metrics_and_no_replicas():
    cfg = KVServeAutoscalingConfig()
    # No replica has reported yet: hold the current target.
    d, state = decide(make_ctx({}, 3, 100.0), cfg)
    assert d.desired == 3 and d.reason == REASON_NO_METRICS
    # Running replicas that have not reported, lazily evaluated metrics that raise.
    ctx = make_ctx({}, 2, 100.0)
    ctx.running_replicas = ["a", "b"]

    class Boom:
        def __get__(self, obj, objtype=None):
            raise RuntimeError("controller hiccup")

    class Ctx(SimpleNamespace):
        aggregated_metrics = Boom()

    c2 = Ctx(**{k: v for k, v in vars(ctx).items() if k != "aggregated_metrics"})
    d, _ = decide(c2, cfg)
    assert d.desired == 2
    # Below min with nothing reported: brought up to min.
    d, _ = decide(make_ctx({}, 0, 100.0), cfg)
    assert d.desired == cfg.min_replicas
    # No capacity reported (and none remembered): fall back to request counts.
    per = {
        f"r{i}": {
            sig.NUM_RUNNING_REQUESTS: 60.0,
            sig.NUM_WAITING_REQUESTS: 4.0,
            sig.GENERATION_TOKENS_PER_S: float("nan"),
        }
        for i in range(2)
    }
    run = drive(cfg, lambda t, n: per, 10.0, target0=2)
    assert run.changes and run.changes[0][3] == REASON_REQUESTS_FALLBACK
    assert run.target == math.ceil(128 / cfg.fallback_ongoing_per_replica - cfg.upscale_tolerance)


def test_latest_raw_sample_is_used():
    cfg = KVServeAutoscalingConfig(max_replicas=16)
    # aggregated (window mean) says idle; the newest raw sample says overloaded
    per_now = fleet(2, util=1.0, waiting=20, waiting_tok=2000)
    idle = fleet(2, util=0.0, running=0.0)
    names = sig.METRIC_NAMES

    class TSV:  # ray.serve._private.common.TimeStampedValue look-alike
        def __init__(self, timestamp, value):
            self.timestamp, self.value = timestamp, value

    def ctx_at(now, state, target):
        c = make_ctx(idle, target, now, state)
        c.raw_metrics = {
            n: {rid: [TSV(now - 5, idle[rid][n]), TSV(now - 1, per_now[rid][n])] for rid in per_now} for n in names
        }
        return c

    state, target = {}, 2
    for i in range(20):
        d, state = decide(ctx_at(1000.0 + i * 0.5, state, target), cfg)
        target = d.desired
    assert target > 2
    d2, _ = decide(ctx_at(2000.0, {}, 2), KVServeAutoscalingConfig(signal_source="aggregated"))
    assert d2.inputs["load_replicas"] == 0.0


def test_state_is_kept_in_policy_state_only():
    cfg = KVServeAutoscalingConfig()
    serve_keys = {"__decision_counter": 3, "__decision_timestamp": 12.0}
    ctx = make_ctx(fleet(2), 2, 100.0, dict(serve_keys))
    before = dict(ctx.policy_state)
    n, state = P.kvserve_policy(ctx, cfg)
    assert ctx.policy_state == before  # input not mutated
    assert all(state[k] == v for k, v in serve_keys.items())  # foreign keys preserved
    assert any(k.startswith("kvserve.") for k in state)
    json.dumps(state)
    # a class instance keeps only the config: two calls with the same state agree
    pol = P.KVServeAutoscalingPolicy(max_replicas=4)
    assert pol(make_ctx(fleet(2), 2, 100.0, state))[0] == pol(make_ctx(fleet(2), 2, 100.0, state))[0]
