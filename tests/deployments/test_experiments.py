"""A/B tests of configurations (deployments/contract/experiments.py, deployments/gateway/experiments.py,
deployments/operator/experiment_report.py): configuration checks, sticky weighted assignment, live weights,
the report's statistics on known samples, and, over real engines in this process (tests/local_app.py),
a report that finds a large real effect with the right sign and none between identical variants."""
from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np
import pytest

from deployments.args import AppArgs
from deployments.contract.experiments import ExperimentArgs, check_weights
from deployments.operator.experiment_report import analyse, render
from deployments.gateway.experiments import Experiments, pick

ADMIN = "sk-kvserve-ab-admin"


def _exp(**kw) -> ExperimentArgs:
    base = {"name": "bs", "model": "tiny", "variants": [{"name": "A"}, {"name": "B", "settings": {"max_num_seqs": 4}}]}
    return ExperimentArgs.model_validate({**base, **kw})


# ---- configuration -------------------------------------------------------------------------
def test_variants_become_deployments_with_their_settings(tiny_llama_path):
    args = AppArgs.model_validate({
        "models": [{"model": str(tiny_llama_path), "served_model_name": "tiny", "max_num_seqs": 8},
                   {"model": str(tiny_llama_path), "served_model_name": "other"}],
        "experiments": [{"name": "bs", "model": "tiny", "variants": [
            {"name": "A"}, {"name": "B", "settings": {"max_num_seqs": 2, "stream_interval": 4,
                                                      "semantic_cache_threshold": 0.8}}]}]})
    deps = {d.deployment_key: d for d in args.deployments()}
    assert list(deps) == ["tiny@A", "tiny@B", "other"]
    assert deps["tiny@A"].max_num_seqs == 8 and deps["tiny@B"].max_num_seqs == 2
    assert deps["tiny@B"].stream_interval == 4 and deps["tiny@A"].stream_interval == 0
    assert deps["tiny@B"].name == "tiny" and deps["tiny@B"].variant == "B"
    # a gateway setting stays out of the deployment and reaches the assignment
    assert args.experiments[0].variants[1].gateway_settings() == {"semantic_cache_threshold": 0.8}
    assert args.experiments[0].differences() == {"B": {"max_num_seqs": (None, 2), "semantic_cache_threshold": (None, 0.8),
                                                       "stream_interval": (None, 4)}}


def test_a_variant_that_changes_the_weights_keeps_the_served_name(tiny_llama_path, tmp_path):
    args = AppArgs.model_validate({
        "model": str(tiny_llama_path), "served_model_name": "tiny",
        "experiments": [{"name": "w", "model": "tiny", "variants": [
            {"name": "A"}, {"name": "B", "settings": {"model": str(tmp_path)}}]}]})
    assert [d.name for d in args.deployments()] == ["tiny", "tiny"]


@pytest.mark.parametrize("bad, match", [
    ({"model": "nope"}, "not served"),
    ({"variants": [{"name": "A"}]}, "at least two variants"),
    ({"variants": [{"name": "A"}, {"name": "A"}]}, "unique"),
    ({"variants": [{"name": "A", "weight": 0}, {"name": "B", "weight": 0}]}, "weight above 0"),
    ({"variants": [{"name": "A"}, {"name": "B", "settings": {"served_model_name": "x"}}]}, "cannot differ"),
    ({"variants": [{"name": "A"}, {"name": "B", "settings": {"max_num_seqs": 0}}]}, "variant 'B'"),
    ({"variants": [{"name": "A"}, {"name": "B", "settings": {"no_such_setting": 1}}]}, "variant 'B'"),
    ({"variants": [{"name": "A b"}, {"name": "B"}]}, "variant's name"),
])
def test_bad_experiments_are_refused_by_name(tiny_llama_path, bad, match):
    exp = {"name": "bs", "model": "tiny", "variants": [{"name": "A"}, {"name": "B"}], **bad}
    with pytest.raises(ValueError, match=match):
        AppArgs.model_validate({"model": str(tiny_llama_path), "served_model_name": "tiny", "experiments": [exp]})


def test_two_experiments_of_one_model_are_refused(tiny_llama_path):
    e = {"model": "tiny", "variants": [{"name": "A"}, {"name": "B"}]}
    with pytest.raises(ValueError, match="two experiments"):
        AppArgs.model_validate({"model": str(tiny_llama_path), "served_model_name": "tiny",
                                "experiments": [{"name": "x", **e}, {"name": "y", **e}]})


def test_check_weights():
    e = _exp()
    assert check_weights({"A": 3}, e) == {"A": 3.0, "B": 0.0}
    for bad, match in (({"C": 1}, "no variant 'C'"), ({"A": -1}, ">= 0"), ({"A": 0}, "above 0"),
                       ({"A": float("nan")}, ">= 0"), ({"A": "x"}, "a number")):
        with pytest.raises(ValueError, match=match):
            check_weights(bad, e)


# ---- assignment ------------------------------------------------------------------------------
def test_sticky_assignment_follows_the_weights_and_moves_few_keys():
    ex = Experiments([_exp()], board=None)
    sessions = [f"s{i}" for i in range(4000)]
    first = {s: ex.assign("tiny", {"x-session-id": s}, None, None).variant for s in sessions}
    assert abs(sum(v == "A" for v in first.values()) / len(sessions) - 0.5) < 0.03
    # sticky: the same session, the same variant, whatever else the request carries
    assert all(ex.assign("tiny", {"x-session-id": s}, "someone", "key1").variant == first[s] for s in sessions[:200])
    # new weights: 90 / 10; every session that was on A stays there, and only the shares' difference moves
    asyncio.run(ex.set_weights("bs", {"A": 90, "B": 10}))
    second = {s: ex.assign("tiny", {"x-session-id": s}, None, None).variant for s in sessions}
    assert all(second[s] == "A" for s in sessions if first[s] == "A")
    assert abs(sum(v == "A" for v in second.values()) / len(sessions) - 0.9) < 0.03
    # a model no experiment splits is not assigned
    assert ex.assign("other", {}, None, None) is None


def test_sticky_keys_fall_back_in_order():
    e = _exp(sticky="session", session_header="X-Conversation")
    assert Experiments.sticky_key(e, {"x-conversation": "c1"}, "u", "k") == "session:c1"
    assert Experiments.sticky_key(e, {}, "u", "k") == "user:u"
    assert Experiments.sticky_key(e, {}, None, "k") == "api_key:k"
    assert Experiments.sticky_key(e, {}, None, "anonymous") is None  # no key configured: a random draw
    assert Experiments.sticky_key(_exp(sticky="api_key"), {"x-session-id": "c"}, "u", "k") == "api_key:k"
    assert Experiments.sticky_key(_exp(sticky="request"), {"x-session-id": "c"}, "u", "k") is None


def test_pick_gives_each_variant_its_range():
    order = ["A", "B", "C"]
    w = {"A": 1, "B": 0, "C": 3}
    assert [pick(w, order, u) for u in (0.0, 0.24, 0.25, 0.99)] == ["A", "A", "C", "C"]
    assert pick({"A": 0, "B": 1, "C": 0}, order, 0.999999) == "B"


# ---- the report's statistics on known samples ---------------------------------------------------
def _samples(rng, n, ttft_scale, tpot=0.02, refuse=0.0, replica="r1"):
    out, t = [], 1000.0
    for _ in range(n):
        t += rng.exponential(0.05)
        if rng.random() < refuse:
            out.append({"t": t, "status": "refused", "e2e_s": 0.001})
            continue
        ttft = rng.lognormal(np.log(ttft_scale), 0.3)
        out.append({"t": t, "status": "ok", "ttft_s": ttft, "tpot_s": rng.lognormal(np.log(tpot), 0.2),
                    "e2e_s": ttft + 15 * tpot, "prompt_tokens": 40, "output_tokens": 16, "cached_tokens": 0,
                    "cache": None, "replica": replica})
    return out


def _experiment(a, b, differences=None):
    return {"name": "x", "model": "m", "weights": {"A": 1, "B": 1},
            "variants": [{"name": "A", "settings": {}}, {"name": "B", "settings": {}}],
            "differences": differences if differences is not None else {"B": {"max_num_seqs": [None, 4]}},
            "samples": {"A": a, "B": b}}


def test_report_finds_a_known_effect_with_its_sign_and_size():
    rng = np.random.default_rng(1)
    rep = analyse(_experiment(_samples(rng, 400, 0.2), _samples(rng, 400, 0.1, refuse=0.2)))
    by = {c["measure"]: c for c in rep["comparisons"]}
    assert by["ttft_p50"]["significant"] and by["ttft_p50"]["better"]
    assert -0.6 < by["ttft_p50"]["estimate"] < -0.4  # half the TTFT
    assert by["refusal_rate"]["significant"] and not by["refusal_rate"]["better"]
    assert 0.15 < by["refusal_rate"]["estimate"] < 0.25
    assert not by["tpot_p50"]["significant"]  # the same distribution
    assert "output_tps_per_replica" not in by and rep["variants"]["B"]["output_tps_per_replica"]["ci"]
    assert any(line.startswith("B better than A on TTFT p50 by") for line in rep["summary"])
    assert "TTFT p50" in render(rep)


def test_report_of_identical_variants_keeps_its_false_verdicts_to_the_confidence():
    """30 reports of identical variants at the default 95 % family-wise confidence: at most 3 say
    anything (5 % of 30 expected, at most, and a margin: these seeds give what they give, always
    the same); at 99.9 % none does."""
    said = []
    for seed in range(30):
        rng = np.random.default_rng(100 + seed)
        data = _experiment(_samples(rng, 120, 0.2), _samples(rng, 120, 0.2))
        rep = analyse(data, n_boot=300, seed=seed)
        if rep["summary"] != ["B vs A: no significant difference"]:
            said.append((seed, rep["summary"]))
        assert analyse(data, n_boot=300, seed=seed, confidence=0.999)["summary"] == [
            "B vs A: no significant difference"], seed
    assert len(said) <= 3, said


def test_report_warns_when_variants_differ_in_more_than_one_setting():
    rng = np.random.default_rng(2)
    rep = analyse(_experiment(_samples(rng, 50, 0.2), _samples(rng, 10, 0.2),
                              differences={"B": {"max_num_seqs": [None, 4], "stream_interval": [None, 2]}}))
    assert any("2 settings (max_num_seqs, stream_interval)" in w for w in rep["warnings"])
    assert any("B has 10 requests" in w for w in rep["warnings"])


# ---- live: real engines behind the gateway ------------------------------------------------------
@pytest.fixture(scope="module")
def ab_app(tiny_llama_path):
    """Two A/B tests of the tiny model in this process: ``batch`` (``max_num_seqs`` 1 against
    16; both let 64 requests wait, so the difference shows as waiting, not as refusals) and
    ``same`` (two identical variants), each drawing every request anew."""
    from local_app import LocalApp

    base = {"model": str(tiny_llama_path), "max_model_len": 256, "torch_num_threads": 1,
            "max_waiting_requests": 64, "enable_prefix_caching": False}
    app = LocalApp({"/": {
        "models": [{**base, "served_model_name": "tiny-batch"}, {**base, "served_model_name": "tiny-same",
                                                                 "max_num_seqs": 8}],
        "response_cache": False, "admin_api_keys": [ADMIN],
        "experiments": [
            {"name": "batch", "model": "tiny-batch", "sticky": "request",
             "variants": [{"name": "seqs1", "settings": {"max_num_seqs": 1}},
                          {"name": "seqs16", "settings": {"max_num_seqs": 16}}]},
            {"name": "same", "model": "tiny-same", "sticky": "request", "variants": [{"name": "A"}, {"name": "B"}]},
        ]}}).start()
    try:
        yield app.namespace()
    finally:
        app.stop()


def _load(base_url: str, model: str, clients: int, per_client: int, seed: int,
          max_tokens: int = 12) -> list[httpx.Response]:
    """``clients`` concurrent clients, each sending ``per_client`` chat requests one after the
    other (fresh random prompts, ``max_tokens`` output tokens each); returns the responses."""
    words = "alpha beta gamma delta river stone cloud lamp paper orbit violet maple".split()
    rng = random.Random(seed)

    async def client(c: int, http: httpx.AsyncClient):
        out = []
        for i in range(per_client):
            prompt = " ".join(rng.choice(words) for _ in range(12)) + f" {seed}-{c}-{i}"
            r = await http.post(f"{base_url}/chat/completions", json={
                "model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "ignore_eos": True})
            out.append(r)
        return out

    async def run():
        async with httpx.AsyncClient(timeout=120) as http:
            return [r for rs in await asyncio.gather(*(client(c, http) for c in range(clients))) for r in rs]

    return asyncio.run(run())


def _report(root: str, name: str) -> dict:
    r = httpx.get(f"{root}/v1/experiments/{name}", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_live_report_finds_the_batch_size_effect(ab_app):
    # long answers: a request queued behind another on seqs1 waits for all of its 48 tokens, however
    # few requests the clients (in this process, beside the gateway) manage to keep in flight
    responses = _load(ab_app.base_url, "tiny-batch", clients=16, per_client=8, seed=1, max_tokens=48)
    assert all(r.status_code == 200 for r in responses), {r.status_code for r in responses}
    variants = [r.headers["x-kvserve-variant"] for r in responses]
    assert set(variants) == {"seqs1", "seqs16"} and all(r.headers["x-kvserve-experiment"] == "batch"
                                                        for r in responses)
    data = _report(ab_app.root, "batch")
    assert sum(len(v) for v in data["samples"].values()) == len(responses)
    rep = analyse(data, confidence=0.999)  # the level at which identical variants never differ (below)
    by = {c["measure"]: c for c in rep["comparisons"]}
    # one request at a time: the others wait their turn, so seqs16 starts them far sooner
    assert by["ttft_p50"]["significant"] and by["ttft_p50"]["better"], render(rep)
    assert by["ttft_p95"]["significant"] and by["ttft_p95"]["better"], render(rep)
    assert any(line.startswith("seqs16 better than seqs1 on TTFT p50") for line in rep["summary"])


def test_live_report_of_identical_variants_finds_no_difference(ab_app):
    responses = _load(ab_app.base_url, "tiny-same", clients=4, per_client=24, seed=2)
    assert all(r.status_code == 200 for r in responses)
    rep = analyse(_report(ab_app.root, "same"), confidence=0.999)
    assert rep["summary"] == ["B vs A: no significant difference"], render(rep)
    assert any("same settings" in w for w in rep["warnings"])


def test_live_weights_change_without_restart_and_need_the_admin_key(ab_app):
    url = f"{ab_app.root}/v1/experiments/same/weights"
    assert httpx.post(url, json={"weights": {"B": 1}}).status_code == 401
    r = httpx.post(url, json={"weights": {"B": 1}}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and "error" in r.json()
    r = httpx.post(url, json={"weights": {"C": 1}}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_weights"
    r = httpx.post(url, json={"weights": {"B": 1}}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["weights"] == {"A": 0.0, "B": 1.0}
    responses = _load(ab_app.base_url, "tiny-same", clients=2, per_client=5, seed=3)
    assert {r.headers["x-kvserve-variant"] for r in responses} == {"B"}
    r = httpx.get(f"{ab_app.root}/v1/experiments", headers={"Authorization": f"Bearer {ADMIN}"})
    assert {e["name"]: e["weights"] for e in r.json()["data"]}["same"] == {"A": 0.0, "B": 1.0}
    assert httpx.get(f"{ab_app.root}/v1/experiments/nope",
                     headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 404
