"""What only the live app shows of the OpenAI API: the gateway's warnings in the Serve replica's
log, and a client that goes away mid-stream through Serve's proxy (the abort crosses Ray's hop and
nothing logs a failure). The API itself, with a real model and real clients (the openai SDK,
langchain-openai), is tests/deployments/test_openai_clients.py, in process."""

import time
from pathlib import Path

import pytest
from helpers import HTTP

from tests.deployments.openai_client_helpers import PARIS, post

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _ingress_logs() -> str:
    """The text of this Ray session's OpenAIIngress replica logs."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return "\n".join(f.read_text(errors="replace") for f in logs.glob("replica_kvserve_OpenAIIngress_*.log"))


def _replica_logs() -> dict[str, str]:
    """This session's kvserve replica logs (ingress and LLM servers), by file."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    return {str(f): f.read_text(errors="replace") for f in logs.glob("replica_kvserve_*.log")}


def test_unknown_fields_warn_once_per_field(serve_app):
    field = f"kvserve_test_field_{int(time.time())}"
    for _ in range(3):
        r = post(serve_app, "/chat/completions", {"messages": PARIS, "max_tokens": 2, field: 1})
        assert r.status_code == 200
    deadline = time.time() + 10
    while time.time() < deadline and field not in _ingress_logs():
        time.sleep(0.5)
    lines = [ln for ln in _ingress_logs().splitlines() if field in ln]
    assert len(lines) == 1 and "ignoring unknown request field" in lines[0], lines


def test_client_disconnect_logs_no_traceback(serve_app):
    """A client that goes away mid-stream is an INFO line: the abort worked, nothing failed."""
    before = _replica_logs()
    with HTTP.stream(
        "POST",
        f"{serve_app.base_url}/chat/completions",
        timeout=120,
        json={"messages": PARIS, "max_tokens": 400, "ignore_eos": True, "stream": True},
    ) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 4:
                break
    deadline = time.time() + 10
    while time.time() < deadline and serve_app.llm.get_stats.remote().result()["num_running_requests"]:
        time.sleep(0.2)
    time.sleep(1.0)
    new = "".join(text[len(before.get(path, "")) :] for path, text in _replica_logs().items())
    assert "disconnected" in new, new[-2000:]
    assert "Traceback" not in new and " ERROR " not in new, new[-3000:]
