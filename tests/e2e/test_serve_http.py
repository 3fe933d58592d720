"""The kvserve Serve app over real HTTP: httpx and the official openai SDK, streaming,
bad input, batching of concurrent streams, client disconnects."""

import asyncio
import time
from typing import Literal

import httpx
import pytest
from helpers import DONE, HTTP, aiter_sse, iter_sse, sse_events

from openai.types import Completion as CompletionResponse
from openai.types import CompletionChoice
from openai.types.chat import ChatCompletion as ChatCompletionResponse
from openai.types.chat import ChatCompletionChunk

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


class StreamedCompletionChoice(CompletionChoice):
    """OpenAI's completion choice as streamed: ``finish_reason`` is null until the choice's
    last chunk (the SDK's type describes whole responses and does not admit null)."""

    finish_reason: Literal["stop", "length", "content_filter"] | None


class CompletionChunk(CompletionResponse):
    """One SSE event of a streamed ``/v1/completions`` response (OpenAI's ``Completion``)."""

    choices: list[StreamedCompletionChoice]


PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def test_chat_paris_httpx(serve_app):
    r = HTTP.post(
        f"{serve_app.base_url}/chat/completions",
        timeout=120,
        json={"model": serve_app.model, "messages": PARIS, "max_tokens": 32, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = ChatCompletionResponse.model_validate(r.json())
    assert "Paris" in body.choices[0].message.content
    assert body.choices[0].finish_reason in ("stop", "length")
    assert body.usage.prompt_tokens > 0 and body.usage.completion_tokens > 0
    assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens


def test_chat_stream_httpx(serve_app):
    with HTTP.stream(
        "POST",
        f"{serve_app.base_url}/chat/completions",
        timeout=120,
        json={
            "messages": PARIS,
            "max_tokens": 32,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    chunks = [ChatCompletionChunk.model_validate(e) for e in events]
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3  # token by token
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert len({c.id for c in chunks}) == 1


def test_completions_httpx_logprobs_stop(serve_app):
    r = HTTP.post(
        f"{serve_app.base_url}/completions",
        timeout=120,
        json={"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0, "logprobs": 2, "echo": True},
    )
    assert r.status_code == 200, r.text
    raw = r.json()["choices"][0]["logprobs"]
    # echo: the prompt's tokens come first, the first with null logprobs (OpenAI's shape, which
    # the SDK's pydantic type does not admit: validated without it)
    assert raw["token_logprobs"][0] is None and raw["top_logprobs"][0] is None
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        raw[key] = raw[key][1:]
    body = CompletionResponse.model_validate(r.json() | {"choices": [r.json()["choices"][0] | {"logprobs": raw}]})
    ch = body.choices[0]
    assert ch.text.startswith("The capital of France is")
    lp = ch.logprobs
    assert len(lp.tokens) + 1 == body.usage.prompt_tokens + body.usage.completion_tokens == len(lp.token_logprobs) + 1
    assert "".join(lp.tokens[: body.usage.prompt_tokens - 1]) == " capital of France is"
    assert all(x <= 0 for x in lp.token_logprobs)
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    # stop strings end the text before the stop string
    r = HTTP.post(
        f"{serve_app.base_url}/completions",
        timeout=120,
        json={"prompt": "1, 2, 3, 4,", "max_tokens": 20, "temperature": 0, "stop": [" 7"]},
    )
    assert r.status_code == 200
    assert r.json()["choices"][0]["finish_reason"] == "stop" and " 7" not in r.json()["choices"][0]["text"]


def test_openai_sdk(serve_app):
    from openai import OpenAI

    client = OpenAI(base_url=serve_app.base_url, api_key="unused")
    models = [m.id for m in client.models.list().data]
    assert serve_app.model in models and "tiny" in models

    chat = client.chat.completions.create(model=serve_app.model, messages=PARIS, max_tokens=32, temperature=0)
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.completion_tokens > 0 and chat.usage.prompt_tokens > 0

    stream = client.chat.completions.create(
        model=serve_app.model,
        messages=PARIS,
        max_tokens=32,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "Paris" in "".join(parts) and usage.completion_tokens == chat.usage.completion_tokens

    comp = client.completions.create(
        model=serve_app.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert comp.choices[0].text and comp.usage.completion_tokens > 0

    stream = client.completions.create(
        model=serve_app.model,
        prompt="The capital of France is",
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == comp.choices[0].text and usage.completion_tokens == comp.usage.completion_tokens

    # seeded sampling is reproducible; vLLM-style extras go through extra_body
    kw = dict(
        model=serve_app.model,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=1.0,
        seed=7,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1},
    )
    assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text


def test_batched_prompts_and_second_model(serve_app):
    r = HTTP.post(
        f"{serve_app.base_url}/completions",
        timeout=120,
        json={"model": "tiny", "prompt": ["a b c", "hello"], "max_tokens": 5, "ignore_eos": True, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1] and body["usage"]["completion_tokens"] == 10
    with HTTP.stream(
        "POST",
        f"{serve_app.base_url}/completions",
        timeout=120,
        json={
            "model": "tiny",
            "prompt": ["a b c", "hello"],
            "max_tokens": 5,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        },
    ) as r:
        events = sse_events(r)
    chunks = [CompletionChunk.model_validate(e) for e in events]
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices[0].index == i) == body["choices"][i]["text"]


BAD = [
    ("malformed json", b'{"messages": [', 400),
    ("messages not a list", {"messages": "hi"}, 400),
    ("empty messages", {"messages": []}, 400),
    ("bad role", {"messages": [{"role": "wizard", "content": "x"}]}, 400),
    ("negative max_tokens", {"messages": PARIS, "max_tokens": -5}, 400),
    ("max_tokens wrong type", {"messages": PARIS, "max_tokens": "many"}, 400),
    ("temperature too high", {"messages": PARIS, "temperature": 3.5}, 400),
    ("top_p zero", {"messages": PARIS, "top_p": 0}, 400),
    ("n over OpenAI's limit", {"messages": PARIS, "n": 129}, 400),
    ("max_tokens over the context", {"messages": PARIS, "max_tokens": 4096}, 400),
    ("top_logprobs without logprobs", {"messages": PARIS, "top_logprobs": 3}, 400),
    ("unknown model", {"model": "no-such-model", "messages": PARIS}, 404),
    ("prompt over the context", {"messages": [{"role": "user", "content": "hello " * 1500}]}, 400),
    (
        "stream with prompt over the context",
        {"messages": [{"role": "user", "content": "hello " * 1500}], "stream": True},
        400,
    ),
]


@pytest.mark.parametrize("name,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_chat_input(serve_app, name, body, status):
    url = f"{serve_app.base_url}/chat/completions"
    if isinstance(body, bytes):
        r = HTTP.post(url, content=body, headers={"Content-Type": "application/json"}, timeout=60)
    else:
        r = HTTP.post(url, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if name == "unknown model":
        assert err["code"] == "model_not_found"
    if name.endswith("over the context"):
        assert err["code"] == "context_length_exceeded"


def test_a_prompt_too_long_by_its_bytes_is_refused_at_the_gateway(serve_app, tiny_llama_path):
    """Issue 63: a prompt whose text alone cannot fit (more than ``max_model_len`` times the
    most bytes one token covers, as the replicas published it) is a 400 from the gateway; one
    just under that bound reaches the replica, which refuses it once a prefix is counted."""
    from kvserve.engine.input_processor import max_token_bytes
    from kvserve.engine.model_loader import load_tokenizer

    per = max_token_bytes(load_tokenizer(tiny_llama_path))
    bound = 256 * per  # the "tiny" model's max_model_len is 256
    words = "the quick brown fox jumps over the lazy dog "
    for body, param in (
        ({"prompt": (words * (bound // 40))[: bound + 1], "max_tokens": 4}, "prompt"),
        ({"messages": [{"role": "user", "content": "é" * (bound // 2 + 1)}]}, "messages"),
    ):
        path = "completions" if "prompt" in body else "chat/completions"
        r = HTTP.post(f"{serve_app.base_url}/{path}", json={"model": "tiny", **body}, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert f"more than any prompt that fits this model's context can hold ({bound} bytes" in err["message"]
    r = HTTP.post(
        f"{serve_app.base_url}/completions",
        json={"model": "tiny", "prompt": (words * (bound // 40))[: bound - 100], "max_tokens": 4},
        timeout=60,
    )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded", r.text
    assert "characters alone are" in err["message"]  # the replica's prefix count, not the gateway's bytes


def test_bad_completion_input_and_routes(serve_app):
    base = serve_app.base_url
    cases = [
        ({"prompt": []}, 400),
        ({"prompt": "x", "max_tokens": 0}, 400),
        ({}, 400),
        ({"prompt": "x", "frequency_penalty": 9}, 400),
        ({"prompt": [[]]}, 400),
        ({"prompt": "x", "best_of": 3, "n": 4}, 400),
        ({"prompt": [10**9]}, 400),
        ({"prompt": "x", "top_k": -7}, 400),
    ]
    for body, status in cases:
        r = HTTP.post(f"{base}/completions", json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        assert "error" in r.json() and "detail" not in r.json()
    r = HTTP.get(f"{base}/no-such-route", timeout=30)
    assert r.status_code == 404 and "error" in r.json()
    r = HTTP.get(f"{base}/chat/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    # still serving after all that
    r = HTTP.post(f"{base}/chat/completions", json={"messages": PARIS, "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert HTTP.get(f"{serve_app.root}/health", timeout=30).json()["status"] == "ok"


async def _stream_chat(client: httpx.AsyncClient, url: str, messages, max_tokens: int) -> tuple[str, int]:
    parts, n = [], 0
    async with client.stream(
        "POST", url, json={"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    ) as r:
        assert r.status_code == 200, (await r.aread()).decode()
        async for ev in aiter_sse(r):
            if ev != DONE and ev["choices"]:
                parts.append(ev["choices"][0]["delta"].get("content") or "")
                n += 1
    return "".join(parts), n


def test_32_concurrent_streams_match_offline_and_batch(serve_app, smollm2_path):
    from kvserve.engine import LLM, SamplingParams

    topics = ["France", "Japan", "Italy", "Spain", "Egypt", "Canada", "Brazil", "India"]
    asks = [
        "What is the capital of {}?",
        "Name a famous dish from {}.",
        "What language is spoken in {}?",
        "Describe {} in one sentence.",
    ]
    convs = [[{"role": "user", "content": a.format(t)}] for a in asks for t in topics]
    assert len(convs) == 32
    max_tokens = 12
    before = serve_app.llm.get_stats.remote().result()

    async def run_all():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(
                *(_stream_chat(client, f"{serve_app.base_url}/chat/completions", c, max_tokens) for c in convs)
            )

    t0 = time.time()
    results = asyncio.run(run_all())
    elapsed = time.time() - t0
    after = serve_app.llm.get_stats.remote().result()

    # the served model's dtype (float32, see conftest): bfloat16 would flip near ties such as the first
    # token of "What is the capital of Italy?" (HF float32's top-2 gap 0.12: test_bf16's margins)
    llm = LLM(model=str(smollm2_path), dtype="float32", max_num_seqs=32, max_model_len=1024)
    offline = llm.chat(convs, SamplingParams(max_tokens=max_tokens, temperature=0), use_tqdm=False)
    llm.engine.shutdown()
    expected = [o.outputs[0].text for o in offline]
    got = [t for t, _ in results]
    assert got == expected
    assert after["max_running_batch"] > 1
    steps = after["num_steps"] - before["num_steps"]
    tokens = after["num_generated_tokens"] - before["num_generated_tokens"]
    assert tokens >= 32 and steps < tokens / 4, (steps, tokens, elapsed)  # many requests per step


def test_streams_share_one_channel_message_per_step(serve_app):
    """Issue 41 item 2: after a first request names its replica, the gateway opens its channel
    there, and concurrent streams then get their tokens in one message per engine step (many
    requests' chunks per message), with the same text as the replica's own path (a Python
    handle, no channel)."""
    llm = serve_app.llm
    r = HTTP.post(f"{serve_app.base_url}/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200
    deadline = time.time() + 30
    while llm.get_stats.remote().result()["gateway_channels"] < 1:
        assert time.time() < deadline, "the gateway opened no channel"
        time.sleep(0.05)
    before = llm.get_stats.remote().result()
    prompts = [f"Count from {k} upwards:" for k in range(12)]
    params = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}

    async def stream(client, prompt):
        parts, finish = [], None
        async with client.stream(
            "POST", f"{serve_app.base_url}/completions", json={"prompt": prompt, "stream": True, **params}
        ) as resp:
            assert resp.status_code == 200, (await resp.aread()).decode()
            async for ev in aiter_sse(resp):
                if ev != DONE and ev["choices"]:
                    parts.append(ev["choices"][0]["text"])
                    finish = ev["choices"][0]["finish_reason"] or finish
        return "".join(parts), finish

    async def run_all():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(stream(client, p) for p in prompts))

    streamed = asyncio.run(run_all())
    after = llm.get_stats.remote().result()
    direct = [llm.complete.remote(p, dict(params)).result().text for p in prompts]
    assert [t for t, _ in streamed] == direct
    assert all(f == "length" for _, f in streamed)
    messages = after["channel_messages"] - before["channel_messages"]
    chunks = after["channel_chunks"] - before["channel_chunks"]
    assert messages > 0 and chunks >= 2 * messages, (messages, chunks)  # several requests' tokens per message


def test_disconnect_mid_stream_frees_blocks(serve_app):
    llm = serve_app.llm
    assert llm.get_stats.remote().result()["kv_cache_usage"] == 0.0
    with HTTP.stream(
        "POST",
        f"{serve_app.base_url}/completions",
        timeout=120,
        json={
            "prompt": "Tell me a very long story about a dragon.",
            "max_tokens": 600,
            "ignore_eos": True,
            "stream": True,
        },
    ) as r:
        got = 0
        for _ in iter_sse(r):
            got += 1
            if got == 3:
                break
        mid = llm.get_stats.remote().result()
        assert mid["num_running_requests"] == 1 and mid["kv_cache_usage"] > 0
    # the response is closed: the request is aborted and its blocks go back to the pool
    deadline = time.time() + 10
    while True:
        s = llm.get_stats.remote().result()
        if s["kv_cache_usage"] == 0.0 and s["num_running_requests"] == 0:
            break
        assert time.time() < deadline, s
        time.sleep(0.05)
    assert s["num_generated_tokens"] - mid["num_generated_tokens"] < 300  # stopped long before 600 tokens
    assert s["free_kv_blocks"] == s["num_kv_blocks"]


def test_api_key_and_tensor_parallel_app(serve_app):
    """The second app: bearer auth, and a TP=2 replica whose workers live in its placement group,
    with a float8 KV cache (each rank calibrates its own heads' scales) and int8 weights (each rank
    quantizes its own shard)."""
    url = f"{serve_app.auth_base_url}/completions"
    body = {"prompt": "hello", "max_tokens": 4, "ignore_eos": True, "temperature": 0}
    r = HTTP.post(url, json=body, timeout=60)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = HTTP.post(url, json=body, headers={"Authorization": "Bearer wrong"}, timeout=60)
    assert r.status_code == 401
    auth = {"Authorization": f"Bearer {serve_app.api_key}"}
    r = HTTP.post(url, json=body, headers=auth, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4 and r.json()["model"] == "tiny-tp2"
    models = HTTP.get(f"{serve_app.auth_base_url}/models", headers=auth, timeout=30)
    card = models.json()["data"][0]
    assert models.status_code == 200 and card["kv_cache_dtype"] == "fp8" and card["quantization"] == "int8"
    assert card["dtype"] == "float32"  # "auto" as the TP replica resolved and published it (int8: float32)
    assert card["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
    # n-gram speculation over TP=2: a repetitive prompt drafts; the stream still has every token
    rep = {"prompt": "1 2 3 4 1 2 3 4 1 2 3 4 1 2 3", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    r = HTTP.post(url, json=rep, headers=auth, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    text = ""
    with HTTP.stream("POST", url, json={**rep, "stream": True}, headers=auth, timeout=60) as s:
        for ev in iter_sse(s):
            if ev != DONE:
                text += ev["choices"][0]["text"]
    assert text == r.json()["choices"][0]["text"]
    from ray import serve as _serve

    stats = _serve.get_deployment_handle("LLMServer", "kvserve-auth").get_stats.remote().result(timeout_s=30)
    assert {"spec_decode_num_drafts", "spec_decode_acceptance_rate"} <= set(stats)  # the engine speculates
    assert HTTP.get(f"{serve_app.base_url}/models", timeout=30).json()["data"][0]["kv_cache_dtype"] == "auto"
    assert HTTP.get(f"{serve_app.root}/auth/health", timeout=30).status_code == 200  # no key needed
    from ray import serve

    info = serve.get_deployment_handle("LLMServer", "kvserve-auth").server_info.remote().result()
    assert info.tensor_parallel_size == 2
    workers = info.workers
    # the ranks run in the placement group Serve reserved for the replica (not one of their own)
    assert workers["created_here"] is False
    assert workers["bundles"] == [{"CPU": 1.0}, {"CPU": 0.5}]
    assert [r["rank"] for r in workers["ranks"]] == [0, 1] and {r["backend"] for r in workers["ranks"]} == {"gloo"}
