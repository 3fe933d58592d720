"""``kvserve warm`` replays only what the gateway admitted, under the limits of the key that sent
it (request_log.py, warm.py, the gateway's warm header): a request its key's limit refused (429)
or the gate refused is not in the request log, and a replay of an admitted one is admitted under
its key's own limits, not the admin key's (none). In-process: the real gateway app over a fake
replica, the real request log and warm's replay through httpx's ASGI transport."""

import asyncio

import httpx
from gateway_fakes import FakeReplica, make_gateway

from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.operator.warm import plan, read_log, replay

ADMIN = "sk-warm-admin"
TENANT = "sk-warm-tenant"


def test_warm_replays_only_admitted_requests_under_their_own_keys_limits(tmp_path):
    gw = make_gateway(
        FakeReplica(),
        api_keys=[f"{TENANT} name=tenant rpm=1"],
        admin_api_keys=[ADMIN],
        request_log_dir=str(tmp_path),
        request_log_prompts="store",
    )
    app = build_api(gw)
    transport = httpx.ASGITransport(app=app)
    body = {"model": "fake", "prompt": "hi", "max_tokens": 2, "temperature": 0.0}

    async def main():
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            tenant = {"authorization": f"Bearer {TENANT}"}
            first = await c.post("/v1/completions", json=body, headers=tenant)
            refused = await c.post("/v1/completions", json={**body, "prompt": "refused"}, headers=tenant)
            wrong = await c.post(
                "/v1/completions", json={**body, "prompt": "no key"}, headers={"authorization": "Bearer sk-wrong"}
            )
        return first, refused, wrong

    first, refused, wrong = asyncio.run(main())
    assert first.status_code == 200 and refused.status_code == 429 and wrong.status_code == 401
    gw.request_log.close()
    lines = read_log(str(tmp_path))
    assert [(d["body"]["prompt"], d["admitted"], d["key"]) for d in lines] == [("hi", True, "tenant")]
    # a line of an older log (no "admitted": it may have been refused) is never replayed
    old = {k: v for k, v in lines[0].items() if k not in ("admitted", "key")}
    p = plan(lines + [{**old, "fingerprint": "old", "body": {**body, "prompt": "old"}}], min_count=1)
    assert p.requests == [("completion", lines[0]["body"])] and p.keys == ["tenant"]
    # the replay runs under the tenant's limit (1 request per minute, spent): refused, not run as the admin
    out = asyncio.run(replay(p, "http://gw", ADMIN, rate=0, retries=0, transport=transport))
    assert out["failed"] == 1 and out["warmed"] == 0, out
