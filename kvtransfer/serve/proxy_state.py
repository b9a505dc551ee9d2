"""What the handoff proxy (kvtransfer.serve.proxy) knows of a request and a session: the outcome of one request
(its `X-KVTransfer` header and `kvtransfer` field), a session's state and the bounded table of them, and the errors
it tells apart (a client's bad request, a session request without a key,
an unreachable engine)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and this message, counted as `bad_request`."""


class Unauthorized(PermissionError):
    """A session request without an API key on a proxy that binds sessions to keys (HTTP 401)."""


class Unreachable(RuntimeError):
    """An engine did not answer (connection refused, reset, timeout) or answered 5xx."""


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
