"""Fixtures of the serving tests: one Ray instance per test session, one kvserve Serve app.

The app serves SmolLM2-135M-Instruct under its default name (as ``make serve`` does) plus a
tiny random-weight model ("tiny") and the bundled sentence encoder (all-MiniLM-L6-v2, for
``/v1/embeddings``), with the default exact response cache, the semantic one
for requests that ask (``opt-in``) and an admin key; a second small app ("kvserve-auth", route ``/auth``)
serves the tiny model with an API key and tensor_parallel_size 2 (worker actors in the
replica's placement group). ``tokenizers``: SmolLM2's tokenizers as the engine and the
prefix router load them (test_router.py, test_router_live.py).
"""

import atexit
import os
import shutil
import tempfile

from kvserve.cluster import set_local_ray_env
from kvserve.cluster.ray_auth import ensure_local_auth

# Ray's token authentication on, as `kvserve serve` runs it, with a token of this test session
# only (RAY_AUTH_TOKEN_PATH in a private temp dir, not the user's ~/.ray/auth_token, which the
# tests neither read nor write); and, like `kvserve serve`, the session's Ray binds its ports to
# 127.0.0.1. All before `import ray`: Ray reads these variables when it is imported.
os.environ["RAY_AUTH_MODE"] = "token"
os.environ.pop("RAY_AUTH_TOKEN", None)
_RAY_AUTH_DIR = tempfile.mkdtemp(prefix="kvserve-ray-auth-")  # mode 0700
atexit.register(shutil.rmtree, _RAY_AUTH_DIR, True)
os.environ["RAY_AUTH_TOKEN_PATH"] = os.path.join(_RAY_AUTH_DIR, "auth_token")
RAY_AUTH = ensure_local_auth()  # writes the session's token (0600); subprocesses inherit the env
set_local_ray_env()  # worker niceness, Serve's loop intervals: as `kvserve serve` does

import time  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
from helpers import free_port  # noqa: E402

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
API_KEY = "sk-kvserve-test"
ADMIN_KEY = "sk-kvserve-admin-test"  # the main app's admin key (DELETE /v1/cache)


@pytest.fixture(scope="session")
def ray_session():
    """A local Ray instance (8 logical CPUs on whatever cores there are), shared by all the
    Ray tests of this session; reused if something already started one. Token auth is on
    (the session's token at ``token_path``) and its ports are on 127.0.0.1, as with `kvserve serve`."""
    import ray

    started = False
    if not ray.is_initialized():
        # address "local": a new instance even where /tmp/ray/ray_current_cluster or RAY_ADDRESS
        # names another (ray.cluster_utils.Cluster writes that file for its own clusters)
        ray.init(address="local", num_cpus=8, include_dashboard=False, log_to_driver=False)
        started = True
    yield SimpleNamespace(
        address=ray.get_runtime_context().gcs_address, auth=RAY_AUTH, token_path=os.environ["RAY_AUTH_TOKEN_PATH"]
    )
    if started:
        try:
            from ray import serve

            serve.shutdown()
        except Exception:
            pass
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_app(ray_session, smollm2_path, tiny_llama_path):
    """The kvserve app over real HTTP; yields base URLs and a handle to SmolLM2's LLMServer."""
    from ray import serve

    from kvserve.deployments.app import build_app

    from tests.engine.test_lora import ADAPTERS, make_adapter

    name, rank, alpha, targets, rslora = ADAPTERS[0]  # the tiny model serves one LoRA adapter, "tiny-lora"
    tiny_lora = make_adapter(tiny_llama_path, tiny_llama_path.parent / "tiny-lora", rank, alpha, targets, rslora, 0)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    t0 = time.time()
    # Deployments autoscale with kvserve's policy by default (1..8 replicas); max_replicas 1
    # keeps one replica per model here (the policy still runs) so the tests know where requests
    # land; test_autoscaling_integration.py lets it scale.
    main = build_app(
        {
            "models": [
                # float32 on every CPU: test_serve_http compares with the offline engine in float32
                {"model": None, "dtype": "float32", "max_num_seqs": 32, "max_model_len": 1024, "max_replicas": 1},
                {
                    "model": str(tiny_llama_path),
                    "served_model_name": "tiny",
                    "max_num_seqs": 8,
                    "max_model_len": 256,
                    "torch_num_threads": 1,
                    "replica_cpus": 0.5,
                    "max_replicas": 1,
                    "enable_lora": True,
                    "max_lora_rank": 16,
                    "lora_modules": {"tiny-lora": str(tiny_lora)},
                },
            ],
            "ingress_cpus": 0.25,
            "semantic_cache": "opt-in",
            "admin_api_keys": [ADMIN_KEY],
            "embedding_model": "bundled",
            "embedding_cpus": 0.1,
        }
    )  # /v1/embeddings: all-MiniLM-L6-v2 beside the LLMs
    # logical CPUs in all: 1.75 here, 1.75 for the auth app, leaving room on 8 for the TP test
    auth = build_app(
        {
            "model": str(tiny_llama_path),
            "served_model_name": "tiny-tp2",
            "tensor_parallel_size": 2,
            "max_num_seqs": 8,
            "max_model_len": 256,
            "torch_num_threads": 1,
            "api_keys": [API_KEY],
            "kv_cache_dtype": "fp8",
            "quantization": "int8",  # both through serving, per TP rank
            "speculative_config": {"method": "ngram", "num_speculative_tokens": 3},  # with TP
            "replica_cpus": 0.5,
            "worker_cpus": 0.5,
            "ingress_cpus": 0.25,
            "num_replicas": 1,
        }
    )
    serve.run(auth, name="kvserve-auth", route_prefix="/auth", blocking=False)
    serve.run(main, name="kvserve", route_prefix="/")
    # the auth app deploys alongside; wait for it too
    deadline = time.time() + 300
    while serve.status().applications["kvserve-auth"].status != "RUNNING":
        if time.time() > deadline:
            raise TimeoutError(f"kvserve-auth not running: {serve.status().applications['kvserve-auth']}")
        time.sleep(0.5)
    ns = SimpleNamespace(
        port=port,
        root=f"http://127.0.0.1:{port}",
        base_url=f"http://127.0.0.1:{port}/v1",
        auth_base_url=f"http://127.0.0.1:{port}/auth/v1",
        model=SMOLLM2,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        llm=serve.get_deployment_handle("LLMServer", "kvserve"),
        tiny_path=tiny_llama_path,
        tiny_lora_path=tiny_lora,
        encoder="sentence-transformers/all-MiniLM-L6-v2",
        deploy_s=time.time() - t0,
    )
    yield ns
    serve.delete("kvserve-auth")
    serve.delete("kvserve")


@pytest.fixture(scope="session")
def tokenizers(smollm2_path):
    """(the engine's tokenizer, as the engine loads it; the router's, as the router loads it), for
    test_router.py and test_router_live.py (session scope: loaded once for both files)."""
    from transformers import PreTrainedTokenizerFast

    from kvserve.engine.model_loader import load_tokenizer

    return load_tokenizer(smollm2_path), PreTrainedTokenizerFast.from_pretrained(str(smollm2_path))
