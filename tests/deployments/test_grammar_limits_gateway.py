"""Structured outputs over a size limit (kvserve/engine/grammar_spec.py GrammarLimits) are a 400
naming the limit at the gateway, where the API payload is parsed, before any replica sees them:
the real gateway (``build_api`` over a :class:`Gateway`) over a fake replica, through httpx's ASGI
transport, for every way a request asks for a grammar."""

import json

from gateway_fakes import FakeReplica, _client, _run

from kvserve.engine.grammar_spec import DEFAULT_LIMITS

LIM = DEFAULT_LIMITS
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BIG_SCHEMA = {
    "type": "object",
    "properties": {
        f"p{i}": {"type": "string", "description": "x" * 200} for i in range(LIM.max_json_schema_bytes // 200)
    },
}
CASES = [  # (path, body, the limit the message must name)
    (
        "/v1/chat/completions",
        {**CHAT, "structured_outputs": {"choice": ["c%d" % i for i in range(LIM.max_choices + 1)]}},
        "max_choices",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "guided_choice": ["y" * 1024] * (LIM.max_choice_bytes // 1024 + 1)},
        "max_choice_bytes",
    ),
    (
        "/v1/completions",
        {"prompt": "hi", "structured_outputs": {"regex": "a" * (LIM.max_regex_bytes + 1)}},
        "max_regex_bytes",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "guided_grammar": 'root ::= "' + "g" * LIM.max_grammar_bytes + '"'},
        "max_grammar_bytes",
    ),
    (
        "/v1/chat/completions",
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}},
        "max_json_schema_bytes",
    ),
]


def test_structured_outputs_over_a_size_limit_are_a_400_naming_the_limit():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return [await c.post(path, json=body) for path, body, _ in CASES]

    for r, (path, body, limit) in zip(_run(main()), CASES):
        assert len(json.dumps(body)) < 4 << 20  # under the body limit: the grammar's own limit answers
        assert r.status_code == 400, (limit, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert limit in err["message"] and str(getattr(LIM, limit)) in err["message"], err
        assert err["type"] == "invalid_request_error"
    assert replica.requests == []  # none reached a replica


def test_structured_outputs_within_the_limits_reach_the_replica():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return await c.post(
                "/v1/chat/completions",
                json={**CHAT, "structured_outputs": {"choice": ["c%d" % i for i in range(LIM.max_choices)]}},
            )

    r = _run(main())
    assert r.status_code == 200, r.text[:300]
    [req] = replica.requests
    assert len(req.sampling_params.structured_outputs["choice"]) == LIM.max_choices
