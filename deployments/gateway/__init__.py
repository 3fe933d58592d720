"""The gateway: kvserve's OpenAI-compatible HTTP front, one room per concern.

- :mod:`~deployments.gateway.api`: ``build_api(gateway) -> FastAPI``, the routes bound at build time;
- :mod:`~deployments.gateway.deployment`: ``OpenAIIngress``, the Serve deployment that builds it per replica;
- :mod:`~deployments.gateway.core`: the shared state and the one request pipeline
  (``Gateway.run``: pick -> cache -> admit -> open with fallback; deliver; settle and store),
  and the rule of what the gateway owns and what the replica owns; its pieces:
  :mod:`~deployments.gateway.call` (the typed specs endpoints build, the ``Call`` on its way),
  :mod:`~deployments.gateway.catalog` (the served names and their cards, given at build time;
  what replicas publish at load), :mod:`~deployments.gateway.handles` (the deployment handles),
  :mod:`~deployments.gateway.replica_calls` (streams and one-answer calls to replicas, retried
  when a replica was lost), :mod:`~deployments.gateway.answers` (delivering an answer, then
  settling the key and storing it), :mod:`~deployments.gateway.shedding` (cheap refusals);
- endpoints: :mod:`~deployments.gateway.chat`, :mod:`~deployments.gateway.completions`,
  :mod:`~deployments.gateway.responses` (with :mod:`~deployments.gateway.responses_input`),
  :mod:`~deployments.gateway.embeddings`, :mod:`~deployments.gateway.tokenize`,
  :mod:`~deployments.gateway.models`, :mod:`~deployments.gateway.probes`, :mod:`~deployments.gateway.admin`,
  :mod:`~deployments.gateway.adapters`;
- plumbing: :mod:`~deployments.gateway.gate` (keys, body size, CORS), :mod:`~deployments.gateway.errors`
  (OpenAI error bodies), :mod:`~deployments.gateway.streams` (replica streams, SSE),
  :mod:`~deployments.gateway.http_metrics` (per-endpoint counts and latencies). The gateway's
  settings are the configuration's sections (:mod:`deployments.contract.config`), passed as objects.

Nothing is imported here, so a module of the package can be imported alone.
"""
