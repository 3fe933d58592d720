"""The gateway in-process, its gate: API keys guard every route but the probes (over the built
app's real route table, each body bounded too), a path no route serves is closed as well, and a
replica's placement is shown to admin keys only. A fake replica (no Ray, no Serve, no engine)
behind httpx's ASGI transport."""

import json
import re

import httpx
from gateway_fakes import FakeReplica, _client, _run, make_gateway

from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.gate import FILE_ENVELOPE_BYTES, FILES_PATH


def test_keys_guard_the_api_but_not_the_probes():
    async def main():
        async with _client(FakeReplica(), api_keys=["sk-test-key-1"]) as c:
            return (
                await c.get("/v1/models"),
                await c.get("/v1/models", headers={"authorization": "Bearer sk-test-key-1"}),
                await c.get("/health"),
            )

    denied, models, health = _run(main())
    assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"
    assert models.status_code == 200
    [card] = models.json()["data"]
    assert card["id"] == "fake" and card["max_model_len"] == 128  # from the model's card
    assert health.status_code == 200 and health.json()["models"] == ["fake"]


PROBES = {"/health", "/ready", "/metrics"}


def _route_table(app) -> list[tuple[str, str, bool]]:
    """``(method, path, takes a body)`` for every route of the built app, path parameters
    filled with ``x``. Every entry must be a plain route: a mount or websocket added later
    fails here instead of escaping the walk."""
    from fastapi.routing import APIRoute
    from starlette.routing import Route

    table = []
    for r in app.routes:
        assert isinstance(r, Route), f"not an HTTP route, the gate test cannot walk it: {r!r}"
        path = re.sub(r"\{[^}]*\}", "x", r.path)
        body = isinstance(r, APIRoute) and r.body_field is not None
        table += [(m, path, body) for m in sorted(r.methods or ())]
    return table


def test_every_route_but_the_probes_needs_a_key_and_every_body_is_bounded():
    """Deny by default, over the real route table of the built app: each route (each method)
    without a key is a 401 unless it is a probe; each route that takes a body refuses an
    oversized one (413) even with a valid key (a file upload past ``max_file_bytes`` and its
    multipart envelope)."""
    key, limit = "sk-test-key-1", 1024
    gw = make_gateway(
        FakeReplica(),
        api_keys=[key],
        max_request_body_bytes=limit,
        max_file_bytes=limit,
        auth_failures_per_minute=10_000,
    )
    app = build_api(gw)
    table = _route_table(app)
    paths = {p for _, p, _ in table}
    assert {"/tokenize", "/detokenize", "/v1/chat/completions", "/v1/load_lora_adapter", "/openapi.json"} <= paths
    assert PROBES <= paths
    with_body = [(m, p) for m, p, b in table if b]
    assert ("POST", "/tokenize") in with_body and ("POST", "/v1/chat/completions") in with_body

    async def main():
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)  # a handler's failure: a 500
        async with httpx.AsyncClient(transport=transport, base_url="http://gw") as c:
            keyless = {(m, p): (await c.request(m, p, json={} if b else None)).status_code for m, p, b in table}
            big = {
                (m, p): await c.request(
                    m,
                    p,
                    content=b"{" + b" " * (limit + FILE_ENVELOPE_BYTES * (p == FILES_PATH)) + b"}",
                    headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
                )
                for m, p in with_body
            }
            return keyless, big

    keyless, big = _run(main())
    open_ = {mp: st for mp, st in keyless.items() if st != 401}
    assert set(open_) == {(m, p) for m, p, _ in table if p in PROBES}, open_
    # the probes reach their handlers (/metrics needs a Ray session or $KVSERVE_METRICS_DIR to render)
    assert open_[("GET", "/health")] == open_[("GET", "/ready")] == 200, open_
    assert {mp: r.status_code for mp, r in big.items()} == {mp: 413 for mp in with_body}
    # Anthropic's Messages API answers in Anthropic's shape (error.type), the rest in OpenAI's (error.code)
    assert all(
        r.json()["error"]["type" if p.startswith("/v1/messages") else "code"] == "request_too_large"
        for (_, p), r in big.items()
    )


def test_a_path_outside_the_route_table_is_closed_too():
    """A path no route serves (a route someone adds later) is a 401 without a key, not a 404."""

    async def main():
        async with _client(FakeReplica(), api_keys=["sk-test-key-1"]) as c:
            return (
                await c.post("/admin/new", json={}),
                await c.get("/health/"),
                await c.post("/new", headers={"authorization": "Bearer sk-test-key-1"}),
            )

    keyless, near_probe, keyed = _run(main())
    assert keyless.status_code == 401 and near_probe.status_code == 401
    assert keyed.status_code == 404


def test_replica_placement_is_shown_to_admin_keys_only(monkeypatch):
    """``/v1/models`` names each replica's node for an admin key; an API key, and anyone when
    no key is configured, sees vLLM's plain cards."""
    from kvserve.deployments.gateway import models

    where = [{"replica_id": "r1", "node_id": "n" * 56, "node_ip": "10.1.2.3", "state": "RUNNING"}]

    async def placement():
        return {("kvserve", "LLMServer"): where}

    monkeypatch.setattr(models, "replica_placement", placement)
    replica = FakeReplica()
    replica.app_name, replica.deployment_name = "kvserve", "LLMServer"

    async def cards(headers=None, **settings):
        async with _client(replica, **settings) as c:
            r = await c.get("/v1/models", headers=headers or {})
            assert r.status_code == 200, r.text
            one = await c.get("/v1/models/fake", headers=headers or {})
            return r.json()["data"][0], one.json()

    keys = dict(api_keys=["sk-user-key-1"], admin_api_keys=["sk-admin-key-1"])
    admin, admin_one = _run(cards({"authorization": "Bearer sk-admin-key-1"}, **keys))
    user, user_one = _run(cards({"authorization": "Bearer sk-user-key-1"}, **keys))
    open_, _ = _run(cards())  # no keys at all: nobody is an admin
    wrong, _ = _run(cards({"authorization": "Bearer sk-admin-key-1"}))  # an admin key where none is configured
    assert admin["replicas"] == where
    for card in (user, user_one, admin_one, open_, wrong):
        assert "replicas" not in card and "10.1.2.3" not in json.dumps(card)
        assert card["id"] == "fake" and card["max_model_len"] == 128
