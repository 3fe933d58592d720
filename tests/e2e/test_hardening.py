"""The hardening issue through a real Serve app: auth before the body, body and prompt
limits, non-ASCII keys, poison sampling values that must fail alone, error bodies without
internals. (A killed tensor-parallel worker making its replica unhealthy at once is
``tests/e2e/test_faults.py::test_killed_tp_worker_mid_stream``, which kills one anyway.)"""

import asyncio
import json
import socket
import time

import httpx
from helpers import HTTP
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

PARIS = [{"role": "user", "content": "What is the capital of France?"}]


def _raw_post(
    port: int, path: str, headers: dict[str, str], body: bytes = b"", wait_s: float = 10.0
) -> tuple[int, dict]:
    """Send request headers (and maybe part of a body) on a raw socket; return the status and
    JSON body the server answers with, without ever sending the rest of the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=wait_s) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        s.sendall(head.encode() + b"\r\n" + body)
        data = b""
        while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    status = int(data.split(b" ", 2)[1])
    return status, json.loads(data.split(b"\r\n\r\n", 1)[1] or b"{}")


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return int(line.split(b":", 1)[1])
    return 1


def test_auth_is_checked_before_the_body_is_read(serve_app):
    """A client without a key announces a 100 MB body and sends none of it: the answer is
    an immediate 401, so the server never waited for (or parsed) the body."""
    t0 = time.time()
    status, body = _raw_post(
        serve_app.port, "/auth/v1/completions", {"Content-Type": "application/json", "Content-Length": str(100 << 20)}
    )
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert time.time() - t0 < 10


def test_body_size_limit(serve_app):
    # announced too large: 413 at once, body never read
    status, body = _raw_post(
        serve_app.port, "/v1/completions", {"Content-Type": "application/json", "Content-Length": str(100 << 20)}
    )
    assert status == 413 and body["error"]["code"] == "request_too_large"

    # no length (chunked): reading stops at the limit
    def chunks():
        yield b'{"prompt": "'
        for _ in range(80):
            yield b"a" * 65536  # 5 MiB in all, over the 4 MiB default
        yield b'", "max_tokens": 1}'

    r = HTTP.post(
        f"{serve_app.base_url}/completions", content=chunks(), timeout=60, headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "request_too_large"
    # the same server still answers a normal request
    r = HTTP.post(
        f"{serve_app.base_url}/completions",
        timeout=60,
        json={"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0},
    )
    assert r.status_code == 200


def test_too_many_prompts(serve_app):
    r = HTTP.post(
        f"{serve_app.base_url}/completions", timeout=60, json={"model": "tiny", "prompt": ["hi"] * 65, "max_tokens": 1}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_many_prompts"
    r = HTTP.post(
        f"{serve_app.base_url}/completions", timeout=60, json={"model": "tiny", "prompt": ["hi"] * 8, "max_tokens": 1}
    )
    assert r.status_code == 200 and len(r.json()["choices"]) == 8


@pytest.mark.parametrize("value", ["Bearer ключ", "Bearer \u00ff\u00fe", "Bäärer x", "Bearer"])
def test_non_ascii_or_malformed_authorization_is_401(serve_app, value):
    r = HTTP.post(
        f"{serve_app.auth_base_url}/completions",
        json={"prompt": "hi", "max_tokens": 1},
        headers={"Authorization": value.encode("utf-8")},
        timeout=30,
    )
    assert r.status_code == 401, r.text
    assert r.json()["error"]["code"] == "invalid_api_key"


def test_models_list_shows_served_names_only(serve_app, smollm2_path):
    r = HTTP.get(f"{serve_app.base_url}/models", timeout=30)
    assert r.status_code == 200
    assert str(smollm2_path) not in r.text and "/root" not in r.text and "/tmp" not in r.text
    cards = {m["id"]: m for m in r.json()["data"]}
    assert cards[serve_app.model]["root"] == serve_app.model
    assert cards[serve_app.model]["max_model_len"] == 1024


POISON = [
    {"seed": 2**64},
    {"seed": -(2**63) - 1},
    {"top_k": 2**64},
    {"top_p": 1e-300, "temperature": 1.0},
    {"stop_token_ids": [10**7], "min_tokens": 2},
    {"temperature": float("inf")},
]


def test_poison_requests_fail_alone(serve_app):
    """Innocent streams run while poison values arrive; every poison request is a 400 naming
    its field (or completes, if the engine can honour it) and every innocent stream finishes."""
    url = f"{serve_app.base_url}/completions"

    async def innocent(client, i):
        r = await client.post(
            url, json={"prompt": f"Count to ten: {i},", "max_tokens": 24, "ignore_eos": True, "temperature": 0}
        )
        return r.status_code, r.json()

    async def poison(client, extra):
        body = json.dumps({"prompt": "hello", "max_tokens": 4, **extra}).replace("Infinity", "1e999")
        r = await client.post(url, content=body, headers={"Content-Type": "application/json"})
        return r.status_code, r.json(), extra

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [innocent(client, i) for i in range(8)]
            await asyncio.sleep(0)
            return await asyncio.gather(*tasks, *(poison(client, p) for p in POISON))

    results = asyncio.run(run())
    for status, body in results[:8]:
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 24
    for status, body, extra in results[8:]:
        if status == 200:  # accepted: then it really ran
            assert body["choices"][0]["finish_reason"] in ("stop", "length"), (extra, body)
        else:
            assert status == 400, (extra, body)
            field = next(iter(extra)) if "stop_token_ids" not in extra else "stop_token_ids"
            assert field in body["error"]["message"], (extra, body)
    s = serve_app.llm.get_stats.remote().result()
    assert s["num_running_requests"] == 0 and s["free_kv_blocks"] == s["num_kv_blocks"]


def test_chat_logprobs_non_streaming(serve_app):
    """(Was a 500: a helper defined below the ingress class did not exist in the running app.)"""
    r = HTTP.post(
        f"{serve_app.base_url}/chat/completions",
        timeout=120,
        json={"messages": PARIS, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2},
    )
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == r.json()["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)
