"""The embeddings and tokenize endpoints in-process: the gateway over a fake replica (no Ray, no
engine), driven by the openai SDK (base64 embeddings decoded by the SDK) and httpx: floats and
base64, errors, the key's token budget, tokenize / detokenize, and one-answer calls sent again when
their replica is lost."""

import base64

import httpx
import numpy as np
from gateway_fakes import ScriptedReplica, _Remote, _run, _sdk


def test_embeddings_float_and_base64_and_errors():
    replica = ScriptedReplica()

    async def main():
        client, app = _sdk(replica)
        floats = await client.embeddings.create(model="fake", input=["ab", "abcd"], encoding_format="float")
        b64 = await client.embeddings.create(model="fake", input="abc")  # the SDK asks base64 and decodes it
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            raw = await c.post("/v1/embeddings", json={"model": "fake", "input": [1, 2], "encoding_format": "base64"})
            empty = await c.post("/v1/embeddings", json={"model": "fake", "input": ["ok", ""]})
            dims = await c.post("/v1/embeddings", json={"model": "fake", "input": "x", "dimensions": 2})
            unknown = await c.post("/v1/embeddings", json={"model": "nope", "input": "x"})
        return floats, b64, raw, empty, dims, unknown

    floats, b64, raw, empty, dims, unknown = _run(main())
    assert [d.embedding for d in floats.data] == [[2.0, 0.5, -0.25], [4.0, 0.5, -0.25]]
    assert [d.index for d in floats.data] == [0, 1] and floats.usage.prompt_tokens == 6
    assert b64.data[0].embedding == [3.0, 0.5, -0.25]
    vec = np.frombuffer(base64.b64decode(raw.json()["data"][0]["embedding"]), dtype="<f4")
    assert vec.tolist() == [2.0, 0.5, -0.25]  # token ids went to the replica as a list of ids
    assert replica.embed_calls[2][0] == [[1, 2]]
    assert empty.status_code == 400 and "empty" in empty.json()["error"]["message"]
    assert dims.status_code == 400 and "dimensions" in dims.json()["error"]["message"]
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"


def test_embedding_tokens_count_against_the_keys_token_budget():
    replica = ScriptedReplica()

    async def main():
        _, app = _sdk(replica, api_keys=["sk-a tpm=40"])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gw", headers={"Authorization": "Bearer sk-a"}
        ) as c:
            codes = []
            for _ in range(6):  # each: 4 inputs estimated at 2 tokens, settled at 12 used
                r = await c.post("/v1/embeddings", json={"model": "fake", "input": ["abcd"] * 4})
                codes.append(r.status_code)
            return codes

    codes = _run(main())
    assert codes[0] == 200 and 429 in codes  # 40 tokens a minute: the settled 12-token requests run out


def test_tokenize_and_detokenize():
    replica = ScriptedReplica()

    async def main():
        _, app = _sdk(replica)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            t = await c.post("/tokenize", json={"model": "fake", "prompt": "hey", "return_token_strs": True})
            m = await c.post("/tokenize", json={"messages": [{"role": "user", "content": "yo"}]})
            d = await c.post("/detokenize", json={"model": "fake", "tokens": [104, 105]})
            both = await c.post("/tokenize", json={"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
            bad = await c.post("/tokenize", json={"prompt": "BAD"})
        return t, m, d, both, bad

    t, m, d, both, bad = _run(main())
    assert t.json() == {"count": 3, "max_model_len": 128, "tokens": [104, 101, 121], "token_strs": ["h", "e", "y"]}
    assert m.json()["count"] == 2
    assert d.json() == {"prompt": "hi"}
    assert both.status_code == 400 and bad.status_code == 400 and bad.json()["error"]["message"] == "cannot tokenize"


def test_unknown_fields_named_like_declared_ones_are_ignored_not_a_500():
    """A body whose unknown field shares a name the warning walks on other endpoints
    (``messages``, ``stream_options``) but holds anything (schemathesis sent ``/detokenize`` a
    dict as ``messages``: a 500): answered, the field ignored."""
    replica = ScriptedReplica()

    async def main():
        _, app = _sdk(replica)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            return [
                await c.post("/detokenize", json={"tokens": [104, 105], "messages": weird, "stream_options": weird})
                for weird in ({"a": 4.0e16}, ["x", 1], "text", 7)
            ]

    for r in _run(main()):
        assert r.status_code == 200 and r.json() == {"prompt": "hi"}, r.text


def test_one_answer_calls_are_sent_again_when_their_replica_is_lost():
    """An embeddings or tokenize call whose replica died under it (a lost node: ActorDiedError)
    is idempotent, so it goes again, as a stream lost before its first token does; a replica that
    stays lost is a 503 after the retries."""
    from ray.exceptions import ActorDiedError

    class Flaky(ScriptedReplica):
        def __init__(self, losses):
            super().__init__()
            self.losses, self.calls = losses, 0
            embed, tokenize = self.embed.remote, self.tokenize.remote

            def lossy(fn):
                async def call(*a, **kw):
                    self.calls += 1
                    if self.losses > 0:
                        self.losses -= 1
                        raise ActorDiedError()
                    return await fn(*a, **kw)

                return _Remote(call)

            self.embed, self.tokenize = lossy(embed), lossy(tokenize)

    async def main(replica):
        _, app = _sdk(replica)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            e = await c.post("/v1/embeddings", json={"model": "fake", "input": "ab"})
            t = await c.post("/tokenize", json={"model": "fake", "prompt": "hey"})
        return e, t

    once = Flaky(losses=1)
    e, t = _run(main(once))
    assert e.status_code == 200 and e.json()["data"][0]["embedding"] == [2.0, 0.5, -0.25]
    assert t.status_code == 200 and t.json()["count"] == 3 and once.calls == 3
    gone = Flaky(losses=100)
    e, t = _run(main(gone))
    assert e.status_code == 503 and e.json()["error"]["code"] == "model_unavailable"
    assert t.status_code == 503 and gone.calls == 6  # 1 + UNAVAILABLE_RETRIES each
