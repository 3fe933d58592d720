"""From updated requests to :class:`RequestOutput` (vLLM V1's ``v1/engine/output_processor.py``,
in the engine's process): incremental detokenization and stop strings, logprobs and prompt
logprobs into the output.

The output processor decides, the scheduler acts, as in vLLM V1: :meth:`OutputProcessor.detokenize`
finds the requests whose text reached a stop string and how many of the step's tokens come after
the one that completed it (several arrive per step with speculative decoding), and returns them
as :class:`StopStringMatch` objects; the engine hands them to
:meth:`kvserve.engine.scheduler.Scheduler.finish_stopped`, which drops those tokens, finishes the request
and frees its KV blocks. EOS, stop token ids and the length limit are the scheduler's own checks
while it appends the sampled tokens (``Request.check_stop_token``, vLLM's ``check_stop``). The
output processor never changes a request's tokens or status and never touches the scheduler; a
request whose detokenization or output assembly raises is returned as failed, for the engine to
finish with an error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.request import CompletionOutput, Request, RequestOutput, RequestStatus

logger = logging.getLogger("kvserve.engine")


@dataclass(frozen=True)
class StopStringMatch:
    """A stop string that the text of ``request`` reached in this step.

    Attributes:
        request: the request (still running, or already finished by the scheduler in the same
            step: its last allowed token or a stop token came after the stop string's).
        stop: the stop string (``SamplingParams.stop`` entry), the request's ``stop_reason``.
        num_dropped_tokens: the step's tokens after the one that completed the stop string
            (>= 0); they are removed from the request's output (and logprobs).
    """

    request: Request
    stop: str
    num_dropped_tokens: int


@dataclass
class DetokenizeResult:
    """What :meth:`OutputProcessor.detokenize` found in a step.

    Attributes:
        stops: the requests that reached a stop string.
        failed: ``(request, exception)`` of the requests whose detokenizer raised.
    """

    stops: list[StopStringMatch]
    failed: list[tuple[Request, BaseException]]


class OutputProcessor:
    """Builds the engine's outputs. The output of a request that has left the engine also drops
    its detokenizer and calls ``on_finished(request)`` (the engine releases the request's grammar
    and gives it to its request loggers there).

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        on_finished: called once the final output of a request is being built (may be called
            again for the same request; it must not raise).

    Attributes:
        detokenizers: the incremental detokenizer of each request in the engine that asked for
            text (``SamplingParams.detokenize``), by id.
    """

    def __init__(self, tokenizer, on_finished: Callable[[Request], None]):
        self.tokenizer, self.on_finished = tokenizer, on_finished
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, req: Request) -> None:
        """A request entered the engine: its detokenizer, if it asked for text."""
        if req.params.detokenize:
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)

    def detokenize(self, updated: list[Request]) -> DetokenizeResult:
        """Feed each updated request's new tokens (``new_token_ids``) to its detokenizer, one
        at a time, up to a stop string. Requests that already failed in the step
        (``FINISHED_ERROR``) and those without a detokenizer are skipped. Changes no request."""
        stops, failed = [], []
        for req in updated:
            detok = self.detokenizers.get(req.request_id)
            if detok is None or req.status is RequestStatus.FINISHED_ERROR:
                continue
            try:
                new = req.new_token_ids
                for i, tok in enumerate(new):
                    stop = detok.update([tok])
                    if stop is not None:
                        stops.append(StopStringMatch(req, stop, len(new) - 1 - i))
                        break
            except Exception as e:  # one bad request must not take the batch down
                failed.append((req, e))
        return DetokenizeResult(stops, failed)

    def make_outputs(self, updated: list[Request]) -> tuple[list[RequestOutput], list[tuple[Request, BaseException]]]:
        """The outputs of a step's requests that got tokens (each one carrying its
        ``new_token_ids``), after the scheduler acted on their stops. Requests that failed in
        the step (``FINISHED_ERROR``: their output is given) are skipped.

        Returns:
            The outputs, and ``(request, exception)`` of the requests whose output assembly
            raised (no output for them here; the engine fails them).
        """
        outputs, failed = [], []
        for req in updated:
            if req.status is RequestStatus.FINISHED_ERROR:
                continue
            try:
                outputs.append(self._output(req, req.new_token_ids))
            except Exception as e:
                failed.append((req, e))
        return outputs, failed

    def final_output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        """The output of a request that has left the engine, which never raises: if the
        detokenizer fails while it is assembled, an output without the text delta."""
        try:
            return self._output(req, new_token_ids)
        except Exception as e:
            logger.error(
                "request %s: output assembly failed (%s: %s); its final output carries no text delta",
                req.request_id,
                type(e).__name__,
                e,
            )
            self.detokenizers.pop(req.request_id, None)
            return self._output(req, new_token_ids)

    def _output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        detok = self.detokenizers.get(req.request_id)
        finished = req.finished
        delta = detok.delta(finished) if detok else ""
        text = detok.text[: detok.emitted] if detok else ""
        out_ids = req.output_token_ids
        if finished:
            self.detokenizers.pop(req.request_id, None)
            self.on_finished(req)
        comp = CompletionOutput(
            index=0,
            text=text,
            token_ids=out_ids,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            delta_text=delta,
            delta_token_ids=list(new_token_ids),
        )
        # prompt logprobs once the prompt is done: on the first output with a token and the final one
        plp = req.prompt_logprobs if (finished or req.num_output_tokens == 1) and req.prompt_logprobs_done else None
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            [comp],
            finished,
            req.metrics,
            error=req.error,
            prompt_logprobs=plp,
            pooled=req.pooled if finished else None,
        )
