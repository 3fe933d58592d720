"""The Triton attention kernels (``kvserve/kernels/triton_attention.py``) against the float64 reference of
attention_cases.py, one test per case of ``CASES``.

* Under ``TRITON_INTERPRET=1`` on CPU tensors, in a child process (triton_case_runner.py): the module
  fixture runs all cases in one child process, to pay the torch/triton import once.
* ``@pytest.mark.gpu`` tests compile the kernels for real on CUDA (fp16 and bf16; fp32 on its own)
  and are skipped without CUDA.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import CASES, _describe
from triton_case_runner import run_cases_in_subprocess


@pytest.fixture(scope="module")
def interpreter_results() -> dict[str, dict]:
    return run_cases_in_subprocess(list(CASES), "cpu", timeout=300)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", list(CASES))
def test_triton_interpreter(name, interpreter_results):
    rec = interpreter_results[name]
    assert rec.get("ok"), f"{name}: {_describe(rec)}"


# GPU: real compile (no interpreter), fp16 + bf16.
_GPU = torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_triton_gpu(dtype):
    res = run_cases_in_subprocess(list(CASES), "cuda", dtype=dtype, timeout=600)
    bad = {n: _describe(r) for n, r in res.items() if not r.get("ok")}
    assert not bad, bad


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU")
def test_triton_gpu_fp32():
    res = run_cases_in_subprocess(list(CASES), "cuda", dtype="float32", timeout=600)
    bad = {n: _describe(r) for n, r in res.items() if not r.get("ok")}
    assert not bad, bad
