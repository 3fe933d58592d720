"""``distributed_executor_backend`` (vLLM's knob): the engine picks its executor by name, importing
Ray only when the ``"ray"`` backend is chosen; ``"mp"`` runs the ranks as local processes (no Ray)
and gives the same greedy tokens as one process. The Ray backend's end-to-end test (which needs a
Ray instance) is ``tests/e2e/test_tensor_parallel.py``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvserve.engine import LLM, EngineConfig, SamplingParams
from kvserve.engine.executor import (
    EXECUTOR_BACKENDS,
    Executor,
    UniProcExecutor,
    executor_backends,
    resolve_executor_backend,
)

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [[1, 2, 3, 4, 5], list(range(200, 230)), [7] * 9]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
KW = dict(dtype="float32", max_model_len=128, num_kv_blocks=32, max_num_seqs=4)


def test_backend_is_resolved_as_vllm_does(monkeypatch):
    import kvserve.engine.executor as executor

    assert resolve_executor_backend(EngineConfig()) == "uni"
    assert resolve_executor_backend(EngineConfig(tensor_parallel_size=2)) == "ray"  # Ray is installed here
    assert resolve_executor_backend(EngineConfig(pipeline_parallel_size=2, distributed_executor_backend="mp")) == "mp"
    monkeypatch.setattr(executor.importlib.util, "find_spec", lambda name: None)  # as on a box without Ray
    assert resolve_executor_backend(EngineConfig(tensor_parallel_size=2)) == "mp"
    assert resolve_executor_backend(EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")) == "ray"
    monkeypatch.undo()
    assert Executor.get_class(EngineConfig()) is UniProcExecutor
    assert (
        Executor.get_class(EngineConfig(tensor_parallel_size=2, distributed_executor_backend="mp")).__name__
        == "MultiprocExecutor"
    )
    assert set(EXECUTOR_BACKENDS) == {"uni", "mp"}  # the engine's own; Ray's is the cluster's plugin
    assert executor_backends()["ray"] == "kvserve.cluster.worker_group:RayWorkerGroup"
    assert Executor.get_class(EngineConfig(tensor_parallel_size=2, distributed_executor_backend="ray")).__name__ == (
        "RayWorkerGroup"
    )
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'ray', 'mp', 'uni' or None"):
        EngineConfig(distributed_executor_backend="thread")
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        EngineConfig(tensor_parallel_size=2, distributed_executor_backend="uni")


def test_the_engine_imports_ray_only_for_the_ray_backend(tiny_llama_path):
    """A one-rank engine and the backend choice itself load no Ray (kvserve/engine/ runs without it)."""
    code = (
        "import sys\nfrom kvserve.engine import LLM, EngineConfig\nfrom kvserve.engine.executor import Executor\n"
        f"llm = LLM({str(tiny_llama_path)!r}, dtype='float32', num_kv_blocks=8, max_model_len=32)\n"
        "Executor.get_class(EngineConfig(tensor_parallel_size=2, distributed_executor_backend='mp'))\n"
        "assert 'ray' not in sys.modules and 'kvserve.cluster' not in sys.modules, sorted(sys.modules)\n"
        "Executor.get_class(EngineConfig(tensor_parallel_size=2, distributed_executor_backend='ray'))\n"
        "assert 'ray' in sys.modules\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.fixture(scope="module")
def reference(tiny_llama_path):
    llm = LLM(str(tiny_llama_path), **KW)
    try:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("tp, pp", [(2, 1), (1, 2)])
def test_mp_backend_matches_one_process(tiny_llama_path, reference, tp, pp):
    """TP=2 (each rank one of the 2 KV heads) and PP=2 (each stage one of the 2 layers) over local
    processes, no Ray: the same greedy tokens as one process (float32, so the split sums round
    alike); the ranks are processes of their own, a rank that dies is named by the next call
    (not waited for forever), and shutdown ends the others."""
    from kvserve.engine.mp_executor import MultiprocExecutor, WorkerError

    llm = LLM(
        str(tiny_llama_path),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        distributed_executor_backend="mp",
        **KW,
    )
    ex = llm.engine.executor
    procs = list(ex._procs)
    try:
        assert isinstance(ex, MultiprocExecutor)
        assert [i["rank"] for i in ex.worker_info] == [0, 1] and {i["backend"] for i in ex.worker_info} == {"gloo"}
        pids = {i["pid"] for i in ex.worker_info}
        assert len(pids) == 2 and os.getpid() not in pids
        shards = ex.shard_info()
        if tp == 2:
            assert [s["num_kv_heads"] for s in shards] == [1, 1] and [s["num_heads"] for s in shards] == [2, 2]
        else:
            assert [s["layers"] for s in shards] == [[0, 1], [1, 2]]
        out = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        ex.check_health()
        procs[1].kill()
        procs[1].join(10)
        with pytest.raises(WorkerError, match="rank 1 .*(exited|gone)"):
            ex.check_health(timeout_s=10)
    finally:
        llm.engine.shutdown()
    assert out == reference
    assert not any(p.is_alive() for p in procs) and not os.path.exists(ex._dir)
