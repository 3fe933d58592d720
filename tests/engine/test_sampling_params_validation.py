"""SamplingParams validation without a model: a bad value is a ValueError whose message starts with
the field's name (out of range, NaN/inf, wrong types, ``min_tokens`` over ``max_tokens``), and the
boundary values are valid. Values checked against a model: ``test_bad_requests.py``."""

from __future__ import annotations

import math

import pytest

from kvserve.engine import SamplingParams


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", 2**64),
        ("seed", -(2**63) - 1),
        ("seed", 1.5),
        ("seed", True),
        ("top_k", True),
        ("top_k", 2.0),
        ("n", True),
        ("max_tokens", True),
        ("logprobs", 2.0),
        ("min_tokens", 1.0),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", math.nan),
        ("min_p", math.nan),
        ("presence_penalty", -math.inf),
        ("frequency_penalty", math.nan),
        ("repetition_penalty", math.inf),
        ("temperature", True),
        ("temperature", "1"),
        ("temperature", 2**2000),
        ("stop", 5),
        ("stop_token_ids", 7),
        ("stop_token_ids", [True]),
        ("stop_token_ids", [1.0]),
        ("ignore_eos", 1),
        ("detokenize", None),
    ],
)
def test_sampling_params_reject_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2),
        ("temperature", -0.1),
        ("temperature", 2.5),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.5),
        ("max_tokens", -1),
        ("max_tokens", -3),
        ("max_tokens", 2.5),
        ("min_tokens", -1),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11.0),
        ("logprobs", -1),
        ("logprobs", 21),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
    ],
)
def test_invalid_sampling_params_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"^{field} "):
        SamplingParams(**{field: value})


def test_min_tokens_over_max_tokens_invalid():
    with pytest.raises(ValueError, match="^min_tokens "):
        SamplingParams(max_tokens=2, min_tokens=3)


@pytest.mark.parametrize(
    "kw",
    [
        dict(temperature=0.0),
        dict(temperature=2.0),
        dict(top_p=1.0),
        dict(top_k=0),
        dict(top_k=-1),
        dict(min_p=1.0),
        dict(max_tokens=None),
        dict(max_tokens=1, min_tokens=1),
        dict(presence_penalty=-2.0),
        dict(frequency_penalty=2.0),
        dict(repetition_penalty=10.0),
        dict(logprobs=0),
        dict(logprobs=20),
        dict(stop="x"),
        dict(stop_token_ids=[0]),
    ],
)
def test_boundary_sampling_params_are_valid(kw):
    sp = SamplingParams(**kw)
    if "stop" in kw:
        assert sp.stop == ["x"]
