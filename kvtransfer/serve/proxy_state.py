"""What the handoff proxy (kvtransfer.serve.proxy) knows of a request and a session: the outcome of one request
(its `X-KVTransfer` header and `kvtransfer` field), a session's state and the bounded table of them, and the errors
it tells apart (a client's bad request, a session request without a key,
an unreachable engine)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

log = logging.getLogger("kvtransfer.proxy")


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and this message, counted as `bad_request`."""


class Unauthorized(PermissionError):
    """A session request without an API key on a proxy that binds sessions to keys (HTTP 401)."""


class Unreachable(RuntimeError):
    """An engine did not answer (connection refused, reset, timeout) or answered 5xx."""


class StateUnavailable(RuntimeError):
    """The shared session table (Redis) did not answer in time or failed: the request is served without its session
    (a normal prefill), counted."""


class SessionBusy(RuntimeError):
    """Another proxy held the session's lock for longer than the bounded wait (HTTP 409: retry)."""


@dataclass
class Outcome:
    """What the proxy did with one request: status is mapped | cached | reused | fallback_reprefill | fallback_source |
    source (reused: a later turn's stream, whose usage counts mapped and cached tokens together).

    mapped: tokens the consumer took from the map; cached: tokens it found in its own prefix cache (this session's
    earlier turns); prefilled: tokens it computed. save_s: seconds the producer took to store the prompt (only a
    switch of a session the source never served has a save step)."""

    status: str
    engine: str
    mapped: int | None = None
    prefilled: int | None = None
    reason: str = ""
    save_s: float | None = None
    cached: int | None = None

    @property
    def code(self) -> str:
        """The reason's counter name: its first word when that is an identifier (e.g. `consumer_fallback`), else
        "other" -- a metric label never carries free text."""
        word = self.reason.split(" ", 1)[0].split("(", 1)[0]
        return word if word and all(c.isalnum() or c in "_-" for c in word) and word.isascii() else "other"

    def header(self) -> str:
        """The `X-KVTransfer` header value: printable ASCII (an engine's error text may carry any character)."""
        return ascii_header(self._text())

    def _text(self) -> str:
        if self.status == "mapped":
            hits = f", cached {self.cached}" if self.cached else ""
            return f"mapped {self.mapped} tokens{hits}, prefilled {self.prefilled}"
        if self.status == "cached":
            return f"cached {self.cached} tokens, prefilled {self.prefilled}"
        if self.status == "reused":
            return f"reused {self.cached} tokens (cached or mapped: a stream does not say), prefilled {self.prefilled}"
        if self.status in ("fallback_reprefill", "fallback_source"):
            return f"{self.status}: {self.reason}"
        return self.status if not self.reason else f"{self.status}: {self.reason}"

    def field(self) -> dict:
        """The `kvtransfer` body field."""
        return {"status": self.status, "engine": self.engine, "mapped": self.mapped, "cached": self.cached,
                "prefilled": self.prefilled, "reason": self.reason, "save_s": self.save_s, "summary": self.header()}


@dataclass
class Session:
    """A conversation's state, a few numbers whatever its length: the engine serving it, who opened it, the cache
    salt of its mapped blocks on the consumer, the store namespace of its blocks, its token sequence as a length
    and a hash (a later turn must extend it), the tokens the producer stored and the tokens handed over at the
    switch."""

    owner: str = ""
    salt: str = ""
    ns: str = ""
    engine: str = "source"
    write_through: bool = True
    n_ids: int = 0
    ids_hash: str = ""
    stored: int = 0
    handed: int = 0
    ephemeral: bool = False  # a request without a session id: its stored blocks go when it is answered

    def extends(self, ids: list[int]) -> bool:
        """Whether `ids` start with the session's previous token sequence (False for a first turn)."""
        return bool(self.n_ids) and len(ids) >= self.n_ids and ids_digest(ids[:self.n_ids]) == self.ids_hash

    def remember(self, ids: list[int]) -> None:
        """Make `ids` the session's token sequence."""
        self.n_ids, self.ids_hash = len(ids), ids_digest(ids)


def ascii_header(text: str) -> str:
    """`text` as a valid HTTP header value: printable ASCII, other characters escaped or replaced by "?"."""
    return "".join(c if " " <= c <= "~" else "?" for c in text.encode("ascii", "backslashreplace").decode())


def ids_digest(ids: list[int]) -> str:
    """sha256 hex of token ids (comma-separated decimal)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


class Sessions:
    """The proxy's sessions: LRU-bounded, keyed by (owner, session id) -- two API keys that pick the same id hold two
    unrelated sessions, so no key can reach, steer or even detect another's -- each with a lock that exists only
    while a request holds or waits for it (rejected requests leave nothing behind).

    Every name a session leaves on an engine is a keyed digest of (owner, id) under the deployment's `secret`: the
    consumer's cache salt of its mapped blocks, and its namespace in the block store. They are the same after an
    LRU eviction or a restart with the same secret (the launcher keeps one per deployment), and differ for every
    other owner of the same id. The source's prefix cache is salted per owner."""

    def __init__(self, secret: bytes, max_sessions: int = 10000):
        self.secret, self.max_sessions = secret, max_sessions
        self.table: OrderedDict[tuple[str, str], Session] = OrderedDict()
        self._locks: dict[tuple[str, str], list] = {}  # (owner, id) -> [lock, holders and waiters]

    def _mac(self, text: str) -> str:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def owner_of(self, authorization: str | None) -> str:
        """A keyed digest of a request's Authorization header ("" without one): what a session is bound to."""
        return self._mac("owner/" + authorization) if authorization else ""

    def salt(self, owner: str, key: str | None) -> str:
        """The session's part of the consumer's cache salt (a fresh random one for a request without a session)."""
        import uuid

        return self._mac(f"salt/{owner}/{key}")[:40] if key is not None else uuid.uuid4().hex

    def namespace(self, owner: str, key: str | None) -> str:
        """The session's store namespace (32 hex): its blocks are found only by its own requests, and deleting the
        session removes exactly them. A request without a session gets a fresh one (nothing else can read it)."""
        import uuid

        return self._mac(f"ns/{owner}/{key}")[:32] if key is not None else uuid.uuid4().hex

    def source_salt(self, owner: str) -> str:
        """The cache salt of an owner's requests to the source (its prefix cache is shared within a key, never
        across keys); "" for requests without a key."""
        return "kvtransfer-source:" + self._mac(f"src/{owner}")[:40] if owner else ""

    def open(self, key: str, owner: str) -> Session:
        """The session `key` of `owner` (created if new, evicting the least recently used beyond max_sessions)."""
        session = self.table.get((owner, key))
        if session is None:
            session = Session(owner=owner, salt=self.salt(owner, key), ns=self.namespace(owner, key))
            self.table[(owner, key)] = session
            while len(self.table) > self.max_sessions:
                self.table.popitem(last=False)
        self.table.move_to_end((owner, key))
        return session

    def get(self, key: str, owner: str) -> Session | None:
        """The session `key` of `owner`, if the table holds it."""
        return self.table.get((owner, key))

    def drop(self, key: str, owner: str) -> Session | None:
        """Forget a session (its lock goes when its last request does)."""
        return self.table.pop((owner, key), None)

    def __len__(self) -> int:
        return len(self.table)

    backend = "memory"

    def count(self) -> int | None:
        """Sessions in the table (None when the table is shared and not counted here)."""
        return len(self.table)

    async def fetch(self, key: str, owner: str) -> tuple[Session, bool]:
        """(the session `key` of `owner`, created if new; whether it is new). Held under `locked`."""
        new = self.get(key, owner) is None
        return self.open(key, owner), new

    async def save(self, key: str, owner: str, session: Session) -> None:
        """Keep the session's state after a turn (in memory the table holds the object itself: nothing to do)."""

    async def forget(self, key: str, owner: str) -> Session | None:
        """Drop the session (DELETE, or a first turn that failed); the dropped state, if the table held it."""
        return self.drop(key, owner)

    def ids(self) -> list[str]:
        """The session ids in the table, least recently used first (all owners; for tests and operators)."""
        return [key for _, key in self.table]

    @asynccontextmanager
    async def locked(self, key: str, owner: str):
        """Hold the session's lock (one turn of a session at a time: its state changes with each)."""
        entry = self._locks.setdefault((owner, key), [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[(owner, key)]


_FIELDS = ("engine", "write_through", "n_ids", "ids_hash", "stored", "handed")


class RedisSessions(Sessions):
    """The session table in Redis, shared by every proxy of a deployment: any proxy serves any turn of a session, and
    a restarted proxy finds its sessions (and the secret) where it left them.

    Keys (kvt:v1:<deployment>:session:<owner digest or _>:<id digest>, the id digest a keyed digest of the id, so no
    raw id or API key is stored): a hash of the session's few numbers with a TTL of `ttl_s` (refreshed each turn); its
    lock `<that key>:lock`, taken with SET NX PX (expiring after `lock_ttl_s` unless its holder renews it, so a
    proxy that dies holding one frees it within seconds) after the proxy's own per-session lock, waiting at most
    `lock_wait_s` (then SessionBusy). The secret is kvt:v1:<deployment>:secret (`shared_secret`). Every call has the
    client's socket timeout; a fault is StateUnavailable (fetch, lock, forget) or a counted, logged miss (save)."""

    backend = "redis"

    def __init__(self, client, secret: bytes, *, deployment: str = "default", ttl_s: float = 7 * 24 * 3600.0,
                 lock_ttl_s: float = 10.0, lock_wait_s: float = 120.0, where: str = "redis", errors=None):
        super().__init__(secret, max_sessions=0)
        self.r, self.deployment, self.where = client, deployment, where
        self.ttl_ms, self.lock_ttl_ms, self.lock_wait_s = int(ttl_s * 1000), int(lock_ttl_s * 1000), lock_wait_s
        self.errors = errors if errors is not None else {}  # a Counter the proxy shares (its /metrics errors)
        self.prefix = f"kvt:v1:{deployment}"
        # compare-and-act on a lock: only its holder (token) may renew or release it
        self._renew = self.r.register_script(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('pexpire', KEYS[1], ARGV[2]) end "
            "return 0")
        self._release = self.r.register_script(
            "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0")

    def key_of(self, key: str, owner: str) -> str:
        """The Redis key of `owner`'s session `key`."""
        return f"{self.prefix}:session:{owner or '_'}:{self._mac('id/' + key)[:32]}"

    def count(self) -> int | None:
        return None

    def ids(self) -> list[str]:
        return []  # ids are stored only as digests

    def _count(self, what: str, err: BaseException) -> str:
        why = f"{type(err).__name__}"
        self.errors[f"state_{what}:{why}"] = self.errors.get(f"state_{what}:{why}", 0) + 1
        return why

    async def _call(self, what: str, fn, *args, **kwargs):
        """fn(*args) on a thread (the event loop never waits on Redis); StateUnavailable on any client error."""
        try:
            return await asyncio.to_thread(fn, *args, **kwargs)
        except Exception as err:  # noqa: BLE001 -- redis' errors (connection, timeout, OOM, ...)
            raise StateUnavailable(f"session table {self.where}: {what} failed ({self._count(what, err)})") from None

    def _parse(self, raw: dict, owner: str, key: str) -> Session | None:
        """A Session from its Redis hash; None for a hash that is not one (counted; the session starts afresh)."""
        try:
            f = {k.decode() if isinstance(k, bytes) else k: v.decode() if isinstance(v, bytes) else v
                 for k, v in raw.items()}
            engine = f["engine"]
            if engine not in ("source", "target") or f["write_through"] not in ("0", "1"):
                raise ValueError(engine)
            return Session(owner=owner, salt=self.salt(owner, key), ns=self.namespace(owner, key), engine=engine,
                           write_through=f["write_through"] == "1", n_ids=int(f["n_ids"]), ids_hash=f["ids_hash"],
                           stored=int(f["stored"]), handed=int(f["handed"]))
        except (KeyError, ValueError, AttributeError, UnicodeDecodeError) as err:
            self._count("corrupt", err)
            return None

    async def fetch(self, key: str, owner: str) -> tuple[Session, bool]:
        def get():
            pipe = self.r.pipeline(transaction=False)
            pipe.set(f"{self.prefix}:secret", self.secret, nx=True)  # restores it should the server have evicted it
            pipe.hgetall(self.key_of(key, owner))
            return pipe.execute()[1]

        raw = await self._call("fetch", get)
        session = self._parse(raw, owner, key) if raw else None
        if session is None:
            return Session(owner=owner, salt=self.salt(owner, key), ns=self.namespace(owner, key)), True
        return session, False

    async def save(self, key: str, owner: str, session: Session) -> None:
        values = {"engine": session.engine, "write_through": "1" if session.write_through else "0",
                  "n_ids": session.n_ids, "ids_hash": session.ids_hash, "stored": session.stored,
                  "handed": session.handed}

        def put():
            pipe = self.r.pipeline(transaction=True)  # the hash and its TTL together
            pipe.hset(self.key_of(key, owner), mapping=values)
            pipe.pexpire(self.key_of(key, owner), self.ttl_ms)
            pipe.execute()

        try:
            await self._call("save", put)
        except StateUnavailable as err:  # the answer is served; the next turn sees the state before this one
            log.warning("kvtransfer proxy: %s", err)

    async def forget(self, key: str, owner: str) -> Session | None:
        def pop():
            pipe = self.r.pipeline(transaction=True)
            pipe.hgetall(self.key_of(key, owner))
            pipe.delete(self.key_of(key, owner))
            return pipe.execute()[0]

        raw = await self._call("forget", pop)
        return (self._parse(raw, owner, key) or Session(owner=owner)) if raw else None

    @asynccontextmanager
    async def locked(self, key: str, owner: str):
        """This proxy's lock on the session, then the fleet's (SET NX PX, renewed while held, released by its
        holder only); SessionBusy after lock_wait_s, StateUnavailable when Redis fails."""
        async with super().locked(key, owner):
            lock, token = self.key_of(key, owner) + ":lock", uuid.uuid4().hex
            deadline = time.monotonic() + self.lock_wait_s
            while not await self._call("lock", self.r.set, lock, token, nx=True, px=self.lock_ttl_ms):
                if time.monotonic() >= deadline:
                    raise SessionBusy(f"a turn of this session has been in flight on another proxy for over "
                                      f"{self.lock_wait_s:g} s: retry when it is answered")
                await asyncio.sleep(0.02)
            renewer = asyncio.create_task(self._keep(lock, token))
            try:
                yield
            finally:
                renewer.cancel()
                try:
                    await self._call("unlock", self._release, keys=[lock], args=[token])
                except StateUnavailable:
                    pass  # counted; the lock expires by itself within lock_ttl_s

    async def _keep(self, lock: str, token: str) -> None:
        """Renew a held lock every third of its TTL (a long generation keeps it; a dead proxy's lapses)."""
        while True:
            await asyncio.sleep(self.lock_ttl_ms / 3000)
            try:
                await self._call("renew", self._renew, keys=[lock], args=[token, self.lock_ttl_ms])
            except StateUnavailable:
                pass  # counted; a lapsed lock costs at most a concurrent turn, never a wrong answer


def shared_secret(client, deployment: str, candidate: bytes) -> bytes:
    """The deployment's secret from Redis: `candidate` if none is there yet (SET NX: the first proxy's wins), else
    the one there. Raises the client's error when Redis fails (the caller decides)."""
    key = f"kvt:v1:{deployment}:secret"
    client.set(key, candidate, nx=True)
    got = client.get(key)
    if not got:
        raise RuntimeError(f"{key} vanished right after it was set")
    return bytes(got)
