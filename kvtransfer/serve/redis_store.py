"""`RedisStore`: the block store on a Redis server, shared by engines and proxies on many hosts.

    open_store("redis://[:password@]host:6379/0?deployment=prod")     (rediss:// for TLS)

Keys (versioned; every part checked before it reaches Redis, so no name can address another's keys):

    kvt:v2:<deployment>:<ns or _>:<model key>:<block hash>    one block: the directory store's file bytes (safetensors
                                                              with the kvtransfer header; kvtransfer.serve.blockformat)
    kvt:v2:<deployment>:models                                the model keys that wrote blocks (a set: `tip` without a
                                                              model key, and `others`, ask it instead of scanning)
    kvt:v2:<deployment>:meta                                  {"block_size": B}: the first store to open it fixes B

The deployment separates fleets sharing one server; the namespace separates tenants' sessions (the proxy's keyed
digest of API key and session id); the model key separates producers (architecture and weights); the hash carries
the prompt's tokens up to and including the block, seeded with model key, block size and namespace.

Round trips: `lookup` is one pipelined GETRANGE of each block's first bytes (its safetensors header), so headers are
checked as the directory store checks them -- a block planted under a namespace with a wrong parent or model is not
mapped -- for about 1 KB per 16-token block instead of the block's ~200 KB, and with no second per-block key that
the server's LRU could evict apart from its block. `stored_blocks` is one pipelined EXISTS. `write` pipelines
`SET NX PX` per block (never overwriting, a few tens of MB per round trip), `read` pipelines `GETEX PX` (the read
refreshes the TTL) and verifies every block's checksum and token ids.

Retention: every block gets `retention_s` as its TTL on write, refreshed on read; block j's TTL is j ms shorter than
block 0's, so expiry takes a chain's tail first. The byte cap is the server's own: `maxmemory` with `allkeys-lru`
(the store never scans). Redis's LRU is approximate and per key (and its clock ticks once a second), so eviction
can take a middle block of a chain: a lookup stops at the first missing block (a chain is a prefix, and a hole ends
it) and the blocks after the hole are dead weight until LRU or their TTL takes them.

Faults: every call has a socket timeout (`timeout_s`, default 2 s; no retries), so a slow or dead server cannot
hang vLLM's scheduler. In `lookup` a fault is "no prefix" with detail "store_unavailable: ...", in `stored_blocks`
0 and in `others` []; `write`, `tip`, `delete_namespace` and `usage` raise StoreUnavailable (an OSError: the
producer's writer counts a failed save, the proxy a counted fallback); `read` raises BadEntry("store_unavailable").
Each is counted in `tier_stats()` (calls, hits, misses, errors, latency). Credentials (from the URL, or
$KVTRANSFER_REDIS_PASSWORD when the URL has none) never appear in a log line, an error message or `repr`.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from .blockformat import (DEFAULT_BLOCK_SIZE, Assembler, BadEntry, Prefix, Scratch, check_block_header,
                          check_model_key, check_namespace, is_int, peek_header, plan_write)
from .blockstore import BlockStore, TierStats, redact, walk_chain

log = logging.getLogger("kvtransfer.serve")

KEY_VERSION = "kvt:v2"  # v1 held v3 blocks (SHA-256 checksums): SET NX would never replace them, so a new prefix
PASSWORD_ENV = "KVTRANSFER_REDIS_PASSWORD"
DEPLOYMENT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
HEADER_PEEK = 2048  # bytes of a block read by `lookup`: its safetensors header (~1 KB) fits; a longer one is re-read


class StoreUnavailable(OSError):
    """The Redis server did not answer in time, refused the connection or failed the command."""


def split_url(url: str) -> tuple[str, dict]:
    """(the URL for the redis client, kvtransfer's own query options: deployment, timeout)."""
    parts = urlsplit(url)
    ours, theirs = {}, []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        (ours.__setitem__(k, v) if k in ("deployment", "timeout") else theirs.append((k, v)))
    return urlunsplit(parts._replace(query=urlencode(theirs))), ours


def connect(url: str, *, timeout_s: float = 2.0, password_env: str = PASSWORD_ENV):
    """A redis client for `url` (redis:// or rediss://) whose every call times out after `timeout_s` seconds and is
    never retried (a retry would multiply the time a dead server holds the caller). The password is the URL's, else
    $KVTRANSFER_REDIS_PASSWORD's. ImportError naming the install when the client is missing."""
    try:
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry
    except ImportError as err:
        raise ImportError("a redis:// store needs the redis client: pip install -e '.[serve]' (or pip install "
                          "redis)") from err
    kwargs = {}
    if urlsplit(url).password is None and os.environ.get(password_env):
        kwargs["password"] = os.environ[password_env]
    try:
        return redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                    retry=Retry(NoBackoff(), 0), retry_on_timeout=False, retry_on_error=[],
                                    health_check_interval=0, **kwargs)
    except ValueError as err:
        raise ValueError(f"store URL {redact(url)}: {err}; use redis://[:password@]host:port/db "
                         f"(rediss:// for TLS)") from None


class RedisStore(BlockStore):
    """Blocks on a Redis server (see the module docstring for keys, round trips, retention and faults).

    url: redis://[user:password@]host:port/db[?deployment=name&timeout=seconds] (rediss:// for TLS; the redis
    client's own query options, e.g. ssl_ca_certs, pass through). deployment: the fleet's key prefix (default the
    URL's, else "default"). block_size: tokens per block, fixed by the first store to open the deployment (default
    16). retention_s: the blocks' TTL, refreshed on read (None: no TTL; the server's maxmemory policy evicts).
    timeout_s: every call's socket timeout. write_chunk_bytes: block bytes per write round trip; read_chunk_blocks:
    blocks per read round trip (both bound the memory a pipeline holds). client: a ready redis client (tests)."""

    OPTIONS = ("block_size", "retention_s", "deployment", "timeout_s", "write_chunk_bytes", "read_chunk_blocks",
               "client", "password_env")

    def __init__(self, url: str, *, block_size: int | None = None, retention_s: float | None = None,
                 deployment: str | None = None, timeout_s: float | None = None, write_chunk_bytes: int = 32 << 20,
                 read_chunk_blocks: int = 64, client=None, password_env: str = PASSWORD_ENV):
        client_url, ours = split_url(url)
        self.url = redact(url)  # the only form of the URL this object keeps
        self._secret = urlsplit(url).password or os.environ.get(password_env) or None
        deployment = deployment or ours.get("deployment") or "default"
        if not DEPLOYMENT.fullmatch(deployment):
            raise ValueError(f"deployment {deployment!r}: 1..64 characters of letters, digits, '_', '.' or '-'")
        try:
            timeout_s = float(timeout_s if timeout_s is not None else ours.get("timeout", 2.0))
        except ValueError:
            raise ValueError(f"store URL {self.url}: timeout={ours.get('timeout')!r} is not a number of seconds")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s!r}: a positive number of seconds")
        if retention_s is not None and (not isinstance(retention_s, (int, float)) or retention_s <= 0):
            raise ValueError(f"retention_s={retention_s!r}: a positive number of seconds")
        if block_size is not None and (not is_int(block_size) or block_size < 1):
            raise ValueError(f"block_size={block_size!r}: a positive integer number of tokens")
        self.deployment, self.timeout_s, self.retention_s = deployment, timeout_s, retention_s
        self.write_chunk_bytes, self.read_chunk_blocks = int(write_chunk_bytes), max(1, int(read_chunk_blocks))
        self.prefix = f"{KEY_VERSION}:{deployment}"
        self.r = client if client is not None else connect(client_url, timeout_s=timeout_s, password_env=password_env)
        self.stats = TierStats()
        self._scratch = Scratch()   # the reused encode buffer, one per writing thread
        self._errors_logged = 0
        self.block_size = self._open_meta(block_size)

    def __repr__(self) -> str:
        return f"RedisStore({self.url!r}, deployment={self.deployment!r}, block_size={self.block_size})"

    # ---------------------------------------------------------------- names and faults
    def key(self, model_key: str, h: str, ns: str = "") -> str:
        """The Redis key of block `h` (64 hex) of model `model_key` in namespace `ns` (all checked)."""
        from .blockformat import check_hash

        return self._key(check_model_key(model_key), check_hash(h), check_namespace(ns))

    def _key(self, model_key: str, h: str, ns: str) -> str:
        return f"{self.prefix}:{ns or '_'}:{model_key}:{h}"

    def _models_key(self) -> str:
        return f"{self.prefix}:models"

    def _why(self, err: BaseException) -> str:
        """An exception as "<Type>: <message>" with any credential scrubbed."""
        text = f"{type(err).__name__}: {err}"
        return text.replace(self._secret, "***") if self._secret else text

    def _fault(self, op: str, err: BaseException, t0: float) -> str:
        """Count and (rate-limited) log a failed call; its scrubbed description."""
        why = self._why(err)
        self.stats.observe(op, time.perf_counter() - t0, error=type(err).__name__)
        self._errors_logged += 1
        if self._errors_logged % 100 == 1:
            log.warning("kvtransfer: Redis store %s: %s failed (%s); %d store errors so far (logged once per 100)",
                        self.url, op, why, self._errors_logged)
        return why

    def _ttl_ms(self, j: int) -> int | None:
        """Block j's TTL in ms: the retention less j ms, so expiry takes a chain's tail first."""
        if self.retention_s is None:
            return None
        return max(1, int(self.retention_s * 1000) - j)

    def _open_meta(self, asked: int | None) -> int:
        """The deployment's block size (the first store to open it sets it); the asked or default one when the
        server cannot be reached now (an engine starts anyway; its lookups are then misses). ValueError naming the
        fix when the server refuses the credentials."""
        want = asked or DEFAULT_BLOCK_SIZE
        t0 = time.perf_counter()
        try:
            self.r.set(f"{self.prefix}:meta", json.dumps({"block_size": want}), nx=True)
            raw = self.r.get(f"{self.prefix}:meta")
        except Exception as err:  # noqa: BLE001 -- an unreachable server is not a reason to refuse to start
            if type(err).__name__ in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError"):
                raise ValueError(f"Redis store {self.url} refused the credentials ({self._why(err)}): check the "
                                 f"password in the URL or ${PASSWORD_ENV}") from None
            self._fault("open", err, t0)
            return want
        try:
            got = json.loads(raw)["block_size"]
        except (TypeError, ValueError, KeyError):
            got = None
        if not is_int(got) or got < 1:
            log.warning("kvtransfer: Redis store %s: meta key holds no block size; using %d", self.url, want)
            return want
        return got

    # ---------------------------------------------------------------- producer
    def _leading(self, keys: list[str]) -> int:
        """How many of `keys`, from the first, exist (one pipelined EXISTS); raises the client's error."""
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        n = 0
        for found in pipe.execute():
            if not found:
                break
            n += 1
        return n

    def stored_blocks(self, token_ids, model_key: str, ns: str = "") -> int:
        """Leading full blocks of the prompt stored (one pipelined EXISTS; 0 on a fault, counted)."""
        hashes = self.hashes(token_ids, model_key, ns)
        if not hashes:
            return 0
        t0 = time.perf_counter()
        try:
            n = self._leading([self._key(model_key, h, ns) for h in hashes])
        except Exception as err:  # noqa: BLE001 -- the producer then re-saves; its write meets the same fault
            self._fault("stored_blocks", err, t0)
            return 0
        self.stats.observe("stored_blocks", time.perf_counter() - t0, hit=n > 0)
        return n

    def write(self, token_ids, layers, model: dict, *, first: int = 0, ns: str = "") -> int:
        """Store the prompt's full blocks from token `first` on (SET NX PX, pipelined in chunks; the chain's earlier
        blocks get their TTL refreshed); returns the blocks written (a block already there is never overwritten).
        ValueError on bad shapes or names; StoreUnavailable when the server fails (blocks of earlier chunks stay)."""
        plan = plan_write(token_ids, layers, model, first, ns, self.block_size)
        B, key = self.block_size, plan.key
        t0 = time.perf_counter()
        written = 0
        try:
            pipe, sets = self.r.pipeline(transaction=False), []
            for j in range(first // B):   # the chain's earlier blocks: a fresh TTL each
                ttl = self._ttl_ms(j)
                if ttl is not None:
                    pipe.pexpire(self._key(key, plan.hashes[j], ns), ttl)
                    sets.append(False)  # one flag per queued command: True for a block's SET
            per_chunk = max(1, self.write_chunk_bytes // max(1, plan.block_bytes()))
            for lo in range(first // B, len(plan.hashes), per_chunk):
                hi = min(lo + per_chunk, len(plan.hashes))
                rows, _ = plan.encode(lo, hi, self._scratch)   # the chunk's blobs in one reused buffer, sent as
                #                                                views of it (execute() below returns before reuse)
                for j in range(lo, hi):
                    k, ttl = self._key(key, plan.hashes[j], ns), self._ttl_ms(j)
                    pipe.set(k, memoryview(rows[j - lo].numpy()), nx=True, px=ttl)
                    sets.append(True)
                    if ttl is not None:
                        pipe.pexpire(k, ttl)  # a block that was there already keeps its bytes and gets a fresh TTL
                        sets.append(False)
                written += sum(bool(r) for r, s in zip(pipe.execute(), sets) if s)
                pipe, sets = self.r.pipeline(transaction=False), []
            pipe.sadd(self._models_key(), key)
            sets.append(False)
            written += sum(bool(r) for r, s in zip(pipe.execute(), sets) if s)
        except Exception as err:  # noqa: BLE001 -- a store fault, counted; the writer counts a failed save
            raise StoreUnavailable(f"Redis store {self.url}: write failed after {written} blocks "
                                   f"({self._fault('write', err, t0)})") from None
        self.stats.observe("write", time.perf_counter() - t0)
        return written

    # ---------------------------------------------------------------- consumer
    def lookup(self, token_ids, model_key: str, ns: str = "") -> Prefix:
        """The longest stored prefix, each block's header checked (one pipelined GETRANGE of the headers); a missing
        block ends it, a bad one or a fault ends it with detail "<reason>: <message>"."""
        hashes = self.hashes(token_ids, model_key, ns)
        if not hashes:
            return Prefix(model_key, self.block_size, (), {}, "", ns)
        t0 = time.perf_counter()
        keys = [self._key(model_key, h, ns) for h in hashes]
        try:
            pipe = self.r.pipeline(transaction=False)
            for k in keys:
                pipe.getrange(k, 0, HEADER_PEEK - 1)
            heads = pipe.execute()
            long = [i for i, head in enumerate(heads) if len(head) == HEADER_PEEK
                    and 8 + int.from_bytes(head[:8], "little") > HEADER_PEEK]
            if long:  # a header longer than the peek (a large identity): read exactly its bytes
                pipe = self.r.pipeline(transaction=False)
                for i in long:
                    pipe.getrange(keys[i], 0, min(8 + int.from_bytes(heads[i][:8], "little"), 1 << 20) - 1)
                for i, head in zip(long, pipe.execute()):
                    heads[i] = head
        except Exception as err:  # noqa: BLE001 -- no prefix: the target prefills normally
            why = self._fault("lookup", err, t0)
            return Prefix(model_key, self.block_size, (), {}, f"store_unavailable: {why}", ns)

        def check(j: int, h: str, parent: str) -> tuple[str, dict] | None:
            if not heads[j]:
                return None  # never written, expired or evicted
            header, shapes = peek_header(heads[j], keys[j])
            return keys[j], check_block_header(header, shapes, keys[j], model_key, j, parent, h, ns, self.block_size)

        prefix = walk_chain(self, model_key, ns, hashes, check)
        self.stats.observe("lookup", time.perf_counter() - t0, hit=prefix.n_blocks > 0)
        return prefix

    def others(self, token_ids, model_key: str, ns: str = "") -> list[str]:
        """Keys of other models that stored the prompt's first block in `ns` ([] on a fault)."""
        check_model_key(model_key)
        ids = list(token_ids)[:self.block_size]
        t0 = time.perf_counter()
        try:
            keys = sorted(k.decode() if isinstance(k, bytes) else k for k in self.r.smembers(self._models_key()))
            keys = [k for k in keys if k != model_key and _is_model_key(k)]
            out = [k for k in keys if self._leading([self._key(k, self.hashes(ids, k, ns)[0], ns)])] \
                if len(ids) == self.block_size else []
        except Exception as err:  # noqa: BLE001 -- only a clearer reason is lost
            self._fault("others", err, t0)
            return []
        self.stats.observe("others", time.perf_counter() - t0)
        return out

    def read(self, prefix: Prefix, token_ids, lo: int, hi: int):
        """Per-layer (keys, values) [n_kv, hi - lo, head_dim] of tokens lo..hi-1 (GETEX PX: the read refreshes each
        block's TTL), every block checksum-verified and its ids compared with the prompt's. BadEntry: "evicted",
        "checksum", "corrupt", "too_short", or "store_unavailable" (the server failed)."""
        B = self.block_size
        prompt = list(token_ids)
        if not 0 <= lo < hi <= min(prefix.n_tokens, len(prompt)):
            raise BadEntry("too_short", f"tokens {lo}..{hi} are not inside the prefix of {prefix.n_tokens} "
                                        f"stored tokens of a {len(prompt)}-token prompt")
        check_namespace(prefix.ns)
        check_model_key(prefix.model_key)
        blocks = list(range(lo // B, (hi - 1) // B + 1))
        t0 = time.perf_counter()
        out = Assembler(prompt, lo, hi, B)
        for c in range(0, len(blocks), self.read_chunk_blocks):
            chunk = blocks[c:c + self.read_chunk_blocks]
            keys = [self.key(prefix.model_key, prefix.hashes[j], prefix.ns) for j in chunk]
            try:
                pipe = self.r.pipeline(transaction=False)
                for j, k in zip(chunk, keys):
                    ttl = self._ttl_ms(j)
                    pipe.getex(k, px=ttl) if ttl is not None else pipe.get(k)
                values = pipe.execute()
            except Exception as err:  # noqa: BLE001 -- the worker reports a load error; vLLM recomputes
                raise BadEntry("store_unavailable", f"Redis store {self.url}: read failed "
                                                    f"({self._fault('read', err, t0)})") from None
            for j, k, value in zip(chunk, keys, values):
                if value is None:
                    self.stats.observe("read", time.perf_counter() - t0, error="evicted")
                    raise BadEntry("evicted", f"{k}: evicted or expired after the lookup")
                out.add(j, value, k)   # verified and copied straight from the reply's bytes
        self.stats.observe("read", time.perf_counter() - t0)
        return out.layers()

    # ---------------------------------------------------------------- the proxy's
    def tip(self, token_ids, model_key: str | None = None, ns: str = "") -> tuple[str, str, int] | None:
        """(model key, hash, tokens) of the prompt's last stored block in `ns` under `model_key` (default: each model
        the deployment has seen); None when nothing is stored. StoreUnavailable on a fault."""
        check_namespace(ns)
        t0 = time.perf_counter()
        try:
            if model_key:
                models = [check_model_key(model_key)]
            else:
                models = sorted(k.decode() if isinstance(k, bytes) else k for k in self.r.smembers(self._models_key()))
            for key in models:
                if not _is_model_key(key):
                    continue
                hashes = self.hashes(token_ids, key, ns)
                n = self._leading([self._key(key, h, ns) for h in hashes]) if hashes else 0
                if n:
                    self.stats.observe("tip", time.perf_counter() - t0, hit=True)
                    return key, hashes[n - 1], n * self.block_size
        except ValueError:
            raise
        except Exception as err:  # noqa: BLE001
            raise StoreUnavailable(f"Redis store {self.url}: tip failed ({self._fault('tip', err, t0)})") from None
        self.stats.observe("tip", time.perf_counter() - t0, hit=False)
        return None

    def delete_namespace(self, ns: str) -> int:
        """Remove every block of namespace `ns` (1..64 lowercase hex), under every model: SCAN MATCH on the
        namespace's key prefix (never KEYS: the server keeps serving others meanwhile), UNLINK in batches; returns
        the number removed. ValueError for "" (the shared namespace belongs to no session); StoreUnavailable on a
        fault (what was unlinked before it stays unlinked)."""
        if check_namespace(ns) == "":
            raise ValueError("delete_namespace(\"\"): the shared namespace belongs to no session; its blocks leave "
                             "by the server's maxmemory policy or retention (retention_s)")
        t0 = time.perf_counter()
        removed, batch = 0, []
        try:
            for k in self.r.scan_iter(match=f"{self.prefix}:{ns}:*", count=1000):
                batch.append(k)
                if len(batch) >= 500:
                    removed += self.r.unlink(*batch)
                    batch = []
            if batch:
                removed += self.r.unlink(*batch)
        except Exception as err:  # noqa: BLE001
            raise StoreUnavailable(f"Redis store {self.url}: delete_namespace failed after {removed} blocks "
                                   f"({self._fault('delete_namespace', err, t0)})") from None
        self.stats.observe("delete_namespace", time.perf_counter() - t0)
        return removed

    def usage(self) -> int:
        """The server's used memory in bytes (INFO memory; every key of the database, not only this deployment's)."""
        t0 = time.perf_counter()
        try:
            return int(self.r.info("memory")["used_memory"])
        except Exception as err:  # noqa: BLE001
            raise StoreUnavailable(f"Redis store {self.url}: usage failed ({self._fault('usage', err, t0)})") from None

    def tier_stats(self) -> dict:
        return {"backend": "redis", "deployment": self.deployment, **self.stats.snapshot()}

    def close(self) -> None:
        try:
            self.r.close()
        except Exception:  # noqa: BLE001 -- closing a dead connection is not an error
            pass


def _is_model_key(k) -> bool:
    try:
        check_model_key(k)
        return True
    except ValueError:
        return False
