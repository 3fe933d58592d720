"""The wrong-key throttle through the live app over HTTP (Serve's proxy, real sockets from distinct
loopback addresses): wrong keys from a shared address (a load balancer's) never lock out valid
keys, its own or another tenant's; wrong keys are still throttled; an X-Forwarded-For from a peer
that is not a trusted proxy counts nothing; behind the trusted proxy each client counts alone.
One app start: the tiny model with two tenants' keys and a trusted proxy (127.0.0.5)."""

import httpx
import pytest

pytestmark = pytest.mark.slow

KEYS = ["sk-throttle-tenant-a name=a", "sk-throttle-tenant-b name=b"]
PROXY = "127.0.0.5"


@pytest.fixture(scope="module")
def throttle_app(serve_app, tiny_llama_path):
    # on the session's Serve (tests/e2e/conftest.py): Serve has one HTTP proxy, and a second
    # serve.start with another port is ignored once it runs
    from ray import serve

    from kvserve.deployments.app import build_app

    app = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-throttle",
            "max_num_seqs": 2,
            "max_model_len": 128,
            "torch_num_threads": 1,
            "replica_cpus": 0.25,
            "ingress_cpus": 0.25,
            "num_replicas": 1,
            "api_keys": KEYS,
            "auth_failures_per_minute": 20,
            "forwarded_allow_ips": [PROXY],
        }
    )
    serve.run(app, name="kvserve-throttle", route_prefix="/throttle")
    yield f"{serve_app.root}/throttle/v1/models"
    serve.delete("kvserve-throttle")


def _codes(url: str, peer: str, keys: list[str], xff: str | None = None) -> list[int]:
    with httpx.Client(transport=httpx.HTTPTransport(local_address=peer), timeout=60) as c:
        return [
            c.get(
                url, headers={"Authorization": f"Bearer {k}", **({"X-Forwarded-For": xff} if xff else {})}
            ).status_code
            for k in keys
        ]


def test_a_shared_address_throttles_wrong_keys_only(throttle_app):
    lb = "127.0.0.3"
    assert _codes(throttle_app, lb, [f"sk-wrong-{i}" for i in range(25)]) == [401] * 20 + [429] * 5
    assert _codes(throttle_app, lb, ["sk-throttle-tenant-a", "sk-throttle-tenant-b"]) == [200, 200]
    assert _codes(throttle_app, "127.0.0.1", ["sk-throttle-tenant-b"]) == [200]


def test_forwarded_for_counts_only_from_the_trusted_proxy(throttle_app):
    # an untrusted peer's header is ignored: 21 wrong keys, each claiming another client, count to the peer
    spoof = [_codes(throttle_app, "127.0.0.4", [f"sk-wrong-{i}"], f"192.0.2.{i}")[0] for i in range(21)]
    assert spoof == [401] * 20 + [429]
    # behind the trusted proxy: the client it names is throttled, the proxy's next client is not
    assert _codes(throttle_app, PROXY, [f"sk-wrong-{i}" for i in range(21)], "6.6.6.6, 198.51.100.7") == [401] * 20 + [
        429
    ]
    assert _codes(throttle_app, PROXY, ["sk-wrong-x"], "198.51.100.8") == [401]
    assert _codes(throttle_app, PROXY, ["sk-throttle-tenant-a"], "198.51.100.7") == [200]
