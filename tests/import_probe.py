"""The import-name probe of tests/test_import_names.py and tests/e2e/test_import_names_live.py:
run inside a process of its own (a fresh interpreter, a Serve replica), it imports Hugging Face's
``kernels`` and kvserve side by side, loads one model through transformers (hub kernels at
transformers' default) and through kvserve, and reports where each name came from."""

from __future__ import annotations

from pathlib import Path

#: Source of ``probe(model: str) -> dict``, run where the check is (``exec`` it as ``__main__``
#: code: a Ray worker cannot import this test module by name, so Ray ships it by value).
PROBE_SOURCE = """
def probe(model):
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
"""


def probe_function():
    """``probe`` compiled as ``__main__`` code."""
    ns: dict = {"__name__": "__main__"}
    exec(compile(PROBE_SOURCE, "<import-probe>", "exec"), ns)
    return ns["probe"]


def check_probe(got: dict, root: Path) -> None:
    """``import kernels`` was Hugging Face's distribution, kvserve's kernels this checkout's, and
    both loaded the model and agree on its next token."""
    assert got["kernels_file"] == got["kernels_dist_file"], got
    assert got["kvserve_kernels_file"] == str((root / "kvserve" / "kernels" / "cpu_backend.py").resolve()), got
    assert got["hf_next"] == got["kvserve_next"], got
