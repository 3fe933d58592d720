"""What serving costs, and what the response cache saves, as metrics.

- On each replica (:class:`ReplicaCost`, given ``cost_per_replica_hour``):
  ``kvserve:replica_cost_total`` (the replica's cost accrued by the wall clock since it started,
  idle time included: a replica costs what it costs whether it generates or not) and the gauge
  ``kvserve:cost_per_million_output_tokens`` (that cost over the tokens it generated, times a
  million). Across replicas and over a window, the cost per token is
  ``sum(increase(kvserve:replica_cost_total[w])) / sum(increase(kvserve:generation_tokens_total[w])) * 1e6``
  (the Grafana dashboard's panel), which weighs each replica by what it did.
- On the gateway (:class:`CacheSavings`): ``kvserve:cache_saved_tokens_total`` (output tokens a
  response cache hit answered that no replica generated) and ``kvserve:cache_saved_cost_total``
  (those tokens priced at the model's measured cost per output token, as its replicas publish
  it; a hit before any replica has measured one counts its tokens but no cost).

Labels: as the engine's (``model_name``, ``replica``, ``variant``) on the replica's; ``model_name``,
``level`` (``exact`` or ``semantic``) and ``variant`` on the gateway's. Costs are in the unit
``cost_per_replica_hour`` is given in (the operator's currency).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvserve.telemetry.registry import metric

#: Labels of the gateway's savings metrics.
SAVINGS_LABELS = ("model_name", "level", "variant")


def cost_per_million(cost: float, tokens: int) -> float | None:
    """``cost`` spread over ``tokens`` output tokens, per million tokens; None for no tokens."""
    return None if tokens <= 0 else cost / tokens * 1e6


class ReplicaCost:
    """One replica's cost: accrued from ``cost_per_hour`` by ``clock`` (seconds) since it was
    made, and its cost per million output tokens so far (see the module docstring).

    Args:
        labels: the replica's engine labels.
        cost_per_hour: what the replica costs per hour (>= 0).
        clock: monotonic seconds (tests give a fake one).

    Raises:
        ValueError: a negative ``cost_per_hour``.
    """

    def __init__(self, labels: dict[str, str], cost_per_hour: float, clock: Callable[[], float] = time.monotonic):
        if not cost_per_hour >= 0:
            raise ValueError(f"cost_per_replica_hour must be >= 0, got {cost_per_hour}")
        self.labels, self.cost_per_hour, self._clock = labels, float(cost_per_hour), clock
        self.cost, self.tokens = 0.0, 0
        self._last = clock()
        self._lock = threading.Lock()  # the step thread and the event loop both call in
        self._total = metric(
            "counter",
            "replica_cost",
            "Cost of the replica accrued by the wall clock since it started (cost_per_replica_hour).",
            tuple(labels),
        )
        self._per_m = metric(
            "gauge",
            "cost_per_million_output_tokens",
            "The replica's cost so far over the output tokens it generated, per million.",
            tuple(labels),
        )

    def accrue(self) -> float:
        """Add the cost of the time since the last call; returns the cost so far."""
        with self._lock:
            now = self._clock()
            delta = max(0.0, now - self._last) * self.cost_per_hour / 3600.0
            self._last = now
            self.cost += delta
            self._total.inc(self.labels, delta)
            per_m = cost_per_million(self.cost, self.tokens)
            if per_m is not None:
                self._per_m.set(self.labels, per_m)
            return self.cost

    def generated(self, tokens: int) -> None:
        """``tokens`` more output tokens were generated (then the cost is brought up to date)."""
        with self._lock:
            self.tokens += max(0, int(tokens))
        self.accrue()

    def per_million(self) -> float | None:
        """The cost per million output tokens so far (None before the first token)."""
        self.accrue()
        with self._lock:
            return cost_per_million(self.cost, self.tokens)


class CacheSavings:
    """The gateway's count of what response cache hits saved (see the module docstring)."""

    def __init__(self):
        self.tokens = metric(
            "counter",
            "cache_saved_tokens",
            "Output tokens answered from the response cache instead of generated, by level.",
            SAVINGS_LABELS,
        )
        self.cost = metric(
            "counter",
            "cache_saved_cost",
            "The cost of the output tokens the response cache answered, at the model's measured "
            "cost per token, by level.",
            SAVINGS_LABELS,
        )

    def hit(
        self, model: str, level: str, variant: str, output_tokens: int, cost_per_million_tokens: float | None
    ) -> float:
        """Count one hit that answered ``output_tokens``; returns the cost saved (0 when the
        model's cost per token is not known)."""
        labels = {"model_name": model, "level": level, "variant": variant}
        self.tokens.inc(labels, output_tokens)
        saved = 0.0 if cost_per_million_tokens is None else output_tokens * cost_per_million_tokens / 1e6
        self.cost.inc(labels, saved)
        return saved
