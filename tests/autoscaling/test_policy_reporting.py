"""How the autoscaling policy reports its decisions (no Ray cluster): one structured log line per change
and the metrics it exports, labelled by reason."""

import json
import logging

from policy_driver import drive, fleet

from kvserve.autoscaling import decision as dec
from kvserve.autoscaling.decision import REASON_HYSTERESIS
from kvserve.autoscaling.demand import REASON_QUEUE
from kvserve.autoscaling.settings import KVServeAutoscalingConfig


def test_decision_logged_as_one_structured_line(caplog):
    cfg = KVServeAutoscalingConfig(max_replicas=16, log_interval_s=30.0, queue_drain_s=0)
    with caplog.at_level(logging.INFO, logger=dec.logger.name):
        run = drive(cfg, lambda t, n: fleet(2, util=0.7, waiting=16, waiting_tok=800), 20.0, target0=2)
    recs = [json.loads(r.getMessage()) for r in caplog.records if r.name == dec.logger.name]
    # 40 evaluations, but only changes of decision/reason (and one line per 30 s) are logged
    assert 1 <= len(recs) <= 6
    up = [r for r in recs if r["action"] == "up"]
    assert up and up[0]["desired"] == run.changes[0][2] and up[0]["reason"] == REASON_QUEUE
    for key in (
        "waiting_requests",
        "waiting_prefill_tokens",
        "load_replicas",
        "raw_desired",
        "smoothed_desired",
        "signals",
        "target_replicas",
        "decode_capacity_tokens_per_s",
    ):
        assert key in up[0]


def test_metrics_export_with_reason_label():
    from kvserve.autoscaling import metrics as M

    class Fake(M._Backend):
        def __init__(self):
            self.desired, self.raw, self.count = {}, {}, {}

        def set_desired(self, labels, value):
            self.desired[labels["reason"]] = value

        def set_raw(self, labels, value):
            self.raw[labels["deployment"]] = value

        def inc_decision(self, labels):
            key = (labels["direction"], labels["reason"])
            self.count[key] = self.count.get(key, 0) + 1

    fake = Fake()
    M.set_backend(fake)
    try:
        cfg = KVServeAutoscalingConfig(max_replicas=16, queue_drain_s=0)
        drive(cfg, lambda t, n: fleet(2, util=0.7, waiting=16, waiting_tok=800), 20.0, target0=2)
        assert fake.desired[REASON_QUEUE] == 0.0 or fake.desired.get(REASON_HYSTERESIS) == 0.0
        current = [r for r, v in fake.desired.items() if v > 0]
        assert len(current) == 1  # one live reason series, the others zeroed
        assert fake.count == {("up", REASON_QUEUE): 1}
        assert fake.raw["LLMServer"] > 0
    finally:
        M.set_backend(None)
