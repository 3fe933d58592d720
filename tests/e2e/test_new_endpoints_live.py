"""The Responses API, embeddings and tokenize / detokenize on the live app (``serve_app``:
SmolLM2 in float32, the tiny model, the bundled all-MiniLM-L6-v2 encoder), through the openai
SDK over HTTP; vectors and token counts against the reference libraries (sentence-transformers,
HF transformers) on the same weights."""
import json

import httpx
import numpy as np
import openai
import pytest
import torch
from pydantic import BaseModel

pytestmark = pytest.mark.slow

TOOLS = [{"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


def _client(serve_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_app.base_url, api_key="unused", max_retries=0, timeout=120)


def _cos(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def test_responses_create_stream_and_chat_agree(serve_app):
    c = _client(serve_app)
    kw = dict(model=serve_app.model, input="Name three colours.", instructions="Answer briefly.",
              max_output_tokens=24, temperature=0, store=False)
    created = c.responses.create(**kw)
    chat = c.chat.completions.create(model=serve_app.model, max_tokens=24, temperature=0, messages=[
        {"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name three colours."}])
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


def test_responses_parse_tools_and_previous_response_id(serve_app):
    class Country(BaseModel):
        name: str
        capital: str

    c = _client(serve_app)
    parsed = c.responses.parse(model=serve_app.model, input="Give a country and its capital as JSON.",
                               text_format=Country, max_output_tokens=64, temperature=0, store=False)
    assert isinstance(parsed.output_parsed, Country) and parsed.output_parsed.capital

    called = c.responses.create(model=serve_app.model, input="What is the weather in Paris?", tools=TOOLS,
                                tool_choice="required", max_output_tokens=64, temperature=0, store=False)
    [item] = [o for o in called.output if o.type == "function_call"]
    assert item.name == "get_weather" and isinstance(json.loads(item.arguments), dict)

    first = c.responses.create(model=serve_app.model, input="My name is Ada.", max_output_tokens=16, temperature=0)
    second = c.responses.create(model=serve_app.model, input="What is my name?", previous_response_id=first.id,
                                max_output_tokens=16, temperature=0)
    # the second prompt holds the first turn (its input and output) before its own input
    alone = c.responses.create(model=serve_app.model, input="What is my name?", max_output_tokens=16, temperature=0,
                               store=False)
    assert second.usage.input_tokens >= alone.usage.input_tokens + first.usage.output_tokens
    assert c.responses.retrieve(first.id).output_text == first.output_text
    c.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(first.id)


def test_encoder_embeddings_equal_sentence_transformers(serve_app):
    from sentence_transformers import SentenceTransformer

    from deployments.contract.encoder import bundled_encoder_path

    texts = ["A man is eating food.", "The weather is lovely today.", "kvserve serves LLMs on Ray. " * 8]
    c = _client(serve_app)
    got = c.embeddings.create(model=serve_app.encoder, input=texts)  # the SDK's default: base64, decoded
    floats = c.embeddings.create(model=serve_app.encoder, input=texts, encoding_format="float")
    ref = SentenceTransformer(str(bundled_encoder_path()), device="cpu").encode(texts)
    assert len(got.data) == 3 and [d.index for d in got.data] == [0, 1, 2]
    for d, f, r in zip(got.data, floats.data, ref):
        assert len(d.embedding) == 384 and _cos(d.embedding, r) >= 0.9999
        assert np.allclose(d.embedding, f.embedding, atol=1e-6)
    tok = SentenceTransformer(str(bundled_encoder_path()), device="cpu").tokenizer
    assert got.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    ids = tok(texts[0])["input_ids"]
    by_ids = c.embeddings.create(model=serve_app.encoder, input=[ids], encoding_format="float")
    assert _cos(by_ids.data[0].embedding, ref[0]) >= 0.9999
    with pytest.raises(openai.BadRequestError, match="256"):
        c.embeddings.create(model=serve_app.encoder, input="word " * 400)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model=serve_app.encoder, input="x", dimensions=128)


def test_decoder_embeddings_equal_hf_last_token_hidden_state(serve_app, smollm2_path):
    from transformers import AutoModel, AutoTokenizer

    texts = ["The quick brown fox jumps over the lazy dog.", "Paris", "Embeddings " * 40]
    got = _client(serve_app).embeddings.create(model=serve_app.model, input=texts, encoding_format="float")
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    hf = AutoModel.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    total = 0
    for d, text in zip(got.data, texts):
        ids = tok(text, return_tensors="pt").input_ids
        total += ids.shape[1]
        with torch.no_grad():
            ref = hf(ids).last_hidden_state[0, -1]
        assert len(d.embedding) == 576 and _cos(d.embedding, ref.numpy()) >= 0.9999
        assert abs(np.linalg.norm(d.embedding) - 1.0) < 1e-4
    assert got.usage.prompt_tokens == total
    # more inputs than the replica's batch and queue (max_num_seqs 32): they wait for each other, no 429
    many = _client(serve_app).embeddings.create(model=serve_app.model, input=[f"item {k}" for k in range(80)])
    assert [d.index for d in many.data] == list(range(80))


def test_tokenize_counts_what_chat_sends_and_detokenize_round_trips(serve_app, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    with httpx.Client(base_url=serve_app.root, timeout=60) as h:
        t = h.post("/tokenize", json={"model": serve_app.model, "messages": messages}).json()
        p = h.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        d = h.post("/detokenize", json={"model": serve_app.model, "tokens": p["tokens"]}).json()
        bad = h.post("/detokenize", json={"tokens": [10 ** 9]})
        enc = h.post("/tokenize", json={"model": serve_app.encoder, "prompt": "Hello world"}).json()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert t["tokens"] == tok.encode(expected, add_special_tokens=False) and t["max_model_len"] == 1024
    chat = _client(serve_app).chat.completions.create(model=serve_app.model, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == t["count"]  # what /tokenize counts is what the request is charged
    assert p["tokens"] == tok.encode("Hello world") and p["token_strs"] == tok.convert_ids_to_tokens(p["tokens"])
    assert d == {"prompt": "Hello world"}
    assert bad.status_code == 400 and "token id" in bad.json()["error"]["message"]
    assert enc["tokens"][0] == 101 and enc["max_model_len"] == 256  # the encoder's own (BERT) tokenizer
