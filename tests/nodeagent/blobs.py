"""Blobs put straight into a node cache, as if fetched a while ago (eviction orders by age)."""

from __future__ import annotations

import hashlib
import os

from ember_runtime.nodeagent.cache import ContentCache


def aged_blob(cache: ContentCache, size: int, age_s: float) -> tuple[str, bytes]:
    """A complete blob of `size` random bytes, fetched `age_s` ago: (digest, bytes)."""
    data = os.urandom(size)
    sha = hashlib.sha256(data).hexdigest()
    cache.blobs.mkdir(parents=True, exist_ok=True)
    cache.path(sha).write_bytes(data)
    then = os.path.getmtime(cache.path(sha)) - age_s
    os.utime(cache.path(sha), (then, then))
    return sha, data
