"""Tensor and pipeline parallelism over Ray actors: one actor per rank, one ``torch.distributed`` group.

``RayWorkerGroup`` implements :class:`kvserve.engine.executor.Executor`. It starts ``N =
tensor_parallel_size x pipeline_parallel_size`` :class:`TPWorker` actors in a placement group (the replica's own, when
it runs inside a Serve replica deployed with ``placement_group_bundles`` and the model's
``placement_group_strategy``; else one it creates, ``STRICT_PACK`` by default so all ranks share a
node). Each worker joins a process group (NCCL on GPU, gloo on CPU). Ranks on one node meet
through a private file on it and keep their sockets on loopback; ranks spread over nodes
(``SPREAD`` / ``STRICT_SPREAD``) meet at a TCP store on rank 0's node and talk over the nodes'
network, which must then be the cluster's private one (torch's store takes no authentication).
Collectives time out after ``collective_timeout_s`` (a rank that died mid-step fails the step
instead of hanging the others). Then each worker (:class:`kvserve.engine.worker.Worker`, the rank code the
local-process executor ``kvserve.engine.mp_executor`` runs too) builds :class:`kvserve.engine.model_runner.ModelRunner`, which
loads that rank's shard of the weights (column/row-parallel linears, vocab-parallel embedding
and LM head, attention split by KV-head groups) and allocates that rank's share of the KV
cache. With pipeline parallelism rank ``stage * tp + t`` holds tensor rank ``t`` of stage ``stage``
(its layers only, and their KV cache); activations pass from stage to stage point to point
(``kvserve/engine/pipeline.py``). The scheduler runs once, in the engine; every step's ``SchedulerOutput``
goes to all ranks, which run the forward pass in lock step (their collectives pair up), and the
sampled tokens of the last stage's tensor rank 0 (rank 0 without a pipeline) are the step's result.

This module imports Ray and the engine, never ``kvserve/deployments/``.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import socket
import tempfile
from pathlib import Path

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvserve.cluster import reset_niceness
from kvserve.cluster.ray_auth import ensure_local_auth
from kvserve.engine.config import EngineConfig
from kvserve.engine.executor import Executor
from kvserve.engine.worker import Worker

logger = logging.getLogger("kvserve.cluster")


class TPWorker(Worker):
    """One rank as a Ray actor: :class:`kvserve.engine.worker.Worker` (a process group member and a model
    runner over its tensor shard of its pipeline stage) plus what Ray adds: where it runs, the
    rendezvous address, and a liveness probe in a concurrency group of its own."""

    def __init__(self, rank: int, world_size: int, torch_num_threads: int | None = None):
        reset_niceness()  # Ray starts workers at niceness 15; a model shard is the node's main work
        super().__init__(rank, world_size, torch_num_threads)

    def where(self) -> dict:
        """This rank's node: ``node_id`` (Ray's) and ``ip``."""
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}

    def rendezvous_tcp(self) -> str:
        """``tcp://<this node's address>:<a free port>`` for a process group whose ranks are on
        several nodes (asked of rank 0, whose ``init`` then hosts the store there)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def rendezvous_file(self) -> str:
        """A fresh path in a private (0700) directory of this node, for the process group's
        ``file://`` rendezvous (asked of rank 0). The ranks of one replica share a node
        (``STRICT_PACK``), so no rank opens a TCP rendezvous store: torch's listens on every
        interface with no authentication."""
        self._rendezvous_dir = tempfile.mkdtemp(prefix="kvserve-tp-")
        return os.path.join(self._rendezvous_dir, "rendezvous")

    def init(
        self,
        config: EngineConfig,
        model_path: str,
        init_method: str,
        one_node: bool = True,
        collective_timeout_s: float = 300.0,
    ) -> dict:
        """:meth:`kvserve.engine.worker.Worker.init` (Ray sets ``CUDA_VISIBLE_DEVICES`` to this actor's
        GPU); the returned dict also has this rank's ``node_id`` and ``ip``."""
        return {**super().init(config, model_path, init_method, one_node, collective_timeout_s), **self.where()}

    @ray.method(concurrency_group="health")
    def ping(self) -> int:
        """Liveness: runs in its own thread (concurrency group ``health``), so it answers even
        while a long ``execute_model`` step holds the default group."""
        return self.rank

    def shutdown(self) -> None:
        super().shutdown()
        if getattr(self, "_rendezvous_dir", None):
            shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


class RayWorkerGroup(Executor):
    """An :class:`kvserve.engine.executor.Executor` over ``tensor_parallel_size x pipeline_parallel_size``
    Ray actors.

    Args:
        config: the engine configuration (``tensor_parallel_size`` x ``pipeline_parallel_size``
            ranks; ``device``).
        model_path: local model folder (every rank loads its own shard from it, so on a
            multi-node cluster it must exist on every node, e.g. a shared file system).
        placement_group: the group to run in (default: the current one when called inside a
            replica or task that has one, else a new ``STRICT_PACK`` group this object owns).
        num_cpus / num_gpus: resources of each worker actor (default: 1 CPU, and 1 GPU when
            the device is CUDA).
        torch_num_threads: CPU threads per rank.
        bundle_offset: index of the bundle of rank 0 in the placement group.
        timeout_s: how long to wait for the placement group and the workers to start.
        strategy: the strategy of a placement group created here (``STRICT_PACK``: one node).
        collective_timeout_s: a collective waiting longer for a rank fails (seconds).

    Without a connected Ray (no ``ray.init`` in this process), one is started on this machine as
    vLLM's Ray executor does (:func:`init_local_ray`), and shut down again by :meth:`shutdown`:
    so the offline ``LLM(model, tensor_parallel_size=2)`` runs with ``distributed_executor_backend``
    ``"ray"`` (or its default where Ray is installed) and nothing else.

    Raises:
        TimeoutError: the placement group could not be reserved in time.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_path: str | Path,
        *,
        placement_group: PlacementGroup | None = None,
        num_cpus: float | None = None,
        num_gpus: float | None = None,
        torch_num_threads: int | None = None,
        bundle_offset: int = 0,
        timeout_s: float = 300.0,
        strategy: str = "STRICT_PACK",
        collective_timeout_s: float = 300.0,
    ):
        super().__init__(config, model_path)
        n = config.tensor_parallel_size * config.pipeline_parallel_size
        self.driver = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        cuda = config.torch_device.type == "cuda"
        num_cpus = 1 if num_cpus is None else num_cpus
        num_gpus = (1 if cuda else 0) if num_gpus is None else num_gpus
        self._owned_pg = None
        self.workers: list = []
        #: this group started the process's Ray (:func:`init_local_ray`) and shuts it down
        self.started_ray = False
        if not ray.is_initialized():
            init_local_ray(n * num_cpus)
            self.started_ray = True
        pg = placement_group or get_current_placement_group()
        self.placement_group = pg
        if pg is None:
            bundle = {"CPU": num_cpus} | ({"GPU": num_gpus} if num_gpus else {})
            pg = placement_group_create([dict(bundle) for _ in range(n)], strategy)
            self._owned_pg = pg
        if not pg.wait(timeout_seconds=timeout_s):
            self.shutdown()
            raise TimeoutError(
                f"placement group for {n} model-parallel workers not ready after {timeout_s}s "
                f"(each needs {num_cpus} CPU, {num_gpus} GPU)"
            )
        if len(pg.bundle_specs) < bundle_offset + n:
            self.shutdown()
            raise ValueError(
                f"placement group has {len(pg.bundle_specs)} bundles; "
                f"{n} ranks (tensor x pipeline parallel) need {n} from bundle {bundle_offset}"
            )
        actor_cls = ray.remote(concurrency_groups={"health": 1})(TPWorker)
        self.workers = [
            actor_cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg,
                    placement_group_bundle_index=bundle_offset + rank,
                    placement_group_capture_child_tasks=True,
                ),
            ).remote(rank, n, torch_num_threads)
            for rank in range(n)
        ]
        try:
            nodes = {w["node_id"] for w in ray.get([w.where.remote() for w in self.workers], timeout=timeout_s)}
            one_node = len(nodes) == 1
            if one_node:
                init_method = "file://" + ray.get(self.workers[0].rendezvous_file.remote(), timeout=timeout_s)
            else:
                init_method = ray.get(self.workers[0].rendezvous_tcp.remote(), timeout=timeout_s)
            infos = ray.get(
                [
                    w.init.remote(config, str(model_path), init_method, one_node, collective_timeout_s)
                    for w in self.workers
                ],
                timeout=timeout_s,
            )
        except Exception:
            self.shutdown()
            raise
        self.worker_info = infos
        logger.info("model-parallel workers ready: %s via %s", infos, init_method)

    # ---- Executor -------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        return min(ray.get([w.determine_num_blocks.remote() for w in self.workers]))

    def init_kv_cache(self, num_blocks: int) -> None:
        ray.get([w.init_kv_cache.remote(num_blocks) for w in self.workers])

    def execute_model(self, sched):
        # Every rank must run every step (also steps that only retire finished requests),
        # so the collectives inside the forward pass pair up across ranks.
        ref = ray.put(sched) if len(self.workers) > 2 else sched
        outs = ray.get([w.execute_model.remote(ref) for w in self.workers])
        return outs[self.driver]

    def add_lora(self, request) -> None:
        ray.get([w.add_lora.remote(request) for w in self.workers])

    def remove_lora(self, lora_int_id: int) -> bool:
        return all(ray.get([w.remove_lora.remote(lora_int_id) for w in self.workers]))

    def read_kv_blocks(self, block_ids: list[int]) -> list:
        return ray.get([w.read_kv_blocks.remote(block_ids) for w in self.workers])

    def write_kv_slots(self, slots: list[int], shards: list) -> None:
        if len(shards) != len(self.workers):
            raise ValueError(f"{len(self.workers)} ranks here, {len(shards)} shards given")
        ray.get([w.write_kv_slots.remote(slots, s) for w, s in zip(self.workers, shards)])

    def placement_group_info(self) -> dict:
        """Where the ranks run: the placement group (the replica's own, or one created here),
        its bundles and strategy, and each rank's process."""
        pg = self.placement_group
        return {
            "placement_group_id": pg.id.hex() if pg is not None else None,
            "created_here": self._owned_pg is not None,
            "bundles": list(pg.bundle_specs) if pg is not None else None,
            "ranks": self.worker_info,
        }

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Ping every rank (blocking, for the engine's step thread).

        Raises:
            RuntimeError: the group has no workers (shut down).
            ray.exceptions.RayActorError: a worker is dead.
            ray.exceptions.GetTimeoutError: a worker did not answer within ``timeout_s`` seconds.
        """
        if not self.workers:
            raise RuntimeError("the tensor-parallel workers are shut down")
        ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    async def check_health_async(self, timeout_s: float = 30.0) -> None:
        """:meth:`check_health` for an event loop (the replica's health probe).

        Raises:
            RuntimeError, ray.exceptions.RayActorError: as :meth:`check_health`.
            asyncio.TimeoutError: a worker did not answer within ``timeout_s`` seconds.
        """
        if not self.workers:
            raise RuntimeError("the tensor-parallel workers are shut down")
        refs = [w.ping.remote() for w in self.workers]
        await asyncio.wait_for(asyncio.gather(*refs), timeout_s)

    def shutdown(self) -> None:
        for w in getattr(self, "workers", []):
            try:
                ray.get(w.shutdown.remote(), timeout=10)
            except Exception:
                pass
            try:
                ray.kill(w)
            except Exception:
                pass
        self.workers = []
        self._release_pg()
        if self.started_ray:
            self.started_ray = False
            ray.shutdown()

    def _release_pg(self) -> None:
        if self._owned_pg is not None:
            try:
                remove_placement_group(self._owned_pg)
            except Exception:
                pass
            self._owned_pg = None


def init_local_ray(num_cpus_needed: float = 1.0) -> None:
    """Start a Ray instance on this machine for an engine that has none (vLLM's
    ``initialize_ray_cluster`` with no address), set up as ``kvserve serve`` starts one: token
    authentication on and its ports on 127.0.0.1 (:func:`kvserve.cluster.ray_auth.ensure_local_auth`:
    the token from ``RAY_AUTH_TOKEN``, else an owner-only file at ``RAY_AUTH_TOKEN_PATH`` or
    ``~/.ray/auth_token``, created if missing; an explicit ``RAY_AUTH_MODE=disabled`` is kept
    with a warning), no dashboard, and at least ``num_cpus_needed`` logical CPUs (a scheduling
    budget: the ranks' actors must fit even on a machine with fewer cores). Always a new
    instance (``address="local"``): never a cluster that ``RAY_ADDRESS`` or the last ``ray start``
    names (joining one with a CPU count is Ray's ValueError; to use a running cluster, call
    ``ray.init(address=...)`` before building the engine).

    Raises:
        SystemExit: ``RAY_AUTH_MODE`` is neither ``token`` nor ``disabled``.
        RuntimeError, ConnectionError: Ray could not start.
    """
    ensure_local_auth()
    os.environ.setdefault("RAY_worker_niceness", "0")
    num_cpus = max(os.cpu_count() or 1, math.ceil(num_cpus_needed))
    logger.info("no Ray instance in this process: starting a local one (%d logical CPUs)", num_cpus)
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False)


def placement_group_create(bundles: list[dict], strategy: str = "STRICT_PACK") -> PlacementGroup:
    return placement_group(bundles, strategy=strategy)


def tp_placement_group_bundles(
    tensor_parallel_size: int,
    device: str = "cpu",
    *,
    replica_cpus: float = 1.0,
    worker_cpus: float = 1.0,
    worker_gpus: float | None = None,
) -> list[dict]:
    """Serve ``placement_group_bundles`` for a replica with ``tensor_parallel_size`` workers (pass
    ``tensor_parallel_size * pipeline_parallel_size``: one bundle per rank of every stage).

    The replica actor itself lands in bundle 0, so bundle 0 holds the replica's CPUs plus
    rank 0's resources; bundles 1..N-1 hold one rank each (``{"GPU": 1}`` per rank on CUDA:
    one worker actor per GPU).
    """
    gpus = (1.0 if device == "cuda" else 0.0) if worker_gpus is None else worker_gpus
    out = []
    for rank in range(tensor_parallel_size):
        b = {"CPU": worker_cpus + (replica_cpus if rank == 0 else 0.0)}
        if gpus:
            b["GPU"] = gpus
        out.append(b)
    return out
