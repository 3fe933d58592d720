"""Issue 63 at the gateway (its real validation path: ``build_api`` over a ``Gateway``, a fake
replica behind it): stop strings and ``logit_bias`` over their limits, and a lone surrogate in any
text field, are 400s with OpenAI's body naming the limit or the field; no replica sees them."""

import pytest
from gateway_fakes import FakeReplica, _client, _run
from openai import AsyncOpenAI, BadRequestError

from kvserve.engine.sampling_params import MAX_LOGIT_BIAS, MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS

JSON = {"content-type": "application/json"}


def _post(*calls):
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return [await c.post(path, **kw) for path, kw in calls]

    return _run(main()), replica


def test_stop_and_logit_bias_limits_are_400s_naming_the_limit():
    ok = {"prompt": "hi", "max_tokens": 2}
    (many, long_, bias, at_limit), replica = _post(
        ("/v1/completions", {"json": {**ok, "stop": [f"s{i}" for i in range(10_000)]}}),
        (
            "/v1/chat/completions",
            {"json": {"messages": [{"role": "user", "content": "hi"}], "stop": "x" * (MAX_STOP_STRING_CHARS + 1)}},
        ),
        ("/v1/completions", {"json": {**ok, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}}}),
        (
            "/v1/completions",
            {
                "json": {
                    **ok,
                    "stop": [f"s{i}" for i in range(MAX_STOP_STRINGS)],
                    "logit_bias": {str(i): -1 for i in range(MAX_LOGIT_BIAS)},
                }
            },
        ),
    )
    for r, param, limit in (
        (many, "stop", "MAX_STOP_STRINGS"),
        (long_, "stop", "MAX_STOP_STRING_CHARS"),
        (bias, "logit_bias", "MAX_LOGIT_BIAS"),
    ):
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["param"] == param and limit in err["message"]
    assert "at most 64 stop strings" in many.json()["error"]["message"]
    assert at_limit.status_code == 200, at_limit.text  # the limits themselves are allowed
    [req] = replica.requests  # only the request within the limits reached a replica
    assert len(req.sampling_params.stop) == MAX_STOP_STRINGS
    assert len(req.sampling_params.logit_bias) == MAX_LOGIT_BIAS


@pytest.mark.parametrize(
    "path,body,field",
    [
        ("/v1/completions", b'{"prompt": "hi \\ud800 there"}', "prompt"),
        ("/v1/completions", b'{"prompt": ["ok", "a\\udfff"]}', "prompt.1"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}', "messages.0.content"),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}',
            "messages.0.content.0.text",
        ),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "stop": ["\\ud800"]}', "stop.0"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ("/v1/embeddings", b'{"model": "fake", "input": "\\ud800"}', "input"),
    ],
)
def test_lone_surrogate_is_a_400_naming_the_field(path, body, field):
    """JSON lets a ``\\ud800`` escape stand alone; it decodes to text no tokenizer or UTF-8 writer
    takes (it was a 500 from the gateway's token estimate)."""
    (r,), replica = _post((path, {"content": body, "headers": JSON}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and f"{field} holds a lone surrogate" in err["message"]
    assert replica.requests == []


def test_a_surrogate_pair_is_text():
    (r,), _ = _post(
        (
            "/v1/chat/completions",
            {"content": b'{"messages": [{"role": "user", "content": "smile \\ud83d\\ude00"}]}', "headers": JSON},
        )
    )
    assert r.status_code == 200, r.text


def test_the_openai_sdk_gets_a_bad_request_for_too_many_stop_strings():
    """The real client's view: a ``BadRequestError`` whose body names the limit (the SDK sends
    what a user passes: it checks no stop count)."""

    async def main():
        async with _client(FakeReplica()) as http:
            client = AsyncOpenAI(base_url="http://gw/v1", api_key="x", max_retries=0, http_client=http)
            with pytest.raises(BadRequestError) as e:
                await client.completions.create(
                    model="fake", prompt="hi", stop=[f"s{i}" for i in range(MAX_STOP_STRINGS + 1)]
                )
            return e.value

    err = _run(main())
    assert err.status_code == 400 and "MAX_STOP_STRINGS" in err.message
