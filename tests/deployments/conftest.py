"""Fixtures of the in-process serving tests: ``local_app``, kvserve's HTTP API over real models in
this process (tests/local_app.py), shared by the files that drive it with real clients."""

import pytest
from local_app import LocalApp

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
API_KEY = "sk-kvserve-test"


@pytest.fixture(scope="session")
def local_app(smollm2_path, tiny_llama_path):
    """The live test app's models (tests/e2e/conftest.py) in this process: SmolLM2-135M-Instruct
    under its default name (float32 on every CPU: logprobs and hidden states are compared with HF
    transformers in float32) and a tiny random-weight model ("tiny"), with the default exact
    response cache; at ``/auth`` the tiny model behind an API key (the encoder is the live app's
    only: tests/e2e/test_embeddings_tokenize_live.py). Yields the URLs (``root``, ``base_url``,
    ``auth_base_url``), the model's name (``model``), the key and SmolLM2's replica handle (``llm``)."""
    tiny = {
        "model": str(tiny_llama_path),
        "served_model_name": "tiny",
        "max_num_seqs": 8,
        "max_model_len": 256,
        "torch_num_threads": 1,
    }
    app = LocalApp(
        {
            "/": {
                "models": [
                    {
                        "model": None,
                        "dtype": "float32",
                        "max_num_seqs": 32,
                        "max_model_len": 1024,
                        "torch_num_threads": 1,
                    },
                    tiny,
                ]
            },
            "/auth": {"models": [tiny], "api_keys": [API_KEY]},
        }
    ).start()
    try:
        yield app.namespace(model=SMOLLM2, api_key=API_KEY, llm=app.handles[SMOLLM2])
    finally:
        app.stop()
