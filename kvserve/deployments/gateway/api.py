"""``build_api(gateway) -> FastAPI``: the gateway's HTTP app, its routes bound to one
:class:`~kvserve.deployments.gateway.core.Gateway` when the app is built (per replica, by the Serve
deployment's ``__serve_build_asgi_app__``; or in-process by a test with fake replicas).

Built per call, nothing at module level: the gate's settings are middleware options and
every route closes over its gateway, so there is no module state for a replica to fill in
and no name a route uses that is not bound when the app is built. (Ray Serve LLM's
``make_fastapi_ingress`` binds its routes at build time for the same reason.)

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models`` (replicas'
placement for an admin key only),
``GET /v1/models/{model}``, ``GET`` and ``DELETE /v1/cache`` (admin key),
``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` (admin key), ``GET /v1/experiments``,
``GET /v1/experiments/{name}`` and ``POST /v1/experiments/{name}/weights`` (admin key), ``GET /health``,
``GET /ready``, ``GET /metrics``, ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's),
``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{response_id}``,
``POST /v1/embeddings``, ``POST /tokenize``, ``POST /detokenize``, the Files API (``POST`` and
``GET /v1/files``, ``GET`` and ``DELETE /v1/files/{id}``, ``GET /v1/files/{id}/content``) and the
Batch API (``POST`` and ``GET /v1/batches``, ``GET /v1/batches/{id}``, ``POST /v1/batches/{id}/cancel``). Each lives in its own module of
this package; every request is counted and timed by route (:mod:`~kvserve.deployments.gateway.http_metrics`).
"""

# No ``from __future__ import annotations``: FastAPI reads the routes' annotations.
from fastapi import Depends, FastAPI, Request, Response

from kvserve.deployments.contract.openai_requests import ChatCompletionRequest, CompletionRequest
from kvserve.deployments.gateway import (
    adapters,
    admin,
    files,
    chat,
    completions,
    embeddings,
    experiment_admin,
    gate,
    messages,
    models,
    probes,
    responses,
    tokenize,
)
from kvserve.deployments.gateway.core import Gateway
from kvserve.deployments.gateway.errors import add_error_handlers
from kvserve.deployments.gateway.http_metrics import EndpointMetrics
from kvserve.deployments.gateway.messages_input import CountTokensRequest, MessagesRequest
from kvserve.deployments.gateway.responses_input import ResponsesRequest


def build_api(gw: Gateway, app_status=None) -> FastAPI:
    """The HTTP app of ``gw``.

    Args:
        gw: the gateway whose state the routes use.
        app_status: an async callable giving Serve's status of this application (``/ready``
            tells "loading" from "not responding" with it); None outside Serve.
    """
    app = FastAPI(title="kvserve", description="OpenAI-compatible LLM serving on Ray Serve", version="0.1.0")
    gate.install(app, gw.gate)  # API key and body size, before any body byte is read
    app.add_middleware(EndpointMetrics)  # outermost: the gate's refusals are counted too
    add_error_handlers(app)
    ready = probes.Readiness(gw, app_status)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, response: Response):
        return await chat.chat_completions(gw, body, request, response)

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request, response: Response):
        return await completions.completions(gw, body, request, response)

    @app.post("/v1/messages")
    async def create_message(body: MessagesRequest, request: Request, response: Response):
        return await messages.create_message(gw, body, request, response)

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens(body: CountTokensRequest, request: Request):
        return await messages.count_tokens(gw, body, request)

    @app.post("/v1/responses")
    async def create_response(body: ResponsesRequest, request: Request):
        return await responses.create_response(gw, gw.responses, body, request)

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return await responses.get_response(gw.responses, response_id, request)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        return await responses.delete_response(gw.responses, response_id, request)

    async def files_owner(request: Request) -> str:
        """The Files and Batch API routes' caller: its owner id, once the request passed its
        key's rate limits (:func:`files.admit`, which raises the 429/403)."""
        await files.admit(gw.keys, request.scope)
        return gate.owner_id(request.scope)

    @app.post("/v1/files", openapi_extra=files.UPLOAD_OPENAPI)
    async def create_file(request: Request, owner: str = Depends(files_owner)):
        return await files.upload_stream(gw.files, owner, request)  # the form is parsed as it arrives

    @app.get("/v1/files")
    async def list_files(
        purpose: str | None = None,
        limit: int = 10000,
        after: str | None = None,
        order: str = "desc",
        owner: str = Depends(files_owner),
    ):
        return await gw.files.list(owner, purpose, limit, after, order)

    @app.get("/v1/files/{file_id}")
    async def get_file(file_id: str, owner: str = Depends(files_owner)):
        return await gw.files.meta(owner, file_id)

    @app.get("/v1/files/{file_id}/content")
    async def get_file_content(file_id: str, owner: str = Depends(files_owner)):
        return await files.content_response(gw.files, owner, file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, owner: str = Depends(files_owner)):
        return await gw.files.delete(owner, file_id)

    @app.post("/v1/batches")
    async def create_batch(body: dict, request: Request, owner: str = Depends(files_owner)):
        return await gw.batches.create(owner, gate.credentials(request.scope), body)

    @app.get("/v1/batches")
    async def list_batches(after: str | None = None, limit: int = 20, owner: str = Depends(files_owner)):
        return await gw.batches.list(owner, after, limit)

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(batch_id: str, owner: str = Depends(files_owner)):
        return await gw.batches.get(owner, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, owner: str = Depends(files_owner)):
        return await gw.batches.cancel(owner, batch_id)

    @app.post("/v1/embeddings")
    async def create_embeddings(body: embeddings.EmbeddingRequest, request: Request):
        return await embeddings.embeddings(gw, body, request)

    @app.post("/tokenize")
    async def tokenize_(body: tokenize.TokenizeRequest, request: Request) -> tokenize.TokenizeResponse:
        return await tokenize.tokenize(gw, body, request)

    @app.post("/detokenize")
    async def detokenize_(body: tokenize.DetokenizeRequest, request: Request) -> tokenize.DetokenizeResponse:
        return await tokenize.detokenize(gw, body, request)

    @app.get("/v1/models")
    async def list_models(request: Request):
        return await models.list_models(gw, placement=admin.is_admin(gw, request))

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        return await models.retrieve_model(gw, model_id)

    @app.delete("/v1/cache")
    async def clear_cache(request: Request, model: str | None = None):
        return await admin.clear_cache(gw, request, model)

    @app.get("/v1/cache")
    async def get_cache_stats(request: Request):
        return await admin.cache_stats(gw, request)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: adapters.LoadLoRAAdapterRequest, request: Request):
        return await adapters.load_adapter(gw, body, request)

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: adapters.UnloadLoRAAdapterRequest, request: Request):
        return await adapters.unload_adapter(gw, body, request)

    @app.get("/v1/experiments")
    async def list_experiments(request: Request):
        return await experiment_admin.list_experiments(gw, request)

    @app.get("/v1/experiments/{name}")
    async def get_experiment(name: str, request: Request, since: float | None = None):
        return await experiment_admin.get_experiment(gw, request, name, since)

    @app.post("/v1/experiments/{name}/weights")
    async def set_experiment_weights(name: str, body: experiment_admin.SetWeightsRequest, request: Request):
        return await experiment_admin.set_weights(gw, request, name, body)

    @app.get("/health")
    async def health():
        return await probes.health(gw)

    @app.get("/ready")
    async def readiness():
        return await ready()

    @app.get("/metrics")
    async def metrics():
        return await probes.metrics()

    gw.batches.app = app  # batches run their requests through this app
    return app
