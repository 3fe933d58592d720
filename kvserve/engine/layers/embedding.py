"""Vocabulary-parallel token embedding and LM head (Megatron-LM sec. 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvserve.engine.layers.linear import linear, prepack_weight
from kvserve.engine.distributed import all_gather_last_dim, all_reduce, split_range, tp_rank, tp_size


class VocabParallelEmbedding(nn.Module):
    """Token embedding ``[vocab_size, hidden]`` with rows split across ranks; each rank looks
    up its own rows (zeros elsewhere) and the results are all-reduced."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.ranges = [split_range(vocab_size, tp_size(), r) for r in range(tp_size())]
        self.start, self.end = self.ranges[tp_rank()]
        self.weight = nn.Parameter(torch.empty(self.end - self.start, hidden_size), requires_grad=False)

    def load(self, name: str, tensor: torch.Tensor, part: int = 0) -> None:
        self.weight.data.copy_(tensor[self.start : self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` int64 ``[num_tokens]`` -> ``[num_tokens, hidden]``."""
        if tp_size() == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        out = F.embedding((input_ids - self.start) * mask, self.weight) * mask.unsqueeze(-1)
        return all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits ``hidden @ W^T`` over the full vocabulary; each rank computes its vocab slice
    and the slices are all-gathered. May share its weight with the embedding (tied)."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__(vocab_size, hidden_size)
        self.register_buffer("qweight", None)  # int8 copy of the weight and its row scales after quantize()
        self.register_buffer("wscale", None)
        self.packed = None  # the weight in oneDNN's layout after prepack() (CPU)

    def prepack(self) -> None:
        """Keep a oneDNN-layout copy of the weight for the logits matmul on CPU
        (``kvserve.engine.layers.linear.prepack_weight``; the plain weight stays for a tied embedding)."""
        if self.qweight is None:
            self.packed = prepack_weight(self.weight)

    def quantize(self, method: str = "int8") -> None:
        """Weight-only int8 logits: an int8 copy of the weight with per-row scales (the float
        weight stays: a tied embedding still looks rows up in it). ``"fp8"`` leaves the LM head
        in the model dtype (as vLLM's FP8 does)."""
        if method != "int8":
            return
        from kvserve.kernels import cpu_backend

        self.qweight, self.wscale = cpu_backend.quantize_int8(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """``hidden`` ``[n, hidden]`` -> float32 logits ``[n, vocab_size]``."""
        if self.qweight is not None:
            from kvserve.kernels.cpu_backend import int8_linear

            logits = int8_linear(hidden.float(), self.qweight, self.wscale)
        else:
            logits = linear(hidden, self.weight, None, self.packed).float()
        return all_gather_last_dim(logits, [e - s for s, e in self.ranges])
