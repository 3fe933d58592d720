"""Issue 63 with the real replica behind the gateway (tests/local_app.py: SmolLM2 in this process,
real HTTP, the openai SDK): a request at the stop-string limit stops where the one-pass matcher
says, a ``logit_bias`` id outside the vocabulary and a lone surrogate are 400s, never 500s."""

import httpx
import pytest
from openai import BadRequestError, OpenAI
from openai_client_helpers import post

from kvserve.engine.sampling_params import MAX_STOP_STRINGS


def test_stop_strings_at_the_limit_stop_the_real_model(local_app):
    """The greedy answer without stops, then the same request with ``MAX_STOP_STRINGS`` stop
    strings, one of them a piece of that answer: the text ends just before it."""
    body = {"model": local_app.model, "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0}
    full = post(local_app, "/completions", body).json()["choices"][0]["text"]
    piece = full.strip()[3:7]
    assert len(piece) == 4
    stops = [f"never-{i}" for i in range(MAX_STOP_STRINGS - 1)] + [piece]
    r = post(local_app, "/completions", {**body, "stop": stops})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["text"] == full[: full.index(piece)]


def test_out_of_vocabulary_logit_bias_and_lone_surrogate_are_400s(local_app):
    client = OpenAI(base_url=local_app.base_url, api_key="x", max_retries=0)
    with pytest.raises(BadRequestError) as e:
        client.completions.create(model=local_app.model, prompt="hi", max_tokens=2, logit_bias={"49152": 5})
    assert "logit_bias" in e.value.message and "49152" in e.value.message
    r = httpx.post(
        f"{local_app.base_url}/chat/completions",
        timeout=300,
        headers={"content-type": "application/json"},
        content=b'{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "hi \\ud800"}]}'
        % local_app.model.encode(),
    )
    assert r.status_code == 400 and "lone surrogate" in r.json()["error"]["message"], r.text
