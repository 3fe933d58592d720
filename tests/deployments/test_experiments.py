"""A/B tests of configurations (kvserve/deployments/contract/experiments.py, kvserve/deployments/gateway/experiments.py,
kvserve/deployments/operator/experiment_report.py): configuration checks, sticky weighted assignment, live weights,
and the report's statistics on known samples. The report over real engines under load is in
tests/e2e/test_experiment_report_live.py."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvserve.deployments.args import AppArgs
from kvserve.deployments.contract.experiments import ExperimentArgs, check_weights
from kvserve.deployments.operator.experiment_report import analyse, render
from kvserve.deployments.gateway.experiments import Experiments, pick


def _exp(**kw) -> ExperimentArgs:
    base = {"name": "bs", "model": "tiny", "variants": [{"name": "A"}, {"name": "B", "settings": {"max_num_seqs": 4}}]}
    return ExperimentArgs.model_validate({**base, **kw})


# ---- configuration -------------------------------------------------------------------------
def test_variants_become_deployments_with_their_settings(tiny_llama_path):
    args = AppArgs.model_validate(
        {
            "models": [
                {"model": str(tiny_llama_path), "served_model_name": "tiny", "max_num_seqs": 8},
                {"model": str(tiny_llama_path), "served_model_name": "other"},
            ],
            "experiments": [
                {
                    "name": "bs",
                    "model": "tiny",
                    "variants": [
                        {"name": "A"},
                        {
                            "name": "B",
                            "settings": {"max_num_seqs": 2, "stream_interval": 4, "semantic_cache_threshold": 0.8},
                        },
                    ],
                }
            ],
        }
    )
    deps = {d.deployment_key: d for d in args.deployments()}
    assert list(deps) == ["tiny@A", "tiny@B", "other"]
    assert deps["tiny@A"].max_num_seqs == 8 and deps["tiny@B"].max_num_seqs == 2
    assert deps["tiny@B"].stream_interval == 4 and deps["tiny@A"].stream_interval == 0
    assert deps["tiny@B"].name == "tiny" and deps["tiny@B"].variant == "B"
    # a gateway setting stays out of the deployment and reaches the assignment
    assert args.experiments[0].variants[1].gateway_settings() == {"semantic_cache_threshold": 0.8}
    assert args.experiments[0].differences() == {
        "B": {"max_num_seqs": (None, 2), "semantic_cache_threshold": (None, 0.8), "stream_interval": (None, 4)}
    }


def test_a_variant_that_changes_the_weights_keeps_the_served_name(tiny_llama_path, tmp_path):
    args = AppArgs.model_validate(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny",
            "experiments": [
                {
                    "name": "w",
                    "model": "tiny",
                    "variants": [{"name": "A"}, {"name": "B", "settings": {"model": str(tmp_path)}}],
                }
            ],
        }
    )
    assert [d.name for d in args.deployments()] == ["tiny", "tiny"]


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"model": "nope"}, "not served"),
        ({"variants": [{"name": "A"}]}, "at least two variants"),
        ({"variants": [{"name": "A"}, {"name": "A"}]}, "unique"),
        ({"variants": [{"name": "A", "weight": 0}, {"name": "B", "weight": 0}]}, "weight above 0"),
        ({"variants": [{"name": "A"}, {"name": "B", "settings": {"served_model_name": "x"}}]}, "cannot differ"),
        ({"variants": [{"name": "A"}, {"name": "B", "settings": {"max_num_seqs": 0}}]}, "variant 'B'"),
        ({"variants": [{"name": "A"}, {"name": "B", "settings": {"no_such_setting": 1}}]}, "variant 'B'"),
        ({"variants": [{"name": "A b"}, {"name": "B"}]}, "variant's name"),
    ],
)
def test_bad_experiments_are_refused_by_name(tiny_llama_path, bad, match):
    exp = {"name": "bs", "model": "tiny", "variants": [{"name": "A"}, {"name": "B"}], **bad}
    with pytest.raises(ValueError, match=match):
        AppArgs.model_validate({"model": str(tiny_llama_path), "served_model_name": "tiny", "experiments": [exp]})


def test_two_experiments_of_one_model_are_refused(tiny_llama_path):
    e = {"model": "tiny", "variants": [{"name": "A"}, {"name": "B"}]}
    with pytest.raises(ValueError, match="two experiments"):
        AppArgs.model_validate(
            {
                "model": str(tiny_llama_path),
                "served_model_name": "tiny",
                "experiments": [{"name": "x", **e}, {"name": "y", **e}],
            }
        )


def test_check_weights():
    e = _exp()
    assert check_weights({"A": 3}, e) == {"A": 3.0, "B": 0.0}
    for bad, match in (
        ({"C": 1}, "no variant 'C'"),
        ({"A": -1}, ">= 0"),
        ({"A": 0}, "above 0"),
        ({"A": float("nan")}, ">= 0"),
        ({"A": "x"}, "a number"),
    ):
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
        out.append(
            {
                "t": t,
                "status": "ok",
                "ttft_s": ttft,
                "tpot_s": rng.lognormal(np.log(tpot), 0.2),
                "e2e_s": ttft + 15 * tpot,
                "prompt_tokens": 40,
                "output_tokens": 16,
                "cached_tokens": 0,
                "cache": None,
                "replica": replica,
            }
        )
    return out


def _experiment(a, b, differences=None):
    return {
        "name": "x",
        "model": "m",
        "weights": {"A": 1, "B": 1},
        "variants": [{"name": "A", "settings": {}}, {"name": "B", "settings": {}}],
        "differences": differences if differences is not None else {"B": {"max_num_seqs": [None, 4]}},
        "samples": {"A": a, "B": b},
    }


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
            "B vs A: no significant difference"
        ], seed
    assert len(said) <= 3, said


def test_report_warns_when_variants_differ_in_more_than_one_setting():
    rng = np.random.default_rng(2)
    rep = analyse(
        _experiment(
            _samples(rng, 50, 0.2),
            _samples(rng, 10, 0.2),
            differences={"B": {"max_num_seqs": [None, 4], "stream_interval": [None, 2]}},
        )
    )
    assert any("2 settings (max_num_seqs, stream_interval)" in w for w in rep["warnings"])
    assert any("B has 10 requests" in w for w in rep["warnings"])
