"""Executor interface: how the engine reaches its model runner(s).

``UniProcExecutor`` runs one :class:`ModelRunner` in-process (tensor_parallel_size 1). For more
ranks (``tensor_parallel_size x pipeline_parallel_size > 1``) the engine picks a distributed
executor by ``EngineConfig.distributed_executor_backend``, as vLLM does
(:meth:`Executor.get_class`): ``"mp"``, :class:`kvserve.engine.mp_executor.MultiprocExecutor` (one local
process per rank, no Ray), or ``"ray"``, ``kvserve.cluster.worker_group.RayWorkerGroup`` (one Ray actor per
rank). Backends are named by ``"module:attribute"`` strings (:data:`EXECUTOR_BACKENDS`) imported
only when chosen, so ``kvserve/engine/`` itself never imports Ray (nor ``kvserve/cluster/``). A caller may also
inject any executor (``LLMEngine(executor_factory=...)``, e.g. a ``RayWorkerGroup`` in a Serve
replica's placement group).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path

from kvserve.engine.config import EngineConfig
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.sched_output import SchedulerOutput

#: The engine's own backends: ``distributed_executor_backend`` -> ``"module:attribute"`` of its
#: executor class, a callable ``(config, model_path) -> Executor`` (imported only when chosen).
EXECUTOR_BACKENDS: dict[str, str] = {
    "uni": "kvserve.engine.executor:UniProcExecutor",
    "mp": "kvserve.engine.mp_executor:MultiprocExecutor",
}
#: The entry-point group of the backends installed beside the engine (a distribution's
#: ``[project.entry-points."kvserve.executor_backends"]``): kvserve's ``ray`` backend is one,
#: registered from ``kvserve/cluster/`` (Ray actors), a floor above the engine, which never names it.
EXECUTOR_ENTRY_POINTS = "kvserve.executor_backends"


def executor_backends() -> dict[str, str]:
    """Every backend by name: the engine's own (:data:`EXECUTOR_BACKENDS`, which win) and the
    installed plugins' (:data:`EXECUTOR_ENTRY_POINTS`), each ``"module:attribute"``."""
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group=EXECUTOR_ENTRY_POINTS)}
    return {**plugins, **EXECUTOR_BACKENDS}


def resolve_executor_backend(config: EngineConfig) -> str:
    """The backend ``config`` runs on: ``distributed_executor_backend`` when set, else (vLLM's
    rule) ``"uni"`` for one rank, ``"ray"`` where Ray is installed, ``"mp"`` where it is not.

    Raises:
        ValueError: ``"uni"`` asked for with more than one rank.
    """
    world = config.tensor_parallel_size * config.pipeline_parallel_size
    name = config.distributed_executor_backend
    if name is None:
        if world == 1:
            return "uni"
        return "ray" if importlib.util.find_spec("ray") is not None else "mp"
    if name == "uni" and world > 1:
        raise ValueError(
            f"distributed_executor_backend 'uni' runs one rank; tensor_parallel_size "
            f"{config.tensor_parallel_size} x pipeline_parallel_size {config.pipeline_parallel_size} "
            f"needs 'mp' (local processes) or 'ray' (Ray actors)"
        )
    return name


class Executor(ABC):
    """Runs scheduler steps on the model. Implementations must return rank 0's output."""

    #: The model runner runs in the engine's process, so a ``SchedulerOutput`` may carry
    #: objects that do not pickle (the grammar bitmask as a ``Future``, filled while the model runs).
    in_process: bool = False

    def __init__(self, config: EngineConfig, model_path: str | Path):
        self.config, self.model_path = config, model_path

    @staticmethod
    def get_class(config: EngineConfig) -> Callable[[EngineConfig, str], "Executor"]:
        """The executor class of ``config``'s backend (:func:`resolve_executor_backend`),
        imported now (vLLM's ``Executor.get_class``).

        Raises:
            ValueError: an unknown backend, or ``"uni"`` with more than one rank.
            ImportError: the backend's module is missing (``"ray"`` without Ray installed:
                the message says to install it or pick ``"mp"``).
        """
        name = resolve_executor_backend(config)
        backends = executor_backends()
        if name not in backends:
            hint = (
                " (kvserve registers 'ray' when it is installed: pip install -e . in a checkout)"
                if name == "ray"
                else ""
            )
            raise ValueError(
                f"distributed_executor_backend must be one of {sorted(backends)} or None, got {name!r}{hint}"
            )
        module, attr = backends[name].split(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except ImportError as e:
            hint = ": install ray, or use 'mp' (local processes, no Ray)" if name == "ray" else ""
            raise ImportError(f"distributed_executor_backend {name!r} needs {module} ({e}){hint}") from e

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
        """Load a LoRA adapter (an ``kvserve.engine.lora.LoRARequest``) on every rank's host cache.

        Raises:
            ValueError: the adapter does not load or fit (the reason in the message).
        """
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Unload an adapter from every rank (False: it was not loaded)."""
        raise NotImplementedError(f"{type(self).__name__} does not serve LoRA adapters")

    def read_kv_blocks(self, block_ids: list[int]) -> list:
        """Every rank's bytes of pool blocks ``block_ids``, in rank order (each a ``uint8
        [len(block_ids), rank's block bytes]`` array: :func:`kvserve.engine.kv_offload.read_blocks`)."""
        raise NotImplementedError(f"{type(self).__name__} does not copy KV blocks out")

    def write_kv_slots(self, slots: list[int], shards: list) -> None:
        """Write blocks into host-tier ``slots`` on every rank: ``shards[rank]`` is that rank's
        ``uint8 [len(slots), rank's block bytes]`` array.

        Raises:
            ValueError: no host tier, or shards of another layout.
        """
        raise NotImplementedError(f"{type(self).__name__} does not copy KV blocks in")

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
            raise ValueError(
                "tensor_parallel_size > 1 or pipeline_parallel_size > 1 needs a distributed executor: "
                "distributed_executor_backend 'mp' (local processes) or 'ray' (Ray actors)"
            )
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

    def read_kv_blocks(self, block_ids: list[int]) -> list:
        return [self.runner.read_kv_blocks(block_ids)]

    def write_kv_slots(self, slots: list[int], shards: list) -> None:
        if len(shards) != 1:
            raise ValueError(f"one rank here, {len(shards)} shards given")
        self.runner.write_kv_slots(slots, shards[0])

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
