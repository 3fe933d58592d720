"""The Grafana dashboard ``helm/kvserve/dashboards/kvserve.json`` names only series kvserve exports.

The exported series come from the code, not from a list kept here: a subprocess instantiates
every metric definition of :mod:`kvserve.telemetry.metrics` (the engine's, the gateway's) and of the
autoscaler's backend, records one sample in each, renders the multiprocess exposition
(``kvserve:<name>``, as the ingress's ``GET /metrics`` does) and derives Ray's export names
(``ray_kvserve_<name>``, same suffixes). Every panel's PromQL, with ``$prefix`` set to each of
the two exports, may reference only those series. No Ray, no model: fast.
"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "helm" / "kvserve" / "dashboards" / "kvserve.json"
PREFIXES = ("kvserve:", "ray_kvserve_")

# Runs in a fresh interpreter: kvserve.telemetry.metrics switches prometheus-client into multiprocess
# mode for its whole process, which must not leak into the pytest process.
_EXPORTED = r"""
import json, os, sys, tempfile
os.environ["KVSERVE_METRICS_DIR"] = tempfile.mkdtemp(prefix="kvserve-metrics-")
from kvserve.telemetry import metrics as M
from kvserve.autoscaling import metrics as AM

from kvserve.telemetry.cost_metrics import CacheSavings
M.PrometheusStatLogger("m", "r", speculative=True, cost_per_hour=1.0)
M.rejected(); M.api_key_tokens(); M.api_key_requests(); CacheSavings()
AM._RayBackend()  # the autoscaler's definitions (kvserve.telemetry.metrics inside the Serve controller)
for m in list(M._metrics.values()):
    labels = {name: "x" for name in m.labels}
    {"counter": lambda: m.inc(labels, 1.0), "gauge": lambda: m.set(labels, 1.0),
     "histogram": lambda: m.observe(labels, 1.0)}[m.kind]()
body, _ = M.render()
names = sorted({line.split("{")[0].split(" ")[0] for line in body.decode().splitlines()
                if line and not line.startswith("#")})
json.dump({"prefix": M.PREFIX, "ray_prefix": M.RAY_PREFIX, "names": names,
           "metrics": {n: m.kind for n, m in M._metrics.items()}}, sys.stdout)
"""

# PromQL words that are not series: functions, aggregations, operators, modifiers.
PROMQL_FUNCTIONS = {
    "abs",
    "absent",
    "absent_over_time",
    "acos",
    "acosh",
    "asin",
    "asinh",
    "atan",
    "atanh",
    "avg_over_time",
    "ceil",
    "changes",
    "clamp",
    "clamp_max",
    "clamp_min",
    "cos",
    "cosh",
    "count_over_time",
    "day_of_month",
    "day_of_week",
    "day_of_year",
    "days_in_month",
    "deg",
    "delta",
    "deriv",
    "exp",
    "floor",
    "histogram_avg",
    "histogram_count",
    "histogram_fraction",
    "histogram_quantile",
    "histogram_stddev",
    "histogram_stdvar",
    "histogram_sum",
    "holt_winters",
    "hour",
    "idelta",
    "increase",
    "irate",
    "label_join",
    "label_replace",
    "last_over_time",
    "ln",
    "log10",
    "log2",
    "mad_over_time",
    "max_over_time",
    "min_over_time",
    "minute",
    "month",
    "pi",
    "predict_linear",
    "present_over_time",
    "quantile_over_time",
    "rad",
    "rate",
    "resets",
    "round",
    "scalar",
    "sgn",
    "sin",
    "sinh",
    "sort",
    "sort_desc",
    "sqrt",
    "stddev_over_time",
    "stdvar_over_time",
    "sum_over_time",
    "tan",
    "tanh",
    "time",
    "timestamp",
    "vector",
    "year",
}
PROMQL_AGGREGATIONS = {
    "sum",
    "min",
    "max",
    "avg",
    "group",
    "stddev",
    "stdvar",
    "count",
    "count_values",
    "bottomk",
    "topk",
    "quantile",
    "limitk",
    "limit_ratio",
}
PROMQL_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "atan2",
    "inf",
    "nan",
}
# clauses whose parentheses hold label names, not expressions
_LABEL_LIST = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.IGNORECASE)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


@pytest.fixture(scope="module")
def exported() -> dict[str, set[str]]:
    """``{prefix: series names}`` of both exports, from the code."""
    r = subprocess.run(
        [sys.executable, "-c", _EXPORTED], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    prefix, ray_prefix = out["prefix"], out["ray_prefix"]
    assert prefix == "kvserve:" and ray_prefix == "kvserve_", out
    names = set(out["names"])
    assert all(n.startswith(prefix) for n in names), names
    # every metric defined rendered a series (one sample each), with its kind's suffixes
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    for base, kind in out["metrics"].items():
        for s in suffixes[kind]:
            assert prefix + base + s in names, (base, kind, sorted(names))
    assert len(names) == sum(len(suffixes[k]) for k in out["metrics"].values()), sorted(names)
    ray_names = {"ray_" + ray_prefix + n[len(prefix) :] for n in names}
    return {"kvserve:": names, "ray_kvserve_": ray_names}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def substitute(expr: str, prefix: str) -> str:
    """The expression as Grafana sends it: variables replaced by concrete values."""
    for var, value in (
        ("prefix", prefix),
        ("model_name", "tiny"),
        ("__rate_interval", "1m"),
        ("__interval", "15s"),
        ("__range", "1h"),
    ):
        expr = expr.replace("${" + var + "}", value)
        expr = re.sub(r"\$" + re.escape(var) + r"(?![A-Za-z0-9_])", value, expr)
    return expr


def series_names(expr: str) -> set[str]:
    """The series (metric names) a PromQL expression reads.

    Raises:
        AssertionError: a leftover template variable, or a call of something that is not a
            PromQL function or aggregation.
    """
    assert "$" not in expr, f"unsubstituted variable in {expr!r}"
    s = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals (label values, regexes)
    s = re.sub(r"\{[^{}]*\}", " ", s)  # label matchers
    s = re.sub(r"\[[^\[\]]*\]", " ", s)  # range / subquery selectors
    s = _LABEL_LIST.sub(" ", s)  # by (...), without (...), on (...), ...
    s = re.sub(r"(?<![A-Za-z0-9_:])[0-9][0-9.eE+-]*(?:(?:ms|[smhdwy])(?:[0-9]+(?:ms|[smhdwy]))*)?", " ", s)
    # (numbers and durations)
    names = set()
    for m in _IDENT.finditer(s):
        word = m.group()
        is_call = s[m.end() :].lstrip().startswith("(")
        low = word.lower()
        if low in PROMQL_KEYWORDS:
            continue
        if is_call:
            assert low in PROMQL_FUNCTIONS or low in PROMQL_AGGREGATIONS, f"unknown function {word!r} in {expr!r}"
            continue
        assert low not in PROMQL_FUNCTIONS and low not in PROMQL_AGGREGATIONS or word.endswith(":"), (
            f"{word!r} used as a series in {expr!r}"
        )
        names.add(word)
    return names


def all_exprs(dash: dict) -> list[tuple[str, str]]:
    """(where, PromQL) of every panel target and of the query variables."""
    out = []
    for p in dash["panels"]:
        for t in p.get("targets", []):
            out.append((f"panel {p['id']} {p['title']!r} {t.get('refId')}", t["expr"]))
    for v in dash["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            m = re.fullmatch(r"\s*label_values\((.*),\s*([A-Za-z_][A-Za-z0-9_]*)\s*\)\s*", q)
            assert m, q
            out.append((f"variable {v['name']}", m.group(1)))
    return out


def test_series_parser():
    e = (
        'histogram_quantile(0.99, sum by (le, model_name) (rate(kvserve:x_bucket{model_name=~"a.*|b"}[1m]))) '
        "/ on (model_name) group_left clamp_min(sum without (replica) (kvserve:y_total offset 5m), 1) "
        '+ count(count by (model_name, replica) (ray_kvserve_z{le="+Inf"})) > 0'
    )
    assert series_names(e) == {"kvserve:x_bucket", "kvserve:y_total", "ray_kvserve_z"}
    with pytest.raises(AssertionError):
        series_names("rat(kvserve:x_total[1m])")


def test_dashboard_shape(dashboard):
    d = dashboard
    assert d["uid"] == "kvserve"
    assert 36 <= d["schemaVersion"] <= 41
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), ids
    for p in d["panels"]:
        assert p.get("targets"), f"panel {p['id']} {p['title']!r} has no target"
        for t in p["targets"]:
            assert t["expr"].strip() and t["refId"], (p["title"], t)
            assert t["datasource"]["uid"] == "${datasource}", (p["title"], t)
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"]), p["title"]
    var = {v["name"]: v for v in d["templating"]["list"]}
    assert var["datasource"]["type"] == "datasource" and var["datasource"]["query"] == "prometheus"
    assert var["prefix"]["type"] == "custom"
    assert [o["value"] for o in var["prefix"]["options"]] == list(PREFIXES)
    assert var["prefix"]["current"]["value"] == "kvserve:"
    mq = var["model_name"]["query"]
    mq = mq["query"] if isinstance(mq, dict) else mq
    assert mq == "label_values(${prefix}num_requests_running, model_name)"
    names = list(var)
    assert names.index("prefix") < names.index("model_name")  # model_name's query uses prefix


def test_every_expression_uses_the_prefix_variable(dashboard):
    for where, expr in all_exprs(dashboard):
        marked = expr.replace("${prefix}", "PREFIXVAR_").replace("$prefix", "PREFIXVAR_")
        names = series_names(substitute(marked, "PREFIXVAR_"))
        assert names, f"{where}: reads no series: {expr}"
        assert all(n.startswith("PREFIXVAR_") for n in names), f"{where}: a series without ${{prefix}}: {expr}"


@pytest.mark.parametrize("prefix", PREFIXES)
def test_dashboard_reads_only_exported_series(dashboard, exported, prefix):
    known = exported[prefix]
    used = set()
    for where, expr in all_exprs(dashboard):
        names = series_names(substitute(expr, prefix))
        missing = names - known
        assert not missing, f"{where} reads series kvserve does not export: {sorted(missing)}\n{expr}"
        used |= names
    # the panels the dashboard promises
    for base in (
        "time_to_first_token_seconds_bucket",
        "inter_token_latency_seconds_bucket",
        "e2e_request_latency_seconds_bucket",
        "request_queue_time_seconds_bucket",
        "generation_tokens_total",
        "prompt_tokens_total",
        "request_success_total",
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prefix_cache_hits_total",
        "prefix_cache_queries_total",
        "num_preemptions_total",
        "requests_rejected_total",
        "autoscaling_desired_replicas",
        "api_key_tokens_total",
    ):
        assert prefix + base in used, f"no panel reads {prefix + base}"


def test_expressions_parse_with_promtool(dashboard, tmp_path):
    """Every expression is valid PromQL for both prefixes: Prometheus' own parser (``promtool
    check rules`` over one recording rule per expression)."""
    import shutil

    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (apt-get install prometheus)")
    rules = []
    for prefix in PREFIXES:
        for where, expr in all_exprs(dashboard):
            rules.append(
                {
                    "record": f"dashboard:check_{len(rules)}",
                    "expr": substitute(expr, prefix),
                    "labels": {"where": f"{prefix} {where}"},
                }
            )
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboard", "rules": rules}]}))  # JSON is YAML
    r = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"{len(rules)} rules found" in r.stdout, r.stdout
