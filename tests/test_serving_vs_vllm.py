"""benchmarks/serving_vs_vllm.py's arithmetic, without the servers: the prefix-cache counters read
from a real Prometheus exposition (kvserve's and vLLM's names), medians and ranges over rounds,
and kvserve / vLLM ratios with issue 41's targets judged from the medians; the headline rows
(kvserve against ``vllm-allcores`` first, the docs default beside it) and ``--from-results``, which
derives a committed file's figures again from its recorded runs."""

import http.server
import json
import shutil
import sys
import threading
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import figures_function, measured_part  # noqa: E402
from benchmarks.serving_vs_vllm import derive, figures, main, prefix_counters, ratios, summary  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COMMITTED = ROOT / "benchmarks" / "results" / "serving_vs_vllm.json"


@pytest.fixture
def metrics_server():
    """A loopback /metrics serving prometheus-client's exposition of both servers' counters
    (two label sets each, as per-model series), and a ``bump`` to advance them."""
    reg = CollectorRegistry()
    kv_q = Counter("kvserve:prefix_cache_queries", "q", ["model_name"], registry=reg)
    kv_h = Counter("kvserve:prefix_cache_hits", "h", ["model_name"], registry=reg)
    vl_q = Counter("vllm:prefix_cache_queries", "q", ["engine"], registry=reg)
    vl_h = Counter("vllm:prefix_cache_hits", "h", ["engine"], registry=reg)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = generate_latest(reg)
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1], (kv_q, kv_h, vl_q, vl_h)
    srv.shutdown()


def test_prefix_counters_sum_every_series_of_both_names(metrics_server):
    port, (kv_q, kv_h, vl_q, vl_h) = metrics_server
    assert prefix_counters(port) == (0.0, 0.0)
    kv_q.labels("a").inc(100)
    kv_q.labels("b").inc(28)
    kv_h.labels("a").inc(16)
    assert prefix_counters(port) == (128.0, 16.0)
    vl_q.labels("0").inc(72)
    vl_h.labels("0").inc(48)
    assert prefix_counters(port) == (200.0, 64.0)  # _created samples and other names are not counted


def _runs(tputs, ttfts, tpots, hits=None):
    return [
        {
            "output_throughput": a,
            "median_ttft_ms": b,
            "median_tpot_ms": c,
            "p99_ttft_ms": 2 * b,
            "prefix_cache_hit_rate": None if hits is None else hits[i],
        }
        for i, (a, b, c) in enumerate(zip(tputs, ttfts, tpots))
    ]


def test_medians_ranges_and_ratios_with_targets():
    kv = {
        "1": summary(_runs([20, 22, 21], [150, 140, 400], [40, 41, 39], [0.0, 0.0, 0.0])),
        "32": summary(_runs([240, 250, 230], [900, 950, 1000], [100, 90, 95])),
    }
    vl = {
        "1": summary(_runs([25, 24, 26], [135, 130, 131], [39, 40, 41], [0.0, 0.0, 0.125])),
        "32": summary(_runs([200, 190, 210], [800, 820, 810], [110, 100, 105])),
    }
    assert kv["1"]["median_ttft_ms"] == {"median": 150, "min": 140, "max": 400}  # one slow round moves no median
    assert kv["32"]["prefix_cache_hit_rate"] is None and vl["1"]["prefix_cache_hit_rate"]["max"] == 0.125
    result = {
        "servers": {"kvserve": {"levels": kv}, "vllm": {"levels": vl}},
        "dtype": "float32",
        "repeats": 3,
        "workload": {"input_len": 128, "output_len": 64, "stream_interval": 1, "vllm_stream_interval": True},
        "client": "c",
        "model": "m",
        "order": [["kvserve", "vllm"], ["vllm", "kvserve"]],
    }
    r = ratios(result, "vllm")
    assert r["32"]["output_throughput"] == 1.2 and r["1"]["median_ttft_diff_ms"] == 19.0
    assert r["1"]["median_tpot"] == 1.0 and r["32"]["median_tpot"] == round(95 / 105, 3)
    assert ratios(result, "vllm-allcores") == {}
    for s in result["servers"].values():
        s["runs"] = []
    result["kvserve_over_vllm"] = {"vllm": r}
    rows = {row["metric"]: row for row in figures(result).as_dict()["summary"]}
    met = {k.split("`vllm`")[1].split(",")[0].split(")")[-1].strip(): v["met"] for k, v in rows.items()}
    assert met == {
        "output tok/s at concurrency 32": True,
        "TPOT p50 at concurrency 1": True,
        "TPOT p50 at concurrency 32": True,
        "TTFT p50 at concurrency 1": False,
    }


def _two_peer_result() -> dict:
    """Raw runs of kvserve and both vLLM configurations at concurrency 1 and 32, three rounds."""

    def runs(tput32):
        return [
            {
                "round": i,
                "concurrency": c,
                "seed": i,
                "failed": 0,
                "output_throughput": t,
                "median_ttft_ms": 100.0,
                "median_tpot_ms": 1000 / t,
                "p99_ttft_ms": 200.0,
                "prefix_cache_hit_rate": 0.0,
                "load_average_before": [1.0, 1.0, 1.0],
                "load_average_after": [1.0, 1.0, 1.0],
            }
            for i in range(3)
            for c, t in ((1, 20.0), (32, tput32 + i))
        ]

    return {
        "servers": {
            "kvserve": {"runs": runs(150.0)},
            "vllm": {"runs": runs(110.0)},
            "vllm-allcores": {"runs": runs(190.0)},
        },
        "dtype": "float32",
        "repeats": 3,
        "client": "c",
        "model": "m",
        "workload": {"input_len": 128, "output_len": 64, "stream_interval": 1, "vllm_stream_interval": True},
        "order": [["kvserve", "vllm", "vllm-allcores"]],
    }


def test_headline_is_the_both_cores_peer_with_the_docs_default_beside_it():
    """Both cores to each engine is the like-for-like comparison: it is the first headline row
    whatever order the configurations ran in, and vLLM's docs default is the second."""
    result = derive(_two_peer_result())
    assert list(result["servers"]["kvserve"]["levels"]) == ["1", "32"]
    assert result["kvserve_over_vllm"]["vllm-allcores"]["32"]["output_throughput"] == round(151 / 191, 3)
    heads = [row for row in figures(result).as_dict()["summary"] if row.get("headline")]
    assert [h["value"] for h in heads] == [round(151 / 191, 3), round(151 / 111, 3)]
    assert "`vllm-allcores` (both cores to each engine)" in heads[0]["metric"] and not heads[0]["met"]
    assert "`vllm` (vLLM's docs default: one core reserved" in heads[1]["metric"] and heads[1]["met"]
    assert all("concurrency 32" in h["metric"] for h in heads)


def test_from_results_rederives_the_committed_file(tmp_path):
    """``--from-results`` on the committed file: every measured value stays as recorded, the
    provenance still names the measurement, the summary is what figures() derives, the command
    and commit of the re-render are recorded, and the plot is drawn; a file whose ratios are not
    what its runs give is refused."""
    out = tmp_path / "serving_vs_vllm.json"
    shutil.copy(COMMITTED, out)
    before = json.loads(out.read_text())
    after = main(["--from-results", "--out", str(out)])
    assert after == json.loads(out.read_text())
    assert measured_part(after) == measured_part(before)
    for k in ("script", "commit", "machine", "command", "loadavg_before", "loadavg_after"):
        assert after[k] == before[k]
    assert (
        after["summary"]
        == json.loads(json.dumps(figures_function(ROOT / after["script"])(measured_part(after)).as_dict()))["summary"]
    )
    assert "--from-results" in after["schema_migrated_by"] and "(at commit " in after["schema_migrated_by"]
    assert (tmp_path / "serving_vs_vllm.png").stat().st_size > 10_000
    bad = json.loads(out.read_text())
    bad["kvserve_over_vllm"]["vllm"]["32"]["output_throughput"] = 9.0  # typed in, not derived
    out.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="not what its runs give"):
        main(["--from-results", "--out", str(out)])
