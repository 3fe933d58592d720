"""Model routing rules (``model: "auto"``) and the fallback's trigger, without Ray; the live
routing and the fallback to a second kvserve are in tests/e2e/test_model_routing_live.py."""

import pytest
from pydantic import ValidationError

from kvserve.deployments.routing.model_routing import ModelRouting, RouteRule, Upstream, UpstreamArgs, user_text

SMALL, LARGE = "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma-3-270m"


def _routing() -> ModelRouting:
    return ModelRouting.model_validate(
        {
            "rules": [
                {"name": "code", "model": LARGE, "keywords": ["Python", "def ", "function"]},
                {
                    "name": "short",
                    "model": SMALL,
                    "max_prompt_tokens": 200,
                    "max_tokens": 256,
                    "exclude_keywords": ["step by step", "prove"],
                },
            ],
            "default": LARGE,
        }
    )


def test_first_matching_rule_wins():
    r = _routing()
    assert r.choose(20, 64, "Write a python function that adds two numbers", SMALL) == (LARGE, "code")
    assert r.choose(20, 64, "What is the capital of France?", SMALL) == (SMALL, "short")
    # every condition of a rule must hold: too long a prompt, too many (or unbounded) tokens, an excluded word
    assert r.choose(201, 64, "What is the capital of France?", SMALL) == (LARGE, "default")
    assert r.choose(20, 257, "What is the capital of France?", SMALL) == (LARGE, "default")
    assert r.choose(20, None, "What is the capital of France?", SMALL) == (LARGE, "default")
    assert r.choose(20, 64, "Prove that there are infinitely many primes", SMALL) == (LARGE, "default")
    # no default: the app's first model; unnamed rules are named by position
    bare = ModelRouting(rules=[RouteRule(model=SMALL, max_tokens=10)])
    assert bare.choose(5, 10, "hi", "first") == (SMALL, "rule0")
    assert bare.choose(5, 11, "hi", "first") == ("first", "default")


def test_config_errors_are_clear():
    r = _routing()
    r.check([SMALL, LARGE])
    with pytest.raises(ValueError, match="rules\\[0\\].model 'gemma-3-270m' is not served"):
        r.check([SMALL])
    with pytest.raises(ValueError, match="default 'x' is not served"):
        ModelRouting(default="x").check([SMALL])
    with pytest.raises(ValueError, match="reserved"):
        ModelRouting().check(["auto"])
    with pytest.raises(ValidationError):  # a typo'd condition is refused, not ignored
        ModelRouting.model_validate({"rules": [{"model": SMALL, "max_prompt_token": 5}]})
    with pytest.raises(ValidationError):
        RouteRule(model=SMALL, max_tokens=-1)
    with pytest.raises(ValidationError, match="http"):
        UpstreamArgs(base_url="ftp://x")
    assert UpstreamArgs(base_url="http://127.0.0.1:9/v1/").base_url == "http://127.0.0.1:9/v1"


def test_user_text_reads_user_turns_and_prompts():
    msgs = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": "def f(): pass"},
        {"role": "user", "content": "again"},
    ]
    assert user_text(msgs) == "Hello\nthere\nagain"  # the system prompt and the assistant turn do not count
    assert user_text(prompt=["a", "b"]) == "a\nb"
    assert user_text(prompt=[1, 2, 3]) == ""


def test_what_falls_back():
    # capacity and failures go upstream; client errors and a key's own limit never do
    assert Upstream.applies(429, "queue_full") and Upstream.applies(503, "model_unavailable")
    assert Upstream.applies(500, None) and Upstream.applies(504, "timeout")
    assert not Upstream.applies(400, "invalid_value") and not Upstream.applies(400, "context_length_exceeded")
    assert not Upstream.applies(429, "rate_limit_exceeded") and not Upstream.applies(404, "model_not_found")
