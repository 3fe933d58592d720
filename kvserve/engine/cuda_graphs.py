"""CUDA graphs of the model's decode forward: one captured graph per batch size, replayed with padding.

Decode steps are short and launch-bound on a GPU; replaying a captured graph runs the whole
forward as one launch. Inputs live in static buffers that a replay fills; a batch is padded up
to the next captured size with rows of slot -1 (the KV store skips them) and ``seq_len`` 0
(attention writes zeros), so padding touches no cache state.
"""

from __future__ import annotations

import torch

from kvserve.kernels.backend import AttentionMetadata


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes that get a graph: 1, 2, 4, 8, then steps of 8 up to ``max_num_seqs``
    (at most 512)."""
    top = min(max_num_seqs, 512)
    return sorted({b for b in [1, 2, 4, 8, *range(16, top + 1, 8)] if b <= top} | {top})


class DecodeCudaGraphs:
    """The captured decode graphs of one model (its KV caches attached).

    Args:
        model: the model; ``model(input_ids, positions, meta)`` returns hidden states.
        sizes: batch sizes to capture (ascending; see :func:`graph_batch_sizes`).
        max_len: longest context a replay may see (tokens); block tables are
            ``ceil(max_len / block_size)`` wide and the split-K count of the decode kernels is
            fixed at capture for contexts this long (the kernels derive each request's split
            bounds from its ``seq_len`` at replay time).
        block_size: the KV cache's block size (tokens).
        device: the CUDA device.
    """

    @torch.inference_mode()
    def __init__(self, model, sizes: list[int], max_len: int, block_size: int, device: torch.device):
        top, dev = sizes[-1], device
        width = -(-max_len // block_size)
        self.input_ids = torch.zeros(top, dtype=torch.long, device=dev)
        self.positions = torch.zeros(top, dtype=torch.long, device=dev)
        self.slots = torch.full((top,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.zeros(top, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(top, width, dtype=torch.int32, device=dev)
        self.cu = torch.arange(top + 1, dtype=torch.int32, device=dev)
        #: batch size -> (graph, its output buffer)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = None
        for b in reversed(sizes):  # largest first, sharing one memory pool
            meta = AttentionMetadata(
                cu_seqlens_q=self.cu[: b + 1],
                seq_lens=self.seq_lens[:b],
                block_tables=self.block_tables[:b],
                slot_mapping=self.slots[:b],
                query_lens_cpu=[1] * b,
                seq_lens_cpu=[max_len] * b,
                max_seqlen_q=1,
                max_seqlen_k=max_len,
            )
            model(self.input_ids[:b], self.positions[:b], meta)  # warm-up: JIT, allocator
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = model(self.input_ids[:b], self.positions[:b], meta)
            pool = graph.pool()
            self.graphs[b] = (graph, out)
        torch.cuda.synchronize()

    def can_replay(self, meta: AttentionMetadata) -> bool:
        """Whether a step of ``meta`` replays a graph: decode only, within the largest size."""
        return bool(self.graphs) and meta.decode_only and meta.num_reqs <= max(self.graphs)

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The hidden states ``[b, hidden]`` of a decode batch of ``b`` rows (``can_replay``),
        from the graph of the smallest captured size ``>= b``; a view of the graph's output
        buffer, valid until the next replay."""
        b = input_ids.shape[0]
        gb = next(s for s in sorted(self.graphs) if s >= b)
        graph, out = self.graphs[gb]
        self.input_ids[:b].copy_(input_ids)
        self.positions[:b].copy_(positions)
        self.slots[:b].copy_(meta.slot_mapping)
        self.slots[b:gb].fill_(-1)
        self.seq_lens[:b].copy_(meta.seq_lens)
        self.seq_lens[b:gb].zero_()
        self.block_tables[:b, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        graph.replay()
        return out[:b]
