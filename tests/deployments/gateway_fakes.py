"""Fake replicas for the in-process gateway tests (test_gateway_*.py, test_responses_*.py,
test_embeddings_tokenize.py, test_shedding.py, test_lora_serving.py): no Ray, no Serve, no engine.

:class:`FakeReplica` answers "hello world" (``FULL``: a typed queue_full error, ``BOOM``: a
failure after the first chunk); :class:`ScriptedReplica` answers given pieces and serves
embed / tokenize calls. :func:`make_gateway` builds a gateway over one as ``build_app`` does;
:func:`_client` (httpx) and :func:`_sdk` (the openai SDK) drive its app through httpx's ASGI
transport."""

import asyncio
import json

import httpx
import openai

from kvserve.deployments.app import gateway_options
from kvserve.deployments.args import AppArgs
from kvserve.deployments.contract.facts import ModelCard
from kvserve.deployments.contract.types import (
    EmbedResult,
    GenerateRequest,
    GenerationChunk,
    GenerationError,
    ServerInfo,
    TokenizeResult,
)
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.core import Gateway

SECRET = 'File "/root/.venv/x.py", line 3, pid=4242, ActorID(ab12cd), 10.0.0.7:6379'


class _Remote:
    def __init__(self, fn):
        self.remote = fn


class FakeGen:
    """What ``handle.options(stream=True).stream.remote(...)`` gives: an async iterator with cancel();
    its chunks numbered (``seq``) as the replica numbers them."""

    def __init__(self, agen):
        self.agen, self.cancelled, self.seq = agen, False, 0

    def __aiter__(self):
        return self

    async def __anext__(self):
        chunk = await self.agen.__anext__()
        if isinstance(chunk, GenerationChunk):
            chunk.seq, self.seq = self.seq, self.seq + 1
        return chunk

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
            yield GenerationChunk(
                text="hello",
                token_ids=[1],
                num_prompt_tokens=4,
                num_output_tokens=1,
                index=i,
                prompt_text=text if request.echo else None,
            )
            await asyncio.sleep(0)
            if text == "BOOM":
                raise RuntimeError(SECRET)
            yield GenerationChunk(
                text=" world",
                token_ids=[2],
                finished=True,
                finish_reason="length",
                num_prompt_tokens=4,
                num_output_tokens=2,
                index=i,
            )


def make_gateway(
    replica, cards: list[ModelCard] | None = None, facts=None, model: dict | None = None, **settings
) -> Gateway:
    """A gateway over ``replica`` served as ``fake``, built as ``build_app`` builds it: the
    model's card from its configuration (``max_model_len`` 128, given at build time, and the
    settings in ``model``) and the sections from ``settings`` (the Serve config's flat names:
    ``api_keys``, ``response_cache``, ...)."""
    args = AppArgs.model_validate(
        {"models": [{"served_model_name": "fake", "max_model_len": 128, **(model or {})}], **settings}
    )
    opts = gateway_options(args)
    if cards is not None:
        opts["cards"] = cards
    return Gateway({"fake": replica}, facts=facts, **opts)


def _client(replica, **settings):
    gw = make_gateway(replica, **settings)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw")


def _run(coro):
    return asyncio.run(coro)


class ScriptedReplica:
    """An LLMServer stand-in whose answer is ``pieces`` (one chunk each) ending with
    ``finish_reason`` (the first chunk saying ``prompt_reasoning``); it records the typed
    requests, and answers embed / tokenize calls."""

    def __init__(self, pieces=("Hello", " there"), finish_reason="stop", prompt_reasoning=""):
        self.pieces, self.finish, self.prompt_reasoning = list(pieces), finish_reason, prompt_reasoning
        self.requests, self.embed_calls = [], []
        self.stream = _Remote(self._stream)
        self.server_info = _Remote(self._info)
        self.embed = _Remote(self._embed)
        self.tokenize = _Remote(self._tokenize)
        self.detokenize = _Remote(self._detokenize)

    def options(self, **_):
        return self

    async def _info(self):
        return ServerInfo(
            name="fake", max_model_len=128, max_in_flight_requests=8, revision="r1", tool_call_parser="hermes"
        )

    def _stream(self, request):
        self.requests.append(request)
        return FakeGen(self._chunks())

    async def _chunks(self):
        for i, p in enumerate(self.pieces):
            last = i == len(self.pieces) - 1
            yield GenerationChunk(
                text=p,
                token_ids=[i],
                num_prompt_tokens=7,
                num_output_tokens=i + 1,
                finished=last,
                finish_reason=self.finish if last else None,
                prompt_reasoning=self.prompt_reasoning if i == 0 else "",
            )
            await asyncio.sleep(0)

    async def _embed(self, inputs, dimensions=None, lora_name=None, priority=0, request_id=None):
        self.embed_calls.append((inputs, dimensions))
        if dimensions is not None:
            return EmbedResult(error=GenerationError("invalid_value", "dimensions: not a matryoshka model"))
        return EmbedResult(data=[[float(len(x)), 0.5, -0.25] for x in inputs], prompt_tokens=3 * len(inputs))

    async def _tokenize(self, prompt=None, messages=None, **kw):
        if prompt == "BAD":
            return TokenizeResult(error=GenerationError("invalid_value", "cannot tokenize"))
        text = prompt if prompt is not None else "".join(m["content"] for m in messages)
        ids = [ord(c) for c in text]
        return TokenizeResult(
            tokens=ids,
            count=len(ids),
            max_model_len=128,
            token_strs=list(text) if kw.get("return_token_strs") else None,
        )

    async def _detokenize(self, tokens):
        return TokenizeResult(tokens=tokens, count=len(tokens), prompt="".join(chr(t) for t in tokens))


def _sdk(replica, api_key="sk-a", model: dict | None = None, **settings):
    gw = make_gateway(replica, model=model, **settings)
    app = build_api(gw)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")
    return openai.AsyncOpenAI(api_key=api_key, base_url="http://gw/v1", http_client=http, max_retries=0), app


def jsonl(lines) -> bytes:
    """``lines`` (dicts) as a JSONL file's bytes: a Batch API input file."""
    return "".join(json.dumps(x) + "\n" for x in lines).encode()


async def wait_batch(client, batch_id, until=("completed", "failed", "cancelled", "expired")):
    """The batch ``batch_id`` (openai SDK ``client``) once its status is in ``until``, polled
    every 10 ms for at most 20 s (a bound on a hang, not a speed check).

    Raises:
        AssertionError: it was still elsewhere then.
    """
    for _ in range(2000):
        b = await client.batches.retrieve(batch_id)
        if b.status in until:
            return b
        await asyncio.sleep(0.01)
    raise AssertionError(f"batch {batch_id} still {b.status}")
