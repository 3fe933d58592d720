"""The autoscaling policy's schedule (no Ray cluster): the time-based floor and hybrid mode, the
schedule's time zone, and the forms a schedule is written in."""

import pytest
from policy_driver import drive, fleet, make_ctx

from kvserve.autoscaling import schedule as sch
from kvserve.autoscaling.decision import REASON_SCHEDULE, decide
from kvserve.autoscaling.settings import KVServeAutoscalingConfig


def test_time_based_floor():
    day = 1_700_006_400.0  # 2023-11-15 00:00:00 UTC
    hour = lambda h: day + h * 3600.0  # noqa: E731
    tb = KVServeAutoscalingConfig(policy_mode="time-based", schedule="8-20:4,22-6:2", max_replicas=8)
    for h, want in ((10, 4), (7.9, 1), (21, 1), (23, 2), (3, 2), (20, 1)):
        d, _ = decide(make_ctx(fleet(1), 1, hour(h)), tb)
        assert d.desired == want, (h, d)
    # pre-warm: the window counts from schedule_prewarm_s earlier
    pw = tb.replace(schedule_prewarm_s=300.0)
    assert decide(make_ctx(fleet(1), 1, hour(7.95)), pw)[0].desired == 4

    hy = KVServeAutoscalingConfig(
        policy_mode="hybrid", schedule=[{"start_hour": 8, "end_hour": 20, "min_replicas": 4}], max_replicas=16
    )
    idle = lambda t, n: fleet(n, util=0.0, running=0.0, kv=0.0)  # noqa: E731
    # idle inside the window: the floor wins at once, cool-downs notwithstanding
    run = drive(hy, idle, 300.0, target0=1, t0=hour(9))
    assert run.changes[0][0] == 0.0 and run.changes[0][3] == REASON_SCHEDULE and run.target == 4
    # idle outside the window: down to min_replicas
    assert drive(hy, idle, 900.0, target0=4, t0=hour(21)).target == 1
    # busy inside the window: metrics above the floor
    assert drive(hy, lambda t, n: fleet(n, util=min(1.0, 7.5 / n)), 120.0, target0=4, t0=hour(9)).target == 10
    # metrics mode ignores the schedule
    assert sch.schedule_floor(KVServeAutoscalingConfig(schedule="0-24:4"), hour(9)) == 0


def test_schedule_timezone():
    pytest.importorskip("zoneinfo")
    from zoneinfo import ZoneInfo

    try:
        ZoneInfo("Asia/Tokyo")
    except Exception:
        pytest.skip("no tzdata")
    cfg = KVServeAutoscalingConfig(policy_mode="time-based", schedule="9-18:3", schedule_timezone="Asia/Tokyo")
    day = 1_700_006_400.0  # 00:00 UTC = 09:00 in Tokyo
    assert decide(make_ctx(fleet(1), 1, day + 60), cfg)[0].desired == 3
    assert decide(make_ctx(fleet(1), 1, day + 10 * 3600), cfg)[0].desired == 1  # 19:00 Tokyo


def test_parse_schedule_forms():
    a = sch.parse_schedule("8-20:4, 22-6:2")
    b = sch.parse_schedule([{"start_hour": 8, "end_hour": 20, "min_replicas": 4}, (22, 6, 2)])
    assert a == b and len(a) == 2
    with pytest.raises(ValueError):
        sch.parse_schedule("8to20=4")
