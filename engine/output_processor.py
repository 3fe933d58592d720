"""From updated requests to :class:`RequestOutput`: incremental detokenization, stop strings,
logprobs and prompt logprobs into the output, and failing one request alone (vLLM V1's
``v1/engine/output_processor.py``, in the engine's process)."""
from __future__ import annotations

import logging
from collections.abc import Callable

from engine.detokenizer import IncrementalDetokenizer
from engine.request import CompletionOutput, Request, RequestOutput, RequestStatus
from engine.scheduler import Scheduler

logger = logging.getLogger("kvserve.engine")


class OutputProcessor:
    """Builds the engine's outputs. The output of a request that has left the engine also drops
    its detokenizer and calls ``on_finished(request)`` (the engine releases the request's grammar
    and gives it to its request loggers there).

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        scheduler: finishes requests (a stop string, a failure).
        on_finished: called once the final output of a request is being built (may be called
            again for the same request; it must not raise).

    Attributes:
        detokenizers: the incremental detokenizer of each request in the engine that asked for
            text (``SamplingParams.detokenize``), by id.
    """

    def __init__(self, tokenizer, scheduler: Scheduler, on_finished: Callable[[Request], None]):
        self.tokenizer, self.scheduler, self.on_finished = tokenizer, scheduler, on_finished
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add_request(self, req: Request) -> None:
        """A request entered the engine: its detokenizer, if it asked for text."""
        if req.params.detokenize:
            self.detokenizers[req.request_id] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)

    def process(self, updated: list[Request]) -> list[RequestOutput]:
        """The outputs of a step's requests that got tokens (``updated``; each one's
        ``new_token_ids``), after detokenization and stop strings. A request that already
        failed in the step (``FINISHED_ERROR``: its output is given) is skipped; one whose
        detokenization or output assembly raises fails alone (:meth:`fail`)."""
        outputs = []
        for req in updated:
            if req.status is RequestStatus.FINISHED_ERROR:  # failed earlier in the step: output given
                continue
            try:
                self._detokenize(req)
                outputs.append(self._output(req, req.new_token_ids))
            except Exception as e:  # one bad request must not take the batch down
                outputs.append(self.fail(req, "detokenization or output assembly", e, req.new_token_ids))
        return outputs

    def fail(self, req: Request, where: str, error: BaseException, new_token_ids: list[int] = ()) -> RequestOutput:
        """Fail ``req`` alone (``FINISHED_ERROR``, blocks freed, ``req.error`` set unless it
        already is) after ``error`` in ``where`` (words for the log); returns its final output
        (``new_token_ids``: the step's tokens it carries), built without the detokenizer if that
        is what fails."""
        logger.error("request %s failed in %s: %s: %s", req.request_id, where, type(error).__name__, error,
                     exc_info=error)
        req.error = req.error or f"{type(error).__name__}: {error}"
        if req.request_id in self.scheduler.requests:
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
        else:  # already left the queues (e.g. finished by length in the same step)
            req.status = RequestStatus.FINISHED_ERROR
        return self.final_output(req, new_token_ids)

    def final_output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        """The output of a request that has left the engine, which never raises: if the
        detokenizer fails while it is assembled, an output without the text delta."""
        try:
            return self._output(req, new_token_ids)
        except Exception as e:
            logger.error("request %s: output assembly failed (%s: %s); its final output carries no text delta",
                         req.request_id, type(e).__name__, e)
            self.detokenizers.pop(req.request_id, None)
            return self._output(req, new_token_ids)

    def _detokenize(self, req: Request) -> None:
        """Feed the step's new tokens to the request's detokenizer one at a time; at a stop
        string, drop the tokens after the one that completed it (several arrive per step with
        speculative decoding) and finish the request (``stop``)."""
        detok = self.detokenizers.get(req.request_id)
        if detok is None:
            return
        new = req.new_token_ids
        for i, tok in enumerate(new):
            stop = detok.update([tok])
            if stop is None:
                continue
            extra = len(new) - 1 - i
            if extra:
                del req.all_token_ids[-extra:]
                if req.params.logprobs is not None:
                    del req.logprobs[-extra:]
                req.new_token_ids = new[:i + 1]
            if not req.finished:
                req.stop_reason = stop
                self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
            elif req.status == RequestStatus.FINISHED_LENGTH:
                # completed by the last allowed token (already finished and freed): a stop
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            return

    def _output(self, req: Request, new_token_ids: list[int] = ()) -> RequestOutput:
        detok = self.detokenizers.get(req.request_id)
        finished = req.finished
        delta = detok.delta(finished) if detok else ""
        text = detok.text[:detok.emitted] if detok else ""
        out_ids = req.output_token_ids
        if finished:
            self.detokenizers.pop(req.request_id, None)
            self.on_finished(req)
        comp = CompletionOutput(
            index=0, text=text, token_ids=out_ids,
            finish_reason=req.status.value if finished else None, stop_reason=req.stop_reason,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            delta_text=delta, delta_token_ids=list(new_token_ids))
        # prompt logprobs once the prompt is done: on the first output with a token and the final one
        plp = req.prompt_logprobs if (finished or req.num_output_tokens == 1) and req.prompt_logprobs_done else None
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [comp], finished,
                             req.metrics, error=req.error, prompt_logprobs=plp,
                             pooled=req.pooled if finished else None)
