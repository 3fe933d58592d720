"""The contract between the walls of kvserve/deployments/: what the gateway side (gateway/, cache/,
limits/, routing/) and the replica side (replica/) both read, so neither imports the other.

- :mod:`~kvserve.deployments.contract.types`: what crosses the Ray hop (``GenerateRequest``,
  ``GenerationChunk``, ``ServerInfo``, ...);
- :mod:`~kvserve.deployments.contract.streams`: consuming the replica's chunk streams;
- :mod:`~kvserve.deployments.contract.prefix`: the prefix hashes a replica reports and a router computes;
- :mod:`~kvserve.deployments.contract.config`: the configuration's sections (``ModelArgs``,
  ``GatewayArgs``, ``LimitArgs``, ``CacheArgs``, ``RoutingArgs``, ``EmbeddingArgs``), passed to
  the deployments as objects;
- :mod:`~kvserve.deployments.contract.facts`: what the gateway knows of a model: its card (given at
  build time) and what its replicas publish when they load (the facts board);
- :mod:`~kvserve.deployments.contract.adapters`: LoRA adapters as both sides know them (flag, registry);
- :mod:`~kvserve.deployments.contract.openai_requests`, :mod:`~kvserve.deployments.contract.openai_errors`: the
  OpenAI wire format (request bodies, error bodies).

Rule (tests/test_architecture.py): contract/ imports nothing from the other folders of
kvserve/deployments/. Nothing is imported here.
"""
