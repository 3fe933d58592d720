"""Cheap refusals: the gateway refuses a request its model's replicas would refuse, before the
request crosses to a replica.

Under a flood (thousands of streams at once) every refusal that crosses the gateway's handle to
a replica costs the same cores the engine runs on: Serve's router probes full replicas over and
over (each probe an actor call the replica answers with a rejection) and the replica's admission
answers each request that gets in: many replica rejections per refused request, and refusals
that arrive late (measured by ``benchmarks/sse_flood.py``).

:class:`LoadShedder` keeps, per model, how many requests this gateway replica has open to it.
When a replica (or Serve's bounded handle queue) refuses one as full, that count is the model's
capacity as this gateway sees it (the mark): while the count stays at or above it, requests are
refused here at once (429 ``queue_full`` with the replica's ``Retry-After``), and a slot freed by
a finished request is taken by the next request at once. One request per :data:`HOLD_S` seconds
goes through beyond the mark as a probe, so capacity added by the autoscaler (or freed by another
gateway replica's traffic) is found again: the mark ends when a request beyond it is admitted,
and a refused probe renews it. Never more than one probe at a time: under a flood, letting every
request through when a hold ran out sent thousands to the replicas before the first refusal came
back (measured by ``benchmarks/sse_flood.py``). Admission stays the replica's: this only saves
the trip when the answer is already known. The same idea as a circuit breaker's half-open probe
(Nygard, *Release It!*, ch. 5).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from kvserve.deployments.contract.openai_errors import OpenAIError

#: Seconds between probes: while a "full" mark holds, one request per HOLD_S goes through beyond it.
HOLD_S = 1.0


@dataclass
class _Mark:
    limit: int  # requests this gateway had open to the model when a replica said "full"
    until: float  # monotonic seconds: the next probe may go from then on
    retry_after_s: float


class LoadShedder:
    """Per-model count of this gateway replica's open requests, and the refusal marks.

    Counts are per handle call (one per prompt of a request). Runs on the gateway's event loop
    (no lock needed).
    """

    def __init__(self, hold_s: float = HOLD_S):
        if hold_s <= 0:
            raise ValueError(f"hold_s must be positive, got {hold_s}")
        self.hold_s = hold_s
        self.open: dict[str, int] = {}
        self.marks: dict[str, _Mark] = {}
        self.shed: dict[str, int] = {}  # refused here since the model's last request went out

    def check(self, model: str, needed: int = 1) -> OpenAIError | None:
        """The refusal of a request that would open ``needed`` more streams to ``model``, or
        None to send it on (also when the mark has expired: the request is the probe, and when
        it needs more than the capacity seen: whether it can ever run is the replica's to say,
        a 400 ``too_large`` where a 429 would promise a retry that cannot succeed). A request
        beyond the mark goes as the probe once :data:`HOLD_S` has passed since the mark was set
        or the last probe went."""
        mark = self.marks.get(model)
        if mark is None:
            return None
        if self.open.get(model, 0) + needed <= mark.limit or needed > mark.limit:
            return None
        now = time.monotonic()
        if now >= mark.until:  # the probe: the next one waits a hold again
            mark.until = now + self.hold_s
            return None
        self.shed[model] = self.shed.get(model, 0) + needed
        return OpenAIError(
            f"the model '{model}' is at capacity, retry later",
            429,
            "rate_limit_error",
            code="queue_full",
            retry_after_s=mark.retry_after_s,
        )

    def opened(self, model: str) -> int:
        """A stream to ``model`` is sent to its handle; returns the requests refused here since
        the previous one (the replica counts them as refused demand for the autoscaler)."""
        self.open[model] = self.open.get(model, 0) + 1
        return self.shed.pop(model, 0)

    def admitted(self, model: str) -> None:
        """A stream to ``model`` got its first chunk (call before :meth:`closed` for it): if
        more requests are open than the mark allowed (a probe got in), the model has room again
        and its mark ends."""
        mark = self.marks.get(model)
        if mark is not None and self.open.get(model, 0) > mark.limit:
            del self.marks[model]

    def closed(self, model: str) -> None:
        """A stream to ``model`` ended (finished, failed, refused or cancelled): its slot is free."""
        self.open[model] = max(0, self.open.get(model, 0) - 1)

    def refused(self, model: str, retry_after_s: float | None) -> None:
        """A replica or Serve refused a request to ``model`` as full (call after :meth:`closed`
        for it): the requests still open are the model's capacity for :data:`HOLD_S` seconds
        (the smallest count seen while the mark holds: Serve's handle queue refuses later than
        the replicas do, with its queue's requests counted as open)."""
        now, limit = time.monotonic(), max(1, self.open.get(model, 0))
        mark = self.marks.get(model)
        if mark is not None and now < mark.until:
            limit = min(limit, mark.limit)
        self.marks[model] = _Mark(limit=limit, until=now + self.hold_s, retry_after_s=max(1.0, retry_after_s or 1.0))
