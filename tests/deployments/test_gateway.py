"""The gateway in-process: ``build_api`` over a :class:`Gateway` whose model is a fake replica
(no Ray, no Serve, no engine), driven over HTTP through httpx's ASGI transport. What crosses
to the replica is checked as typed values; errors as OpenAI bodies without internals."""
import asyncio
import json
import re

import httpx
from helpers import DONE, iter_sse
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from deployments.app import gateway_options
from deployments.args import AppArgs
from deployments.contract.facts import LoadedFacts, ModelCard
from deployments.gateway.api import build_api
from deployments.gateway.core import Gateway
from deployments.contract.types import GenerateRequest, GenerationChunk, GenerationError, ServerInfo
from engine.sampling_params import SamplingParams

SECRET = 'File "/root/.venv/x.py", line 3, pid=4242, ActorID(ab12cd), 10.0.0.7:6379'


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeGen:
    """What ``handle.options(stream=True).stream.remote(...)`` gives: an async iterator with cancel()."""

    def __init__(self, agen):
        self.agen, self.cancelled = agen, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.agen.__anext__()

    def cancel(self):
        self.cancelled = True


class FakeReplica:
    """An LLMServer stand-in: answers "hello world" in two chunks per choice; a prompt or last
    message of ``FULL`` gets a typed queue_full error, ``BOOM`` fails after its first chunk."""

    def __init__(self):
        self.requests: list[GenerateRequest] = []
        self.stream = _Remote(self._stream)
        self.server_info = _Remote(self._info)
        self.health = _Remote(self._ok)
        self.ready = _Remote(self._ok)

    def options(self, **_):
        return self

    async def _info(self):
        return ServerInfo(name="fake", max_model_len=128, max_in_flight_requests=8, revision="r1")

    async def _ok(self):
        return {"status": "ok"}

    def _stream(self, request: GenerateRequest) -> FakeGen:
        self.requests.append(request)
        return FakeGen(self._chunks(request))

    async def _chunks(self, request: GenerateRequest):
        text = request.prompt if request.messages is None else request.messages[-1]["content"]
        if text == "FULL":
            yield GenerationChunk.failed(GenerationError("queue_full", "the model is at capacity", 3.0))
            return
        for i in range(request.n):
            yield GenerationChunk(text="hello", token_ids=[1], num_prompt_tokens=4, num_output_tokens=1, index=i,
                                  prompt_text=text if request.echo else None)
            await asyncio.sleep(0)
            if text == "BOOM":
                raise RuntimeError(SECRET)
            yield GenerationChunk(text=" world", token_ids=[2], finished=True, finish_reason="length",
                                  num_prompt_tokens=4, num_output_tokens=2, index=i)


def make_gateway(replica, cards: list[ModelCard] | None = None, facts=None, **settings) -> Gateway:
    """A gateway over ``replica`` served as ``fake``, built as ``build_app`` builds it: the
    model's card from its configuration (``max_model_len`` 128, given at build time) and the
    sections from ``settings`` (the Serve config's flat names: ``api_keys``, ``response_cache``, ...)."""
    args = AppArgs.model_validate({"models": [{"served_model_name": "fake", "max_model_len": 128}], **settings})
    opts = gateway_options(args)
    if cards is not None:
        opts["cards"] = cards
    return Gateway({"fake": replica}, facts=facts, **opts)


def _client(replica, **settings):
    gw = make_gateway(replica, **settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw")


def _run(coro):
    return asyncio.run(coro)


def test_chat_sends_typed_request_and_renders_openai_body():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "n": 2})

    r = _run(main())
    assert r.status_code == 200, r.text
    body = ChatCompletion.model_validate(r.json())
    assert [c.message.content for c in body.choices] == ["hello world", "hello world"]
    assert body.usage.prompt_tokens == 4 and body.usage.completion_tokens == 4  # the prompt counted once
    [req] = replica.requests
    assert isinstance(req.sampling_params, SamplingParams)  # validated by the gateway, typed on the wire
    assert req.sampling_params.max_tokens == 5 and req.sampling_params.temperature == 0.0
    assert req.n == 2 and req.messages == [{"role": "user", "content": "hi"}]
    assert req.request_id == body.id and body.id.startswith("chatcmpl-")


def test_chat_stream_is_openai_sse_ending_with_done():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}})

    r = _run(main())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = list(iter_sse(r.text))
    assert events[-1] == DONE
    chunks = [ChatCompletionChunk.model_validate(e) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "hello world"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2


def test_a_value_the_engine_refuses_is_a_400_before_any_replica_sees_it():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "seed": 2 ** 70})

    r = _run(main())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_value" and "seed" in err["message"]
    assert replica.requests == []


def test_replica_refusal_is_its_typed_status():
    async def main():
        async with _client(FakeReplica()) as c:
            return await c.post("/v1/completions", json={"prompt": "FULL"})

    r = _run(main())
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert r.json()["error"]["code"] == "queue_full"


def test_failures_tell_the_request_id_and_no_internals():
    async def main():
        async with _client(FakeReplica()) as c:
            whole = await c.post("/v1/completions", json={"prompt": "BOOM"}, headers={"x-request-id": "req-123"})
            streamed = await c.post("/v1/completions", json={"prompt": "BOOM", "stream": True},
                                    headers={"x-request-id": "req-456"})
            chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "BOOM"}],
                                                              "stream": True}, headers={"x-request-id": "req-789"})
            return whole, streamed, chat

    whole, streamed, chat = _run(main())
    assert whole.status_code == 500 and "req-123" in whole.json()["error"]["message"]
    for r, rid in ((streamed, "req-456"), (chat, "req-789")):  # the response had started: an SSE error event
        events = list(iter_sse(r.text))
        assert events[-1] == DONE and "error" in events[-2] and rid in events[-2]["error"]["message"]
        assert events[0].get("choices"), "the first chunk went out before the failure"
    for text in (whole.text, streamed.text, chat.text):
        # (the secret's parts, not a bare "4242", which a random request id may contain)
        assert "pid=4242" not in text and "/root" not in text and "ActorID" not in text and "10.0.0.7" not in text


def test_completions_echo_and_best_of_and_prompt_batch():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/completions", json={"prompt": ["a", "b"], "echo": True, "n": 1,
                                                         "best_of": 2, "max_tokens": 3})

    r = _run(main())
    assert r.status_code == 200, r.text
    body = Completion.model_validate(r.json())
    assert [c.text for c in body.choices] == ["ahello world", "bhello world"]
    assert [q.n for q in replica.requests] == [2, 2] and all(q.echo for q in replica.requests)
    assert sorted(q.request_id.rsplit("-", 1)[1] for q in replica.requests) == ["0", "1"]


def test_streamed_prompts_and_choices_interleave_with_their_indexes():
    async def main():
        async with _client(FakeReplica()) as c:
            return await c.post("/v1/completions", json={"prompt": ["a", "b"], "n": 2, "stream": True,
                                                         "stream_options": {"include_usage": True}})

    r = _run(main())
    events = list(iter_sse(r.text))
    assert events[-1] == DONE
    texts: dict[int, str] = {}
    for e in events[:-2]:
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {i: "hello world" for i in range(4)}  # prompt p, choice i -> index p * n + i
    assert events[-2]["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_keys_guard_the_api_but_not_the_probes():
    async def main():
        async with _client(FakeReplica(), api_keys=["sk-test-key-1"]) as c:
            return (await c.get("/v1/models"), await c.get("/v1/models", headers={"authorization": "Bearer sk-test-key-1"}),
                    await c.get("/health"))

    denied, models, health = _run(main())
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert models.status_code == 200
    [card] = models.json()["data"]
    assert card["id"] == "fake" and card["max_model_len"] == 128  # from the model's card
    assert health.status_code == 200 and health.json()["models"] == ["fake"]


PROBES = {"/health", "/ready", "/metrics"}


def _route_table(app) -> list[tuple[str, str, bool]]:
    """``(method, path, takes a body)`` for every route of the built app, path parameters
    filled with ``x``. Every entry must be a plain route: a mount or websocket added later
    fails here instead of escaping the walk."""
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    table = []
    for r in app.routes:
        assert isinstance(r, Route), f"not an HTTP route, the gate test cannot walk it: {r!r}"
        path = re.sub(r"\{[^}]*\}", "x", r.path)
        body = isinstance(r, APIRoute) and r.body_field is not None
        table += [(m, path, body) for m in sorted(r.methods or ())]
    return table


def test_every_route_but_the_probes_needs_a_key_and_every_body_is_bounded():
    """Deny by default, over the real route table of the built app: each route (each method)
    without a key is a 401 unless it is a probe; each route that takes a body refuses an
    oversized one (413) even with a valid key."""
    key, limit = "sk-test-key-1", 1024
    gw = make_gateway(FakeReplica(), api_keys=[key], max_request_body_bytes=limit, auth_failures_per_minute=10_000)
    app = build_api(gw)
    table = _route_table(app)
    paths = {p for _, p, _ in table}
    assert {"/tokenize", "/detokenize", "/v1/chat/completions", "/v1/load_lora_adapter", "/openapi.json"} <= paths
    assert PROBES <= paths
    with_body = [(m, p) for m, p, b in table if b]
    assert ("POST", "/tokenize") in with_body and ("POST", "/v1/chat/completions") in with_body

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a handler's failure: a 500
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            keyless = {(m, p): (await c.request(m, p, json={} if b else None)).status_code for m, p, b in table}
            big = {(m, p): await c.request(m, p, content=b"{" + b" " * limit + b"}", headers={
                "authorization": f"Bearer {key}", "content-type": "application/json"}) for m, p in with_body}
            return keyless, big

    keyless, big = _run(main())
    open_ = {mp: st for mp, st in keyless.items() if st != 401}
    assert set(open_) == {(m, p) for m, p, _ in table if p in PROBES}, open_
    # the probes reach their handlers (/metrics needs a Ray session or $KVSERVE_METRICS_DIR to render)
    assert open_[("GET", "/health")] == open_[("GET", "/ready")] == 200, open_
    assert {mp: r.status_code for mp, r in big.items()} == {mp: 413 for mp in with_body}
    assert all(r.json()["error"]["code"] == "request_too_large" for r in big.values())


def test_a_path_outside_the_route_table_is_closed_too():
    """A path no route serves (a route someone adds later) is a 401 without a key, not a 404."""
    async def main():
        async with _client(FakeReplica(), api_keys=["sk-test-key-1"]) as c:
            return (await c.post("/admin/new", json={}), await c.get("/health/"),
                    await c.post("/new", headers={"authorization": "Bearer sk-test-key-1"}))

    keyless, near_probe, keyed = _run(main())
    assert keyless.status_code == 401 and near_probe.status_code == 401
    assert keyed.status_code == 404


def test_replica_placement_is_shown_to_admin_keys_only(monkeypatch):
    """``/v1/models`` names each replica's node for an admin key; an API key, and anyone when
    no key is configured, sees vLLM's plain cards."""
    from deployments.gateway import models

    where = [{"replica_id": "r1", "node_id": "n" * 56, "node_ip": "10.1.2.3", "state": "RUNNING"}]

    async def placement():
        return {("kvserve", "LLMServer"): where}

    monkeypatch.setattr(models, "replica_placement", placement)
    replica = FakeReplica()
    replica.app_name, replica.deployment_name = "kvserve", "LLMServer"

    async def cards(headers=None, **settings):
        async with _client(replica, **settings) as c:
            r = await c.get("/v1/models", headers=headers or {})
            assert r.status_code == 200, r.text
            one = await c.get("/v1/models/fake", headers=headers or {})
            return r.json()["data"][0], one.json()

    keys = dict(api_keys=["sk-user-key-1"], admin_api_keys=["sk-admin-key-1"])
    admin, admin_one = _run(cards({"authorization": "Bearer sk-admin-key-1"}, **keys))
    user, user_one = _run(cards({"authorization": "Bearer sk-user-key-1"}, **keys))
    open_, _ = _run(cards())  # no keys at all: nobody is an admin
    wrong, _ = _run(cards({"authorization": "Bearer sk-admin-key-1"}))  # an admin key where none is configured
    assert admin["replicas"] == where
    for card in (user, user_one, admin_one, open_, wrong):
        assert "replicas" not in card and "10.1.2.3" not in json.dumps(card)
        assert card["id"] == "fake" and card["max_model_len"] == 128


def test_unknown_model_is_404_and_draining_is_not_ready():
    replica = FakeReplica()
    gw = make_gateway(replica)

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            missing = await c.post("/v1/completions", json={"model": "nope", "prompt": "x"})
            ready = await c.get("/ready")
            gw.draining = True
            return missing, ready, await c.get("/ready")

    missing, ready, draining = _run(main())
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert ready.status_code == 200
    assert draining.status_code == 503 and draining.json()["error"]["code"] == "draining"


def test_exact_cache_answers_a_repeat_without_the_replica():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            body = {"prompt": "same", "max_tokens": 2, "temperature": 0}
            first = await c.post("/v1/completions", json=body)
            await asyncio.sleep(0.05)  # the store runs in the background
            return first, await c.post("/v1/completions", json=body)

    first, second = _run(main())
    assert first.status_code == second.status_code == 200
    assert json.loads(second.text)["choices"][0]["text"] == "hello world"
    assert len(replica.requests) == 1, "the repeat reached the replica"


def test_a_replica_lost_before_the_first_chunk_is_retried_once_elsewhere():
    """A replica that died (its node lost) before producing anything: the request goes again
    (nothing was generated), and the client gets the answer, not a 503."""
    from ray.exceptions import ActorDiedError

    class LosesFirst(FakeReplica):
        def __init__(self):
            super().__init__()
            self.lost = 0

        def _stream(self, request):
            if self.lost == 0:
                self.lost += 1

                async def dead():
                    raise ActorDiedError()
                    yield  # noqa: unreachable (an async generator)
                return FakeGen(dead())
            return super()._stream(request)

    replica = LosesFirst()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    r = _run(main())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello world"
    assert replica.lost == 1 and len(replica.requests) == 1


# ---- the catalog: cards given at build time, facts published at load ---------------------------
def test_cards_given_at_build_time_answer_without_a_replica_call():
    """``/v1/models``, a chat's tool parser and a key's reservation up to the context come from
    the cards ``build_app`` gives the gateway: no request asks a replica for its facts."""
    replica = FakeReplica()
    asked = []

    async def server_info():
        asked.append(1)
        raise AssertionError("the gateway asked a replica for its facts")

    replica.server_info = _Remote(server_info)
    card = ModelCard("fake", max_model_len=96, tensor_parallel_size=2, kv_cache_dtype="fp8",
                     tool_call_parser="mistral", lora_modules=("sql-lora",))

    async def main():
        gw = make_gateway(replica, cards=[card], api_keys=["sk-key-1 tpm=100000"])
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw",
                                     headers={"authorization": "Bearer sk-key-1"}) as c:
            models = await c.get("/v1/models")
            one = await c.get("/v1/models/fake")
            chat = await c.post("/v1/chat/completions", json={  # no max_tokens: the key reserves up to the context
                "messages": [{"role": "user", "content": "hi"}], "tool_choice": "auto", "tools": [
                    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]})
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
    publishes one; the published revision keys the response cache (a new revision: the old answer
    is not served); facts published under another configuration's digest are not taken."""
    from deployments.args import ModelArgs
    from deployments.gateway import catalog

    monkeypatch.setattr(catalog, "MISSING_RETRY_S", 0.0)
    monkeypatch.setattr(catalog, "REVISION_REFRESH_S", 0.0)  # every read refreshes in the background
    replica, board = FakeReplica(), FactsBoard()
    card = ModelCard.of(ModelArgs(served_model_name="fake"))
    assert card.max_model_len is None and card.digest
    gw = make_gateway(replica, cards=[card], facts=board)
    body = {"prompt": "same", "max_tokens": 2, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            before = (await c.get("/v1/models/fake")).json()["max_model_len"]
            board.published["fake"] = LoadedFacts(200, "rev-a", card.digest)
            after = (await c.get("/v1/models/fake")).json()["max_model_len"]
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
    assert before is None and after == 200
    assert statuses == ["miss", "exact", "miss", "exact"] and len(replica.requests) == 2
    assert stale is None  # another configuration's facts: the card's (unknown) again


# ---- the size check: the replica's, rendered as it is ------------------------------------------
class SizedReplica(FakeReplica):
    """A fake replica that checks a request's size as ``LLMServer.stream`` does, with a real
    :class:`~deployments.replica.admission.Admission` (9 requests in flight at most)."""

    def __init__(self):
        from deployments.replica.admission import Admission

        super().__init__()
        self.admission = Admission(max_num_seqs=8, max_waiting_requests=1, max_prompt_tokens=1000)

    async def _chunks(self, request):
        too_large = self.admission.never_fits(request.n, request.num_prompts)
        if too_large is not None:
            yield GenerationChunk.failed(too_large)
            return
        async for chunk in super()._chunks(request):
            yield chunk


def test_the_size_check_is_the_replicas_and_renders_as_the_same_400():
    """A batch of prompts x choices larger than a replica holds at once is refused by the
    replica, which knows its bound (the gateway has none to check), with the 400 the gateway used
    to give: code ``too_large``, param ``prompt``, the numbers in the message; one prompt with
    too many choices likewise; a batch that fits runs."""
    replica = SizedReplica()

    async def main():
        async with _client(replica) as c:
            big = await c.post("/v1/completions", json={"prompt": ["hi"] * 10, "max_tokens": 1})
            sent = list(replica.requests)
            many = await c.post("/v1/completions", json={"prompt": "hi", "n": 10, "max_tokens": 1})
            fits = await c.post("/v1/completions", json={"prompt": ["hi"] * 9, "max_tokens": 1})
            return big, sent, many, fits

    big, sent, many, fits = _run(main())
    assert big.status_code == 400 and big.json()["error"] == {
        "message": "10 prompts x 1 choices in one request; a replica of this model takes at most 9 requests at once "
                   "(max_num_seqs + max_waiting_requests), so this request can never be admitted: send fewer "
                   "prompts or choices per request",
        "type": "invalid_request_error", "param": "prompt", "code": "too_large"}
    assert len(sent) == 10 and {r.num_prompts for r in sent} == {10}  # the gateway sent it: no check of its own
    assert many.status_code == 400 and many.json()["error"]["code"] == "too_large"
    assert many.json()["error"]["param"] is None and "n=10" in many.json()["error"]["message"]
    assert fits.status_code == 200 and len(fits.json()["choices"]) == 9


def test_a_batch_larger_than_the_capacity_seen_gets_the_replicas_verdict_under_a_full_mark():
    """While the model is marked full (the load shedder refuses at once what would exceed the
    capacity it saw), a batch larger than that capacity still goes to the replica: it may never
    fit, and then its answer is the replica's 400 ``too_large``, not a 429 no retry could fix."""
    replica = SizedReplica()
    gw = make_gateway(replica)
    gw.shedder.open["fake"] = 9
    gw.shedder.refused("fake", 3.0)  # the replica said "full" with 9 open: capacity 9
    gw.shedder.open["fake"] = 1

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw") as c:
            return (await c.post("/v1/completions", json={"prompt": ["hi"] * 10, "max_tokens": 1}),
                    await c.post("/v1/completions", json={"prompt": ["hi"] * 9, "max_tokens": 1}))

    big, full = _run(main())
    assert big.status_code == 400 and big.json()["error"]["code"] == "too_large"
    assert full.status_code == 429 and full.json()["error"]["code"] == "queue_full"  # 1 open + 9 > 9: shed here
    assert len(replica.requests) == 10
