"""The response caches' configuration: ``AppArgs`` fields and ``kvserve serve`` flags, their defaults
and their validation. No Ray, no model."""

import pytest
from pydantic import ValidationError

from kvserve.deployments.cache import CacheSettings


def test_app_args_and_cli_flags_of_the_caches(monkeypatch):
    from kvserve.deployments.args import AppArgs
    from kvserve.deployments.cli import app_args_from_cli, build_parser

    monkeypatch.delenv("KVSERVE_REDIS_URL", raising=False)
    monkeypatch.delenv("KVSERVE_ADMIN_API_KEYS", raising=False)
    default = AppArgs()
    assert CacheSettings(**default.cache_settings()) == CacheSettings()  # exact on, memory, semantic off
    argv = [
        "serve",
        "--no-response-cache",
        "--cache-backend",
        "redis",
        "--redis-url",
        "redis://127.0.0.1:1/0",
        "--cache-ttl-s",
        "60",
        "--cache-max-entries",
        "5",
        "--cache-max-bytes",
        "1000",
        "--semantic-cache",
        "opt-in",
        "--semantic-cache-threshold",
        "0.9",
        "--admin-api-key",
        "sk-admin",
        "--cache-shared-across-keys",
    ]
    args = AppArgs.model_validate(app_args_from_cli(build_parser().parse_args(argv)))
    assert args.cache_settings() == {
        "enabled": False,
        "backend": "redis",
        "ttl_s": 60.0,
        "max_entries": 5,
        "max_bytes": 1000,
        "semantic": "opt-in",
        "semantic_threshold": 0.9,
        "semantic_max_entries": 10_000,
        "redis_url": "redis://127.0.0.1:1/0",
        "shared_across_keys": True,
    }
    assert not default.cache.cache_shared_across_keys  # per owner unless the operator says so
    assert args.gateway.admin_api_keys == ["sk-admin"]
    assert AppArgs(semantic_cache=True).cache.semantic_cache == "on"  # YAML's booleans
    with pytest.raises(ValidationError, match="redis_url"):
        AppArgs(cache_backend="redis")
    with pytest.raises(ValidationError):
        AppArgs(semantic_cache_threshold=1.5)
    monkeypatch.setenv("KVSERVE_ADMIN_API_KEYS", "sk-a, sk-b")
    assert AppArgs().gateway.admin_api_keys == ["sk-a", "sk-b"]
    with pytest.raises(ValueError, match="semantic cache mode"):
        CacheSettings(semantic="sometimes")
