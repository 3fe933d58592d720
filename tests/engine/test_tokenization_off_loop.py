"""Tokenization runs off the async engine's event loop: while a huge prompt is tokenized, the loop
keeps ticking and another stream keeps getting tokens (tiny Llama). Shown by events, not by
timing: the tokenizing call itself waits, in its thread, until the loop has ticked and the other
stream has had tokens; on the loop's own thread that wait could never end."""

from __future__ import annotations

import asyncio
import threading

import pytest

from _hardening_helpers import PROMPTS, arun, collect
from kvserve.engine import SamplingParams
from kvserve.engine.llm_engine import chat_template_ids

#: Ticks of the loop and tokens of the other stream seen while the huge prompt is tokenized.
PROGRESS = 5
#: How long the tokenizing call waits for that progress (a hang guard, not a speed bound).
GUARD_S = 120


def test_tokenization_does_not_stall_the_event_loop(tiny_llama_path):
    text = "The quick brown fox jumps over the lazy dog. " * 30000  # ~1.35 MB, ~300k tokens

    async def body(eng):
        loop_thread = threading.get_ident()
        inside = threading.Event()  # the huge prompt's tokenizing call has started
        progressed = threading.Event()  # the loop ticked and the stream got tokens meanwhile
        seen = {"ticks": 0, "tokens": 0, "thread": None, "waited": None}

        def note(kind):
            if inside.is_set() and not progressed.is_set():
                seen[kind] += 1
                if seen["ticks"] >= PROGRESS and seen["tokens"] >= PROGRESS:
                    progressed.set()

        real_make = eng._make_request

        def make_request(request_id, prompt, *a, **kw):
            if prompt is text:
                seen["thread"] = threading.get_ident()
                inside.set()
                seen["waited"] = progressed.wait(GUARD_S)
            return real_make(request_id, prompt, *a, **kw)

        eng._make_request = make_request

        async def streamer():
            async for _ in eng.generate(
                PROMPTS[0],
                SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True, detokenize=False),
                request_id="bg",
            ):
                note("tokens")

        bg = asyncio.create_task(streamer())
        while eng.engine.scheduler.requests.get("bg") is None:
            await asyncio.sleep(0.01)

        stop = asyncio.Event()

        async def ticker():
            while not stop.is_set():
                await asyncio.sleep(0.01)
                note("ticks")

        tick = asyncio.create_task(ticker())
        with pytest.raises(ValueError, match="max_model_len"):  # too long, found after tokenizing it
            await collect(eng.generate(text, SamplingParams(max_tokens=1)))
        stop.set()
        await tick
        bg.cancel()
        msgs = [{"role": "user", "content": "hi there"}]
        ids = await eng.apply_chat_template(msgs)
        return seen, loop_thread, ids, eng.tokenizer, msgs

    seen, loop_thread, ids, tok, msgs = arun(body, tiny_llama_path)
    assert seen["thread"] is not None and seen["thread"] != loop_thread  # tokenized in another thread
    assert seen["waited"], seen  # the loop ticked and the other stream got tokens while it tokenized
    assert seen["ticks"] >= PROGRESS and seen["tokens"] >= PROGRESS
    assert ids == chat_template_ids(tok, msgs)
