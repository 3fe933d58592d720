"""The gateway in-process, its requests: ``build_api`` over a :class:`Gateway` whose model is a fake
replica (no Ray, no Serve, no engine), driven over HTTP through httpx's ASGI transport. What crosses
to the replica is checked as typed values; answers as OpenAI bodies and SSE streams; errors as
OpenAI bodies without internals; an unknown model, a draining gateway, the exact cache and a replica
lost before its first chunk."""

import asyncio
import json

import httpx
from gateway_fakes import FakeGen, FakeReplica, _client, _run, make_gateway
from helpers import DONE, iter_sse
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from kvserve.deployments.gateway.api import build_api
from kvserve.engine.sampling_params import SamplingParams


def test_chat_sends_typed_request_and_renders_openai_body():
    replica = FakeReplica()

    async def main():
        async with _client(replica) as c:
            return await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0, "n": 2},
            )

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
            return await c.post(
                "/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": "hi"}],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )

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
            return await c.post("/v1/completions", json={"prompt": "hi", "seed": 2**70})

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
            streamed = await c.post(
                "/v1/completions", json={"prompt": "BOOM", "stream": True}, headers={"x-request-id": "req-456"}
            )
            chat = await c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": "BOOM"}], "stream": True},
                headers={"x-request-id": "req-789"},
            )
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
            return await c.post(
                "/v1/completions", json={"prompt": ["a", "b"], "echo": True, "n": 1, "best_of": 2, "max_tokens": 3}
            )

    r = _run(main())
    assert r.status_code == 200, r.text
    body = Completion.model_validate(r.json())
    assert [c.text for c in body.choices] == ["ahello world", "bhello world"]
    assert [q.n for q in replica.requests] == [2, 2] and all(q.echo for q in replica.requests)
    assert sorted(q.request_id.rsplit("-", 1)[1] for q in replica.requests) == ["0", "1"]


def test_streamed_prompts_and_choices_interleave_with_their_indexes():
    async def main():
        async with _client(FakeReplica()) as c:
            return await c.post(
                "/v1/completions",
                json={"prompt": ["a", "b"], "n": 2, "stream": True, "stream_options": {"include_usage": True}},
            )

    r = _run(main())
    events = list(iter_sse(r.text))
    assert events[-1] == DONE
    texts: dict[int, str] = {}
    for e in events[:-2]:
        for ch in e["choices"]:
            texts[ch["index"]] = texts.get(ch["index"], "") + ch["text"]
    assert texts == {i: "hello world" for i in range(4)}  # prompt p, choice i -> index p * n + i
    assert events[-2]["usage"] == {
        "prompt_tokens": 8,
        "completion_tokens": 8,
        "total_tokens": 16,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


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


def test_a_request_that_reached_its_replica_is_not_run_again_when_the_replica_is_lost():
    """A replica that took the request (it reached the engine: recorded) and then died (its node
    lost, before the first chunk): the gateway does not send it again (it may have run, or be
    running still); the client gets the typed 503 ``model_unavailable`` and the replica saw the
    request once."""
    from ray.exceptions import ActorDiedError

    class DiesAfterTaking(FakeReplica):
        def _stream(self, request):
            self.requests.append(request)  # the engine has it

            async def dead():
                raise ActorDiedError()
                yield  # unreachable: makes this an async generator

            return FakeGen(dead())

    replica = DiesAfterTaking()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    r = _run(main())
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_unavailable", r.text
    assert len(replica.requests) == 1, "the request ran twice"


def test_a_request_no_replica_took_is_sent_again():
    """Serve had no replica to send the request to (DeploymentUnavailableError: it never started
    anywhere): the gateway sends it again, and the client gets the answer, not a 503."""
    from ray.serve._private.common import DeploymentID
    from ray.serve.exceptions import DeploymentUnavailableError

    class NoneAtFirst(FakeReplica):
        def __init__(self):
            super().__init__()
            self.refused = 0

        def _stream(self, request):
            if self.refused == 0:
                self.refused += 1

                async def refused():
                    raise DeploymentUnavailableError(DeploymentID(name="LLMServer", app_name="kvserve"))
                    yield  # unreachable: makes this an async generator

                return FakeGen(refused())
            return super()._stream(request)

    replica = NoneAtFirst()

    async def main():
        async with _client(replica) as c:
            return await c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})

    r = _run(main())
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == "hello world"
    assert replica.refused == 1 and len(replica.requests) == 1
