"""The gateway: kvserve's OpenAI-compatible HTTP front, one room per concern.

- :mod:`~deployments.gateway.api`: ``build_api(gateway) -> FastAPI``, the routes bound at build time;
- :mod:`~deployments.gateway.deployment`: ``OpenAIIngress``, the Serve deployment that builds it per replica;
- :mod:`~deployments.gateway.core`: the shared state and the one request pipeline
  (pick -> cache -> admit -> open with fallback -> settle), and the rule of what the gateway
  owns and what the replica owns;
- endpoints: :mod:`~deployments.gateway.chat`, :mod:`~deployments.gateway.completions`,
  :mod:`~deployments.gateway.responses` (with :mod:`~deployments.gateway.responses_input`),
  :mod:`~deployments.gateway.embeddings`, :mod:`~deployments.gateway.tokenize`,
  :mod:`~deployments.gateway.models`, :mod:`~deployments.gateway.probes`, :mod:`~deployments.gateway.admin`,
  :mod:`~deployments.gateway.adapters`;
- plumbing: :mod:`~deployments.gateway.gate` (keys, body size, CORS), :mod:`~deployments.gateway.errors`
  (OpenAI error bodies), :mod:`~deployments.gateway.streams` (replica streams, SSE),
  :mod:`~deployments.gateway.http_metrics` (per-endpoint counts and latencies),
  :mod:`~deployments.gateway.settings` (a replica's settings).

Nothing is imported here, so a module of the package can be imported alone.
"""
