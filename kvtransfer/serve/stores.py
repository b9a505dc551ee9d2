"""`open_store`: the block store a setting names -- a directory path (kvtransfer.serve.store.KVStore) or a
redis:// / rediss:// URL (kvtransfer.serve.redis_store.RedisStore). Apart from kvtransfer.serve.blockstore so that
the interface imports neither implementation."""
from __future__ import annotations

import os

from .blockstore import BlockStore, is_url, redact


def open_store(spec, **opts) -> BlockStore:
    """The store at `spec`: a RedisStore for a redis:// or rediss:// URL (options: kvtransfer.serve.redis_store),
    else a directory store (KVStore) at that path, created if missing. ValueError naming the fix for a bad spec."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"store {spec!r}: give a directory path or a redis://host:port/db URL")
    if is_url(spec):
        from .redis_store import RedisStore

        return RedisStore(spec, **{k: v for k, v in opts.items() if k in RedisStore.OPTIONS})
    if "://" in spec:
        raise ValueError(f"store {redact(spec)}: only redis:// and rediss:// URLs are stores; a directory is a plain "
                         f"path")
    from .store import KVStore

    return KVStore(spec, **{k: v for k, v in opts.items() if k in KVStore.OPTIONS})
