"""Tensor and pipeline parallelism over local processes, without Ray (vLLM's ``MultiprocExecutor``,
``distributed_executor_backend="mp"``).

:class:`MultiprocExecutor` starts one process per rank (``tensor_parallel_size x
pipeline_parallel_size``) with the ``spawn`` start method (no state inherited from the engine's
process: torch's thread pools and a CUDA context do not survive ``fork``). Each runs an
:class:`kvserve.engine.worker.Worker`, the same rank code as the Ray actors of ``kvserve/cluster/``: it joins a
``torch.distributed`` group (gloo on CPU, NCCL on CUDA, rank ``r`` on the ``r``-th visible GPU) that
meets through a file in a private (0700) temporary directory, so no rendezvous port is opened,
and loads its shard of the model. The engine's process talks to each rank over a pipe: every
call goes to all ranks, which run it in lock step (their collectives pair up), and the step's
result is the driver's (the last stage's tensor rank 0).

Because of ``spawn``, a script that builds an engine with this backend must guard its entry
point with ``if __name__ == "__main__":`` (each rank imports the main module, as with any
``spawn`` multiprocessing program).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import traceback
import weakref
from pathlib import Path

from kvserve.engine.config import EngineConfig
from kvserve.engine.executor import Executor
from kvserve.engine.sched_output import SchedulerOutput
from kvserve.engine.worker import Worker

logger = logging.getLogger("kvserve.engine")

#: Seconds between checks that a rank is still alive while waiting for its answer.
_POLL_S = 0.5


class WorkerError(RuntimeError):
    """A rank's call raised (the message names the rank, the call and the rank's exception;
    ``remote_traceback`` holds its traceback), or a rank process is gone."""

    def __init__(self, message: str, remote_traceback: str | None = None, remote_type: str | None = None):
        super().__init__(message)
        self.remote_traceback, self.remote_type = remote_traceback, remote_type


def _worker_main(rank: int, world_size: int, torch_num_threads: int | None, conn) -> None:
    """A rank process: build a :class:`Worker` (on CUDA, on the ``rank``-th visible GPU), then answer ``(method, args)`` calls from the
    engine with ``("ok", result)`` or ``("error", (exception type name, message, traceback))`` until ``"shutdown"`` or
    until the engine's end of the pipe closes (the engine's process is gone)."""
    worker = None
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            break
        try:
            if method == "start":
                worker = Worker(rank, world_size, torch_num_threads, device_index=rank)
                result = os.getpid()
            else:
                result = getattr(worker, method)(*args)
            reply = ("ok", result)
        except BaseException as e:  # the engine decides; this process keeps answering
            reply = ("error", (type(e).__name__, str(e), traceback.format_exc()))
        try:
            conn.send(reply)
        except Exception as e:  # a result that does not pickle
            conn.send(("error", ("RuntimeError", f"its result could not be sent: {e}", None)))
        if method == "shutdown":
            break
    conn.close()


def _stop(procs: list, conns: list, rendezvous_dir: str | None) -> None:
    """Ask every rank process to leave, then end those still running; remove the rendezvous
    directory. Idempotent (also the executor's finalizer)."""
    for conn, proc in zip(conns, procs):
        if proc.is_alive():
            try:
                conn.send(("shutdown", ()))
            except Exception:
                pass
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()
    procs.clear()
    conns.clear()
    if rendezvous_dir:
        shutil.rmtree(rendezvous_dir, ignore_errors=True)


class MultiprocExecutor(Executor):
    """An :class:`Executor` over ``tensor_parallel_size x pipeline_parallel_size`` local rank
    processes (see the module docstring).

    Args:
        config: the engine configuration (ranks, ``device``).
        model_path: local model folder (every rank loads its own shard from it).
        torch_num_threads: CPU threads of each rank (default: this machine's cores divided
            among the ranks, at least 1).
        timeout_s: how long the ranks may take to start and load the model (seconds).
        collective_timeout_s: a collective waiting longer for a rank fails (seconds).

    Raises:
        ValueError: CUDA with fewer visible GPUs than ranks.
        WorkerError: a rank failed to start, join the group or load the model (the rank's
            own error in the message), or did not within ``timeout_s``.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_path: str | Path,
        *,
        torch_num_threads: int | None = None,
        timeout_s: float = 300.0,
        collective_timeout_s: float = 300.0,
    ):
        super().__init__(config, model_path)
        n = config.tensor_parallel_size * config.pipeline_parallel_size
        self.driver = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        if config.torch_device.type == "cuda":
            import torch

            if torch.cuda.device_count() < n:
                raise ValueError(
                    f"{n} ranks (tensor x pipeline parallel) need {n} GPUs; {torch.cuda.device_count()} visible"
                )
        threads = torch_num_threads or max(1, (os.cpu_count() or 1) // n)
        ctx = multiprocessing.get_context("spawn")
        self._lock = threading.Lock()
        self._procs: list = []
        self._conns: list = []
        self._dir = tempfile.mkdtemp(prefix="kvserve-mp-")  # 0700: the rendezvous file is ours alone
        self._finalizer = weakref.finalize(self, _stop, self._procs, self._conns, self._dir)
        try:
            for rank in range(n):
                parent, child = ctx.Pipe()
                proc = ctx.Process(
                    target=_worker_main, args=(rank, n, threads, child), name=f"kvserve-rank-{rank}", daemon=True
                )
                proc.start()
                child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            pids = self._call_all("start", timeout_s=timeout_s)
            init_method = "file://" + os.path.join(self._dir, "rendezvous")
            self.worker_info = self._call_all(
                "init", config, str(model_path), init_method, True, collective_timeout_s, timeout_s=timeout_s
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info("model-parallel rank processes ready (pids %s): %s", pids, self.worker_info)

    # ---- calls to the ranks ------------------------------------------------------------------
    def _call_all(self, method: str, *args, timeout_s: float | None = None, per_rank: list | None = None) -> list:
        """Call ``method(*args)`` on every rank's :class:`Worker` and wait for all answers
        (all are read even when one fails, so the pipes stay in step). ``per_rank``: one more
        argument for each rank, appended to ``args`` (rank order).

        Raises:
            WorkerError: a rank raised (the first rank's error), died, or (``timeout_s``) did
                not answer in time.
        """
        with self._lock:
            if not self._procs:
                raise WorkerError("the rank processes are shut down")
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send((method, args if per_rank is None else (*args, per_rank[rank])))
                except (OSError, ValueError) as e:
                    raise WorkerError(f"rank {rank} is gone ({method}): {e}") from e
            replies = [self._recv(rank, method, timeout_s) for rank in range(len(self._conns))]
        errors = [(rank, r) for rank, r in enumerate(replies) if isinstance(r, WorkerError)]
        if errors:
            raise errors[0][1]
        return replies

    def _recv(self, rank: int, method: str, timeout_s: float | None):
        """Rank ``rank``'s answer to ``method``: its result, or a :class:`WorkerError` (returned,
        not raised) for its exception, its death or a timeout."""
        conn, proc = self._conns[rank], self._procs[rank]
        waited = 0.0
        while not conn.poll(_POLL_S):
            waited += _POLL_S
            if not proc.is_alive() and not conn.poll():
                return WorkerError(f"rank {rank} process exited (code {proc.exitcode}) during {method}")
            if timeout_s is not None and waited >= timeout_s:
                return WorkerError(f"rank {rank} did not answer {method} within {timeout_s:.0f} s")
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as e:
            return WorkerError(f"rank {rank} process is gone ({method}): {e}")
        if status == "ok":
            return value
        kind, message, tb = value
        return WorkerError(f"rank {rank} failed in {method}: {kind}: {message}", tb, kind)

    # ---- Executor ----------------------------------------------------------------------------
    def determine_num_blocks(self) -> int:
        return min(self._call_all("determine_num_blocks"))

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call_all("init_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput):
        # every rank runs every step (also steps that only retire finished requests)
        return self._call_all("execute_model", sched)[self.driver]

    def add_lora(self, request) -> None:
        """Load an adapter on every rank.

        Raises:
            ValueError: the adapter does not load or fit (a rank's reason in the message).
        """
        self._call_all_bad_input("add_lora", request)

    def _call_all_bad_input(self, method: str, *args, **kw) -> list:
        """:meth:`_call_all` for calls whose ``ValueError`` on a rank is the caller's bad input:
        raised here as ``ValueError`` (a rank's reason in the message), other failures as
        :class:`WorkerError`."""
        try:
            return self._call_all(method, *args, **kw)
        except WorkerError as e:
            if e.remote_type == "ValueError":
                raise ValueError(str(e)) from e
            raise

    def remove_lora(self, lora_int_id: int) -> bool:
        return all(self._call_all("remove_lora", lora_int_id))

    def read_kv_blocks(self, block_ids: list[int]) -> list:
        return self._call_all("read_kv_blocks", block_ids)

    def write_kv_slots(self, slots: list[int], shards: list) -> None:
        if len(shards) != len(self._conns):
            raise ValueError(f"{len(self._conns)} ranks here, {len(shards)} shards given")
        self._call_all_bad_input("write_kv_slots", slots, per_rank=shards)

    def shard_info(self) -> list[dict]:
        """Each rank's share of the model (:meth:`kvserve.engine.worker.Worker.shard_info`)."""
        return self._call_all("shard_info")

    def check_health(self, timeout_s: float = 30.0) -> None:
        """Ping every rank (blocking; not while a step runs in another thread).

        Raises:
            WorkerError: a rank is gone or did not answer within ``timeout_s`` seconds.
        """
        self._call_all("ping", timeout_s=timeout_s)

    def shutdown(self) -> None:
        """Stop every rank process (each leaves its process group first) and remove the
        rendezvous directory; idempotent."""
        with self._lock:
            self._finalizer()
