"""Shared pytest fixtures: the real default model and tiny random-weight models."""

import os

os.environ["RAY_AUTH_MODE"] = "token"  # Ray token auth on for every Ray of the session (token: tests/serve/conftest.py)

import pytest  # noqa: E402

from engine.model_loader import resolve_model  # noqa: E402
from tiny_models import make_tiny_model  # noqa: E402  (tests/ is on sys.path for this conftest)


@pytest.fixture(scope="session")
def smollm2_path():
    """SmolLM2-135M-Instruct as a float32 safetensors folder (converted once into $KVSERVE_CACHE
    or ~/.cache/kvserve; about 30 s the first time, instant afterwards)."""
    return resolve_model(None)


@pytest.fixture(scope="session")
def tiny_llama_path(tmp_path_factory):
    """Tiny Llama (hidden 64, 2 layers, 4 heads / 2 KV heads, untied lm_head), SmolLM2 tokenizer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama")


@pytest.fixture(scope="session")
def tiny_qwen3_path(tmp_path_factory):
    """Tiny Qwen3 (q/k RMSNorm), same shape as tiny_llama."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3")


@pytest.fixture(scope="session")
def tiny_qwen2_path(tmp_path_factory):
    """Tiny Qwen2 (q/k/v biases), same shape as tiny_llama."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2")
