"""Redis faults never delete (kvserve/deployments/cache/stores.py, owner_stores.py; issue 63): with
a real redis-server paused (SIGSTOP) mid-use, the Files, Batch and Responses APIs answer 503
``store_unavailable`` (an OpenAI error body), never "not found"; no id leaves a key's index,
during the pause or just after it; a ``store: true`` response that was not stored says so; a
batch's final status is retried until stored, and the batch is not reported complete before.
The gateway over a scripted replica (no Ray, no engine), driven by httpx and the openai SDK."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest
from gateway_fakes import ScriptedReplica, make_gateway, wait_batch
from redis_helpers import own_redis  # noqa: F401  (the fixture)

from kvserve.deployments.gateway.api import build_api

pytestmark = pytest.mark.timeout(120)

KEY = "sk-store-faults-1"


def _line(i):
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "fake", "messages": [{"role": "user", "content": f"q{i}"}]},
    }


def _gateway(replica, url):
    gw = make_gateway(replica, api_keys=[f"{KEY} name=t"], cache_backend="redis", redis_url=url)
    for owners in (gw.files.owners, gw.batches.owners, gw.responses.owners):
        owners.timeout_s = 0.3  # a paused Redis is found out fast (files default to 2 s)
    app = build_api(gw)
    http = httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://gw/v1", headers={"Authorization": f"Bearer {KEY}"}
    )
    return gw, http, openai.AsyncOpenAI(api_key=KEY, base_url="http://gw/v1", http_client=http, max_retries=0)


def test_a_redis_pause_is_a_503_and_no_id_leaves_an_index(own_redis):
    """Files, a finished batch and a stored response; Redis paused: every read is a 503
    ``store_unavailable``, and a new ``store: true`` response comes back with ``store: false``
    and ``x-kvserve-store: failed``; Redis back: the lists right after it hold every id
    (before: the reads in the pause were misses, and for 5 s after it the list endpoints
    dropped every id from the index for good)."""
    replica = ScriptedReplica(["Hello"])

    async def run():
        _, http, client = _gateway(replica, own_redis.url)
        files = [
            await client.files.create(file=(f"f{i}.jsonl", json.dumps(_line(i)).encode() + b"\n"), purpose="batch")
            for i in range(2)
        ]
        b = await wait_batch(
            client,
            (
                await client.batches.create(
                    input_file_id=files[0].id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            ).id,
        )
        kept = await client.responses.create(model="fake", input="remember me")
        before = ({f.id for f in (await client.files.list()).data}, [x.id for x in (await client.batches.list()).data])
        own_redis.pause()
        try:
            paused = {
                path: await http.get(path)
                for path in (
                    "/files",
                    "/batches",
                    f"/files/{files[1].id}",
                    f"/files/{files[1].id}/content",
                    f"/batches/{b.id}",
                    f"/responses/{kept.id}",
                )
            }
            unstored = await http.post("/responses", json={"model": "fake", "input": "during the pause"})
        finally:
            own_redis.resume()
        after = ({f.id for f in (await client.files.list()).data}, [x.id for x in (await client.batches.list()).data])
        still = await client.responses.retrieve(kept.id)
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(unstored.json()["id"])
        return b, before, paused, unstored, after, still

    b, before, paused, unstored, after, still = asyncio.run(run())
    assert b.status == "completed" and len(before[0]) == 3 and before[1] == [b.id]  # 2 uploads + the output
    for path, r in paused.items():
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert r.json()["error"]["code"] == "store_unavailable" and r.headers["retry-after"], path
    assert unstored.status_code == 200 and unstored.json()["store"] is False
    assert unstored.headers["x-kvserve-store"] == "failed"
    assert after == before  # nothing lost
    assert still.output_text == "Hello"


class HeldReplica(ScriptedReplica):
    """Answers one chunk once ``release`` (an asyncio.Event of the test's loop) is set."""

    def __init__(self):
        super().__init__(["Hello"])

    async def _chunks(self):
        await self.release.wait()
        async for c in super()._chunks():
            yield c


class Seen(logging.Handler):
    """Sets ``event`` (an asyncio.Event, from the loop's thread) on a record containing ``text``."""

    def __init__(self, text, event):
        super().__init__(logging.WARNING)
        self.text, self.event = text, event

    def emit(self, record):
        if self.text in record.getMessage():
            self.event.set()


def test_a_batch_is_complete_only_once_its_final_status_is_stored(own_redis):
    """Redis is paused as a batch's last answer comes: its output file and final status do
    not go in; the batch retries them (it says so in the log), and reads as ``completed``, with
    its output, only after Redis is back and they are stored (before: the failed writes were
    ignored and the batch read as in progress, then failed)."""
    replica = HeldReplica()
    logger = logging.getLogger("ray.serve")

    async def run():
        replica.release = asyncio.Event()
        retrying = asyncio.Event()
        handler = Seen(": the store failed (", retrying)  # a result or the final status: retried
        logger.addHandler(handler)
        try:
            gw, http, client = _gateway(replica, own_redis.url)
            f = await client.files.create(file=("in.jsonl", json.dumps(_line(0)).encode() + b"\n"), purpose="batch")
            b = await client.batches.create(
                input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
            )
            while not replica.requests:  # the line reached the replica
                await asyncio.sleep(0.005)
            own_redis.pause()
            try:
                replica.release.set()
                await asyncio.wait_for(retrying.wait(), 60)
                during = await http.get(f"/batches/{b.id}")
            finally:
                own_redis.resume()
            done = await wait_batch(client, b.id)
            out = (await client.files.content(done.output_file_id)).text
            return during, done, out
        finally:
            logger.removeHandler(handler)

    during, done, out = asyncio.run(run())
    assert during.status_code == 503 and during.json()["error"]["code"] == "store_unavailable"
    assert done.status == "completed" and done.request_counts.completed == 1
    assert json.loads(out)["response"]["body"]["choices"][0]["message"]["content"] == "Hello"
