"""Metrics export for every kvserve process (the bottom floor: imports only prometheus-client and, lazily, Ray)."""
