"""Time-of-day floor: minimum replicas by local hour ("time-based" and "hybrid" modes).

A schedule is a tuple of :class:`ScheduleEntry`; :func:`parse_schedule` reads the forms a
config file or a CLI flag gives (``"8-20:4,22-6:1"``), :func:`schedule_floor` evaluates it.

Pure: standard library only (``zoneinfo`` for named time zones).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Mapping, Protocol, Tuple, Union


@dataclass(frozen=True)
class ScheduleEntry:
    """Minimum replicas between two local hours; ``end_hour < start_hour`` wraps midnight.

    Hours are floats in [0, 24] (9.5 = 09:30); the window is ``[start_hour, end_hour)``;
    ``start_hour == end_hour`` is the whole day. Raises ValueError on an hour outside
    [0, 24] or a negative ``min_replicas``.
    """

    start_hour: float
    end_hour: float
    min_replicas: int

    def __post_init__(self):
        for name in ("start_hour", "end_hour"):
            v = getattr(self, name)
            if not (0.0 <= float(v) <= 24.0):
                raise ValueError(f"schedule {name}={v} must be within [0, 24]")
        if int(self.min_replicas) < 0:
            raise ValueError("schedule min_replicas must be >= 0")

    def contains(self, hour: float) -> bool:
        s, e = float(self.start_hour), float(self.end_hour)
        if s == e:
            return True  # whole day
        if s < e:
            return s <= hour < e
        return hour >= s or hour < e

    def to_dict(self) -> Dict[str, Any]:
        return {
            "start_hour": float(self.start_hour),
            "end_hour": float(self.end_hour),
            "min_replicas": int(self.min_replicas),
        }


def parse_schedule(spec: Union[None, str, Iterable[Any]]) -> Tuple[ScheduleEntry, ...]:
    """Parse a schedule from ``"8-20:4,20-23:2"`` (``START-END:MIN_REPLICAS``, hours as
    floats, 9.5 = 09:30), a list of dicts ``{"start_hour", "end_hour", "min_replicas"}``,
    a list of ``(start, end, n)`` tuples, or ``ScheduleEntry`` objects.

    Raises ValueError on a malformed string entry or a bad hour / replica count."""
    if spec is None or spec == "" or spec == ():
        return ()
    if isinstance(spec, str):
        entries = []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            try:
                window, n = part.rsplit(":", 1)
                start, end = window.split("-", 1)
                entries.append(ScheduleEntry(float(start), float(end), int(n)))
            except ValueError as e:
                raise ValueError(
                    f"bad schedule entry {part!r}: expected START-END:MIN_REPLICAS (hours, e.g. '8-20:4' or '22-6:1')"
                ) from e
        return tuple(entries)
    out = []
    for item in spec:
        if isinstance(item, ScheduleEntry):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(ScheduleEntry(float(item["start_hour"]), float(item["end_hour"]), int(item["min_replicas"])))
        else:
            s, e, n = item
            out.append(ScheduleEntry(float(s), float(e), int(n)))
    return tuple(out)


def local_hour(now: float, tz_name: str) -> float:
    """Hour of day (0..24, fractional) of the Unix time ``now`` (seconds) in ``tz_name``.

    An unknown zone (or no tzdata) falls back to UTC rather than failing the controller."""
    tz: Any = datetime.timezone.utc
    if tz_name and tz_name.upper() != "UTC":
        try:
            from zoneinfo import ZoneInfo

            tz = ZoneInfo(tz_name)
        except Exception:
            tz = datetime.timezone.utc
    dt = datetime.datetime.fromtimestamp(now, tz)
    return dt.hour + dt.minute / 60.0 + dt.second / 3600.0


class ScheduleSettings(Protocol):
    """The knobs :func:`schedule_floor` reads; ``kvserve.autoscaling.settings.KVServeAutoscalingConfig``
    has them. A protocol, so this module needs nothing from settings.py (which imports it)."""

    schedule: Tuple[ScheduleEntry, ...]
    policy_mode: str
    schedule_timezone: str
    schedule_prewarm_s: float


def schedule_floor(config: ScheduleSettings, now: float) -> int:
    """Minimum replicas the schedule asks for at ``now + schedule_prewarm_s`` (Unix seconds),
    in ``schedule_timezone``; 0 without a schedule or in "metrics" mode."""
    if not config.schedule or config.policy_mode == "metrics":
        return 0
    hour = local_hour(now + config.schedule_prewarm_s, config.schedule_timezone)
    floor = 0
    for e in config.schedule:
        if e.contains(hour):
            floor = max(floor, int(e.min_replicas))
    return floor


def _floor_at(schedule: Tuple[ScheduleEntry, ...], hour: float) -> int:
    return max((int(e.min_replicas) for e in schedule if e.contains(hour)), default=0)


#: Resolution of :func:`low_traffic_now` / :func:`seconds_until_low_traffic` over a day, hours.
_STEP_H = 0.25


def low_traffic_now(schedule: Tuple[ScheduleEntry, ...], now: float, tz_name: str = "UTC") -> bool:
    """Whether ``now`` (Unix seconds) is in one of the schedule's low-traffic windows: the
    hours whose floor is the lowest of the day (hours no entry covers have floor 0). An empty
    schedule has no such window (False): "low traffic" must be declared, not assumed.
    Used by ``kvserve warm --schedule`` (cache warming off-peak)."""
    if not schedule:
        return False
    lowest = min(_floor_at(schedule, i * _STEP_H) for i in range(int(24 / _STEP_H)))
    return _floor_at(schedule, local_hour(now, tz_name)) == lowest


def seconds_until_low_traffic(schedule: Tuple[ScheduleEntry, ...], now: float, tz_name: str = "UTC") -> float | None:
    """Seconds from ``now`` to the next low-traffic window (0: in one now), to a quarter of an
    hour; None for an empty schedule."""
    if not schedule:
        return None
    for i in range(int(24 / _STEP_H) + 1):
        t = now + i * _STEP_H * 3600.0
        if low_traffic_now(schedule, t, tz_name):
            return i * _STEP_H * 3600.0
    return None
