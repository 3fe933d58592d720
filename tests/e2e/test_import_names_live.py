"""One import root inside a Ray Serve replica (issue 62): a replica's worker process starts in the
driver's working directory, the repository root, where a top-level ``kernels/`` folder used to
shadow Hugging Face's ``kernels`` and failed every model load in ``LLMServer``. Here a
deployment's replica imports both, loads a model through transformers (hub kernels at its
default) and through kvserve, and reports where each name came from."""
from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: The deployment, compiled as ``__main__`` code so that Ray ships it by value (a worker cannot
#: import this test module by name).
PROBE_DEPLOYMENT = textwrap.dedent('''
    class ImportProbe:
        def __call__(self, model: str) -> dict:
            import importlib.metadata as md
            import os
            from pathlib import Path

            import kernels
            import torch
            from transformers import AutoModelForCausalLM

            from kvserve.engine import LLM, SamplingParams
            from kvserve.kernels import cpu_backend

            hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
            hf_next = int(hf(torch.tensor([[1, 2, 3, 4]])).logits[0, -1].argmax())
            llm = LLM(model, dtype="float32", num_kv_blocks=16, max_model_len=64)
            out = llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0))[0]
            return {
                "cwd": os.getcwd(),
                "kernels_file": str(Path(kernels.__file__).resolve()),
                "kernels_dist_file": str(Path(md.distribution("kernels").locate_file("kernels/__init__.py")).resolve()),
                "kvserve_kernels_file": str(Path(cpu_backend.__file__).resolve()),
                "hf_next": hf_next, "kvserve_next": int(out.outputs[0].token_ids[0]),
            }
''')


@pytest.mark.slow
def test_a_replica_imports_hf_kernels_and_kvserve(serve_app, tiny_llama_path):
    """(``serve_app``: Serve started as the session's apps need it, so this app only joins it.)"""
    from ray import serve

    assert Path(os.getcwd()).resolve() == ROOT  # the driver (and so its workers) at the repository root
    ns: dict = {"__name__": "__main__"}
    exec(compile(PROBE_DEPLOYMENT, "<import-probe>", "exec"), ns)
    app = serve.deployment(ns["ImportProbe"], ray_actor_options={"num_cpus": 0}).bind()
    handle = serve.run(app, name="import-probe", route_prefix=None)
    try:
        got = handle.remote(str(tiny_llama_path)).result(timeout_s=300)
    finally:
        serve.delete("import-probe")
    assert Path(got["cwd"]).resolve() == ROOT, got
    assert got["kernels_file"] == got["kernels_dist_file"], got  # Hugging Face's, not a folder of ours
    assert got["kvserve_kernels_file"] == str((ROOT / "kvserve" / "kernels" / "cpu_backend.py").resolve()), got
    assert got["hf_next"] == got["kvserve_next"], got
