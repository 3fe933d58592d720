"""Batches that outlive their ingress replica (kvserve/deployments/gateway/batches.py; issue 63): on
a real Redis, an ingress replica (a process of its own here) runs a batch and is killed
(SIGKILL) mid-way; another ingress replica claims the batch once its lease ran out and goes on
from its last progress: every line in the output once, in order, and the lines the dead
replica had written are not run again. The gateways over scripted replicas (no Ray, no engine)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import openai
import pytest
from gateway_fakes import ScriptedReplica, make_gateway
from redis_helpers import own_redis  # noqa: F401  (the fixture)

from kvserve.deployments.gateway.api import build_api

pytestmark = pytest.mark.timeout(120)

KEY = "sk-resume-1"
HERE = Path(__file__).resolve().parent

# Ingress replica A: answers the first 3 lines, holds the rest forever; writes its progress at
# every line (PROGRESS_S 0) under a 1 s lease; prints the batch id once it runs.
FIRST_REPLICA = textwrap.dedent("""
    import asyncio, json, sys
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from gateway_fakes import ScriptedReplica, make_gateway
    from kvserve.deployments.gateway import batches
    from kvserve.deployments.gateway.api import build_api
    import httpx, openai

    batches.PROGRESS_S = 0.0

    class ThreeThenHold(ScriptedReplica):
        async def _chunks(self):
            if len(self.requests) > 3:
                await asyncio.Event().wait()
            async for c in super()._chunks():
                yield c

    async def main():
        gw = make_gateway(ThreeThenHold(["Hello"]), api_keys=[sys.argv[4] + " name=t"], cache_backend="redis",
                          redis_url=sys.argv[1], batch_concurrency=4)
        gw.batches.lease_s = 1.0
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw/v1")
        client = openai.AsyncOpenAI(api_key=sys.argv[4], base_url="http://gw/v1", http_client=http, max_retries=0)
        lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "fake", "messages": [{"role": "user", "content": f"q{i}"}]}} for i in range(10)]
        f = await client.files.create(file=("in.jsonl", "".join(json.dumps(x) + "\\n" for x in lines).encode()),
                                      purpose="batch")
        b = await client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        print(json.dumps({"batch": b.id}), flush=True)
        await asyncio.Event().wait()

    asyncio.run(main())
""")


def test_a_batch_goes_on_in_another_ingress_replica_after_a_crash(own_redis):
    a = subprocess.Popen(
        [sys.executable, "-c", FIRST_REPLICA, own_redis.url, str(HERE), str(HERE.parent), KEY],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        batch_id = json.loads(a.stdout.readline())["batch"]
        replica = ScriptedReplica(["Hello"])
        gw = make_gateway(replica, api_keys=[f"{KEY} name=t"], cache_backend="redis", redis_url=own_redis.url)
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=build_api(gw)), base_url="http://gw/v1")
        client = openai.AsyncOpenAI(api_key=KEY, base_url="http://gw/v1", http_client=http, max_retries=0)

        async def run():
            while (b := await client.batches.retrieve(batch_id)).request_counts.completed < 3:  # A's progress
                assert a.poll() is None
                await asyncio.sleep(0.02)
            a.kill()  # the ingress replica dies mid-batch: no final write, its lease left to run out
            a.wait()
            resumed = []
            while not resumed:  # until the dead replica's lease expires
                resumed = await gw.batches.sweep()
                await asyncio.sleep(0.05)
            while (b := await client.batches.retrieve(batch_id)).status not in ("completed", "failed"):
                await asyncio.sleep(0.02)
            return b, resumed, [json.loads(x) for x in (await client.files.content(b.output_file_id)).text.splitlines()]

        b, resumed, out = asyncio.run(run())
    finally:
        a.kill()
        a.wait()
    assert resumed == [batch_id]
    assert b.status == "completed" and b.request_counts.model_dump() == {"total": 10, "completed": 10, "failed": 0}
    assert [x["custom_id"] for x in out] == [f"req-{i}" for i in range(10)]  # each line once, in order
    # the lines A had written were not run again here
    ran_here = {r.messages[-1]["content"] for r in replica.requests}
    assert ran_here <= {f"q{i}" for i in range(3, 10)} and len(replica.requests) == len(ran_here)
