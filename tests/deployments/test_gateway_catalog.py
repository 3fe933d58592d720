"""The gateway in-process, its catalog: cards given at build time answer without a replica call,
and facts a replica publishes at load complete the card and key the response cache. A fake replica
and a dict as the facts board (no Ray, no Serve, no engine)."""

import asyncio

import httpx
from gateway_fakes import FakeReplica, _Remote, _run, make_gateway

from kvserve.deployments.contract.facts import LoadedFacts, ModelCard
from kvserve.deployments.gateway.api import build_api


def test_cards_given_at_build_time_answer_without_a_replica_call():
    """``/v1/models``, a chat's tool parser and a key's reservation up to the context come from
    the cards ``build_app`` gives the gateway: no request asks a replica for its facts."""
    replica = FakeReplica()
    asked = []

    async def server_info():
        asked.append(1)
        raise AssertionError("the gateway asked a replica for its facts")

    replica.server_info = _Remote(server_info)
    card = ModelCard(
        "fake",
        max_model_len=96,
        tensor_parallel_size=2,
        kv_cache_dtype="fp8",
        tool_call_parser="mistral",
        lora_modules=("sql-lora",),
    )

    async def main():
        gw = make_gateway(replica, cards=[card], api_keys=["sk-key-1 tpm=100000"])
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=build_api(gw)),
            base_url="http://gw",
            headers={"authorization": "Bearer sk-key-1"},
        ) as c:
            models = await c.get("/v1/models")
            one = await c.get("/v1/models/fake")
            chat = await c.post(
                "/v1/chat/completions",
                json={  # no max_tokens: the key reserves up to the context
                    "messages": [{"role": "user", "content": "hi"}],
                    "tool_choice": "auto",
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
                },
            )
            return models, one, chat

    models, one, chat = _run(main())
    assert models.status_code == one.status_code == chat.status_code == 200, (models.text, chat.text)
    cards = {m["id"]: m for m in models.json()["data"]}
    assert cards["fake"]["max_model_len"] == 96 and cards["fake"]["tensor_parallel_size"] == 2
    assert cards["fake"]["kv_cache_dtype"] == "fp8" and one.json() == cards["fake"]
    assert cards["sql-lora"]["parent"] == "fake" and cards["sql-lora"]["max_model_len"] == 96
    assert asked == [] and replica.requests[0].tools[0]["function"]["name"] == "f"


class FactsBoard:
    """The facts board as a dict (what replicas published), without Ray."""

    def __init__(self):
        self.published: dict[str, LoadedFacts] = {}

    def get(self, model):
        return self.published.get(model)


def test_facts_published_at_load_complete_the_card_and_key_the_cache(monkeypatch):
    """A model whose ``max_model_len`` is left to its KV pool has none on its card until a replica
    publishes one, and its ``dtype`` is ``auto`` until a replica publishes what ``auto`` became (and
    its ``quantization`` what the replica detected in a 4-bit checkpoint); the
    published revision keys the response cache (a new revision: the old answer is not served);
    facts published under another configuration's digest are not taken."""
    from kvserve.deployments.args import ModelArgs
    from kvserve.deployments.gateway import catalog

    monkeypatch.setattr(catalog, "MISSING_RETRY_S", 0.0)
    monkeypatch.setattr(catalog, "REVISION_REFRESH_S", 0.0)  # every read refreshes in the background
    replica, board = FakeReplica(), FactsBoard()
    card = ModelCard.of(ModelArgs(served_model_name="fake"))
    assert card.max_model_len is None and card.digest
    gw = make_gateway(replica, cards=[card], facts=board)
    body = {"prompt": "same", "max_tokens": 2, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            first = (await c.get("/v1/models/fake")).json()
            board.published["fake"] = LoadedFacts(200, "rev-a", card.digest, "bfloat16", "gptq")
            loaded = (await c.get("/v1/models/fake")).json()
            before = (first["max_model_len"], first["dtype"], first["quantization"])
            after = (loaded["max_model_len"], loaded["dtype"], loaded["quantization"])
            statuses = []
            for revision in ("rev-a", "rev-a", "rev-b", "rev-b"):
                if revision != board.published["fake"].revision:
                    board.published["fake"] = LoadedFacts(200, revision, card.digest)
                    await gw.catalog.revision("fake")  # the read that starts the refresh
                await asyncio.sleep(0.05)  # the refresh and the store run in the background
                r = await c.post("/v1/completions", json=body)
                statuses.append(r.headers["x-kvserve-cache"])
            board.published["fake"] = LoadedFacts(300, "rev-c", "another-configuration")
            await gw.catalog.max_model_len("fake")
            await asyncio.sleep(0.05)
            return before, after, statuses, await gw.catalog.max_model_len("fake")

    before, after, statuses, stale = _run(main())
    assert before == (None, "auto", None) and after == (200, "bfloat16", "gptq")  # a 4-bit checkpoint's own
    assert statuses == ["miss", "exact", "miss", "exact"] and len(replica.requests) == 2
    assert stale is None  # another configuration's facts: the card's (unknown) again
