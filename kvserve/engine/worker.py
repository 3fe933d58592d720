"""One model-parallel rank (vLLM's ``Worker``): a ``torch.distributed`` process-group member that
owns a :class:`kvserve.engine.model_runner.ModelRunner` over its shard of the model (its tensor shard of
its pipeline stage, ``kvserve/engine/distributed.py``).

Executors that run ranks in processes of their own wrap it: :class:`kvserve.engine.mp_executor.MultiprocExecutor`
(local processes, no Ray) and ``kvserve.cluster.worker_group.TPWorker`` (a Ray actor). Nothing here
imports Ray.
"""

from __future__ import annotations

import datetime
import os

from kvserve.engine.config import EngineConfig
from kvserve.engine.distributed import init_model_parallel
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.sched_output import SchedulerOutput


class Worker:
    """Rank ``rank`` of ``world_size`` = ``tensor_parallel_size x pipeline_parallel_size``;
    global rank ``stage * tp + t`` is tensor rank ``t`` of stage ``stage``.

    Args:
        rank: this process's global rank.
        world_size: ranks in all.
        torch_num_threads: CPU threads of this rank's intra-op pool (None: torch's default).
        device_index: the CUDA device of this rank among those the process sees (a Ray actor
            sees only its own GPU: 0; a local rank process sees them all: its rank).
    """

    def __init__(self, rank: int, world_size: int, torch_num_threads: int | None = None, device_index: int = 0):
        import torch

        self.rank, self.world_size, self.device_index = rank, world_size, device_index
        if torch_num_threads:
            torch.set_num_threads(torch_num_threads)
        self.runner = None
        self.driver = False

    def init(
        self,
        config: EngineConfig,
        model_path: str,
        init_method: str,
        one_node: bool = True,
        collective_timeout_s: float = 300.0,
    ) -> dict:
        """Join the process group (NCCL on CUDA, gloo on CPU) at ``init_method`` (``file://`` or
        ``tcp://``), split it into stages (:func:`kvserve.engine.distributed.init_model_parallel`) and
        load this rank's shard (:class:`ModelRunner`). ``one_node``: every rank is on this node,
        so collectives stay on loopback (unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``
        say otherwise). A collective that waits longer than ``collective_timeout_s`` seconds for
        a rank fails.

        Returns:
            ``{"rank", "pid", "backend", "threads"}`` of this rank.

        Raises:
            ValueError: the world size is not ``tensor_parallel_size x pipeline_parallel_size``;
                whatever the rendezvous or the model load raises.
        """
        import torch
        import torch.distributed as dist

        backend = "nccl" if config.torch_device.type == "cuda" else "gloo"
        if one_node:  # ranks share a node: keep the collectives' sockets on loopback unless told otherwise
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        if backend == "nccl":
            torch.cuda.set_device(self.device_index)  # "cuda" is then this rank's GPU (the model runner's device)
        dist.init_process_group(
            backend=backend,
            init_method=init_method,
            rank=self.rank,
            world_size=self.world_size,
            timeout=datetime.timedelta(seconds=collective_timeout_s),
        )
        init_model_parallel(config.tensor_parallel_size, config.pipeline_parallel_size)
        self.driver = self.rank == (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.runner = ModelRunner(config, model_path)
        return {"rank": self.rank, "pid": os.getpid(), "backend": backend, "threads": torch.get_num_threads()}

    def determine_num_blocks(self) -> int:
        """KV blocks this rank can hold."""
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate this rank's share of ``num_blocks`` KV blocks."""
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput):
        """Run one step on this rank; the ``ModelRunnerOutput`` on the driver (the last stage's
        tensor rank 0, whose sampled tokens are the step's), None on every other rank."""
        out = self.runner.execute_model(sched)
        return out if self.driver else None

    def add_lora(self, request) -> None:
        """Load a LoRA adapter (``kvserve.engine.lora.LoRARequest``) into this rank's host cache.

        Raises:
            ValueError: the adapter does not load or fit.
        """
        self.runner.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter (False: it was not loaded)."""
        return self.runner.lora.remove(lora_int_id)

    def read_kv_blocks(self, block_ids: list[int]):
        """This rank's bytes of pool blocks ``block_ids`` (:meth:`ModelRunner.read_kv_blocks`)."""
        return self.runner.read_kv_blocks(block_ids)

    def write_kv_slots(self, slots: list[int], rows) -> None:
        """This rank's bytes of blocks into host-tier ``slots`` (:meth:`ModelRunner.write_kv_slots`)."""
        self.runner.write_kv_slots(slots, rows)

    def ping(self) -> int:
        """Liveness: this rank's number."""
        return self.rank

    def shard_info(self) -> dict:
        """This rank's share of the model: its layers (checkpoint indices ``[start, end)``),
        attention heads and KV cache (shape, and one K and one V tensor per layer it holds)."""
        model = self.runner.model
        attn = model.layers[0].self_attn
        k = self.runner.kv_caches[0][0] if self.runner.kv_caches else None
        return {
            "rank": self.rank,
            "num_heads": attn.num_heads,
            "num_kv_heads": attn.num_kv_heads,
            "layers": [getattr(model, "start_layer", 0), getattr(model, "end_layer", len(model.layers))],
            "num_kv_caches": len(self.runner.kv_caches),
            "kv_cache_shape": list(k.shape) if k is not None else None,
        }

    def shutdown(self) -> None:
        """Drop the model and leave the process group."""
        import torch.distributed as dist

        self.runner = None
        if dist.is_initialized():
            dist.destroy_process_group()
