"""Redis URLs as logs may show them: :func:`safe_url` (no password), for the caches and limits
that share a Redis."""

from __future__ import annotations

from urllib.parse import urlsplit


def safe_url(url: str) -> str:
    """A Redis URL without its password, for logs."""
    try:
        u = urlsplit(url)
        return f"{u.scheme}://{u.hostname}:{u.port or 6379}{u.path}"
    except ValueError:
        return "<redis url>"
