"""Python handles (in-process and from a separate Ray driver), and the docs' examples run as
written (only the port differs)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


def test_handle_stream_in_process(serve_app):
    import asyncio

    from ray import serve

    async def run():
        gen = serve_app.llm.options(stream=True).generate.remote(
            "The capital of France is", {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
        )
        return [item async for item in gen]

    from kvserve.deployments.contract.types import GenerationChunk

    items = asyncio.run(run())
    assert all(isinstance(i, GenerationChunk) for i in items)  # the typed server -> caller contract
    assert len(items) == 6 and items[-1].finished and items[-1].finish_reason == "length"
    assert items[0].num_prompt_tokens > 0 and all(len(i.token_ids) == 1 for i in items)
    assert not any(i.finished for i in items[:-1]) and all(i.error is None for i in items)
    full = serve_app.llm.complete.remote(
        "The capital of France is", {"max_tokens": 6, "temperature": 0, "ignore_eos": True}
    ).result()
    assert full.text == "".join(i.text for i in items) and full.num_output_tokens == 6 and full.finished

    from kvserve.deployments.contract.types import GenerateRequest

    with pytest.raises(ValueError, match="temperature"):  # validated where the request is built
        GenerateRequest.of("x", {"temperature": 9})

    async def errors():  # what the gateway sees for input that cannot run: a typed error chunk, no exception
        out = []
        for req in (
            GenerateRequest.of("word " * 2000, {"max_tokens": 1}),
            GenerateRequest.of([10**9], {"max_tokens": 1}),
        ):
            gen = serve_app.llm.options(stream=True).stream.remote(req)
            out.append([c async for c in gen])
        return out

    (long,), (bad,) = asyncio.run(errors())
    assert long.finished and long.error.code == "context_length_exceeded" and long.error.status == 400
    assert bad.error.code == "invalid_value" and bad.error.status == 400

    # through the application's ingress handle, and by model name
    app = serve.get_app_handle("kvserve")

    async def run_app():
        gen = app.options(stream=True).generate.remote("hello", {"max_tokens": 3, "ignore_eos": True}, model="tiny")
        return [item async for item in gen]

    assert len(asyncio.run(run_app())) == 3
    # bad input raises ValueError through the handle
    with pytest.raises(ValueError):
        serve_app.llm.complete.remote("x", {"temperature": 9}).result()


def doc_blocks() -> dict[str, tuple[str, str]]:
    """``{name: (language, code)}`` of the fenced blocks marked ``<!-- test: name -->`` in the
    README and the docs (a block in both: the same example)."""
    blocks = {}
    for path in (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))):
        for m in re.finditer(r"<!-- test: ([\w-]+) -->\s*```(\w+)\n(.*?)```", path.read_text(), re.S):
            blocks[m.group(1)] = (m.group(2), m.group(3))
    assert blocks, "no tested examples found in README.md or docs/"
    return blocks


def _run(lang: str, code: str, serve_app, ray_session, timeout=180) -> str:
    code = code.replace("http://127.0.0.1:8000", serve_app.root)
    env = dict(os.environ, RAY_ADDRESS=ray_session.address, PYTHONPATH=str(ROOT))
    for k in list(env):  # a plain driver, as a user would run it (no Serve fast-path settings)
        if k.startswith("RAY_SERVE_"):
            del env[k]
    if lang == "python":
        cmd = [sys.executable, "-c", code]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    assert p.returncode == 0, f"{lang} example failed:\n{code}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr[-3000:]}"
    return p.stdout


def test_docs_curl_examples(serve_app, ray_session):
    blocks = doc_blocks()
    out = _run(*blocks["curl-chat"], serve_app, ray_session)
    assert "Paris" in out
    out = _run(*blocks["curl-stream"], serve_app, ray_session)
    assert "data: [DONE]" in out


def test_docs_openai_sdk_example(serve_app, ray_session):
    out = _run(*doc_blocks()["openai-sdk"], serve_app, ray_session)
    assert "Paris" in out


def test_docs_python_handle_example_from_another_driver(serve_app, ray_session):
    """A separate Ray driver (a new process joining the cluster) streams tokens through a handle."""
    out = _run(*doc_blocks()["python-handle"], serve_app, ray_session)
    assert "Paris" in out
    assert out.count("\n") >= 2
