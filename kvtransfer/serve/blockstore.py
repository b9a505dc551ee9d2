"""`BlockStore`: what the connector (both engines) and the handoff proxy ask of a block store
(kvtransfer.serve.stores.open_store opens one from a directory path or a URL).

Two implementations: the directory store (kvtransfer.serve.store.KVStore: the embedded default, no server) and the
Redis store (kvtransfer.serve.redis_store.RedisStore: one store for engines and proxies on many hosts). Both hold the
same blocks (kvtransfer.serve.blockformat: the same bytes, hashes and checks) and pass one contract suite
(tests/test_store_contract.py).

Eviction and retention are each implementation's own, set when the store is opened: the directory store evicts
least-recently-used blocks beyond `max_bytes` and expires blocks unused for `retention_s` on its writes; the
Redis store gives every block a TTL (`retention_s`, refreshed on read) and leaves the byte cap to the server's
`maxmemory` with an LRU policy.
"""
from __future__ import annotations

import abc
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from threading import Lock
from urllib.parse import urlsplit, urlunsplit

from .blockformat import BadEntry, Prefix, chain_hashes, chain_seed

URL_SCHEMES = ("redis", "rediss")


class BlockStore(abc.ABC):
    """A store of KV blocks keyed by chained hashes, per model key and namespace (kvtransfer.serve.blockformat).

    `block_size` (tokens per block) is fixed when the store is opened. No method but `write`, `read`, `tip` and
    `delete_namespace` raises for a store fault: lookups then find nothing, with the reason in `Prefix.detail`."""

    block_size: int

    def hashes(self, token_ids, model_key: str, ns: str = "") -> list[str]:
        """Chained hashes h_1 .. h_m (64 hex) of the prompt's m full blocks under `model_key` in namespace `ns`."""
        return chain_hashes(token_ids, model_key, self.block_size, ns)

    def seed(self, model_key: str, ns: str = "") -> str:
        """h_0 (64 hex): the chain's root for a model key, this store's block size and a namespace."""
        return chain_seed(model_key, self.block_size, ns)

    @abc.abstractmethod
    def write(self, token_ids, layers, model: dict, *, first: int = 0, ns: str = "") -> int:
        """Store the prompt's full blocks from token `first` on (layers: per-layer (keys, values) of tokens
        first..n-1); returns the blocks written. ValueError for bad shapes or names, OSError for a store fault."""

    @abc.abstractmethod
    def stored_blocks(self, token_ids, model_key: str, ns: str = "") -> int:
        """How many leading full blocks of the prompt the store holds (the producer's writer asks; 0 on a fault)."""

    @abc.abstractmethod
    def lookup(self, token_ids, model_key: str, ns: str = "") -> Prefix:
        """The longest stored prefix, headers checked and data not read; a missing block ends it, a bad block or a
        store fault ends it with `detail` = "<reason>: <message>"."""

    @abc.abstractmethod
    def others(self, token_ids, model_key: str, ns: str = "") -> list[str]:
        """Keys of other models that stored the prompt's first block in `ns` (for a clear wrong_pair reason)."""

    @abc.abstractmethod
    def read(self, prefix: Prefix, token_ids, lo: int, hi: int) -> list:
        """Per-layer (keys, values) [n_kv, hi - lo, head_dim] of tokens lo..hi-1, every block checksum-verified and
        its ids compared with the prompt's; BadEntry(reason) otherwise (evicted, checksum, corrupt, ...)."""

    @abc.abstractmethod
    def tip(self, token_ids, model_key: str | None = None, ns: str = "") -> tuple[str, str, int] | None:
        """(model key, hash, tokens) of the prompt's last stored block in `ns` (any model when None); None if none."""

    @abc.abstractmethod
    def delete_namespace(self, ns: str) -> int:
        """Remove every block of namespace `ns` (never ""), under every model; returns the number removed."""

    @abc.abstractmethod
    def usage(self) -> int:
        """Bytes the store holds (directory: its blocks; Redis: the server's used memory)."""

    def local_dir(self) -> Path | None:
        """A directory beside the store for this host's own files (the consumer's sink cache), or None when the
        store lives on a server and such files belong in a local state or cache directory."""
        return None

    def tier_stats(self) -> dict:
        """The store's call counters (hits, misses, errors, latency); {} for a store that keeps none."""
        return {}

    def close(self) -> None:
        """Release connections (a no-op for a directory)."""


BlockCheck = Callable[[int, str, str], "tuple[str, dict] | None"]  # (j, h, parent) -> (where, header) or None


def walk_chain(store: BlockStore, model_key: str, ns: str, hashes: list[str], check: BlockCheck) -> Prefix:
    """The longest stored prefix of the chain `hashes` (the prompt's, under `model_key` in `ns`), walked from h_0.

    check(j, h, parent) reads block j (hash h, parent hash `parent`) the store's own way: it returns (where,
    header) -- `where` names the block in messages, `header` is checked (kvtransfer.serve.blockformat
    .check_block_header) -- or None when the block is missing, or raises BadEntry. A missing block ends the
    chain; a BadEntry, or a model identity that differs from block 0's, ends it with `detail`
    "<reason>: <message>". Blocks after the end are never checked."""
    parent = store.seed(model_key, ns)
    found, model, detail = [], {}, ""
    for j, h in enumerate(hashes):
        try:
            block = check(j, h, parent)
        except BadEntry as err:
            detail = f"{err.reason}: {err}"
            break
        if block is None:
            break  # missing (never written, evicted or expired): a chain is a prefix, a hole ends it
        where, header = block
        if model and header["model"] != model:
            detail = f"corrupt: {where}: model identity differs from block 0's"
            break
        model = header["model"]
        found.append(h)
        parent = h
    return Prefix(model_key, store.block_size, tuple(found), model, detail, ns)


def is_url(spec) -> bool:
    """Whether a store setting is a server URL (redis:// or rediss://) rather than a directory path."""
    return isinstance(spec, str) and spec.split("://", 1)[0].lower() in URL_SCHEMES and "://" in spec


def redact(url: str) -> str:
    """`url` with its password (and a user name's password part) replaced by "***": safe for logs and errors."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable store URL>"
    if parts.password is None and "@" not in parts.netloc:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, f"{user}:***@{host}" if parts.password is not None else f"{user}@{host}",
                       parts.path, re.sub(r"(?i)(password=)[^&]*", r"\1***", parts.query), parts.fragment))


class TierStats:
    """Counters of a store's calls, by operation: calls, hits and misses (a lookup finding >= 1 block or none),
    errors by kind, latency (sum and count). Thread-safe; `snapshot` is JSON-ready."""

    def __init__(self):
        self._lock = Lock()
        self.calls: Counter = Counter()
        self.hits: Counter = Counter()
        self.misses: Counter = Counter()
        self.errors: Counter = Counter()
        self.seconds: Counter = Counter()

    def observe(self, op: str, seconds: float, *, hit: bool | None = None, error: str | None = None) -> None:
        """Count one call of `op` that took `seconds` (hit: True / False for a lookup's outcome; error: its kind)."""
        with self._lock:
            self.calls[op] += 1
            self.seconds[op] += seconds
            if hit is not None:
                (self.hits if hit else self.misses)[op] += 1
            if error is not None:
                self.errors[f"{op}:{error}"] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"calls": dict(self.calls), "hits": dict(self.hits), "misses": dict(self.misses),
                    "errors": dict(self.errors), "latency_s_sum": {k: round(v, 6) for k, v in self.seconds.items()}}
