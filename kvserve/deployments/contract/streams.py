"""Consuming the replica's chunk streams, on either side of the Ray hop: :func:`merge_streams` (n
streams as one, tagged with their index) and :func:`next_before` (the next item, or a timeout at
a deadline)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any


async def merge_streams(gens: list) -> AsyncIterator[tuple[int, Any]]:
    """``(index in gens, item)`` of several async generators, as the items come; the first
    exception one of them raises is raised here. Leaving early (or an error) cancels the
    others, each closed, so a generator's cleanup (an engine abort) runs before this returns."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen):
        try:
            async for item in gen:
                await queue.put((i, item, None))
        except Exception as e:  # raised to the reader below
            await queue.put((i, None, e))
        finally:
            await gen.aclose()
            queue.put_nowait((i, None, None))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item, err = await queue.get()
            if err is not None:
                raise err
            if item is None:
                left -= 1
                continue
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def next_before(stream, deadline: float | None):
    """The stream's next item, or ``TimeoutError`` once ``time.monotonic()`` passes ``deadline``."""
    if deadline is None:
        return await anext(stream)
    async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
        return await anext(stream)
