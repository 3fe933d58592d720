"""A kvserve application in this process, over real HTTP, without Ray: the gateway's HTTP app
(:func:`deployments.gateway.api.build_api` over a :class:`~deployments.gateway.core.Gateway` built
as ``build_app`` builds it) served by uvicorn on 127.0.0.1 in a thread of its own, in front of real
:class:`~deployments.replica.llm_server.LLMServer` replicas (real engines and models) reached
through :class:`LocalHandle`, which pickles each call's arguments and answers as Ray's hop does.

For the tests of what the OpenAI API does with a real model and real clients (the openai SDK,
langchain-openai: tests/deployments/test_openai_clients.py); the live Serve apps of tests/e2e prove
the wiring (Serve's proxy, handles, routers, replicas in Ray workers)."""
from __future__ import annotations

import asyncio
import pickle
import threading
import time
from types import SimpleNamespace

from helpers import free_port

#: Seconds to wait for the server to listen, or to stop.
START_TIMEOUT_S = 60.0


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


class LocalApp:
    """kvserve applications in this process (see the module docstring), started by :meth:`start`
    and stopped by :meth:`stop`.

    Args:
        apps: route prefix (``"/"``, ``"/auth"``) -> the application's args (what ``build_app``
            takes: ``models``, ``api_keys``, ...). A model that two applications name with the
            same settings is loaded once and shared. No embedding model: ``EmbeddingServer``
            batches with ``serve.batch``, which runs only inside a Serve replica.

    Attributes:
        port: the HTTP port on 127.0.0.1.
        servers: served model name (``model@variant`` for a variant of an A/B test) -> its
            ``LLMServer`` instance.
        handles: the same keys -> its :class:`LocalHandle`.
    """

    def __init__(self, apps: dict[str, dict]):
        self.apps = apps
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.servers: dict = {}
        self.handles: dict[str, LocalHandle] = {}
        self._server = None
        self._thread: threading.Thread | None = None

    def start(self) -> "LocalApp":
        """Load the models, build the gateways and start listening.

        Raises:
            ValueError: an application's args are invalid, name an embedding model, or name a
                model another application names with other settings.
            TimeoutError: the server did not listen within :data:`START_TIMEOUT_S`.
        """
        import uvicorn
        from starlette.applications import Starlette
        from starlette.routing import Mount

        from deployments.app import gateway_options
        from deployments.args import AppArgs
        from deployments.gateway.api import build_api
        from deployments.gateway.core import Gateway
        from deployments.replica.llm_server import LLMServer

        routes, loaded = [], {}

        def handle(m) -> LocalHandle:
            key = m.deployment_key
            if key in self.servers and loaded[key] != m:
                raise ValueError(f"model {key!r} is named twice with different settings")
            if key not in self.servers:
                self.servers[key], loaded[key] = LLMServer.func_or_class(m, tracing), m
                self.handles[key] = LocalHandle(self.servers[key], self.loop)
            return self.handles[key]

        for prefix, raw in self.apps.items():
            args = AppArgs.model_validate(raw)
            tracing = args.tracing
            if args.embeddings.embedding_model is not None:
                raise ValueError("LocalApp serves no embedding model (serve.batch needs a Serve replica)")
            models, variants = {}, {}
            for d in args.deployments():  # as build_app: one per model, or per variant of an A/B test
                models.setdefault(d.name, handle(d))
                if d.variant is not None:
                    variants.setdefault(d.name, {})[d.variant] = handle(d)
            api = build_api(Gateway(models, variants=variants, **gateway_options(args)))
            routes.append(Mount(prefix.rstrip("/"), app=api))  # "/" mounts at "", the root
        routes.sort(key=lambda r: r.path == "")  # the root app last: a prefix matches first
        config = uvicorn.Config(Starlette(routes=routes), host="127.0.0.1", port=self.port, log_level="warning",
                                lifespan="off", loop="asyncio")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="local-app", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self._server.started:  # a server thread that died (a port taken) fails at once
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise TimeoutError(f"the local app did not listen on 127.0.0.1:{self.port}")
            time.sleep(0.02)
        return self

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._server.serve())
            for server in self.servers.values():  # the engines' loops end in the loop they ran in
                self.loop.run_until_complete(server.engine.shutdown())
        finally:
            self.loop.close()

    def stop(self) -> None:
        """Stop listening and shut the engines down."""
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(START_TIMEOUT_S)

    def namespace(self, **extra) -> SimpleNamespace:
        """URLs of the app (``root``, ``base_url``, and ``<name>_base_url`` per other prefix) and ``extra``."""
        root = f"http://127.0.0.1:{self.port}"
        urls = {f"{p.strip('/')}_base_url": f"{root}{p.rstrip('/')}/v1" for p in self.apps if p.strip("/")}
        return SimpleNamespace(port=self.port, root=root, base_url=f"{root}/v1", **urls, **extra)
