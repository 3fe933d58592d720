"""Calls to a model's replicas as the pipeline makes them: a stream opened up to its first chunk
(:meth:`ReplicaCalls.open`) or a one-answer method (:meth:`ReplicaCalls.ask`).

A generating request is never run twice. It is sent again (up to :data:`UNAVAILABLE_RETRIES`
times) only when the first attempt is known not to have started on any replica
(:func:`never_started`: Serve had no replica to send it to, or the replica's actor never came
up). A replica lost under it (``ActorDiedError``, ``ActorUnavailableError``: its node gone, or
unreachable) may already have admitted it and run part of it, or (unreachable, not dead) be
running it still, so that is the client's 503 ``model_unavailable``, its own to retry. (Serve's
router takes a replica out of rotation at the first call that fails with ``ActorDiedError``, so
the next request goes elsewhere.) The one-answer methods (:data:`READ_ONLY_METHODS`: tokenize, detokenize,
embed) change nothing, so they are sent again after any ``model_unavailable`` (Serve's router
has dropped the dead replica by then). Whatever refuses the call comes back as an :class:`~kvserve.deployments.contract.openai_errors.OpenAIError`:
the replica's typed verdict as it is (a full queue, a request too large, a prompt over the
context), Serve's refusals (``queue_full`` 429, ``model_unavailable`` 503) counted, anything else
a 500 naming only the request id."""

from __future__ import annotations

import asyncio
import logging

from kvserve.deployments.contract.openai_errors import OpenAIError
from kvserve.deployments.contract.types import GenerateRequest, GenerationChunk
from kvserve.deployments.gateway.call import Call
from kvserve.deployments.gateway.channels import ChannelHub
from kvserve.deployments.gateway.errors import as_client_error, internal
from kvserve.deployments.gateway.shedding import LoadShedder
from kvserve.deployments.gateway.streams import ChunkStream

logger = logging.getLogger("ray.serve")

#: Times a request is sent again when it never reached a replica (or, for a read-only method, when
#: its replica was lost).
UNAVAILABLE_RETRIES = 2
#: Replica methods that change nothing (no engine step, no stored state): safe to run twice.
READ_ONLY_METHODS = frozenset({"tokenize", "detokenize", "embed"})


def never_started(exc: BaseException) -> bool:
    """Whether the failure ``exc`` of a replica call proves the call never started on a replica:
    Serve found no replica to send it to (``DeploymentUnavailableError``), or the replica's
    actor died in its constructor (``ActorDiedError.actor_init_failed``), before it could take
    any call. A replica that died or went unreachable otherwise may have run it."""
    from ray.exceptions import ActorDiedError
    from ray.serve.exceptions import DeploymentUnavailableError

    if isinstance(exc, DeploymentUnavailableError):
        return True
    return isinstance(exc, ActorDiedError) and bool(getattr(exc, "actor_init_failed", False))


class _NotStarted(Exception):
    """A refusal of a call that never reached a replica (safe to send again)."""

    def __init__(self, error: OpenAIError):
        super().__init__(error.message)
        self.error = error


class ReplicaCalls:
    """How the gateway calls replicas (see the module docstring).

    Args:
        rejected: the ``kvserve:requests_rejected_total`` counter (Serve's refusals count there).
        channels: the gateway's channels to the replicas (None: every request streams on its own).
    """

    def __init__(self, rejected, channels: ChannelHub | None = None):
        self.rejected, self.channels = rejected, channels

    async def open(self, call: Call, request: GenerateRequest, shedder: LoadShedder | None) -> ChunkStream:
        """Start the replica's stream of ``request`` and wait for its first chunk; ``shedder``
        counts the stream open until it ends, and a ``queue_full`` refusal (the replica's or
        Serve's) marks the model full there (None: background work, cache warming's or a batch
        job's, which the live traffic's load shedding neither counts nor learns from).

        Raises:
            OpenAIError: the replica refused the request (its typed error), or Serve did
                (``queue_full`` 429, ``model_unavailable`` 503).
        """
        model = call.target  # the deployment: a variant's replicas are full or not on their own
        request.shed_requests = shedder.opened(model) if shedder is not None else 0
        hub = self.channels
        slot = hub.register() if hub is not None else None
        request.channel = slot[0] if slot is not None else None
        try:
            for attempt in range(UNAVAILABLE_RETRIES + 1):
                gen = call.handle.stream.remote(request)
                try:
                    first = await self._first_chunk(call, gen)
                    break
                except _NotStarted as e:
                    if attempt == UNAVAILABLE_RETRIES:
                        raise e.error from None
                    logger.info("request %s: no replica took it (%s); sent again", call.http_id, e.error.code)
                    await asyncio.sleep(0.2 * (attempt + 1))
        except BaseException as e:  # the request left before its first token
            if shedder is not None:
                shedder.closed(model)
            if slot is not None:
                hub.unregister(slot[0][1])
            if shedder is not None and isinstance(e, OpenAIError) and e.code == "queue_full":
                shedder.refused(model, e.retry_after_s)
            raise
        if shedder is not None:
            shedder.admitted(model)
        channel = None
        if slot is not None:
            hub.saw(model, first.replica)
            key = slot[0][1]
            if first.via_channel:
                channel = (slot[1], lambda: hub.unregister(key))
            else:
                hub.unregister(key)
        on_end = (lambda: shedder.closed(model)) if shedder is not None else None
        return ChunkStream(gen, first, request.n, on_end=on_end, channel=channel)

    async def ask(self, call: Call, method: str, *args, **kwargs):
        """``call.handle.<method>.remote(*args, **kwargs)``'s answer; a typed ``error`` on it (the
        replica's verdict) is raised as its :class:`OpenAIError`.

        A read-only method (:data:`READ_ONLY_METHODS`) is sent again after ``model_unavailable``;
        any other only when it never reached a replica (:func:`never_started`).

        Raises:
            OpenAIError: the replica's verdict, Serve's refusal, or a 500 (logged).
        """
        for attempt in range(UNAVAILABLE_RETRIES + 1):
            try:
                out = await getattr(call.handle, method).remote(*args, **kwargs)
                break
            except Exception as e:  # (a cancellation is no Exception: it goes through)
                err = self.error(call, e)
                again = err.code == "model_unavailable" and (method in READ_ONLY_METHODS or never_started(e))
                if not again or attempt == UNAVAILABLE_RETRIES:
                    raise err from None
                await asyncio.sleep(0.2 * (attempt + 1))
        if getattr(out, "error", None) is not None:
            raise OpenAIError.of(out.error)
        return out

    def error(self, call: Call, e: Exception) -> OpenAIError:
        """The client's error for a failed call to a replica: Serve's refusals (counted) and
        client errors as they are, anything else a 500 with the request id (details logged)."""
        err = as_client_error(e)
        if err is None:
            logger.error("request %s: the model server failed", call.http_id, exc_info=e)
            err = internal(call.http_id)
        elif err.code in ("queue_full", "model_unavailable"):  # refused by Serve before any replica saw it
            self.rejected.inc({"model_name": call.model, "reason": err.code, "variant": call.variant})
        return err

    async def _first_chunk(self, call: Call, gen) -> GenerationChunk:
        """The stream's first chunk; a refusal or failure as an :class:`OpenAIError` (wrapped in
        :class:`_NotStarted` when the request never reached a replica)."""
        try:
            first = await gen.__anext__()
        except asyncio.CancelledError:  # the client went away before the first token
            gen.cancel()
            raise
        except StopAsyncIteration:
            logger.error("request %s: the model server returned no output", call.http_id)
            raise internal(call.http_id) from None
        except Exception as e:
            err = self.error(call, e)
            raise (_NotStarted(err) if err.code == "model_unavailable" and never_started(e) else err) from None
        if first.error is not None:  # the replica's own verdict: a client error, a full queue, a dead engine
            raise OpenAIError.of(first.error)
        return first
