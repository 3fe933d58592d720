"""kvserve's metrics through a real Prometheus server.

A Prometheus (the ``prometheus`` binary; Debian's package, which ``.ci/run`` installs) scrapes
both exports of the live app every second: job ``kvserve`` the ingress's ``GET /metrics``
(prometheus-client multiprocess, ``kvserve:<name>``) and job ``ray`` the node's Ray metrics
agent (``ray_kvserve_<name>``). The test reads the current values through Prometheus' HTTP
API, sends a known workload and polls until the increases are exactly what was sent, in both
exports: finished requests by reason, prompt and generation tokens against the ``usage`` the
API reported, the per-request histograms' counts, sums and buckets, inter-token latencies,
prefix-cache queries, the gateway's per-API-key requests and tokens, the ``queue_full``
rejections of a burst against the 429s the client saw, and a wrong API key. Then every query of
the Grafana dashboard (``helm/kvserve/dashboards/kvserve.json``) runs against this Prometheus
with both exports.
"""

import concurrent.futures
import shutil
import subprocess
import time

import httpx
import pytest
from _prometheus_helpers import (
    EXPORTS,
    RAY_SCRAPE_S,
    TINY,
    Prom,
    _baseline,
    _check_dashboard,
    _expect,
    _ray_hist_sum,
    _wait,
)
from helpers import HTTP, free_port

# constants only: importing kvserve.telemetry.metrics switches nothing on
from kvserve.telemetry.metrics import TOKEN_BUCKETS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

N = 5  # completions of the exact-count phase
MAX_TOKENS = 8
CHAT = [{"role": "user", "content": "Count the planets of the solar system, one by one."}]
# a shared prefix longer than a few KV blocks (16 tokens), so the later prompts hit the prefix cache
PREFIX = (
    "You are a careful assistant. Answer in one short sentence, using plain words, and never repeat "
    "the question back to the user. The topic of this request is the weather on a quiet day, "
)


@pytest.fixture(scope="module")
def prometheus(serve_app, tmp_path_factory):
    """A real Prometheus scraping the ingress's ``/metrics`` (job ``kvserve``) and the Ray
    metrics agent of every live node (job ``ray``) every second; terminated at the end."""
    import ray

    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus not installed (apt-get install prometheus)")
    ray_targets = [
        f"127.0.0.1:{n['MetricsExportPort']}" for n in ray.nodes() if n.get("Alive") and n.get("MetricsExportPort")
    ]
    assert ray_targets, ray.nodes()
    d = tmp_path_factory.mktemp("prometheus")
    port = free_port()
    cfg = d / "prometheus.yml"
    cfg.write_text(
        "global:\n"
        "  scrape_interval: 1s\n"
        "  scrape_timeout: 1s\n"
        "  evaluation_interval: 1s\n"
        "scrape_configs:\n"
        "  - job_name: kvserve\n"
        "    metrics_path: /metrics\n"
        "    static_configs:\n"
        f"      - targets: ['127.0.0.1:{serve_app.port}']\n"
        "  - job_name: ray\n"
        # Ray's agent renders every Ray metric of the node (hundreds of KB, seconds on a busy
        # 2-core box): a 1 s timeout failed every scrape there and froze the job's values
        f"    scrape_interval: {RAY_SCRAPE_S}s\n"
        f"    scrape_timeout: {RAY_SCRAPE_S}s\n"
        "    metrics_path: /metrics\n"
        "    static_configs:\n"
        f"      - targets: [{', '.join(repr(t) for t in ray_targets)}]\n"
    )
    (d / "data").mkdir()
    log_path = str(d / "prometheus.log")
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [
            exe,
            f"--config.file={cfg}",
            f"--web.listen-address=127.0.0.1:{port}",
            f"--storage.tsdb.path={d / 'data'}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    prom = Prom(f"http://127.0.0.1:{port}", proc, log_path)
    try:
        deadline = time.time() + 60
        while True:
            if proc.poll() is not None:
                pytest.fail(f"prometheus exited with {proc.returncode}:\n{prom.log_tail()}")
            try:
                if HTTP.get(f"{prom.url}/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                pytest.fail(f"prometheus not ready in 60 s:\n{prom.log_tail()}")
            time.sleep(0.3)
        yield prom
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
        log.close()


def test_prometheus_scrapes_both_exports(serve_app, prometheus):
    prom = prometheus

    # both targets up (a scrape succeeded) and the kvserve series of the app are there
    def targets_up():
        up = {r["metric"]["job"]: float(r["value"][1]) for r in prom.query("up")}
        return up.get("kvserve") == 1 and up.get("ray") == 1, up

    _wait(targets_up, 60, "scrape targets not up")
    for job in ("kvserve", "ray"):
        res = prom.query(f'up{{job="{job}"}}')
        assert res and all(float(r["value"][1]) == 1 for r in res), (job, res)
    names = {r["metric"]["model_name"] for r in prom.query("kvserve:num_requests_running")}
    assert {TINY, serve_app.model} <= names, names

    # ---- phase 1: a known workload, exact counts --------------------------------------------
    base = _baseline(prom, TINY)
    usages = []
    with httpx.Client(timeout=120) as c:
        for i in range(N):
            r = c.post(
                f"{serve_app.base_url}/completions",
                json={
                    "model": TINY,
                    "prompt": PREFIX + f"request number {i}.",
                    "max_tokens": MAX_TOKENS,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["choices"][0]["finish_reason"] == "length", body
            usages.append(body["usage"])
        r = c.post(
            f"{serve_app.base_url}/chat/completions",
            json={"model": TINY, "messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["finish_reason"] == "length", body
        usages.append(body["usage"])
    n_req = N + 1
    assert all(u["completion_tokens"] == MAX_TOKENS for u in usages), usages
    prompt_tokens = sum(u["prompt_tokens"] for u in usages)
    gen_tokens = n_req * MAX_TOKENS
    expected = {
        "success_length": n_req,
        "success_all": n_req,
        "prompt_tokens": prompt_tokens,
        "generation_tokens": gen_tokens,
        "ttft_count": n_req,
        "e2e_count": n_req,
        "queue_count": n_req,
        "prefill_count": n_req,
        "decode_count": n_req,
        "itl_count": n_req * (MAX_TOKENS - 1),  # one per token after the first
        "req_prompt_count": n_req,
        "req_prompt_sum": {
            "kvserve": prompt_tokens,
            "ray": _ray_hist_sum([u["prompt_tokens"] for u in usages], TOKEN_BUCKETS),
        },
        "req_gen_count": n_req,
        "req_gen_sum": {"kvserve": gen_tokens, "ray": _ray_hist_sum([MAX_TOKENS] * n_req, TOKEN_BUCKETS)},
        "req_gen_le5": 0,
        "req_gen_le10": n_req,
        "req_gen_le100": n_req,
        "pc_queries": prompt_tokens,  # each prompt looked up once (no preemption here)
        "preemptions": 0,
        "rejected_queue_full": 0,
        "key_requests": n_req,
        "key_prompt": prompt_tokens,
        "key_gen": gen_tokens,
    }
    d = _expect(prom, base, TINY, expected)
    # the later prompts share PREFIX (several 16-token blocks) with the first: prefix-cache hits
    for job in EXPORTS:
        assert 0 < d[(job, "pc_hits")] <= d[(job, "pc_queries")], d
    # nothing left running or waiting (gauges: Ray's export carries the last value it saw until
    # its next report, a few seconds later)
    gauges = {
        f"{job} {g}": f'{p}{g}{{model_name="{TINY}"}}'
        for job, p in EXPORTS.items()
        for g in ("num_requests_running", "num_requests_waiting")
    }
    _wait(
        lambda: (not any(prom.values(gauges).values()), prom.values(gauges)), 30, "running / waiting gauges back to 0"
    )

    # ---- phase 2: a burst over the replica's admission bound -> 429 queue_full, counted --------
    base = _baseline(prom, TINY)
    # 40 > what Serve lets through to the one replica (max_ongoing_requests 14: 8 + 2 x 1 + batch
    # work's share 4; + the ingress handle's max_queued_requests 9): refused by Serve's
    # back-pressure (counted by the ingress)
    # and by the replica's admission (max_num_seqs 8 + 1 queued, counted by the replica), both
    # code and reason "queue_full"
    burst, burst_tokens = 40, 96

    def one(i):
        with httpx.Client(timeout=180) as c:
            r = c.post(
                f"{serve_app.base_url}/completions",
                json={
                    "model": TINY,
                    "prompt": f"burst {i}",
                    "max_tokens": burst_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            return r.status_code, r.json()

    with concurrent.futures.ThreadPoolExecutor(burst) as ex:
        results = list(ex.map(one, range(burst)))
    codes = [s for s, _ in results]
    ok = [b for s, b in results if s == 200]
    rejected = [b for s, b in results if s == 429]
    assert len(ok) + len(rejected) == burst, [(s, b) for s, b in results if s not in (200, 429)]
    codes_429 = sorted(b["error"]["code"] for b in rejected)
    assert set(codes_429) == {"queue_full"}, rejected
    if not rejected:
        pytest.fail(
            f"a burst of {burst} requests on a replica that admits max_num_seqs + max_queued_requests "
            f"= 9 got no 429: {codes}"
        )
    ok_prompt = sum(b["usage"]["prompt_tokens"] for b in ok)
    assert all(b["usage"]["completion_tokens"] == burst_tokens for b in ok)
    n_ok = len(ok)
    print(f"burst of {burst}: {n_ok} x 200, 429 codes {codes_429}")
    _expect(
        prom,
        base,
        TINY,
        {
            "rejected_queue_full": len(rejected),
            "success_length": n_ok,
            "success_all": n_ok,
            "prompt_tokens": ok_prompt,
            "generation_tokens": n_ok * burst_tokens,
            "ttft_count": n_ok,
            "e2e_count": n_ok,
            "req_gen_count": n_ok,
            "req_gen_le10": 0,
            "req_gen_le100": n_ok,
            "req_gen_sum": {"kvserve": n_ok * burst_tokens, "ray": _ray_hist_sum([burst_tokens] * n_ok, TOKEN_BUCKETS)},
            # every request of the burst passed the gateway's key admission; tokens only for those served
            "key_requests": burst,
            "key_prompt": ok_prompt,
            "key_gen": n_ok * burst_tokens,
        },
    )

    # ---- the Grafana dashboard's queries, run against this Prometheus with each export ----------
    # rate() needs two samples in its window: the burst may have created the queue_full series
    # (when no earlier test of the session had a request of this model refused), and Ray's job
    # is scraped every RAY_SCRAPE_S
    def samples():
        n = {
            p: [
                float(r["value"][1])
                for r in prom.query(
                    f'count_over_time({p}requests_rejected_total{{model_name="{TINY}",reason="queue_full"}}[1m])'
                )
            ]
            for p in EXPORTS.values()
        }
        return all(v and max(v) >= 2 for v in n.values()), n

    _wait(samples, 60, "two samples of a queue_full rejections series in each export")
    _check_dashboard(prom)

    # ---- phase 3: the app with an API key: per-key tokens, a wrong key counted ----------------
    tp2 = "tiny-tp2"
    base = _baseline(prom, tp2)
    r = HTTP.post(
        f"{serve_app.auth_base_url}/completions",
        timeout=120,
        headers={"Authorization": f"Bearer {serve_app.api_key}"},
        json={"model": tp2, "prompt": "one request with a key", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["completion_tokens"] == 4, usage
    bad = HTTP.post(
        f"{serve_app.auth_base_url}/completions",
        timeout=60,
        headers={"Authorization": "Bearer sk-not-the-key"},
        json={"model": tp2, "prompt": "x", "max_tokens": 1},
    )
    # 401, or 429 when earlier tests of the session used up this address's failed attempts
    assert bad.status_code in (401, 429), bad.text
    _expect(
        prom,
        base,
        tp2,
        {
            "success_length": 1,
            "prompt_tokens": usage["prompt_tokens"],
            "generation_tokens": 4,
            "key_requests": 1,
            "key_prompt": usage["prompt_tokens"],
            "key_gen": 4,
            "rejected_unauthorized": int(bad.status_code == 401),
            "rejected_auth_throttled": int(bad.status_code == 429),
        },
    )
