"""CORS defaults of the gateway's gate (gate.py), through the built app in-process: an open server
(no API keys) sends no CORS headers unless origins are configured, so no web page can read its
answers; with keys, any origin (a page must still know a key); an explicit list is kept as given."""

import httpx
from gateway_fakes import FakeReplica, _run, make_gateway

from kvserve.deployments.gateway.api import build_api

ORIGIN = "https://evil.example"


def _cors(**settings):
    app = build_api(make_gateway(FakeReplica(), **settings))

    async def main():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as c:
            pre = await c.options("/v1/models", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "GET"})
            get = await c.get("/v1/models", headers={"Origin": ORIGIN, "authorization": "Bearer sk-cors-key"})
            return pre.headers.get("access-control-allow-origin"), get.headers.get("access-control-allow-origin")

    return _run(main())


def test_an_open_server_allows_no_origin_by_default():
    assert _cors() == (None, None)


def test_with_keys_any_origin_by_default_and_configured_origins_as_given():
    assert _cors(api_keys=["sk-cors-key"]) == ("*", "*")
    assert _cors(allowed_origins=["https://app.example"]) == (None, None)  # not that page's origin
    assert _cors(allowed_origins=[ORIGIN]) == (ORIGIN, ORIGIN)
    assert _cors(api_keys=["sk-cors-key"], allowed_origins=[]) == (None, None)
