"""The replica side: the Serve deployments that own an engine (``LLMServer``) or an encoder
(``EmbeddingServer``), and what runs beside the engine in a replica (admission, outputs as
chunks, adapters, pooling endpoints, the prefix report).

Rule (tests/test_architecture.py): replica/ imports nothing from gateway/, routing/, cache/ or
limits/; what it shares with them is in :mod:`kvserve.deployments.contract`. Nothing is imported here.
"""
