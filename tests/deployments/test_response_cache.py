"""The ingress's response caches (deployments/cache/), without Ray:
the exact key (what makes two requests equal, every field that changes the output), the
in-process and Redis backends (LRU, TTL, byte bound, a shared Redis, a Redis that is down) and
the semantic level with the real all-MiniLM-L6-v2 (paraphrases, scopes, threshold)."""
import asyncio
import logging
import time

import numpy as np
import pytest
from helpers import free_port
from pydantic import ValidationError

from deployments.cache import (NON_OUTPUT_FIELDS, CacheSettings, MemoryStore, RedisStore, RequestOptions,
                               ResponseCache, complete, decode_entry, deterministic, encode_entry, exact_key,
                               request_options, semantic_parts)
from deployments.cache.semantic import SemanticIndex, numbers_of
from deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.contract.types import GenerationChunk, TokenLogprob, TopLogprob, model_revision


def run(coro):
    return asyncio.run(coro)


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def chat(**kw) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
            "max_tokens": 8}
    return ChatCompletionRequest.model_validate({**body, **kw})


def completion(**kw) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "The capital of France is", "temperature": 0,
                                             "max_tokens": 8, **kw})


def key(body, model="m", revision="r1") -> str:
    return exact_key(model, revision, "chat" if isinstance(body, ChatCompletionRequest) else "completion", body)


def answer(text="Paris.", n=1, reason="stop") -> list[GenerationChunk]:
    """A replica's chunks for one prompt, ``n`` choices of two steps each."""
    out = []
    for i in range(n):
        out.append(GenerationChunk(text=text[:3], token_ids=[11], num_prompt_tokens=9, num_output_tokens=1, index=i))
        out.append(GenerationChunk(text=text[3:], token_ids=[12], finished=True, finish_reason=reason,
                                   num_prompt_tokens=9, num_output_tokens=2, num_cached_tokens=4, index=i))
    return out


# ---- the key --------------------------------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}

# field -> (extra base fields, the changed value): each must change the key
SAMPLING_VARIANTS = {
    "max_tokens": ({}, 9), "temperature": ({}, 0.5), "top_p": ({}, 0.5),
    "n": ({}, 2), "stop": ({}, ["."]), "seed": ({}, 1), "presence_penalty": ({}, 0.5),
    "frequency_penalty": ({}, 0.5), "logit_bias": ({}, {"5": 1.0}), "response_format": ({}, {"type": "json_object"}),
    "top_k": ({}, 5), "min_p": ({}, 0.1), "repetition_penalty": ({}, 1.1), "ignore_eos": ({}, True),
    "min_tokens": ({}, 2), "stop_token_ids": ({}, [3]), "skip_special_tokens": ({}, False),
    "include_stop_str_in_output": ({}, True), "structured_outputs": ({}, {"regex": "a+"}),
    "guided_json": ({}, {"type": "object"}), "guided_regex": ({}, "b+"), "guided_choice": ({}, ["a", "b"]),
    "guided_grammar": ({}, 'root ::= "a"'),
}
CHAT_VARIANTS = {
    **SAMPLING_VARIANTS,
    "messages": ({}, [{"role": "user", "content": "What is the capital of Spain?"}]),
    "max_completion_tokens": ({}, 9), "logprobs": ({}, True), "top_logprobs": ({"logprobs": True}, 2),
    "tools": ({}, [WEATHER]), "tool_choice": ({"tools": [WEATHER]}, "required"),
    "parallel_tool_calls": ({"tools": [WEATHER]}, False),
}
COMPLETION_VARIANTS = {
    **SAMPLING_VARIANTS,
    "prompt": ({}, "The capital of Spain is"), "logprobs": ({}, 1), "echo": ({}, True), "best_of": ({}, 2),
    "suffix": ({}, ""),
}


@pytest.mark.parametrize("model,variants", [(ChatCompletionRequest, CHAT_VARIANTS),
                                            (CompletionRequest, COMPLETION_VARIANTS)])
def test_every_request_field_is_in_the_key_or_declared_output_neutral(model, variants):
    """A field added to the protocol must be decided on: in the key (a variant here) or in
    NON_OUTPUT_FIELDS. Nothing is silently left out of the key."""
    assert set(variants) | NON_OUTPUT_FIELDS == set(model.model_fields)


@pytest.mark.parametrize("field", sorted(CHAT_VARIANTS))
def test_each_output_changing_chat_field_changes_the_key(field):
    extra, value = CHAT_VARIANTS[field]
    assert key(chat(**extra)) != key(chat(**extra, **{field: value}))


@pytest.mark.parametrize("field", sorted(COMPLETION_VARIANTS))
def test_each_output_changing_completion_field_changes_the_key(field):
    extra, value = COMPLETION_VARIANTS[field]
    assert key(completion(**extra)) != key(completion(**extra, **{field: value}))


def test_model_revision_and_endpoint_change_the_key():
    b = chat()
    assert len({key(b), key(b, model="other"), key(b, revision="r2"), exact_key("m", "r1", "completion", b)}) == 4


def test_fields_that_do_not_change_the_output_leave_the_key_alone():
    base = key(chat())
    for extra in ({"stream": True}, {"stream": True, "stream_options": {"include_usage": True}}, {"user": "u1"},
                  {"priority": 5}, {"cache": {"semantic": True}}, {"cache": True}, {"model": "anything"},
                  {"metadata": {"trace": "x"}, "unknown_vendor_field": 1}):
        assert key(chat(**extra)) == base, extra
    assert key(completion(stream=True, user="u")) == key(completion())


def test_equal_requests_spelled_differently_have_one_key():
    parts = [{"type": "text", "text": "What is the capital "}, {"type": "text", "text": "of France?"}]
    assert key(chat(messages=[{"role": "user", "content": parts}])) == key(chat())
    assert key(chat(max_tokens=None, max_completion_tokens=8)) == key(chat())
    assert key(chat(stop=".")) == key(chat(stop=["."]))
    assert key(chat(temperature=0.0)) == key(chat(temperature=0))
    assert key(chat(temperature=None, seed=3)) == key(chat(temperature=1.0, seed=3))
    assert key(chat(top_p=1.0)) == key(chat())
    assert key(chat(response_format={"type": "json_object"})) == key(chat(structured_outputs={"json_object": True}))
    assert key(chat(guided_regex="a+")) == key(chat(structured_outputs={"regex": "a+"}))
    assert key(chat(logit_bias={"7": 1, "5": 2})) == key(chat(logit_bias={"5": 2.0, "7": 1.0}))
    assert key(completion(prompt=["The capital of France is"])) == key(completion())
    # a system message is part of the conversation: not equal
    system = [{"role": "system", "content": "Answer in French."}, *chat().model_dump()["messages"]]
    assert key(chat(messages=system)) != key(chat())


def test_only_deterministic_requests_are_cacheable():
    assert deterministic(chat()) and deterministic(chat(temperature=0, n=3))
    assert deterministic(chat(temperature=0.8, seed=7, n=3))  # choice i samples with seed + i
    assert not deterministic(chat(temperature=None)) and not deterministic(chat(temperature=0.7))


def test_request_options_from_body_and_cache_control():
    h = {}
    assert request_options(chat(), h) == RequestOptions(True, True, None)
    assert request_options(chat(cache=False), h) == RequestOptions(False, False, False)
    assert request_options(chat(cache={"semantic": True}), h) == RequestOptions(True, True, True)
    assert request_options(chat(cache={"semantic": False}), h).semantic is False
    assert request_options(chat(), {"cache-control": "no-cache"}) == RequestOptions(False, True, None)
    assert request_options(chat(), {"cache-control": "max-age=0, no-store"}) == RequestOptions(False, False, False)
    with pytest.raises(ValidationError, match="semantik"):
        chat(cache={"semantik": True})  # a typo is a 400, not silently ignored
    assert "cache" not in ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], "cache": False}).model_extra


def test_semantic_parts_leave_the_text_out_of_the_scope():
    s1, t1 = semantic_parts("m", "r", "chat", chat())
    s2, t2 = semantic_parts("m", "r", "chat", chat(messages=[{"role": "user", "content": "Capital of France?"}]))
    assert s1 == s2 and t1 == "What is the capital of France?" and t2 == "Capital of France?"
    sys_msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of France?"}]
    assert semantic_parts("m", "r", "chat", chat(messages=sys_msgs))[0] != s1
    assert semantic_parts("m", "r", "chat", chat(max_tokens=9))[0] != s1
    assert semantic_parts("m", "r2", "chat", chat())[0] != s1
    tool_last = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "",
                 "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "content": "42", "tool_call_id": "c"}]
    assert semantic_parts("m", "r", "chat", chat(messages=tool_last)) is None
    assert semantic_parts("m", "r", "completion", completion(prompt=[1, 2, 3])) is None
    assert semantic_parts("m", "r", "completion", completion())[1] == "The capital of France is"


def test_model_revision_follows_the_weights(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    r1 = model_revision(tmp_path)
    assert r1.startswith("sha256:") and model_revision(tmp_path) == r1
    (tmp_path / "model.safetensors").write_bytes(b"y" * 101)
    r2 = model_revision(tmp_path)
    assert r2 != r1
    (tmp_path / "config.json").write_text('{"hidden_size": 65}')
    assert model_revision(tmp_path) != r2
    snap = tmp_path / "snapshots" / ("a1" * 20)
    snap.mkdir(parents=True)
    assert model_revision(snap) == "hub:" + "a1" * 20


# ---- entries --------------------------------------------------------------------------------
def test_entries_round_trip_with_logprobs():
    lp = TokenLogprob(5, "Par", [80, 97, 114], -0.5, [TopLogprob(5, "Par", [80, 97, 114], -0.5),
                                                        TopLogprob(6, "Lon", [76], -2.0)])
    first = GenerationChunk(text="Par", token_ids=[5], num_prompt_tokens=3, num_output_tokens=1, logprobs=[lp],
                            prompt_logprobs=[None, TokenLogprob(1, "a", [97], -1.0)], prompt_text="a b")
    last = GenerationChunk(text="is", token_ids=[6], finished=True, finish_reason="length", stop_reason=None,
                           num_prompt_tokens=3, num_output_tokens=2, num_cached_tokens=2, index=1)
    streams = [[first, last], answer()]
    assert decode_entry(encode_entry(streams)) == streams
    with pytest.raises(ValueError):
        decode_entry(b'{"v": 2, "streams": []}')


def test_only_complete_answers_are_stored():
    assert complete([answer()], 1) and complete([answer(n=2), answer(n=2)], 2)
    assert complete([answer(reason="length")], 1)
    assert not complete([answer(reason="abort")], 1)
    assert not complete([answer(n=2)[:3]], 2)  # choice 1 never finished
    assert not complete([answer(), answer()[:1]], 1)  # the second prompt did not finish
    assert not complete([], 1)


# ---- in-process backend ------------------------------------------------------------------------
def test_memory_store_lru_by_entries():
    s = MemoryStore(max_entries=2, max_bytes=1 << 20)

    async def go():
        await s.put("m", "a", b"A", 60)
        await s.put("m", "b", b"B", 60)
        assert await s.get("m", "a") == b"A"  # a is now the most recently used
        await s.put("m", "c", b"C", 60)
        return [await s.get("m", k) for k in "abc"]

    assert run(go()) == [b"A", None, b"C"]


def test_memory_store_ttl_and_bytes_bound():
    clock = FakeClock()
    s = MemoryStore(max_entries=100, max_bytes=10, clock=clock)

    async def go():
        await s.put("m", "a", b"aaaa", 5)
        await s.put("m", "b", b"bbbb", 50)
        clock.t += 6
        assert await s.get("m", "a") is None and await s.get("m", "b") == b"bbbb"  # a expired
        assert await s.put("m", "c", b"cccc", 50) and await s.put("m", "d", b"dddd", 50)  # 12 bytes > 10: b goes
        assert await s.get("m", "b") is None and await s.size() == (2, 8)
        assert not await s.put("m", "big", b"x" * 11, 50)  # larger than the whole bound: never stored
        await s.put("other", "e", b"e", 50)
        assert await s.clear("m") == 2 and await s.size() == (1, 1)

    run(go())


# ---- Redis backend ---------------------------------------------------------------------------
def _redis_store(url, prefix, **kw) -> RedisStore:
    return RedisStore(url, kw.pop("max_entries", 100), kw.pop("max_bytes", 1 << 20), prefix=prefix, **kw)


def test_redis_store_is_shared_by_two_instances(redis_server):
    async def go():
        a, b = _redis_store(redis_server, "t1:"), _redis_store(redis_server, "t1:")
        assert await a.put("m", "k", b"answer", 60)
        got = await b.get("m", "k")
        assert await b.get("other-model", "k") is None
        n = await b.clear("m")
        after = await a.get("m", "k")
        await a.close(), await b.close()
        return got, n, after

    assert run(go()) == (b"answer", 1, None)


def test_redis_store_lru_bytes_and_ttl(redis_server):
    async def go():
        s = _redis_store(redis_server, "t2:", max_entries=2, max_bytes=10)
        await s.put("m", "a", b"aaa", 60)
        await asyncio.sleep(0.01)  # scores are Redis's clock in ms
        await s.put("m", "b", b"bbb", 60)
        await asyncio.sleep(0.01)
        assert await s.get("m", "a") == b"aaa"  # touched: b is now least recently used
        await asyncio.sleep(0.01)
        await s.put("m", "c", b"ccc", 60)
        lru = [await s.get("m", k) for k in "abc"]
        assert await s.size() == (2, 6)
        await s.put("m", "d", b"dddddddd", 60)  # 8 bytes: a and c go (10-byte bound)
        bounded = [await s.get("m", k) for k in "acd"], await s.size()
        assert not await s.put("m", "e", b"x" * 11, 60)
        await s.put("m", "short", b"s", 0.2)
        present = await s.get("m", "short")
        deadline = time.monotonic() + 5
        while await s.get("m", "short") is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        expired = await s.get("m", "short") is None
        await s.clear()
        await s.close()
        return lru, bounded, present, expired

    lru, bounded, present, expired = run(go())
    assert lru == [b"aaa", None, b"ccc"]
    assert bounded == ([None, None, b"dddddddd"], (1, 8))
    assert present == b"s" and expired


def test_redis_down_is_a_miss_not_an_error(caplog):
    caplog.set_level(logging.WARNING, logger="ray.serve")
    settings = CacheSettings(backend="redis", redis_url=f"redis://127.0.0.1:{free_port()}/0")  # nothing listens there

    async def go():
        cache = ResponseCache(settings, metrics=False)
        cache.store_backend.retry_s = 0.0  # try Redis on every call: each one fails
        looks = [await cache.lookup("m", "r", "chat", chat(), RequestOptions()) for _ in range(3)]
        cache.store_soon(looks[0], [answer()], 1)
        await asyncio.gather(*cache._tasks)
        await cache.close()
        return looks

    looks = run(go())
    assert [lk.status for lk in looks] == ["miss"] * 3 and not any(lk.hit for lk in looks)
    warnings = [r for r in caplog.records if "response cache: Redis" in r.getMessage()]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]  # logged once, not per request


# ---- the cache ------------------------------------------------------------------------------
def test_exact_hit_after_a_stored_answer_and_the_opt_outs():
    async def go():
        cache = ResponseCache(CacheSettings(), metrics=False)
        opts = RequestOptions()
        first = await cache.lookup("m", "r1", "chat", chat(), opts)
        assert first.status == "miss" and first.store and not first.hit
        cache.store_soon(first, [answer()], 1)
        await asyncio.gather(*cache._tasks)
        hit = await cache.lookup("m", "r1", "chat", chat(stream=True, user="someone"), opts)
        new_revision = await cache.lookup("m", "r2", "chat", chat(), opts)
        refresh = await cache.lookup("m", "r1", "chat", chat(), RequestOptions(read=False, write=True))
        off = await cache.lookup("m", "r1", "chat", chat(cache=False), RequestOptions(False, False, False))
        sampled = await cache.lookup("m", "r1", "chat", chat(temperature=0.7), opts)
        stats = await cache.stats()
        cleared = await cache.clear("m")
        gone = await cache.lookup("m", "r1", "chat", chat(), opts)
        return hit, new_revision, refresh, off, sampled, stats, cleared, gone

    hit, new_revision, refresh, off, sampled, stats, cleared, gone = run(go())
    assert hit.status == "exact" and hit.streams == [answer()] and not hit.store
    assert hit.headers == {"x-kvserve-cache": "exact"}
    assert new_revision.status == "miss"  # a new weights revision never serves old answers
    assert refresh.status == "bypass" and refresh.store  # no-cache: not read, the fresh answer replaces it
    assert off.status == "bypass" and not off.store
    assert sampled.status == "bypass" and not sampled.store
    assert stats["exact"]["hits"] == 1 and stats["exact"]["entries"] == 1 and stats["stores"] == 1
    assert cleared == {"exact": 1, "semantic": 0} and gone.status == "miss"


def test_incomplete_answers_are_not_stored():
    async def go():
        cache = ResponseCache(CacheSettings(), metrics=False)
        look = await cache.lookup("m", "r", "chat", chat(), RequestOptions())
        cache.store_soon(look, [answer(reason="abort")], 1)
        cache.store_soon(look, [answer()[:1]], 1)
        await asyncio.gather(*cache._tasks)
        return await cache.lookup("m", "r", "chat", chat(), RequestOptions())

    assert run(go()).status == "miss"


# ---- the semantic level (real all-MiniLM-L6-v2) ------------------------------------------------
@pytest.fixture(scope="module")
def embedder():
    from deployments.contract.encoder import SentenceEncoder, bundled_encoder_path

    try:
        bundled_encoder_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return SentenceEncoder()  # leaves torch's thread count alone


def test_embeddings_are_unit_vectors_and_paraphrases_are_close(embedder):
    v = embedder.embed(["What is the capital of France?", "Which city is the capital of France?",
                        "How do I sort a list in Python?"])
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.9 > 0.3 > v[0] @ v[2]


def semantic_cache(embedder, mode="opt-in", threshold=0.92, **kw) -> ResponseCache:
    return ResponseCache(CacheSettings(semantic=mode, semantic_threshold=threshold, **kw),
                         embedder_factory=lambda: embedder, metrics=False)


def ask(text: str, system: str | None = None, **kw) -> ChatCompletionRequest:
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    return chat(messages=msgs, **kw)


async def _seed(cache: ResponseCache, body, opts=RequestOptions(semantic=True)):
    look = await cache.lookup("m", "r", "chat", body, opts)
    cache.store_soon(look, [answer("Leap years have 366 days.")], 1)
    await asyncio.gather(*cache._tasks)
    return look


def test_semantic_paraphrase_hits_unrelated_and_other_instructions_miss(embedder):
    sem = RequestOptions(semantic=True)

    async def go():
        cache = semantic_cache(embedder)
        await _seed(cache, ask("How many days are there in a leap year?", system="Be brief."))
        para = await cache.lookup("m", "r", "chat", ask("How many days does a leap year have?", system="Be brief."), sem)
        unrelated = await cache.lookup("m", "r", "chat", ask("What is the capital of France?", system="Be brief."),
                                       sem)
        other_system = await cache.lookup("m", "r", "chat",
                                          ask("How many days does a leap year have?", system="Answer in French."), sem)
        same_text_other_system = await cache.lookup(
            "m", "r", "chat", ask("How many days are there in a leap year?", system="Answer in French."), sem)
        other_sampling = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?", system="Be brief.", max_tokens=9), sem)
        not_asked = await cache.lookup("m", "r", "chat", ask("How many days does a leap year have?",
                                                             system="Be brief."), RequestOptions())
        return para, unrelated, other_system, same_text_other_system, other_sampling, not_asked, cache.counts

    para, unrelated, other_system, same_text_other_system, other_sampling, not_asked, counts = run(go())
    assert para.status == "semantic" and para.streams == [answer("Leap years have 366 days.")]
    assert para.headers == {"x-kvserve-cache": "semantic"}
    assert unrelated.status == "miss" and not unrelated.hit
    assert other_system.status == "miss" and same_text_other_system.status == "miss"
    assert other_sampling.status == "miss"
    assert not_asked.status == "miss"  # opt-in mode: only requests that ask use the semantic level
    assert counts["semantic"] == {"hits": 1, "misses": 5}  # the seeding lookup missed too


def test_semantic_threshold_and_numbers(embedder):
    sem = RequestOptions(semantic=True)

    async def go(threshold):
        cache = semantic_cache(embedder, mode="on", threshold=threshold)
        await _seed(cache, ask("How many days are there in a leap year?"))
        await _seed(cache, ask("What is 12 times 12?"))
        para = await cache.lookup("m", "r", "chat", ask("How many days does a leap year have?"), RequestOptions())
        loose = await cache.lookup("m", "r", "chat", ask("How many days are there in February?"), sem)
        numbers = await cache.lookup("m", "r", "chat", ask("What is 12 times 13?"), sem)
        declined = await cache.lookup("m", "r", "chat", ask("How many days does a leap year have?"),
                                      RequestOptions(semantic=False))
        return para.status, loose.status, numbers.status, declined.status

    # mode "on": a request that does not say anything gets the semantic level; one that declines does not
    assert run(go(0.92)) == ("semantic", "miss", "miss", "miss")
    assert run(go(0.999))[0] == "miss"  # stricter than this paraphrase's similarity
    # a loose threshold lets a near miss through ("February" is 0.70 similar), never different numbers
    assert run(go(0.6))[1:3] == ("semantic", "miss")
    assert numbers_of("What is 12 times 1,000.5?") == ("12", "1,000.5")


def test_semantic_entry_whose_answer_is_gone_is_a_miss(embedder):
    async def go():
        cache = semantic_cache(embedder, max_entries=1)
        await _seed(cache, ask("How many days are there in a leap year?"))
        await _seed(cache, ask("Name a famous painter."))  # evicts the first exact entry (max_entries 1)
        look = await cache.lookup("m", "r", "chat", ask("How many days does a leap year have?"),
                                  RequestOptions(semantic=True))
        return look.status, len(cache.index)

    assert run(go()) == ("miss", 1)  # and the dangling vector was dropped


def test_semantic_index_lru_ttl_and_clear():
    clock = FakeClock()
    idx = SemanticIndex(dim=3, max_entries=2, clock=clock)
    e = np.eye(3, dtype=np.float32)
    idx.add("s1", "m1", "a", e[0], ttl_s=10)
    idx.add("s2", "m2", "b", e[1], ttl_s=10)
    assert idx.search("s1", e[0], 0.9) == ("a", 1.0)  # a used: b is least recently used
    assert idx.search("s2", e[0], 0.9) is None  # another scope never answers
    idx.add("s1", "m1", "c", e[2], ttl_s=100)
    assert idx.search("s2", e[1], 0.9) is None and len(idx) == 2  # b evicted
    clock.t += 11
    assert idx.search("s1", e[0], 0.9) is None and idx.search("s1", e[2], 0.9) == ("c", 1.0)  # a expired
    assert idx.clear("m2") == 0 and idx.clear("m1") == 2 and len(idx) == 0


# ---- configuration ------------------------------------------------------------------------------
def test_app_args_and_cli_flags_of_the_caches(monkeypatch):
    from deployments.args import AppArgs
    from deployments.cli import app_args_from_cli, build_parser

    monkeypatch.delenv("KVSERVE_REDIS_URL", raising=False)
    monkeypatch.delenv("KVSERVE_ADMIN_API_KEYS", raising=False)
    default = AppArgs()
    assert CacheSettings(**default.cache_settings()) == CacheSettings()  # exact on, memory, semantic off
    argv = ["serve", "--no-response-cache", "--cache-backend", "redis", "--redis-url", "redis://127.0.0.1:1/0",
            "--cache-ttl-s", "60", "--cache-max-entries", "5", "--cache-max-bytes", "1000",
            "--semantic-cache", "opt-in", "--semantic-cache-threshold", "0.9", "--admin-api-key", "sk-admin"]
    args = AppArgs.model_validate(app_args_from_cli(build_parser().parse_args(argv)))
    assert args.cache_settings() == {"enabled": False, "backend": "redis", "ttl_s": 60.0, "max_entries": 5,
                                     "max_bytes": 1000, "semantic": "opt-in", "semantic_threshold": 0.9,
                                     "semantic_max_entries": 10_000, "redis_url": "redis://127.0.0.1:1/0"}
    assert args.gateway.admin_api_keys == ["sk-admin"]
    assert AppArgs(semantic_cache=True).cache.semantic_cache == "on"  # YAML's booleans
    with pytest.raises(ValidationError, match="redis_url"):
        AppArgs(cache_backend="redis")
    with pytest.raises(ValidationError):
        AppArgs(semantic_cache_threshold=1.5)
    monkeypatch.setenv("KVSERVE_ADMIN_API_KEYS", "sk-a, sk-b")
    assert AppArgs().gateway.admin_api_keys == ["sk-a", "sk-b"]
    with pytest.raises(ValueError, match="semantic cache mode"):
        CacheSettings(semantic="sometimes")
