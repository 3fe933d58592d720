"""The response cache's exact level (kvserve/deployments/cache/), without Ray: entries round-trip, only
complete answers are stored, a repeat hits and the opt-outs bypass it (in-process backend)."""

import asyncio

import pytest
from response_cache_helpers import answer, chat, run

from kvserve.deployments.cache import CacheSettings, RequestOptions, ResponseCache, complete, decode_entry, encode_entry
from kvserve.deployments.contract.types import GenerationChunk, TokenLogprob, TopLogprob


def test_entries_round_trip_with_logprobs():
    lp = TokenLogprob(
        5, "Par", [80, 97, 114], -0.5, [TopLogprob(5, "Par", [80, 97, 114], -0.5), TopLogprob(6, "Lon", [76], -2.0)]
    )
    first = GenerationChunk(
        text="Par",
        token_ids=[5],
        num_prompt_tokens=3,
        num_output_tokens=1,
        logprobs=[lp],
        prompt_logprobs=[None, TokenLogprob(1, "a", [97], -1.0)],
        prompt_text="a b",
    )
    last = GenerationChunk(
        text="is",
        token_ids=[6],
        finished=True,
        finish_reason="length",
        stop_reason=None,
        num_prompt_tokens=3,
        num_output_tokens=2,
        num_cached_tokens=2,
        index=1,
    )
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
