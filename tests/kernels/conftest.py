"""Fixtures of the kernel tests."""

import pytest


@pytest.fixture(scope="module")
def cpu_kernel():
    from kvserve.kernels import cpu_backend

    if not cpu_backend.load_kernel():
        pytest.skip(f"cpu attention kernel cannot be built here: {cpu_backend.kernel_error()}")
    return cpu_backend
