"""The OpenAI API surface our users' tools send, with a real model and real clients (the openai
SDK, langchain-openai), through the gateway's HTTP app in this process (tests/local_app.py: real
LLMServer replicas, each call pickled as across Ray's hop): structured outputs, tool calling,
n > 1, best_of, logit_bias, prompt logprobs (checked against HF transformers), CORS, max_tokens over
the context. The same app under Serve, with what only Serve shows (its logs, a client's disconnect
through Serve's proxy): tests/e2e/test_openai_api.py. The gateway alone over fake replicas:
test_gateway_*.py."""

import asyncio
import json
import re

import jsonschema
import pytest
from helpers import HTTP, sse_events
from openai_client_helpers import PARIS, PERSON, PROMPTS, TIME, WEATHER, nulls_dropped, post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


# ---- every endpoint and option, through the live app --------------------------------------
def test_every_endpoint_and_option_answers(local_app):
    """One request per endpoint and per option a client may send: each answers 200 with the
    shape OpenAI's clients parse (a NameError or a bad field in any handler is a 500 here).
    On the tiny model (what is checked is that each option runs through the gateway and the
    engine, not what the model writes), but for the tools, whose definitions in the chat
    template exceed its 256-token context: SmolLM2."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    chat = {"model": "tiny", "messages": PARIS, "max_tokens": 6}
    chat_cases = [
        {},
        {"logprobs": True},
        {"logprobs": True, "top_logprobs": 3},
        {"temperature": 0.7, "seed": 3},
        {"n": 2},
        {"logit_bias": {"42": 5}},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}},
        {"tools": [WEATHER], "tool_choice": "auto"},
        {"tools": [WEATHER], "tool_choice": "none"},
        {"tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 60},
        {
            "tools": [WEATHER],
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            "max_tokens": 40,
        },
        {
            "stop": ["."],
            "presence_penalty": 0.5,
            "frequency_penalty": 0.5,
            "top_k": 5,
            "min_p": 0.05,
            "repetition_penalty": 1.1,
            "user": "u1",
            "priority": 1,
        },
        {"max_completion_tokens": 5},
        {"guided_choice": ["yes", "no"]},
        {"guided_regex": "[0-9]{3}"},
        {"structured_outputs": {"choice": ["red", "blue"]}},
    ]
    for extra in chat_cases:
        if "tools" in extra:
            extra = {"model": local_app.model, **extra}
        r = post(local_app, "/chat/completions", {**chat, **extra})
        assert r.status_code == 200, (extra, r.text)
        resp = ChatCompletion.model_validate(r.json())
        assert len(resp.choices) == extra.get("n", 1) and resp.usage.completion_tokens > 0, extra
        if extra.get("logprobs"):
            assert resp.choices[0].logprobs.content, extra
        r = post(
            local_app, "/chat/completions", {**chat, **extra, "stream": True, "stream_options": {"include_usage": True}}
        )
        assert r.status_code == 200, (extra, r.text)
        events = sse_events(r)
        assert events[-1]["usage"]["completion_tokens"] > 0 and not events[-1]["choices"], extra
        assert {c["index"] for e in events for c in e["choices"]} == set(range(extra.get("n", 1))), extra

    cmpl = {"model": "tiny", "prompt": "The capital of France is", "max_tokens": 5}
    cmpl_cases = [
        {},
        {"echo": True},
        {"logprobs": 2},
        {"echo": True, "logprobs": 1},
        {"echo": True, "logprobs": 1, "max_tokens": 0},
        {"n": 2, "temperature": 0.8},
        {"best_of": 3, "n": 2, "temperature": 0.8},
        {"prompt": ["a", "b"], "n": 2},
        {"prompt": [1, 2, 3], "echo": True},
        {"logit_bias": {"42": -100}},
        {"response_format": {"type": "json_object"}, "max_tokens": 12},
    ]
    for extra in cmpl_cases:
        body = {**cmpl, **extra}
        r = post(local_app, "/completions", body)
        assert r.status_code == 200, (extra, r.text)
        # OpenAI's echoed first prompt token has null logprobs, which the SDK's type does not
        # admit (the SDK builds responses unvalidated)
        resp = Completion.model_validate(nulls_dropped(r.json()))
        batch = isinstance(body["prompt"], list) and isinstance(body["prompt"][0], str)
        n_prompts = len(body["prompt"]) if batch else 1
        assert len(resp.choices) == n_prompts * body.get("n", 1), extra
        if body.get("best_of", 1) > 1:
            continue  # best_of cannot stream
        r = post(local_app, "/completions", {**body, "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, (extra, r.text)
        events = sse_events(r)
        assert events[-1]["usage"]["prompt_tokens"] > 0, extra

    for path in ("/models", f"/models/{local_app.model}"):
        r = HTTP.get(f"{local_app.base_url}{path}", timeout=30)
        assert r.status_code == 200, r.text
    for path in ("/health", "/ready"):  # /metrics: tests/e2e/test_prometheus.py (it renders a Ray session's files)
        assert HTTP.get(f"{local_app.root}{path}", timeout=60).status_code == 200, path


def test_continuous_usage_stats_on_every_chunk(local_app):
    r = post(
        local_app,
        "/chat/completions",
        {
            "messages": PARIS,
            "max_tokens": 8,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    events = sse_events(r)
    used = [e["usage"]["completion_tokens"] for e in events]
    assert all(e.get("usage") for e in events) and used == sorted(used) and used[-1] == 8


# ---- structured outputs -----------------------------------------------------------------
def test_json_schema_on_20_varied_prompts(local_app):
    """The openai SDK's ``response_format`` json_schema: every one of 20 concurrent requests
    (greedy and sampled) parses and validates against the schema."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=local_app.base_url, api_key="none", max_retries=0)

    async def one(i: int, prompt: str):
        r = await client.chat.completions.create(
            model=local_app.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=120,
            temperature=0 if i % 2 else 0.9,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": PERSON, "strict": True},
            },
        )
        return r.choices[0]

    async def run():
        try:
            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))
        finally:
            await client.close()

    for choice in asyncio.run(run()):
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_regex_choice_and_bad_schema(local_app):
    # greedy: sampled at temperature 1, about 1 in 5 of SmolLM2's JSON objects run past 60 tokens
    r = post(
        local_app,
        "/chat/completions",
        {"messages": PARIS, "max_tokens": 60, "temperature": 0, "response_format": {"type": "json_object"}},
    )
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = post(
        local_app, "/completions", {"prompt": "Today's date is", "max_tokens": 12, "guided_regex": r"\d{4}-\d{2}-\d{2}"}
    )
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", r.json()["choices"][0]["text"]), r.text
    r = post(
        local_app,
        "/chat/completions",
        {"messages": PARIS, "max_tokens": 10, "structured_outputs": {"choice": ["Paris", "Lyon", "Nice"]}},
    )
    assert r.json()["choices"][0]["message"]["content"] in ("Paris", "Lyon", "Nice")
    # a JSON cut off by max_tokens is reported as such
    r = post(
        local_app,
        "/chat/completions",
        {
            "messages": PARIS,
            "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        },
    )
    assert r.json()["choices"][0]["finish_reason"] == "length"
    # an invalid schema is the client's error, and the server goes on
    r = post(
        local_app,
        "/chat/completions",
        {
            "messages": PARIS,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "no-such-type"}},
            },
        },
    )
    assert r.status_code == 400 and "structured_outputs" in r.json()["error"]["message"], r.text
    r = post(local_app, "/chat/completions", {"messages": PARIS, "guided_regex": "[", "max_tokens": 4})
    assert r.status_code == 400, r.text
    r = post(local_app, "/chat/completions", {"messages": PARIS, "guided_regex": "a", "guided_choice": ["b"]})
    assert r.status_code == 400, r.text
    assert post(local_app, "/chat/completions", {"messages": PARIS, "max_tokens": 2}).status_code == 200


# ---- tool calling -----------------------------------------------------------------------
def test_tool_choice_required_always_gives_valid_calls(local_app):
    from openai import OpenAI

    client = OpenAI(base_url=local_app.base_url, api_key="none", max_retries=0)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for prompt in (
        "What's the weather in Paris?",
        "What time is it in Tokyo?",
        "Hello!",
        "Is it raining in London right now, in fahrenheit?",
    ):
        r = client.chat.completions.create(
            model=local_app.model,
            messages=[{"role": "user", "content": prompt}],
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=100,
            parallel_tool_calls=False,
        )
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        call = choice.message.tool_calls[0]
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert call.id.startswith("call_")
    # a named function, streamed: OpenAI's tool-call deltas add up to valid arguments
    stream = client.chat.completions.create(
        model=local_app.model,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60,
        stream=True,
    )
    name, args, reasons = None, "", []
    for chunk in stream:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or []:
                name = tc.function.name or name
                args += tc.function.arguments or ""
            reasons.append(c.finish_reason)
    assert name == "get_weather" and reasons[-1] == "tool_calls"
    jsonschema.validate(json.loads(args), schemas["get_weather"])


def test_auto_tool_calls_are_parsed_from_the_text(local_app):
    """``tool_choice: auto``: a Hermes ``<tool_call>`` block in the model's text becomes
    ``tool_calls`` (whole and streamed), and none of its text leaks into ``content``. The
    model is made to write one with a choice constraint (a 135M model rarely calls on its own)."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": "auto",
        "max_tokens": 60,
        "structured_outputs": {"choice": [call]},
    }
    r = post(local_app, "/chat/completions", body).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and not choice["message"]["content"], choice
    (tc,) = choice["message"]["tool_calls"]
    assert tc["function"]["name"] == "get_weather"
    assert json.loads(tc["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    events = sse_events(post(local_app, "/chat/completions", {**body, "stream": True}))
    content = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    calls = [t for e in events for c in e["choices"] for t in c["delta"].get("tool_calls") or []]
    assert "<tool_call" not in content and len(calls) == 1 and calls[0]["function"]["name"] == "get_weather"
    assert [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]] == ["tool_calls"]


def test_tool_history_reaches_the_prompt(local_app):
    """Assistant ``tool_calls`` and ``tool`` results in the history are part of the prompt
    (SmolLM2's template knows no tools: they are written in the Hermes convention)."""
    base = [{"role": "user", "content": "Weather in Paris?"}]
    history = base + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees and sunny"},
    ]
    short = post(local_app, "/chat/completions", {"messages": base, "tools": [WEATHER], "max_tokens": 1}).json()
    long = post(local_app, "/chat/completions", {"messages": history, "tools": [WEATHER], "max_tokens": 1}).json()
    # the call and its result add their tokens (the arguments, the result text)
    assert long["usage"]["prompt_tokens"] - short["usage"]["prompt_tokens"] > 20
    no_tools = post(local_app, "/chat/completions", {"messages": base, "max_tokens": 1}).json()
    assert short["usage"]["prompt_tokens"] - no_tools["usage"]["prompt_tokens"] > 30  # the tool list


def test_langchain_structured_output_and_tools(local_app):
    """langchain-openai's ``ChatOpenAI``: ``with_structured_output`` (json_schema and
    function calling) and ``bind_tools`` with a tool round trip."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class City(BaseModel):
        """A city and its country."""

        name: str = Field(max_length=30)
        country: str = Field(max_length=30)
        population_millions: float

    llm = ChatOpenAI(
        base_url=local_app.base_url, api_key="none", model=local_app.model, temperature=0, max_tokens=80, max_retries=0
    )
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Tell me about Paris.")
        assert isinstance(city, City) and city.name, (method, city)

    @tool
    def get_weather(city: str) -> str:
        """Current weather of a city."""
        return f"It is 21 degrees and sunny in {city}."

    bound = llm.bind_tools([get_weather], tool_choice="any")
    question = HumanMessage("What's the weather in Paris?")
    ai = bound.invoke([question])
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather" and "city" in ai.tool_calls[0]["args"]
    result = get_weather.invoke(ai.tool_calls[0]["args"])
    final = llm.invoke([question, ai, ToolMessage(result, tool_call_id=ai.tool_calls[0]["id"])])
    assert isinstance(final.content, str) and final.content


# ---- n > 1, best_of, logit_bias ------------------------------------------------------------
def test_n_choices(local_app):
    body = {"messages": [{"role": "user", "content": "Write a word."}], "max_tokens": 12, "ignore_eos": True}
    greedy = post(local_app, "/chat/completions", {**body, "n": 3, "temperature": 0}).json()
    texts = [c["message"]["content"] for c in greedy["choices"]]
    assert [c["index"] for c in greedy["choices"]] == [0, 1, 2] and len(set(texts)) == 1
    assert greedy["usage"]["completion_tokens"] == 36  # every choice counted, the prompt once
    single = post(local_app, "/chat/completions", {**body, "temperature": 0}).json()
    assert single["usage"]["prompt_tokens"] == greedy["usage"]["prompt_tokens"]
    assert single["choices"][0]["message"]["content"] == texts[0]
    sampled = post(local_app, "/chat/completions", {**body, "n": 3, "temperature": 1.0, "seed": 7}).json()
    assert len({c["message"]["content"] for c in sampled["choices"]}) == 3
    again = post(local_app, "/chat/completions", {**body, "n": 3, "temperature": 1.0, "seed": 7}).json()
    assert [c["message"]["content"] for c in again["choices"]] == [c["message"]["content"] for c in sampled["choices"]]
    # the other choices found the prompt's blocks in the prefix cache
    long_prompt = [{"role": "user", "content": "Summarize the history of France. " * 12}]
    r = post(local_app, "/chat/completions", {"messages": long_prompt, "n": 2, "max_tokens": 2}).json()
    timings = local_app.llm.recent_request_metrics.remote([f"{r['id']}-0", f"{r['id']}-1"]).result()
    assert timings[f"{r['id']}-0"]["num_cached_tokens"] < timings[f"{r['id']}-1"]["num_cached_tokens"], timings
    assert timings[f"{r['id']}-1"]["num_cached_tokens"] >= 64
    # streamed: the choices interleave by index, each ends with its own finish_reason
    r = post(local_app, "/chat/completions", {**body, "n": 2, "temperature": 0.8, "stream": True})
    events = sse_events(r)
    ends = [c["index"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert sorted(ends) == [0, 1]


def test_best_of_returns_the_most_likely(local_app):
    body = {"prompt": "My favourite colour is", "max_tokens": 6, "temperature": 1.0, "seed": 1, "logprobs": 0}
    best = post(local_app, "/completions", {**body, "best_of": 4, "n": 1}).json()["choices"][0]
    every = post(local_app, "/completions", {**body, "n": 4}).json()["choices"]
    score = [sum(c["logprobs"]["token_logprobs"]) for c in every]
    assert best["text"] == every[max(range(4), key=score.__getitem__)]["text"]


def test_logit_bias(local_app, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    body = {"prompt": "The capital of France is", "max_tokens": 3, "temperature": 0}
    plain = post(local_app, "/completions", body).json()["choices"][0]["text"]
    x = tok(" banana", add_special_tokens=False)["input_ids"][-1]
    forced = post(local_app, "/completions", {**body, "logit_bias": {str(x): 100}}).json()["choices"][0]["text"]
    assert forced == tok.decode([x] * 3)
    banned = {str(t): -100 for t in tok(plain, add_special_tokens=False)["input_ids"]}
    other = post(local_app, "/completions", {**body, "logit_bias": banned}).json()["choices"][0]["text"]
    assert other != plain and not set(tok(other, add_special_tokens=False)["input_ids"][:1]) & {int(k) for k in banned}
    r = post(local_app, "/completions", {**body, "logit_bias": {"10000000": 1}})
    assert r.status_code == 400, r.text
    r = post(local_app, "/completions", {**body, "logit_bias": {"5": 101}})
    assert r.status_code == 400, r.text


# ---- prompt logprobs ---------------------------------------------------------------------
def test_prompt_logprobs_equal_hf(local_app, smollm2_path):
    """lm-evaluation-harness' loglikelihood request (``echo``, ``max_tokens: 0``,
    ``logprobs``): every prompt token's logprob equals HF transformers' log-softmax."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = "The quick brown fox jumps over the lazy dog because it was in a hurry."
    r = post(local_app, "/completions", {"prompt": text, "echo": True, "max_tokens": 0, "logprobs": 2})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length"
    lp = choice["logprobs"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == text and lp["text_offset"][0] == 0
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    ids = tok(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expect = [ref[i - 1, ids[i]].item() for i in range(1, len(ids))]
    assert len(lp["token_logprobs"]) == len(ids)
    assert max(abs(a - b) for a, b in zip(lp["token_logprobs"][1:], expect)) < 1e-4
    top2 = ref[len(ids) - 2].topk(2)
    assert sorted(lp["top_logprobs"][-1].values(), reverse=True)[:2] == pytest.approx(top2.values.tolist(), abs=1e-4)
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] == len(ids) and usage["completion_tokens"] == 0


# ---- CORS, unknown fields, limits, disconnects --------------------------------------------
def test_cors_preflight_and_headers(local_app):
    origin = "https://app.example.com"
    # the open app (no keys): no CORS by default, so no web page can read what it answers
    r = post(local_app, "/chat/completions", {"messages": PARIS, "max_tokens": 2}, headers={"Origin": origin})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    # the API-key app: a preflight needs no key; a 401 still carries the CORS header
    pre = HTTP.options(
        f"{local_app.auth_base_url}/completions",
        timeout=30,
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type",
        },
    )
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] in ("*", origin)
    assert "POST" in pre.headers["access-control-allow-methods"]
    r = HTTP.post(
        f"{local_app.auth_base_url}/completions", json={"prompt": "x"}, headers={"Origin": origin}, timeout=30
    )
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] in ("*", origin)


def test_max_tokens_over_the_context_is_a_400(local_app):
    r = post(local_app, "/chat/completions", {"messages": PARIS, "max_tokens": 5000})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "1024" in r.json()["error"]["message"]
    r = post(local_app, "/completions", {"prompt": "hi", "max_tokens": 1024})  # 1 + 1024 tokens
    assert r.status_code == 400, r.text
    assert post(local_app, "/completions", {"prompt": "hi", "max_tokens": 3}).status_code == 200
