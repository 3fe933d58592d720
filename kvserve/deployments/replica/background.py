"""One background task of an ``LLMServer`` replica on its event loop (the KV event publisher, the
cluster tier's saves): started where the replica's loop runs (Serve's health check, the routing
stats poll), idempotently, and stopped on shutdown."""

from __future__ import annotations

import asyncio


class BackgroundLoop:
    """:meth:`start` runs ``self._run()`` (a coroutine method of the subclass, looping until
    cancelled) as one task on the running event loop; :meth:`stop` cancels it and waits."""

    #: the task's name (in asyncio's task dumps)
    task_name = "kvserve-background"
    _task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the task on the running event loop (idempotent; again after it ended)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self.task_name)

    async def stop(self) -> None:
        """Cancel the task and wait for it (whatever it raised is dropped)."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass

    async def _run(self) -> None:  # pragma: no cover (subclasses define it)
        raise NotImplementedError
