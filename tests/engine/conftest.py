"""Fixtures shared by several files of tests/engine (the session-wide ones are tests/conftest.py's);
a module-scoped one is built once per test file that uses it."""

import pytest

from kvserve.engine.model_loader import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_path):
    return load_tokenizer(tiny_llama_path)
