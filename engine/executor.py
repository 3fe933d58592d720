"""Executor interface: how the engine reaches its model runner(s).

``UniProcExecutor`` runs one :class:`ModelRunner` in-process (tensor_parallel_size 1). For
more ranks the engine takes an injected executor, e.g. ``cluster.worker_group.RayWorkerGroup``,
so ``engine/`` itself never imports Ray.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path

from engine.config import EngineConfig
from engine.scheduler import SchedulerOutput


class Executor(ABC):
    """Runs scheduler steps on the model. Implementations must return rank 0's output."""

    #: The model runner runs in the engine's process, so a ``SchedulerOutput`` may carry
    #: objects that do not pickle (the grammar bitmask as a ``Future``, filled while the model runs).
    in_process: bool = False

    def __init__(self, config: EngineConfig, model_path: str | Path):
        self.config, self.model_path = config, model_path

    @abstractmethod
    def determine_num_blocks(self) -> int:
        """KV blocks every rank can hold (the minimum over ranks)."""

    @abstractmethod
    def init_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every rank."""

    @abstractmethod
    def execute_model(self, sched: SchedulerOutput):
        """Run one step; returns a ``ModelRunnerOutput``."""

    def add_lora(self, request) -> None:
        """Load a LoRA adapter (an ``engine.lora.LoRARequest``) on every rank's host cache.

        Raises:
            ValueError: the adapter does not load or fit (the reason in the message).
        """
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from every rank (False: it was not loaded)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def check_health(self) -> None:
        """Raise if the executor can no longer run steps (a worker is gone, the device
        failed). Called by the async engine after a step failure that no single request
        explains; must not block for long. Default: nothing to check.

        Raises:
            RuntimeError (or the transport's error): the executor is dead.
        """

    def shutdown(self) -> None:
        """Release workers and memory."""


class UniProcExecutor(Executor):
    """One model runner in the engine's own process."""

    in_process = True

    def __init__(self, config: EngineConfig, model_path: str | Path):
        super().__init__(config, model_path)
        if config.tensor_parallel_size != 1 or config.pipeline_parallel_size != 1:
            raise ValueError("tensor_parallel_size > 1 or pipeline_parallel_size > 1 needs a distributed executor "
                             "(e.g. cluster.worker_group.RayWorkerGroup)")
        from engine.model_runner import ModelRunner
        self.runner = ModelRunner(config, model_path)

    def determine_num_blocks(self) -> int:
        return self.runner.determine_num_blocks()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def execute_model(self, sched: SchedulerOutput):
        return self.runner.execute_model(sched)

    def add_lora(self, request) -> None:
        self.runner.lora.add(request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.runner.lora.remove(lora_int_id)

    def check_health(self) -> None:
        """Raises if the runner is gone (shut down) or, on CUDA, the device context is broken
        (a device-side assert poisons every later kernel launch)."""
        runner = self.runner
        if runner is None:
            raise RuntimeError("the model runner is gone (executor shut down)")
        if runner.device.type == "cuda":
            import torch

            torch.cuda.synchronize(runner.device)

    def shutdown(self) -> None:
        self.runner = None
