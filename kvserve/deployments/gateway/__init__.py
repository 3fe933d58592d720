"""The gateway: kvserve's OpenAI-compatible HTTP front, one room per concern.

- :mod:`~kvserve.deployments.gateway.api`: ``build_api(gateway) -> FastAPI``, the routes bound at build time;
- :mod:`~kvserve.deployments.gateway.deployment`: ``OpenAIIngress``, the Serve deployment that builds it per replica;
- :mod:`~kvserve.deployments.gateway.core`: the shared state and the one request pipeline
  (``Gateway.run``: pick -> cache -> admit -> open with fallback; deliver; settle and store),
  and the rule of what the gateway owns and what the replica owns; its pieces:
  :mod:`~kvserve.deployments.gateway.call` (the typed specs endpoints build, the ``Call`` on its way),
  :mod:`~kvserve.deployments.gateway.catalog` (the served names and their cards, given at build time;
  what replicas publish at load), :mod:`~kvserve.deployments.gateway.handles` (the deployment handles),
  :mod:`~kvserve.deployments.gateway.replica_calls` (streams and one-answer calls to replicas, retried
  when a replica was lost), :mod:`~kvserve.deployments.gateway.answers` (delivering an answer, then
  settling the key and storing it), :mod:`~kvserve.deployments.gateway.shedding` (cheap refusals);
- endpoints: :mod:`~kvserve.deployments.gateway.chat`, :mod:`~kvserve.deployments.gateway.completions`,
  :mod:`~kvserve.deployments.gateway.responses` (with :mod:`~kvserve.deployments.gateway.responses_input`),
  :mod:`~kvserve.deployments.gateway.embeddings`, :mod:`~kvserve.deployments.gateway.tokenize`,
  :mod:`~kvserve.deployments.gateway.models`, :mod:`~kvserve.deployments.gateway.probes`, :mod:`~kvserve.deployments.gateway.admin`,
  :mod:`~kvserve.deployments.gateway.adapters`;
- plumbing: :mod:`~kvserve.deployments.gateway.gate` (keys, body size, CORS), :mod:`~kvserve.deployments.gateway.errors`
  (OpenAI error bodies), :mod:`~kvserve.deployments.gateway.streams` (replica streams, SSE),
  :mod:`~kvserve.deployments.gateway.http_metrics` (per-endpoint counts and latencies). The gateway's
  settings are the configuration's sections (:mod:`kvserve.deployments.contract.config`), passed as objects.

Nothing is imported here, so a module of the package can be imported alone.
"""
