"""A kvserve application in this process, over real HTTP, without Ray: the gateway's HTTP app
(:func:`kvserve.deployments.gateway.api.build_api` over a :class:`~kvserve.deployments.gateway.core.Gateway` built
as ``build_app`` builds it) served by uvicorn on 127.0.0.1 in a thread of its own, in front of real
:class:`~kvserve.deployments.replica.llm_server.LLMServer` replicas (real engines and models) reached
through :class:`kvserve.deployments.local.LocalHandle`, which pickles each call's arguments and answers as
Ray's hop does (:func:`kvserve.deployments.local.build_local` builds them).

For the tests of what the OpenAI API does with a real model and real clients (the openai SDK,
langchain-openai: tests/deployments/test_openai_clients.py); the live Serve apps of tests/e2e prove
the wiring (Serve's proxy, handles, routers, replicas in Ray workers)."""

from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from helpers import free_port

#: Seconds to wait for the server to listen, or to stop.
START_TIMEOUT_S = 60.0


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
        handles: the same keys -> its :class:`kvserve.deployments.local.LocalHandle`.
    """

    def __init__(self, apps: dict[str, dict]):
        self.apps = apps
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.servers: dict = {}
        self.handles: dict = {}
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

        from kvserve.deployments.args import AppArgs
        from kvserve.deployments.local import build_local

        apps, self.servers, self.handles = build_local(
            {prefix: AppArgs.model_validate(raw) for prefix, raw in self.apps.items()}, self.loop
        )
        routes = [Mount(prefix.rstrip("/"), app=api) for prefix, api in apps.items()]  # "/" mounts at ""
        routes.sort(key=lambda r: r.path == "")  # the root app last: a prefix matches first
        config = uvicorn.Config(
            Starlette(routes=routes),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            lifespan="off",
            loop="asyncio",
        )
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
