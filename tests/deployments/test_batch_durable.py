"""Files and Batches that neither exhaust nor lose (kvserve/deployments/gateway/files.py, batches.py,
batch_lines.py; issue 63): a batch output over ``max_file_bytes`` keeps what finished; uploads
refused as their bytes arrive, each key within its share of the store; the Files and Batch
routes behind the key's rate limits; a cap on a key's active batches and files; the batch mark
no client can send. The gateway over a scripted replica, driven by the openai SDK (no Ray, no
engine). Batches that survive their ingress replica on a real Redis: tests/deployments/test_batch_resume_redis.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from gateway_fakes import ScriptedReplica, _sdk, jsonl, make_gateway, wait_batch

from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.core import WARM_PRIORITY

KEYS = ["sk-tenant-a-1 name=a", "sk-tenant-b-1 name=b"]


def _line(i, content=None):
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {"model": "fake", "messages": [{"role": "user", "content": content or f"q{i}"}]},
    }


def test_an_output_over_max_file_bytes_keeps_every_answer_that_fits():
    """Each answer line is ~900 bytes and the output file may hold 4000: the first answers go
    to the output file, in order, and the ones that no longer fit become error lines
    ``batch_output_too_large``; the batch completes (before: it failed at its end and every
    finished answer was dropped)."""

    async def run():
        client, _ = _sdk(ScriptedReplica(["x" * 600]), api_keys=KEYS, api_key="sk-tenant-a-1", max_file_bytes=4000)
        f = await client.files.create(file=("in.jsonl", jsonl([_line(i) for i in range(10)])), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        b = await wait_batch(client, b.id)
        assert b.status == "completed", b
        out = [json.loads(x) for x in (await client.files.content(b.output_file_id)).text.splitlines()]
        err = [json.loads(x) for x in (await client.files.content(b.error_file_id)).text.splitlines()]
        return b, out, err

    b, out, err = asyncio.run(run())
    assert 1 <= len(out) < 10 and [x["custom_id"] for x in out] == [f"req-{i}" for i in range(len(out))]
    assert all(x["response"]["body"]["choices"][0]["message"]["content"] == "x" * 600 for x in out)
    assert [x["custom_id"] for x in err] == [f"req-{i}" for i in range(len(out), 10)]
    assert all(
        x["error"]["code"] == "batch_output_too_large" and "max_file_bytes" in x["error"]["message"] for x in err
    )
    assert b.request_counts.model_dump() == {"total": 10, "completed": len(out), "failed": 10 - len(out)}
    assert b.usage.output_tokens == len(out)  # the usage of the answers kept


class Counted:
    """A request body sent in 1 KiB chunks that counts how many were read."""

    def __init__(self, head: bytes, size: int, tail: bytes):
        self.head, self.size, self.tail, self.sent = head, size, tail, 0

    async def __aiter__(self):
        yield self.head
        for _ in range(self.size // 1024):
            self.sent += 1024
            yield b"x" * 1024
        yield self.tail


def _multipart(size: int, boundary="kvservebnd") -> tuple[Counted, dict]:
    head = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="big.jsonl"\r\n'
        "Content-Type: application/octet-stream\r\n\r\n"
    ).encode()
    return Counted(head, size, f"\r\n--{boundary}--\r\n".encode()), {
        "content-type": f"multipart/form-data; boundary={boundary}",
        "authorization": "Bearer sk-tenant-a-1",
    }


def test_an_upload_is_refused_as_its_bytes_cross_the_keys_share():
    """Two keys share ``cache_max_bytes`` 6000, so each keeps 3000 bytes of files (before: each
    had all 6000). A 2500-byte file fits; a 200 KiB upload streamed after it is refused with 413
    ``quota_exceeded`` naming the limit before most of its body was read (before: the whole form
    was parsed and spooled first); the other key still has its own 3000 bytes."""
    gw = make_gateway(ScriptedReplica(), api_keys=KEYS, cache_max_bytes=6000, max_file_bytes=1 << 20)
    app = build_api(gw)

    async def run():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")
        a = openai.AsyncOpenAI(api_key="sk-tenant-a-1", base_url="http://gw/v1", http_client=http, max_retries=0)
        b = openai.AsyncOpenAI(api_key="sk-tenant-b-1", base_url="http://gw/v1", http_client=http, max_retries=0)
        first = await a.files.create(file=("a.jsonl", b"a" * 2500), purpose="batch")
        body, headers = _multipart(200 << 10)
        r = await http.post("/files", content=body, headers=headers)
        listed = await a.files.list()
        other = await b.files.create(file=("b.jsonl", b"b" * 2900), purpose="batch")
        with pytest.raises(openai.APIStatusError) as over:
            await a.files.create(file=("c.jsonl", b"c" * 600), purpose="batch")
        return first, r, body, listed, other, over.value

    first, r, body, listed, other, over = asyncio.run(run())
    assert first.bytes == 2500 and other.bytes == 2900
    assert r.status_code == 413 and r.json()["error"]["code"] == "quota_exceeded"
    assert "3000" in r.json()["error"]["message"]
    assert body.sent < 16 << 10  # refused after a few KiB of its 200 KiB
    assert [f.id for f in listed.data] == [first.id]  # nothing of the refused upload was kept
    assert over.status_code == 413 and over.body["code"] == "quota_exceeded"


def test_files_and_batch_routes_are_behind_the_keys_rate_limit():
    """A key of 3 requests per minute: its fourth Files or Batch API call gets 429
    ``rate_limit_exceeded`` with Retry-After (before: those routes were never limited)."""

    async def run():
        client, _ = _sdk(ScriptedReplica(), api_keys=["sk-slow-1 name=slow rpm=3"], api_key="sk-slow-1")
        f = await client.files.create(file=("in.jsonl", jsonl([_line(0)])), purpose="batch")
        await client.files.list()
        await client.batches.list()
        with pytest.raises(openai.RateLimitError) as e:
            await client.files.retrieve(f.id)
        return e.value

    e = asyncio.run(run())
    assert e.body["code"] == "rate_limit_exceeded" and int(e.response.headers["retry-after"]) >= 1


class HeldReplica(ScriptedReplica):
    """Each answer (one chunk) waits for ``release`` (an asyncio.Event made on the test's loop)."""

    def __init__(self):
        super().__init__(["Hello"])

    release: asyncio.Event

    async def _chunks(self):
        await self.release.wait()
        async for c in super()._chunks():
            yield c


def test_a_key_may_have_so_many_active_batches_and_files():
    """``max_active_batches_per_key`` 1: a second batch while the first runs gets 429
    ``too_many_active_batches`` naming the setting, and is accepted once the first ended;
    ``max_files_per_key`` 3: a fourth upload gets 400 ``quota_exceeded``."""
    replica = HeldReplica()

    async def run():
        replica.release = asyncio.Event()
        client, _ = _sdk(
            replica, api_keys=KEYS, api_key="sk-tenant-a-1", max_active_batches_per_key=1, max_files_per_key=3
        )
        f = await client.files.create(file=("in.jsonl", jsonl([_line(0)])), purpose="batch")
        first = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        with pytest.raises(openai.RateLimitError) as too_many:
            await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        replica.release.set()
        assert (await wait_batch(client, first.id)).status == "completed"  # + its output file: 2 files
        second = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        await wait_batch(client, second.id)  # its output: 3 files
        with pytest.raises(openai.BadRequestError) as files_cap:
            await client.files.create(file=("more.jsonl", jsonl([_line(1)])), purpose="batch")
        return too_many.value, files_cap.value

    too_many, files_cap = asyncio.run(run())
    assert too_many.body["code"] == "too_many_active_batches" and "max_active_batches_per_key" in too_many.message
    assert files_cap.body["code"] == "quota_exceeded" and "max_files_per_key" in files_cap.message


def test_a_client_cannot_mark_its_request_as_batch_work():
    """``x-kvserve-batch: 1`` from a client changes nothing: its request runs live (not batch
    work, its own priority), while the batch runner's own requests stay batch work
    (before: the header alone made any request skip shedding and the request log)."""
    replica = ScriptedReplica(["Hello"])

    async def run():
        client, _ = _sdk(replica, api_keys=KEYS, api_key="sk-tenant-a-1")
        await client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], extra_headers={"x-kvserve-batch": "1"}
        )
        f = await client.files.create(file=("in.jsonl", jsonl([_line(0)])), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        await wait_batch(client, b.id)

    asyncio.run(run())
    live, batch = replica.requests
    assert not live.sheddable and not live.batch and live.priority < WARM_PRIORITY
    assert batch.batch and not batch.sheddable and batch.priority == WARM_PRIORITY
