"""OpenAI's Files and Batch APIs (kvserve/deployments/gateway/files.py, batches.py, batch_lines.py) through
the openai SDK's ``files`` and ``batches``: over a scripted replica (the gateway's side: the
objects, statuses, output and error files, ownership, limits, cancel; each batch request marked
as batch work at the lowest priority), and over real engines in this process (tests/local_app.py)
beside live traffic; and ``kvserve run-batch`` offline."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.gateway.batch_lines import parse_batch
from kvserve.deployments.gateway.batches import window_seconds
from kvserve.deployments.gateway.core import WARM_PRIORITY
from gateway_fakes import FakeGen, ScriptedReplica, _sdk, jsonl, make_gateway, wait_batch
from kvserve.deployments.contract.types import GenerationChunk, GenerationError
from kvserve.deployments.gateway.api import build_api

KEYS = ["sk-a name=alice", "sk-b name=bob"]


def _line(i, url="/v1/chat/completions", **body):
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": url,
        "body": {"model": "fake", "messages": [{"role": "user", "content": f"question {i}"}], **body},
    }


def test_batch_runs_every_request_in_order_with_output_and_error_files():
    async def run():
        replica = ScriptedReplica(["Hello", " there"])
        client, _ = _sdk(replica, api_keys=KEYS)
        lines = [_line(i) for i in range(6)] + [_line(6, messages=[])]  # the last one is a 400
        f = await client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        assert (f.purpose, f.bytes, f.filename, f.status) == ("batch", len(jsonl(lines)), "in.jsonl", "processed")
        b = await client.batches.create(
            input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"job": "nightly"}
        )
        assert b.status == "validating" and b.metadata == {"job": "nightly"}
        b = await wait_batch(client, b.id)
        assert b.status == "completed" and b.request_counts.model_dump() == {"total": 7, "completed": 6, "failed": 1}
        assert b.model == "fake" and b.usage.output_tokens == 12 and b.completed_at >= b.in_progress_at
        out = [json.loads(x) for x in (await client.files.content(b.output_file_id)).text.splitlines()]
        assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(6)]  # input order
        for x in out:
            assert x["response"]["status_code"] == 200 and x["error"] is None
            assert x["response"]["body"]["choices"][0]["message"]["content"] == "Hello there"
        err = [json.loads(x) for x in (await client.files.content(b.error_file_id)).text.splitlines()]
        assert [(x["custom_id"], x["response"]["status_code"]) for x in err] == [("req-6", 400)]
        assert err[0]["response"]["body"]["error"]["param"] == "messages"
        # each request ran as batch work (not warming's sheddable work), after every live request
        assert len(replica.requests) == 6 and all(
            r.batch and not r.sheddable and r.priority == WARM_PRIORITY for r in replica.requests
        )
        assert (await client.files.retrieve(b.output_file_id)).purpose == "batch_output"
        page = await client.batches.list(limit=5)
        assert [x.id for x in page.data] == [b.id]
        names = {x.filename for x in (await client.files.list()).data}
        assert names == {"in.jsonl", f"{b.id}_output.jsonl", f"{b.id}_error.jsonl"}

    asyncio.run(run())


def test_files_and_batches_belong_to_their_key():
    async def run():
        alice, app = _sdk(ScriptedReplica(), api_keys=KEYS)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw/v1")
        bob = openai.AsyncOpenAI(api_key="sk-b", base_url="http://gw/v1", http_client=http, max_retries=0)
        f = await alice.files.create(file=("in.jsonl", jsonl([_line(0)])), purpose="batch")
        b = await wait_batch(
            alice,
            (
                await alice.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
            ).id,
        )
        for call in (
            bob.files.retrieve(f.id),
            bob.files.content(f.id),
            bob.files.delete(f.id),
            bob.batches.retrieve(b.id),
            bob.batches.cancel(b.id),
            bob.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"),
        ):
            with pytest.raises(openai.NotFoundError):
                await call
        assert (await bob.files.list()).data == [] and (await bob.batches.list()).data == []
        assert (await alice.files.delete(f.id)).deleted
        with pytest.raises(openai.NotFoundError):
            await alice.files.content(f.id)
        anonymous = openai.AsyncOpenAI(api_key="sk-nobody", base_url="http://gw/v1", http_client=http, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            await anonymous.files.list()

    asyncio.run(run())


def test_bad_input_is_refused_or_fails_the_batch_with_its_lines():
    async def run():
        client, _ = _sdk(ScriptedReplica(), api_keys=KEYS, max_file_bytes=2000)
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError) as e:
            await client.files.create(file=("big.jsonl", b"x" * 3000), purpose="batch")
        assert e.value.status_code == 413
        bad = (
            b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {}}\nnot json\n'
            b'{"custom_id": "a", "method": "GET", "url": "/v1/images", "body": {}}\n'
        )
        f = await client.files.create(file=("bad.jsonl", bad), purpose="batch")
        b = await wait_batch(
            client,
            (
                await client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            ).id,
        )
        assert b.status == "failed" and b.output_file_id is None
        assert [(e.line, e.code) for e in b.errors.data] == [
            (2, "invalid_json_line"),
            (3, "duplicate_custom_id"),
            (3, "invalid_method"),
            (3, "invalid_url"),
        ]
        for kw, status in (
            (dict(endpoint="/v1/images"), 400),
            (dict(completion_window="48h"), 400),
            (dict(input_file_id="file-nope"), 404),
        ):
            args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h", **kw}
            with pytest.raises(openai.APIStatusError) as e:
                await client.batches.create(**args)
            assert e.value.status_code == status

    asyncio.run(run())
    assert window_seconds("24h") == 86400 and window_seconds("30m") == 1800
    with pytest.raises(OpenAIError):
        parse_batch(b"\n\n")


class SlowReplica(ScriptedReplica):
    """Each answer takes 50 ms: a batch is still running when it is cancelled."""

    async def _chunks(self):
        await asyncio.sleep(0.05)
        async for c in super()._chunks():
            yield c


def test_cancel_keeps_the_results_so_far():
    async def run():
        client, _ = _sdk(SlowReplica(), api_keys=KEYS, batch_concurrency=1)
        f = await client.files.create(file=("in.jsonl", jsonl([_line(i) for i in range(40)])), purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        await wait_batch(client, b.id, until=("in_progress",))
        await asyncio.sleep(0.2)
        assert (await client.batches.cancel(b.id)).status == "cancelling"
        b = await wait_batch(client, b.id)
        assert b.status == "cancelled" and b.cancelled_at is not None
        done, failed = b.request_counts.completed, b.request_counts.failed
        assert 1 <= done < 40 and done + failed == 40
        err = [json.loads(x) for x in (await client.files.content(b.error_file_id)).text.splitlines()]
        assert len(err) == failed and all(x["error"]["code"] == "batch_cancelled" for x in err)
        with pytest.raises(openai.ConflictError):
            f2 = await client.files.create(file=("one.jsonl", jsonl([_line(0)])), purpose="batch")
            b2 = await wait_batch(
                client,
                (
                    await client.batches.create(
                        input_file_id=f2.id, endpoint="/v1/chat/completions", completion_window="24h"
                    )
                ).id,
            )
            await client.batches.cancel(b2.id)  # completed: nothing to cancel

    asyncio.run(run())


class RefusingReplica(ScriptedReplica):
    """Refuses its first ``refusals`` requests as full (``queue_full``, as a replica whose batch
    share is taken), then answers."""

    def __init__(self, refusals: int):
        super().__init__(["Hello"])
        self.refusals = refusals

    def _stream(self, request):
        self.requests.append(request)
        if len(self.requests) <= self.refusals:
            return FakeGen(self._refused())
        return FakeGen(self._chunks())

    async def _refused(self):
        yield GenerationChunk.failed(GenerationError("queue_full", "batch work has its share", retry_after_s=0.05))


def test_batch_work_waits_for_local_capacity_and_never_goes_upstream():
    """With an upstream configured, a live request every replica refuses as full goes upstream;
    a batch job's refused request does not (a replica's batch share being full is routine): the
    batch retries it locally until a replica answers."""
    from starlette.responses import JSONResponse

    replica = RefusingReplica(refusals=3)
    gw = make_gateway(replica, api_keys=KEYS, upstream={"base_url": "http://127.0.0.1:9/v1"})
    forwarded = []

    async def forward(path, body, model, request_id):
        forwarded.append(body["messages"][0]["content"])
        return JSONResponse(
            {
                "id": "up",
                "object": "chat.completion",
                "created": 0,
                "model": "up",
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": "upstream"}, "finish_reason": "stop"}
                ],
            }
        )

    gw.upstream.forward = forward
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw/v1")
    client = openai.AsyncOpenAI(api_key="sk-a", base_url="http://gw/v1", http_client=http, max_retries=0)

    async def run():
        live = await client.chat.completions.create(model="fake", messages=[{"role": "user", "content": "live"}])
        f = await client.files.create(file=("in.jsonl", jsonl([_line(0)])), purpose="batch")
        b = await wait_batch(
            client,
            (
                await client.batches.create(
                    input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h"
                )
            ).id,
        )
        return live, b, (await client.files.content(b.output_file_id)).text

    live, b, out = asyncio.run(run())
    assert live.choices[0].message.content == "upstream" and forwarded == ["live"]  # only the live one went
    assert b.status == "completed" and b.request_counts.completed == 1
    assert json.loads(out)["response"]["body"]["choices"][0]["message"]["content"] == "Hello"
    assert len(replica.requests) == 4 and all(r.batch for r in replica.requests[1:])  # refused twice, then run


# ---- real engines ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def batch_app(tiny_llama_path):
    from local_app import LocalApp

    app = LocalApp(
        {
            "/": {
                "models": [
                    {
                        "model": str(tiny_llama_path),
                        "served_model_name": "tiny",
                        "max_model_len": 256,
                        "max_num_seqs": 2,
                        "torch_num_threads": 1,
                    }
                ],
                "api_keys": ["sk-live"],
                "response_cache": False,
                "batch_concurrency": 4,
            }
        }
    ).start()
    try:
        yield app.namespace()
    finally:
        app.stop()


def test_live_batch_beside_live_traffic(batch_app):
    """A batch of 8 long answers on a replica that runs 2 at a time, with live requests sent
    while it runs: the live ones are answered (batch work runs beside them at the lowest
    priority, preempted when they need its slot, never stopped), and the batch ends with every
    answer (those over the replica's batch share, max_batch_requests, retried)."""
    client = openai.OpenAI(api_key="sk-live", base_url=batch_app.base_url, max_retries=0)
    lines = [
        {
            "custom_id": f"j{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "tiny", "prompt": f"Story {i}:", "max_tokens": 48, "ignore_eos": True, "temperature": 0},
        }
        for i in range(8)
    ]
    f = client.files.create(file=("jobs.jsonl", jsonl(lines)), purpose="batch")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/completions", completion_window="24h")
    live = [client.completions.create(model="tiny", prompt=f"Live {i}:", max_tokens=8, temperature=0) for i in range(3)]
    assert all(r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 8 for r in live)
    deadline = time.monotonic() + 120
    while (b := client.batches.retrieve(b.id)).status not in ("completed", "failed"):
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    assert b.status == "completed" and b.request_counts.completed == 8 and b.error_file_id is None
    out = [json.loads(x) for x in client.files.content(b.output_file_id).text.splitlines()]
    assert [x["custom_id"] for x in out] == [f"j{i}" for i in range(8)]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 48 for x in out)
    # the same prompt answered live (greedy) gives the same text: batch work is the same work
    ref = client.completions.create(
        model="tiny", prompt="Story 3:", max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out[3]["response"]["body"]["choices"][0]["text"] == ref.choices[0].text


def test_run_batch_offline(tiny_llama_path, tmp_path):
    lines = [
        {
            "custom_id": f"o{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": "tiny",
                "messages": [{"role": "user", "content": f"hi {i}"}],
                "max_tokens": 6,
                "temperature": 0,
            },
        }
        for i in range(3)
    ]
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "other", "messages": [{"role": "user", "content": "x"}]},
        }
    )
    (tmp_path / "in.jsonl").write_bytes(jsonl(lines))
    cmd = [
        sys.executable,
        "-m",
        "kvserve.deployments.cli",
        "run-batch",
        "-i",
        str(tmp_path / "in.jsonl"),
        "-o",
        str(tmp_path / "out.jsonl"),
        "--model",
        str(tiny_llama_path),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "128",
        "--torch-num-threads",
        "1",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "3 of 4 requests answered, 1 failed" in p.stderr
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [x["custom_id"] for x in out] == ["o0", "o1", "o2", "bad"]
    assert [x["response"]["status_code"] for x in out] == [200, 200, 200, 404]
    assert all(x["response"]["body"]["usage"]["completion_tokens"] == 6 for x in out[:3])
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    p = subprocess.run([*cmd[:5], str(tmp_path / "bad.jsonl"), *cmd[6:]], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "not a valid batch" in p.stderr
