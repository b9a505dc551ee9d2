"""What the handoff proxy (kvtransfer.serve.proxy) knows of a request and a session, and counts: the outcome of
one request (its `X-KVTransfer` header and `kvtransfer` field), a session's state and the bounded table of them,
the proxy's counters, and the errors it tells apart (a client's bad request, another client's session, an
unreachable engine)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
from collections import Counter, OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and this message, counted as `bad_request`."""


class Forbidden(PermissionError):
    """A request for a session another client opened (HTTP 403)."""


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

    def header(self) -> str:
        """The `X-KVTransfer` header value (ASCII)."""
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
    salt of its mapped blocks on the consumer, and its token sequence as a length and a hash (a later turn must
    extend it), the tokens the producer stored and the tokens handed over at the switch."""

    owner: str = ""
    salt: str = ""
    engine: str = "source"
    write_through: bool = True
    n_ids: int = 0
    ids_hash: str = ""
    stored: int = 0
    handed: int = 0
    tip: str = ""  # the store's hash of the session's last stored block (what deleting the session removes)

    def extends(self, ids: list[int]) -> bool:
        """Whether `ids` start with the session's previous token sequence (False for a first turn)."""
        return bool(self.n_ids) and len(ids) >= self.n_ids and ids_digest(ids[:self.n_ids]) == self.ids_hash

    def remember(self, ids: list[int]) -> None:
        """Make `ids` the session's token sequence."""
        self.n_ids, self.ids_hash = len(ids), ids_digest(ids)


def ids_digest(ids: list[int]) -> str:
    """sha256 hex of token ids (comma-separated decimal)."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()


class Sessions:
    """The proxy's sessions: LRU-bounded, each bound to the client key that opened it, each with a lock that exists
    only while a request holds or waits for it (rejected requests leave nothing behind)."""

    def __init__(self, secret: bytes, max_sessions: int = 10000):
        self.secret, self.max_sessions = secret, max_sessions
        self.table: OrderedDict[str, Session] = OrderedDict()
        self._locks: dict[str, list] = {}  # key -> [lock, holders and waiters]

    def _mac(self, text: str) -> str:
        return hmac.new(self.secret, text.encode(), hashlib.sha256).hexdigest()

    def owner_of(self, authorization: str | None) -> str:
        """A keyed digest of a request's Authorization header ("" without one): what a session is bound to."""
        return self._mac("owner/" + authorization) if authorization else ""

    def salt(self, key: str | None) -> str:
        """The session's part of the consumer's cache salt (a fresh random one for a request without a session)."""
        import uuid

        return self._mac("salt/" + key)[:40] if key is not None else uuid.uuid4().hex

    def open(self, key: str, owner: str) -> Session:
        """The session `key` (created, bound to `owner`, if new); Forbidden if another owner opened it."""
        session = self.table.get(key)
        if session is None:
            session = Session(owner=owner, salt=self.salt(key))
            self.table[key] = session
            while len(self.table) > self.max_sessions:
                self.table.popitem(last=False)
        elif not hmac.compare_digest(session.owner, owner) and session.owner:
            raise Forbidden("this session was opened with another API key")
        self.table.move_to_end(key)
        return session

    def drop(self, key: str) -> Session | None:
        """Forget a session (its lock goes when its last request does)."""
        return self.table.pop(key, None)

    def __len__(self) -> int:
        return len(self.table)

    def __contains__(self, key) -> bool:
        return key in self.table

    def __iter__(self):
        return iter(self.table)

    @asynccontextmanager
    async def locked(self, key: str):
        """Hold the session's lock (one turn of a session at a time: its state changes with each)."""
        entry = self._locks.setdefault(key, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            async with entry[0]:
                yield
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._locks[key]


class Stats:
    """The proxy's counters (requests, routes, mapped, fallbacks by reason, errors), served as JSON."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.errors: Counter = Counter()
        self.mapped_tokens = 0
        self.cached_tokens = 0
        self.prefilled_tokens = 0
        self.handoff: Counter = Counter()  # switches, write-through, partial maps, rewritten histories, waits

    def outcome(self, out: Outcome) -> None:
        """Count one request's outcome (its status, its fallback reason, its mapped and prefilled tokens)."""
        self.counts[out.status] += 1
        self.cached_tokens += out.cached or 0
        if out.status.startswith("fallback"):
            self.fallbacks[f"{out.status}:{out.reason.split(' ')[0]}"] += 1
        self.mapped_tokens += out.mapped or 0
        self.prefilled_tokens += out.prefilled or 0

    def as_dict(self) -> dict:
        """The counters as JSON-ready dicts (what `/kvtransfer/stats` serves)."""
        return {"counts": dict(self.counts), "fallbacks": dict(self.fallbacks), "errors": dict(self.errors),
                "handoff": dict(self.handoff), "mapped_tokens": self.mapped_tokens,
                "cached_tokens": self.cached_tokens, "prefilled_tokens": self.prefilled_tokens}
