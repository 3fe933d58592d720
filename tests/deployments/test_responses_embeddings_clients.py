"""The Responses API and a decoder's embeddings over HTTP with the openai SDK, on the in-process
app (``local_app``, tests/deployments/conftest.py: SmolLM2 in float32 and the tiny model, real
replicas); vectors against HF transformers on the same weights. The encoder's embeddings and
``/tokenize``: tests/e2e/test_embeddings_tokenize_live.py, on the live app."""

import json

import numpy as np
import openai
import pytest
import torch
from helpers import cosine
from pydantic import BaseModel

pytestmark = pytest.mark.slow

TOOLS = [
    {
        "type": "function",
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    }
]


def _client(local_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=local_app.base_url, api_key="unused", max_retries=0, timeout=120)


def test_responses_create_stream_and_chat_agree(local_app):
    c = _client(local_app)
    kw = dict(
        model=local_app.model,
        input="Name three colours.",
        instructions="Answer briefly.",
        max_output_tokens=24,
        temperature=0,
        store=False,
    )
    created = c.responses.create(**kw)
    chat = c.chat.completions.create(
        model=local_app.model,
        max_tokens=24,
        temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}],
    )
    with c.responses.stream(**kw) as s:
        kinds = [e.type for e in s]
    assert kinds[0] == "response.created" and kinds[-1] in ("response.completed", "response.incomplete")
    # the same greedy answer three ways: Responses, chat, Responses streamed
    assert created.output_text and created.output_text == chat.choices[0].message.content
    assert created.usage.input_tokens == chat.usage.prompt_tokens
    assert created.usage.output_tokens == chat.usage.completion_tokens
    assert created.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    with c.responses.stream(**{**kw, "max_output_tokens": 400}) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text.startswith(created.output_text)


def test_responses_parse_tools_and_previous_response_id(local_app):
    class Country(BaseModel):
        name: str
        capital: str

    c = _client(local_app)
    parsed = c.responses.parse(
        model=local_app.model,
        input="Give a country and its capital as JSON.",
        text_format=Country,
        max_output_tokens=64,
        temperature=0,
        store=False,
    )
    assert isinstance(parsed.output_parsed, Country) and parsed.output_parsed.capital

    called = c.responses.create(
        model=local_app.model,
        input="What is the weather in Paris?",
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=64,
        temperature=0,
        store=False,
    )
    [item] = [o for o in called.output if o.type == "function_call"]
    assert item.name == "get_weather" and isinstance(json.loads(item.arguments), dict)

    first = c.responses.create(model=local_app.model, input="My name is Ada.", max_output_tokens=16, temperature=0)
    second = c.responses.create(
        model=local_app.model,
        input="What is my name?",
        previous_response_id=first.id,
        max_output_tokens=16,
        temperature=0,
    )
    # the second prompt holds the first turn (its input and output) before its own input
    alone = c.responses.create(
        model=local_app.model, input="What is my name?", max_output_tokens=16, temperature=0, store=False
    )
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    assert c.responses.retrieve(first.id).output_text == first.output_text
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_decoder_embeddings_equal_hf_last_token_hidden_state(local_app, smollm2_path):
    from transformers import AutoModel, AutoTokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "Paris", "Embeddings " * 40]
    got = _client(local_app).embeddings.create(model=local_app.model, input=texts, encoding_format="float")
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModel.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    total = 0
    for d, text in zip(got.data, texts):
        ids = tok(text, return_tensors="pt").input_ids
        total += ids.shape[1]
        with torch.no_grad():
            ref = hf(ids).last_hidden_state[0, -1]
        assert len(d.embedding) == 576 and cosine(d.embedding, ref.numpy()) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-4
    assert got.usage.prompt_tokens == total
    # more inputs than the replica's batch and queue (max_num_seqs 32): they wait for each other, no 429
    many = _client(local_app).embeddings.create(model=local_app.model, input=[f"item {k}" for k in range(80)])
    assert [d.index for d in many.data] == list(range(80))
