"""Helpers of test_prometheus.py: a Prometheus server's query API (:class:`Prom`), the series of
one model in each of the two exports, waiting until they settled or rose by what was sent, what
Ray's export makes of a histogram's sum, and every query of the Grafana dashboard run against
the server.
"""

import itertools
import os
import subprocess
import time

import pytest
from helpers import HTTP

TINY = "tiny"


class Prom:
    """A Prometheus server started for this test, and its HTTP query API."""

    def __init__(self, url: str, proc: subprocess.Popen, log_path: str):
        self.url, self.proc, self.log_path = url, proc, log_path

    def log_tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def query(self, expr: str) -> list[dict]:
        r = HTTP.get(f"{self.url}/api/v1/query", params={"query": expr}, timeout=10)
        r.raise_for_status()
        body = r.json()
        assert body["status"] == "success", body
        assert body["data"]["resultType"] == "vector", body
        return body["data"]["result"]

    def value(self, expr: str) -> float:
        """``sum(expr)``; 0 when the series does not exist (yet)."""
        res = self.query(f"sum({expr})")
        return float(res[0]["value"][1]) if res else 0.0

    def values(self, exprs: dict[str, str]) -> dict[str, float]:
        return {k: self.value(e) for k, e in exprs.items()}


def _wait(cond, timeout: float, what: str, interval: float = 1.0):
    """Poll ``cond()`` (returns (done, detail)) until done; fail with the last detail."""
    deadline = time.time() + timeout
    while True:
        done, detail = cond()
        if done:
            return detail
        if time.time() > deadline:
            pytest.fail(f"{what} (after {timeout:.0f} s): {detail}")
        time.sleep(interval)


def _exprs(prefix: str, model: str) -> dict[str, str]:
    """The counters and histogram counts/sums of one model, in one export's names."""
    m = f'model_name="{model}"'
    p = prefix
    return {
        "success_length": f'{p}request_success_total{{{m},finished_reason="length"}}',
        "success_all": f"{p}request_success_total{{{m}}}",
        "prompt_tokens": f"{p}prompt_tokens_total{{{m}}}",
        "generation_tokens": f"{p}generation_tokens_total{{{m}}}",
        "ttft_count": f"{p}time_to_first_token_seconds_count{{{m}}}",
        "itl_count": f"{p}inter_token_latency_seconds_count{{{m}}}",
        "e2e_count": f"{p}e2e_request_latency_seconds_count{{{m}}}",
        "queue_count": f"{p}request_queue_time_seconds_count{{{m}}}",
        "prefill_count": f"{p}request_prefill_time_seconds_count{{{m}}}",
        "decode_count": f"{p}request_decode_time_seconds_count{{{m}}}",
        "req_prompt_count": f"{p}request_prompt_tokens_count{{{m}}}",
        "req_prompt_sum": f"{p}request_prompt_tokens_sum{{{m}}}",
        "req_gen_count": f"{p}request_generation_tokens_count{{{m}}}",
        "req_gen_sum": f"{p}request_generation_tokens_sum{{{m}}}",
        "pc_queries": f"{p}prefix_cache_queries_total{{{m}}}",
        "pc_hits": f"{p}prefix_cache_hits_total{{{m}}}",
        "preemptions": f"{p}num_preemptions_total{{{m}}}",
        "rejected_queue_full": f'{p}requests_rejected_total{{{m},reason="queue_full"}}',
        # the gateway's: per API key name ("anonymous" without keys); 401s (the gate knows no model)
        "key_requests": f"{p}api_key_requests_total{{{m}}}",
        "key_prompt": f'{p}api_key_tokens_total{{{m},kind="prompt"}}',
        "key_gen": f'{p}api_key_tokens_total{{{m},kind="generation"}}',
        "rejected_unauthorized": f'{p}requests_rejected_total{{reason="unauthorized"}}',
        "rejected_auth_throttled": f'{p}requests_rejected_total{{reason="auth_throttled"}}',
        # bucket placement (cumulative buckets; prometheus-client writes le="5.0", Ray le="5")
        "req_gen_le5": f'{p}request_generation_tokens_bucket{{{m},le=~"5|5[.]0"}}',
        "req_gen_le10": f'{p}request_generation_tokens_bucket{{{m},le=~"10|10[.]0"}}',
        "req_gen_le100": f'{p}request_generation_tokens_bucket{{{m},le=~"100|100[.]0"}}',
    }


EXPORTS = {"kvserve": "kvserve:", "ray": "ray_kvserve_"}
#: Seconds between scrapes of Ray's metrics agent, and the scrape's timeout.
RAY_SCRAPE_S = 5


def _all_exprs(model: str) -> dict[tuple[str, str], str]:
    return {(job, k): e for job, p in EXPORTS.items() for k, e in _exprs(p, model).items()}


#: Keys whose two exports differ by design once there was traffic: Ray's agent rebuilds a
#: histogram's ``_sum`` from its bucket counts (:func:`_ray_hist_sum`).
APPROXIMATED_BY_RAY = ("req_prompt_sum", "req_gen_sum")


def _baseline(prom: Prom, model: str) -> dict[tuple[str, str], float]:
    """Current values once nothing is in flight and Ray's export has caught up.

    The ingress's ``/metrics`` is rendered at each scrape, so Prometheus' ``kvserve:`` values
    are current within a scrape; Ray's agent gets each worker's values every
    ``metrics_report_interval_ms``, so a ``ray_kvserve_`` value can lag. It has caught up when it
    equals the ``kvserve:`` one, for every value but the histogram sums Ray approximates
    (:data:`APPROXIMATED_BY_RAY`; a worker reports all its values at once). The multiprocess
    files keep a dead process's counters, Ray's agent does not, so after a replica restart they
    can differ for good: then wait until Ray's values stood still for two report intervals."""
    import ray

    m = f'model_name="{model}"'
    _wait(
        lambda: (
            (
                v := prom.value(f"kvserve:num_requests_running{{{m}}}")
                + prom.value(f"kvserve:num_requests_waiting{{{m}}}")
            )
            == 0,
            v,
        ),
        120,
        f"{model} still has requests in flight",
    )
    exprs = _all_exprs(model)
    keys = [k for _, k in exprs if k not in APPROXIMATED_BY_RAY]
    stable_for = 2 * max(ray._config.metrics_report_interval_ms() / 1000, RAY_SCRAPE_S) + 3
    last, since = None, time.time()
    deadline = time.time() + stable_for + 60
    while True:
        vals = {k: prom.value(e) for k, e in exprs.items()}
        time.sleep(1.5)  # > one scrape: the kvserve values must not move either
        again = {k: prom.value(e) for k, e in exprs.items()}
        if vals == again:
            if all(vals[("ray", k)] == vals[("kvserve", k)] for k in keys):
                return vals
            if last != vals:
                last, since = vals, time.time()
            elif time.time() - since >= stable_for:
                return vals
        if time.time() > deadline:
            pytest.fail(f"metrics of {model} never settled: {again}")


def _deltas(prom: Prom, base: dict, model: str) -> dict[tuple[str, str], float]:
    return {k: prom.value(e) - base[k] for k, e in _all_exprs(model).items()}


def _expect(prom: Prom, base: dict, model: str, expected: dict[str, float], timeout: float = 60):
    """Poll until every expected increase holds in both exports (a value, or ``{job: value}``
    where the exports differ); fail naming each mismatch."""

    def want(job, v):
        return v[job] if isinstance(v, dict) else v

    def cond():
        d = _deltas(prom, base, model)
        bad = {
            f"{job}:{k}": (d[(job, k)], want(job, v))
            for job in EXPORTS
            for k, v in expected.items()
            if d[(job, k)] != want(job, v)
        }
        return not bad, (d, bad)

    deadline = time.time() + timeout
    while True:
        done, (d, bad) = cond()
        if done:
            return d
        if time.time() > deadline:
            scrapes = {
                f'{q}{{job="{r["metric"]["job"]}"}}': r["value"][1]
                for q in ("up", "scrape_duration_seconds")
                for r in prom.query(q)
            }
            pytest.fail(
                f"metric increases != what was sent after {timeout:.0f} s, (got, expected): {bad}; "
                f"all increases: { {f'{j}:{k}': v for (j, k), v in d.items()} }; last scrapes: {scrapes}"
            )
        time.sleep(1.0)


def _ray_hist_sum(values, buckets) -> float:
    """What Ray's export reports as a histogram's ``_sum`` for these observations: Ray's
    metrics agent rebuilds histograms from bucket counts, recording each bucket's midpoint
    (``open_telemetry_metric_recorder.py``: first bucket from 0, ``+Inf`` as twice the last
    bound), so ``ray_*_sum`` is an approximation while the bucket counts are exact."""
    mids = [buckets[0] / 2] + [(a + b) / 2 for a, b in itertools.pairwise(buckets)] + [buckets[-1] * 2]
    return sum(mids[next((i for i, b in enumerate(buckets) if v <= b), len(buckets))] for v in values)


DASHBOARD = os.path.join(os.path.dirname(__file__), "..", "..", "helm", "kvserve", "dashboards", "kvserve.json")
# panels that must show the tiny model's traffic just sent, in both exports
MUST_HAVE_DATA = (
    "Time to first token",
    "Inter-token latency",
    "End-to-end request latency",
    "Queue / prefill",
    "Token throughput",
    "Finished requests",
    "Running and waiting",
    "KV-cache usage",
    "Prefix-cache hit rate",
    "Rejected requests",
    "Replicas",
    "Request length",
)


def _check_dashboard(prom: Prom):
    """Every query of ``helm/kvserve/dashboards/kvserve.json`` parses and runs in Prometheus
    for both values of ``$prefix``; the panels of the traffic just sent show data, and the
    replica count of the tiny model is 1 in both exports."""
    import json
    import re

    with open(DASHBOARD) as f:
        dash = json.load(f)
    for prefix in EXPORTS.values():
        for p in dash["panels"]:
            for t in p["targets"]:
                expr = t["expr"]
                for var, value in (
                    ("prefix", prefix),
                    ("model_name", TINY),
                    ("__rate_interval", "1m"),
                    ("__interval", "15s"),
                    ("__range", "1h"),
                ):
                    expr = expr.replace("${" + var + "}", value)
                    expr = re.sub(r"\$" + re.escape(var) + r"(?![A-Za-z0-9_])", value, expr)
                res = prom.query(expr)  # raises on a PromQL error (HTTP 400)
                where = f"{prefix} panel {p['id']} {p['title']!r} {t['refId']}: {expr}"
                if p["title"].startswith(MUST_HAVE_DATA) and t["refId"] == "A":
                    assert res, f"no data: {where}"
                if p["title"] == "Replicas" and t["refId"] == "A":
                    assert [(r["metric"]["model_name"], float(r["value"][1])) for r in res] == [(TINY, 1.0)], (
                        where,
                        res,
                    )
