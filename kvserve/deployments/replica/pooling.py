"""The replica side of ``/v1/embeddings``, ``/tokenize`` and ``/detokenize``.

- :class:`PoolingEndpoints`: the methods an ``LLMServer`` replica adds for them. Embeddings of
  a decoder model are its final hidden states pooled by the engine (:mod:`kvserve.engine.pooling`:
  ``last`` token by default, or ``mean``), batched with the replica's other requests, nothing
  generated; each input is one engine request through the replica's admission.
- :func:`tokenize` / :func:`detokenize`: vLLM's ``/tokenize`` and ``/detokenize`` on a Hugging
  Face tokenizer (shared with :class:`kvserve.deployments.replica.embedding_server.EmbeddingServer`).
- :func:`dimensions_error` / :func:`shorten`: OpenAI's ``dimensions``, honoured only by a model
  trained for shorter embeddings (Matryoshka representation learning, Kusupati et al. 2022:
  ``is_matryoshka`` or ``matryoshka_dimensions`` in its ``config.json``, as vLLM reads them).
"""

from __future__ import annotations

import asyncio
import math

from kvserve.deployments.contract.openai_errors import random_id
from kvserve.deployments.contract.types import EmbedResult, GenerationError, TokenizeResult
from kvserve.deployments.replica.lora import UnknownAdapterError


def dimensions_error(dimensions: int | None, dim: int, hf_config) -> GenerationError | None:
    """Why ``dimensions`` cannot be served by a model of ``dim``-long embeddings (None: it can).
    Equal to ``dim`` always can; shorter only for a Matryoshka-trained model."""
    if dimensions is None or dimensions == dim:
        return None
    allowed = getattr(hf_config, "matryoshka_dimensions", None)
    ok = 1 <= dimensions <= dim and (
        allowed is None and getattr(hf_config, "is_matryoshka", False) or allowed is not None and dimensions in allowed
    )
    if ok:
        return None
    return GenerationError(
        "invalid_value",
        f"dimensions: this model gives {dim}-dimensional embeddings and was not "
        f"trained for shorter ones (no matryoshka_dimensions); omit dimensions "
        f"or send {dim}",
    )


def shorten(vectors: list[list[float]], dimensions: int | None) -> list[list[float]]:
    """The first ``dimensions`` values of each vector, scaled back to unit length (Matryoshka)."""
    if dimensions is None or not vectors or dimensions >= len(vectors[0]):
        return vectors
    out = []
    for v in vectors:
        head = v[:dimensions]
        norm = math.sqrt(sum(x * x for x in head)) or 1.0
        out.append([x / norm for x in head])
    return out


def tokenize(
    tokenizer,
    max_model_len: int,
    *,
    prompt: str | None = None,
    messages: list[dict] | None = None,
    tools: list[dict] | None = None,
    add_special_tokens: bool | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    return_token_strs: bool = False,
) -> TokenizeResult:
    """vLLM's ``/tokenize``: the token ids of ``prompt`` (special tokens added unless
    ``add_special_tokens=False``) or of chat ``messages`` under the model's chat template (with
    the assistant generation prompt, or ``continue_final_message`` leaving the last assistant
    message open; no special tokens added beyond the template's unless asked).

    Raises:
        ValueError: neither or both of ``prompt`` and ``messages``; the template rejects the messages.
    """
    from kvserve.engine.input_processor import chat_template_ids

    if (prompt is None) == (messages is None):
        raise ValueError("give either prompt or messages")
    if messages is not None:
        ids = chat_template_ids(
            tokenizer, messages, add_generation_prompt, tools, continue_final_message, bool(add_special_tokens)
        )
    else:
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens is not False)
    strs = tokenizer.convert_ids_to_tokens(ids) if return_token_strs else None
    return TokenizeResult(tokens=ids, count=len(ids), max_model_len=max_model_len, token_strs=strs)


def detokenize(tokenizer, tokens: list[int]) -> TokenizeResult:
    """vLLM's ``/detokenize``: the text of ``tokens``.

    Raises:
        ValueError: an id outside the vocabulary.
    """
    vocab = len(tokenizer)
    bad = [t for t in tokens if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"tokens: {bad[0]} is not a token id of this model (ids are in [0, {vocab}))")
    return TokenizeResult(tokens=list(tokens), count=len(tokens), prompt=tokenizer.decode(tokens))


async def tokenizer_call(fn, *args, **kwargs) -> TokenizeResult:
    """``fn(*args, **kwargs)`` (:func:`tokenize`, :func:`detokenize`) in a worker thread; bad
    input (``ValueError``, ``TypeError``) becomes the result's ``invalid_value`` error."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except (ValueError, TypeError) as e:
        return TokenizeResult(error=GenerationError("invalid_value", str(e)))


class PoolingEndpoints:
    """``LLMServer``'s embedding and tokenizer methods (a mixin: it uses the replica's
    ``engine``, ``admission``, ``adapters``, ``max_model_len`` and ``pooling``)."""

    async def embed(
        self,
        inputs: list[str | list[int]],
        dimensions: int | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> EmbedResult:
        """Embeddings of ``inputs`` (texts, or token id lists), one engine request each
        (``<request_id>-<i>``), at most ``max_num_seqs`` of them at once, each through the
        replica's admission; ``lora_name``: an adapter of this model.

        Returns:
            An :class:`EmbedResult`; a bad input fails the call with ``error``
            (``context_length_exceeded``, ``invalid_value``, ``queue_full``, ...), nothing left
            in the engine.
        """
        from kvserve.engine.async_engine import EngineDeadError
        from kvserve.engine.input_processor import PromptTooLongError

        cfg = self.engine.hf_config
        dim = int(cfg.hidden_size)
        if (err := dimensions_error(dimensions, dim, cfg)) is not None:
            return EmbedResult(error=err)
        request_id = request_id or random_id("embd")
        try:
            lora = await self.adapters.resolve(lora_name)
            ids = await asyncio.gather(*(self.engine.encode(x) for x in inputs))
        except UnknownAdapterError as e:
            return EmbedResult(error=GenerationError("model_not_found", str(e)))
        except (ValueError, TypeError) as e:
            return EmbedResult(error=GenerationError("invalid_value", str(e)))
        # a call's inputs take at most max_num_seqs of the replica's slots at once: a long list
        # waits for its own earlier inputs instead of overflowing the queue into a 429
        window = asyncio.Semaphore(max(1, self.admission.max_num_seqs))
        tasks = [
            asyncio.ensure_future(self._embed_one(x, f"{request_id}-{i}", priority, lora, window))
            for i, x in enumerate(ids)
        ]
        try:
            vectors = await asyncio.gather(*tasks)
        except EngineDeadError:
            return EmbedResult(error=GenerationError("engine_dead", "the model's engine stopped; retry"))
        except PromptTooLongError as e:
            return EmbedResult(error=GenerationError("context_length_exceeded", str(e)))
        except GenerationFailed as e:
            return EmbedResult(error=e.error)
        except (ValueError, TypeError) as e:
            return EmbedResult(error=GenerationError("invalid_value", str(e)))
        finally:
            for t in tasks:
                t.cancel()  # the others of a failed call leave the engine (their blocks freed)
            await asyncio.gather(*tasks, return_exceptions=True)
        return EmbedResult(data=shorten(vectors, dimensions), prompt_tokens=sum(map(len, ids)))

    async def _embed_one(
        self, ids: list[int], request_id: str, priority: int, lora, window: asyncio.Semaphore
    ) -> list[float]:
        from kvserve.engine.pooling import PoolingParams

        if len(ids) > self.max_model_len:  # before admission: a clear 400 rather than "too_large"
            from kvserve.engine.input_processor import PromptTooLongError

            raise PromptTooLongError(
                f"an input is {len(ids)} tokens; this model's context is {self.max_model_len} tokens (max_model_len)"
            )
        async with window:
            refused = self.admission.admit(len(ids))
            if refused is not None:
                raise GenerationFailed(refused)
            started = False
            try:
                out = await self.engine.embed(ids, PoolingParams(self.pooling_type), request_id, priority, lora)
                self.admission.start(len(ids))
                started = True
                return out.pooled
            finally:
                self.admission.end(len(ids), started)

    async def tokenize(
        self, prompt: str | None = None, messages: list[dict] | None = None, tools: list[dict] | None = None, **kw
    ) -> TokenizeResult:
        """``/tokenize`` with this model's tokenizer and chat template (:func:`tokenize`, whose
        keyword arguments ``kw`` are); tools and tool calls written as for generation."""
        from kvserve.engine.chat_templates import prepare_messages

        def run():
            msgs, tls = (
                (messages, tools)
                if messages is None
                else prepare_messages(messages, tools, self.engine.tokenizer.chat_template)
            )
            return tokenize(self.engine.tokenizer, self.max_model_len, prompt=prompt, messages=msgs, tools=tls, **kw)

        return await tokenizer_call(run)

    async def detokenize(self, tokens: list[int]) -> TokenizeResult:
        """``/detokenize`` with this model's tokenizer (:func:`detokenize`)."""
        return await tokenizer_call(detokenize, self.engine.tokenizer, tokens)


class GenerationFailed(Exception):
    """A typed refusal inside :meth:`PoolingEndpoints.embed` (admission)."""

    def __init__(self, error: GenerationError):
        super().__init__(error.message)
        self.error = error
