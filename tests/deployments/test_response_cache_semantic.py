"""The response cache's semantic level (kvserve/deployments/cache/semantic.py) with the real
all-MiniLM-L6-v2 (loaded once for the module; skips without it): paraphrases hit, other
instructions, sampling and numbers miss, the threshold, a dangling entry; the index's LRU, TTL and
clear. No Ray."""

import asyncio

import numpy as np
import pytest
from response_cache_helpers import FakeClock, answer, chat, run

from kvserve.deployments.cache import CacheSettings, RequestOptions, ResponseCache
from kvserve.deployments.cache.semantic import SemanticIndex, numbers_of
from kvserve.deployments.contract.openai_requests import ChatCompletionRequest


@pytest.fixture(scope="module")
def embedder():
    from kvserve.deployments.contract.encoder import SentenceEncoder, bundled_encoder_path

    try:
        bundled_encoder_path()
    except RuntimeError as e:
        pytest.skip(str(e))
    return SentenceEncoder()  # leaves torch's thread count alone


def test_embeddings_are_unit_vectors_and_paraphrases_are_close(embedder):
    v = embedder.embed(
        ["What is the capital of France?", "Which city is the capital of France?", "How do I sort a list in Python?"]
    )
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-5)
    assert v[0] @ v[1] > 0.9 > 0.3 > v[0] @ v[2]


def semantic_cache(embedder, mode="opt-in", threshold=0.92, **kw) -> ResponseCache:
    return ResponseCache(
        CacheSettings(semantic=mode, semantic_threshold=threshold, **kw),
        embedder_factory=lambda: embedder,
        metrics=False,
    )


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
        para = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?", system="Be brief."), sem
        )
        unrelated = await cache.lookup("m", "r", "chat", ask("What is the capital of France?", system="Be brief."), sem)
        other_system = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?", system="Answer in French."), sem
        )
        same_text_other_system = await cache.lookup(
            "m", "r", "chat", ask("How many days are there in a leap year?", system="Answer in French."), sem
        )
        other_sampling = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?", system="Be brief.", max_tokens=9), sem
        )
        not_asked = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?", system="Be brief."), RequestOptions()
        )
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
        declined = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?"), RequestOptions(semantic=False)
        )
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
        look = await cache.lookup(
            "m", "r", "chat", ask("How many days does a leap year have?"), RequestOptions(semantic=True)
        )
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
