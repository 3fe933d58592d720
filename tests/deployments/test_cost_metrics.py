"""The cost metrics' arithmetic on known inputs (kvserve/telemetry/cost_metrics.py): a replica's cost
accrued by a clock, its cost per million output tokens, and what a response cache hit saves."""

import pytest

from kvserve.telemetry.cost_metrics import CacheSavings, ReplicaCost, cost_per_million


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def _value(metric, labels):
    return metric.prom.labels(**labels)._value.get()


def test_replica_cost_accrues_by_the_clock_idle_time_included():
    clock = Clock()
    labels = {"model_name": "cost-test", "replica": "r1", "variant": "B"}
    cost = ReplicaCost(labels, cost_per_hour=7.2, clock=clock)  # 0.002 per second
    assert cost.per_million() is None  # nothing generated yet
    clock.t += 1800  # half an hour idle: 3.6
    assert cost.accrue() == pytest.approx(3.6)
    cost.generated(1000)
    clock.t += 1800
    cost.generated(2000)  # 7.2 over 3000 tokens
    assert cost.cost == pytest.approx(7.2)
    assert cost.per_million() == pytest.approx(7.2 / 3000 * 1e6)
    assert _value(cost._total, labels) == pytest.approx(7.2)
    assert _value(cost._per_m, labels) == pytest.approx(2400.0)
    clock.t -= 10  # a clock that steps back accrues nothing
    assert cost.accrue() == pytest.approx(7.2)
    with pytest.raises(ValueError, match=">= 0"):
        ReplicaCost(labels, -1.0)


def test_cost_per_million():
    assert cost_per_million(3.0, 1_500_000) == pytest.approx(2.0)
    assert cost_per_million(3.0, 0) is None


def test_cache_savings_price_the_saved_tokens():
    s = CacheSavings()
    labels = {"model_name": "cost-test-save", "level": "exact", "variant": ""}
    assert s.hit("cost-test-save", "exact", "", 250, 2400.0) == pytest.approx(0.6)
    assert s.hit("cost-test-save", "exact", "", 100, None) == 0.0  # no measured cost yet: tokens only
    assert _value(s.tokens, labels) == 350
    assert _value(s.cost, labels) == pytest.approx(0.6)
