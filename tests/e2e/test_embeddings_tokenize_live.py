"""The encoder on the live app (``serve_app``: the bundled all-MiniLM-L6-v2 in an
``EmbeddingServer`` replica beside SmolLM2) through the openai SDK: its vectors against
sentence-transformers on the same weights; ``/tokenize`` and ``/detokenize`` for the models and
the encoder, counted as chat charges. (The encoder batches with ``serve.batch``, which runs only
in a Serve replica; SmolLM2's embeddings and the Responses API are in process:
tests/deployments/test_responses_embeddings_clients.py.)"""

import httpx
import numpy as np
import openai
import pytest
from helpers import cosine

pytestmark = pytest.mark.slow


def _client(serve_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_app.base_url, api_key="unused", max_retries=0, timeout=120)


def test_encoder_embeddings_equal_sentence_transformers(serve_app):
    from sentence_transformers import SentenceTransformer

    from kvserve.deployments.contract.encoder import bundled_encoder_path

    texts = ["A man is eating food.", "The weather is lovely today.", "kvserve serves LLMs on Ray. " * 8]
    c = _client(serve_app)
    got = c.embeddings.create(model=serve_app.encoder, input=texts)  # the SDK's default: base64, decoded
    floats = c.embeddings.create(model=serve_app.encoder, input=texts, encoding_format="float")
    ref = SentenceTransformer(str(bundled_encoder_path()), device="cpu").encode(texts)
    assert len(got.data) == 3 and [d.index for d in got.data] == [0, 1, 2]
    for d, f, r in zip(got.data, floats.data, ref):
        assert len(d.embedding) == 384 and cosine(d.embedding, r) >= 0.9999
        assert np.allclose(d.embedding, f.embedding, atol=1e-6)
    tok = SentenceTransformer(str(bundled_encoder_path()), device="cpu").tokenizer
    assert got.usage.prompt_tokens == sum(len(tok(t)["input_ids"]) for t in texts)
    ids = tok(texts[0])["input_ids"]
    by_ids = c.embeddings.create(model=serve_app.encoder, input=[ids], encoding_format="float")
    assert cosine(by_ids.data[0].embedding, ref[0]) >= 0.9999
    with pytest.raises(openai.BadRequestError, match="256"):
        c.embeddings.create(model=serve_app.encoder, input="word " * 400)
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model=serve_app.encoder, input="x", dimensions=128)


def test_tokenize_counts_what_chat_sends_and_detokenize_round_trips(serve_app, smollm2_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
    with httpx.Client(base_url=serve_app.root, timeout=60) as h:
        t = h.post("/tokenize", json={"model": serve_app.model, "messages": messages}).json()
        p = h.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
        d = h.post("/detokenize", json={"model": serve_app.model, "tokens": p["tokens"]}).json()
        bad = h.post("/detokenize", json={"tokens": [10**9]})
        enc = h.post("/tokenize", json={"model": serve_app.encoder, "prompt": "Hello world"}).json()
    expected = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert t["tokens"] == tok.encode(expected, add_special_tokens=False) and t["max_model_len"] == 1024
    chat = _client(serve_app).chat.completions.create(model=serve_app.model, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == t["count"]  # what /tokenize counts is what the request is charged
    assert p["tokens"] == tok.encode("Hello world") and p["token_strs"] == tok.convert_ids_to_tokens(p["tokens"])
    assert d == {"prompt": "Hello world"}
    assert bad.status_code == 400 and "token id" in bad.json()["error"]["message"]
    assert enc["tokens"][0] == 101 and enc["max_model_len"] == 256  # the encoder's own (BERT) tokenizer
