"""One request's run on a replica's engine: admission, the engine's stream as chunks, the request
timeout and the ``n`` choices of one prompt interleaved (:class:`RequestRunner`), what
``LLMServer.stream`` hands each prompt to.

Three kinds of request share a replica: *live* ones (every client request), *cache warming*
(``sheddable``: refused while a live request is in flight, stopped when one arrives, so it
never shares an engine step with live traffic) and *batch work* (the Batch API's ``batch``
requests: admitted within a bounded share, :class:`~kvserve.deployments.replica.admission.Admission`,
and never stopped for live traffic; at the lowest priority, the engine's priority scheduling
preempts a running one by recompute when a live request waits for its slot in a full batch, or
a running request needs KV blocks, and it resumes with its generated tokens kept)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator

from kvserve.deployments.contract.streams import merge_streams, next_before
from kvserve.deployments.contract.types import GenerationChunk, GenerationError
from kvserve.deployments.replica.admission import Admission
from kvserve.deployments.replica.recent_requests import RecentRequests
from kvserve.deployments.replica.tracing import record_request
from kvserve.deployments.replica.request_outputs import ChunkBuilder, stream_interval
from kvserve.engine.bounded_pool import PoolFullError
from kvserve.telemetry.metrics import rejected


def engine_dead(index: int = 0, during: bool = False) -> GenerationChunk:
    """The last chunk of a request whose engine stopped (before it started, or ``during`` it)."""
    return GenerationChunk.failed(
        GenerationError(
            "engine_dead",
            "the model server's engine "
            + ("stopped during this request" if during else "has stopped")
            + " and is being restarted; retry later",
        ),
        index,
    )


class RequestRunner:
    """Runs engine requests for one replica.

    Args:
        engine: the replica's :class:`engine.AsyncLLMEngine`.
        admission: the replica's bounded admission (a request is admitted before it enters the engine).
        recent: where finished requests' timings go.
        model_name: the served name (the ``model_name`` label of refusals).
        request_timeout_s: seconds a request may run before it is stopped (None: no limit).
        stream_interval_setting: engine outputs per streamed chunk (0: automatic, see
            :func:`~kvserve.deployments.replica.request_outputs.stream_interval`).
        variant: the A/B test variant the replica serves ("" outside one: its metrics' label).
        tracing: this process's :class:`~kvserve.telemetry.tracing.Tracing` (None: no spans).
    """

    def __init__(
        self,
        engine,
        admission: Admission,
        recent: RecentRequests,
        model_name: str,
        request_timeout_s: float | None,
        stream_interval_setting: int,
        variant: str = "",
        tracing=None,
    ):
        self.engine, self.admission, self.recent, self.model_name = engine, admission, recent, model_name
        self.request_timeout_s, self.stream_interval = request_timeout_s, stream_interval_setting
        self.variant, self.tracing = variant, tracing
        self.rejected = rejected()
        self.live = 0  # live (neither warming nor batch) engine requests admitted and not yet ended
        self.warm: dict[str, _Sheddable] = {}  # sheddable (cache-warming) engine requests in flight

    def _make_room(self) -> None:
        """A live request is coming: stop every sheddable (cache-warming) request in flight and
        give its admission slot back at once, so the live request is admitted in its place. The
        engine applies aborts before its next step, the one that takes the live request. Batch
        work is not stopped (the engine preempts it, keeping its progress)."""
        for request_id, s in self.warm.items():
            if not s.stopped:
                s.stopped = True
                self.engine.abort(request_id)
                if s.admitted:
                    self.admission.end(s.num_prompt_tokens, s.started)

    @staticmethod
    def _deferred(index: int = 0) -> GenerationChunk:
        return GenerationChunk.failed(
            GenerationError(
                "warming_deferred",
                "cache warming gives way to live requests on this replica; retry when it is idle",
                retry_after_s=1.0,
            ),
            index,
        )

    async def fan_out(
        self,
        ids: list[int],
        params,
        request_id: str,
        priority: int,
        n: int,
        prompt_text: str | None,
        lora=None,
        trace: dict | None = None,
        sheddable: bool = False,
        cache_salt: str | None = None,
        batch: bool = False,
    ) -> AsyncIterator[GenerationChunk]:
        """``n`` engine requests of one prompt, their chunks interleaved (see :meth:`LLMServer.stream`).
        A choice that fails fails the request: its error chunk ends the stream and the other
        choices are aborted. Prompt logprobs are computed by choice 0 only (the same for all).
        ``sheddable``, ``batch``: as :meth:`run`, for every choice."""
        from kvserve.engine.sampling_params import SEED_MAX, SEED_MIN

        prefilled = asyncio.Event()  # choice 0's prompt is in the KV cache (or it ended)

        def child(i: int):
            p, seed = params, params.seed
            if i:  # a given seed becomes seed + i, wrapped into the seed range
                seed = None if seed is None else seed + i - (SEED_MAX - SEED_MIN + 1) * (seed + i > SEED_MAX)
                p = dataclasses.replace(params, seed=seed, prompt_logprobs=None)
            return self.run(
                ids,
                p,
                f"{request_id}-{i}",
                priority,
                index=i,
                wait_for=prefilled if i else None,
                on_first=prefilled if not i else None,
                prompt_text=prompt_text,
                lora=lora,
                trace=trace,
                sheddable=sheddable,
                cache_salt=cache_salt,
                batch=batch,
            )

        choices = merge_streams([child(i) for i in range(n)])
        try:
            async for _, chunk in choices:
                yield chunk
                if chunk.error is not None:  # a choice that fails fails the request
                    return
        finally:
            prefilled.set()
            await choices.aclose()  # cancels the other choices at once (aborted in the engine)

    async def run(
        self,
        ids: list[int],
        params,
        request_id: str,
        priority: int,
        index: int = 0,
        wait_for: asyncio.Event | None = None,
        on_first: asyncio.Event | None = None,
        prompt_text: str | None = None,
        lora=None,
        trace: dict | None = None,
        sheddable: bool = False,
        cache_salt: str | None = None,
        batch: bool = False,
    ) -> AsyncIterator[GenerationChunk]:
        """One engine request of :meth:`LLMServer.stream`: admission, the engine's stream as chunks
        tagged ``index``, the request timeout. ``cache_salt``: vLLM's, into the engine's prompt.
        ``wait_for``: an event to await after admission, before the request enters the engine;
        ``on_first``: an event set once the request's first output arrived (its prompt is
        computed) or it ended; ``prompt_text`` goes on the first chunk; ``trace``: the W3C
        context of the gateway's span (the request's spans go under it when tracing is on);
        ``sheddable``: a cache-warming request, refused while a live request is in flight here
        and stopped when one arrives (its last chunk is a ``warming_deferred`` error);
        ``batch``: a Batch-API request, admitted within the batch share (else a ``queue_full``
        chunk) and run to its end beside live requests at its ``priority`` (the engine
        preempts it for better ones; it is neither refused nor stopped for them, and a live
        request does not count it); a request with both flags is batch work."""
        from kvserve.engine.async_engine import EngineDeadError
        from kvserve.engine.input_processor import PromptTooLongError

        deadline = None if self.request_timeout_s is None else time.monotonic() + self.request_timeout_s
        n_prompt, admitted, started = len(ids), False, False
        stream = None
        counted = False
        sheddable = sheddable and not batch  # batch work is never shed
        if sheddable and self.live > 0:
            yield self._deferred(index)
            return
        shed = None
        try:
            if sheddable:
                shed = self.warm[request_id] = _Sheddable(n_prompt)
            elif not batch:
                self.live += 1
                counted = True
                self._make_room()
            try:
                refused = self.admission.admit(n_prompt, batch=batch)
                if refused is not None:
                    if refused.code == "queue_full" and not batch:  # batch work's share is full: not a rejection
                        self.rejected.inc(
                            {"model_name": self.model_name, "reason": "queue_full", "variant": self.variant}
                        )
                    yield GenerationChunk.failed(refused, index)
                    return
                admitted = True
                if shed is not None:
                    shed.admitted = True
                if wait_for is not None:
                    await wait_for.wait()
                    if shed is not None and shed.stopped:  # stopped for a live request meanwhile
                        yield self._deferred(index)
                        return
                prompt = ids if cache_salt is None else {"prompt_token_ids": ids, "cache_salt": cache_salt}
                stream = self.engine.generate(prompt, params, request_id, priority, lora_request=lora)
                out = await next_before(stream, deadline)  # validates the prompt, then waits for the first token
            except EngineDeadError:
                yield engine_dead(index)
                return
            except PoolFullError as e:  # the engine's grammar compile / adapter load queue is full: retry later
                yield GenerationChunk.failed(GenerationError("queue_full", str(e), retry_after_s=1.0), index)
                return
            except (ValueError, TypeError) as e:
                code = "context_length_exceeded" if isinstance(e, PromptTooLongError) else "invalid_value"
                yield GenerationChunk.failed(GenerationError(code, str(e)), index)
                return
            except TimeoutError:
                yield self._timed_out(index)
                return
            finally:
                if on_first is not None:
                    on_first.set()
            started = True
            if shed is None or not shed.stopped:  # a stopped one gave its slot back already
                self.admission.start(n_prompt, batch=batch)
            if shed is not None:
                shed.started = True
            chunks = ChunkBuilder(self.engine.tokenizer, params, index, prompt_text)
            while True:
                if out.finished and shed is not None and shed.stopped:
                    yield self._deferred(index)  # stopped for a live request
                    return
                if out.finished:
                    self.recent.add(out)
                    if trace is not None and self.tracing is not None:
                        record_request(
                            self.tracing,
                            trace,
                            out,
                            self.model_name,
                            params,
                            getattr(lora, "lora_name", None),
                            self.variant,
                        )
                if (
                    chunk := chunks.add(out, stream_interval(self.stream_interval, self.admission.in_flight))
                ) is not None:
                    yield chunk
                if out.finished:
                    return
                try:
                    out = await next_before(stream, deadline)
                except TimeoutError:
                    yield self._timed_out(index)
                    return
                except EngineDeadError:  # mid-stream (e.g. a tensor-parallel worker died): typed, retryable
                    yield engine_dead(index, during=True)
                    return
        finally:
            if counted:
                self.live -= 1
            self.warm.pop(request_id, None)
            if admitted and (shed is None or not shed.stopped):  # a stopped one gave its slot back already
                self.admission.end(n_prompt, started, batch=batch)
            if stream is not None:
                await stream.aclose()  # aborts the request in the engine unless it finished

    def _timed_out(self, index: int = 0) -> GenerationChunk:
        """The last chunk of a request that ran past ``request_timeout_s`` (the caller's
        ``finally`` aborts it in the engine, which frees its blocks)."""
        self.rejected.inc({"model_name": self.model_name, "reason": "timeout", "variant": self.variant})
        msg = f"the request ran longer than the server's limit of {self.request_timeout_s:g} s and was stopped"
        return GenerationChunk.failed(GenerationError("timeout", msg), index)


class _Sheddable:
    """A sheddable request in flight: its admission state, and whether a live request stopped it
    (its slot is then given back at once, not when its stream ends)."""

    __slots__ = ("num_prompt_tokens", "admitted", "started", "stopped")

    def __init__(self, num_prompt_tokens: int):
        self.num_prompt_tokens, self.admitted, self.started, self.stopped = num_prompt_tokens, False, False, False
