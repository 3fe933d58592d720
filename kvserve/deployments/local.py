"""kvserve in this process, without Ray: the gateway's HTTP app over in-process
:class:`~kvserve.deployments.replica.llm_server.LLMServer` replicas (real engines), reached through
:class:`LocalHandle`, which stands in for Serve's ``DeploymentHandle`` and pickles each call's
arguments and answers as Ray's hop does. ``kvserve run-batch`` runs a batch file through it
(:func:`run_batch`); the tests serve it over HTTP (tests/local_app.py)."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
from pathlib import Path

from kvserve.deployments.app import gateway_options
from kvserve.deployments.args import AppArgs
from kvserve.deployments.gateway.api import build_api
from kvserve.deployments.gateway.batch_lines import BatchLineRunner, parse_batch
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.replica.llm_server import LLMServer


def _hop(value):
    """``value`` after a round trip through pickle (what crosses Ray's hop is serialized: a
    request or chunk that does not pickle fails here as it would there)."""
    return pickle.loads(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


class LocalStream:
    """What ``handle.options(stream=True).<method>.remote(...)`` gives, for an in-process replica:
    an async iterator of the replica's items, produced by a task of its own (as a replica
    produces independently of its caller), with ``cancel()`` (the task is cancelled, so the
    replica's generator sees a ``CancelledError`` as under Serve)."""

    def __init__(self, agen):
        self._queue: asyncio.Queue = asyncio.Queue()
        self._task = asyncio.get_running_loop().create_task(self._pump(agen))

    async def _pump(self, agen) -> None:
        try:
            async for item in agen:
                await self._queue.put(("item", _hop(item)))
            await self._queue.put(("end", None))
        except asyncio.CancelledError:
            await self._queue.put(("error", asyncio.CancelledError()))
            raise
        except Exception as e:  # the replica's failure reaches the caller, as Serve re-raises it
            await self._queue.put(("error", e))

    def __aiter__(self):
        return self

    async def __anext__(self):
        kind, value = await self._queue.get()
        if kind == "item":
            return value
        if kind == "end":
            raise StopAsyncIteration
        raise value

    def cancel(self) -> None:
        self._task.cancel()


class LocalResponse:
    """What ``handle.<method>.remote(...)`` gives, for an in-process replica: awaitable in the
    app's event loop, or ``result()`` from another thread (as a ``DeploymentResponse``)."""

    def __init__(self, fn, args, kwargs, loop: asyncio.AbstractEventLoop):
        self._fn, self._args, self._kwargs, self._loop = fn, args, kwargs, loop

    async def _run(self):
        out = self._fn(*self._args, **self._kwargs)
        if asyncio.iscoroutine(out):
            out = await out
        return _hop(out)

    def __await__(self):
        return self._run().__await__()

    def result(self, timeout_s: float | None = None):
        """The answer, waited for from a thread other than the app's (seconds; None: no limit).

        Raises:
            TimeoutError: no answer within ``timeout_s``; whatever the replica's method raised.
        """
        return asyncio.run_coroutine_threadsafe(self._run(), self._loop).result(timeout_s)


class LocalHandle:
    """A ``DeploymentHandle`` stand-in over one in-process deployment instance (``LLMServer``):
    ``handle.<method>.remote(*args, **kwargs)``, ``handle.options(stream=True)``; other options
    (``multiplexed_model_id``) are accepted and ignored."""

    def __init__(self, instance, loop: asyncio.AbstractEventLoop, stream: bool = False):
        self._instance, self._loop, self._stream = instance, loop, stream

    def options(self, *, stream: bool | None = None, **_) -> "LocalHandle":
        return LocalHandle(self._instance, self._loop, self._stream if stream is None else stream)

    def __getattr__(self, method: str):
        fn = getattr(self._instance, method)
        handle = self

        class _Method:
            @staticmethod
            def remote(*args, **kwargs):
                args, kwargs = _hop((args, kwargs))
                if handle._stream:
                    return LocalStream(fn(*args, **kwargs))
                return LocalResponse(fn, args, kwargs, handle._loop)

        return _Method


def build_local(apps: dict[str, AppArgs], loop: asyncio.AbstractEventLoop) -> tuple[dict, dict, dict]:
    """The gateways' HTTP apps of ``apps`` (route prefix -> app args) over in-process replicas,
    built as ``build_app`` builds them (one ``LLMServer`` per model, or per variant of an A/B
    test); a model two apps name with the same settings is loaded once.

    Returns:
        ``(apps, servers, handles)``: prefix -> FastAPI app; deployment key -> ``LLMServer``;
        deployment key -> :class:`LocalHandle`.

    Raises:
        ValueError: an app names an embedding model (``serve.batch`` needs a Serve replica), or
            a model another app names with other settings.
    """
    servers, handles, loaded, out = {}, {}, {}, {}

    def handle(m) -> LocalHandle:
        key = m.deployment_key
        if key in servers and loaded[key] != m:
            raise ValueError(f"model {key!r} is named twice with different settings")
        if key not in servers:
            servers[key], loaded[key] = LLMServer.func_or_class(m, tracing), m
            handles[key] = LocalHandle(servers[key], loop)
        return handles[key]

    for prefix, args in apps.items():
        tracing = args.tracing
        if args.embeddings.embedding_model is not None:
            raise ValueError("in-process apps serve no embedding model (serve.batch needs a Serve replica)")
        models, variants = {}, {}
        for d in args.deployments():
            models.setdefault(d.name, handle(d))
            if d.variant is not None:
                variants.setdefault(d.name, {})[d.variant] = handle(d)
        out[prefix] = build_api(Gateway(models, variants=variants, **gateway_options(args)))
    return out, servers, handles


async def run_batch(args: AppArgs, input_path: str, output_path: str, concurrency: int = 16) -> dict[str, int]:
    """vLLM's ``run-batch``: every request of the batch file ``input_path`` (OpenAI's batch
    JSONL, :func:`~kvserve.deployments.gateway.batch_lines.parse_batch`) through the gateway's app over
    in-process replicas of ``args``' models (no Ray, no API keys), ``concurrency`` at once; one
    output line per request in input order (OpenAI's batch output lines, answers and errors
    alike) written to ``output_path`` (``-``: stdout). Returns the counts ``total``,
    ``completed``, ``failed`` and ``seconds``.

    Raises:
        OpenAIError: an invalid input file (its ``errors`` list the lines).
        ValueError: see :func:`build_local`.
    """
    requests = parse_batch(Path(input_path).read_bytes())
    args = args.model_copy(
        update={"gateway": args.gateway.model_copy(update={"api_keys": None, "admin_api_keys": None})}
    )
    apps, servers, _ = build_local({"/": args}, asyncio.get_running_loop())
    lines: list = [None] * len(requests)
    counts = {"total": len(requests), "completed": 0, "failed": 0}
    t0 = time.monotonic()

    def done(i: int, line: dict, ok: bool) -> None:
        lines[i] = line
        counts["completed" if ok else "failed"] += 1

    try:
        await BatchLineRunner(apps["/"], {}, concurrency).run(requests, done)
    finally:
        for server in servers.values():
            await server.engine.shutdown()
    text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    if output_path == "-":
        print(text, end="")
    else:
        Path(output_path).write_text(text, encoding="utf-8")
    return {**counts, "seconds": round(time.monotonic() - t0, 3)}
