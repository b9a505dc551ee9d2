"""What the handoff proxy (kvtransfer.serve.proxy) knows of a request and a session, and counts: the outcome of
one request (its `X-KVTransfer` header and `kvtransfer` field), a session's state, the proxy's counters, and the
two errors it tells apart (a client's bad request, an unreachable engine)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 and this message, counted as `bad_request`."""


class Unreachable(RuntimeError):
    """An engine did not answer (connection refused, reset, timeout) or answered 5xx."""


@dataclass
class Outcome:
    """What the proxy did with one request: status is mapped | fallback_reprefill | fallback_source | source."""

    status: str
    engine: str
    mapped: int | None = None
    prefilled: int | None = None
    reason: str = ""
    save_s: float | None = None

    def header(self) -> str:
        """The `X-KVTransfer` header value (ASCII)."""
        if self.status == "mapped":
            return f"mapped {self.mapped} tokens, prefilled {self.prefilled}"
        if self.status in ("fallback_reprefill", "fallback_source"):
            return f"{self.status}: {self.reason}"
        return self.status if not self.reason else f"{self.status}: {self.reason}"

    def field(self) -> dict:
        """The `kvtransfer` body field."""
        return {"status": self.status, "engine": self.engine, "mapped": self.mapped, "prefilled": self.prefilled,
                "reason": self.reason, "save_s": self.save_s, "summary": self.header()}


@dataclass
class Session:
    """A conversation's state: the engine serving it and, once handed over, the ids the source read."""

    engine: str = "source"
    handed_ids: list[int] = field(default_factory=list)


class Stats:
    """The proxy's counters (requests, routes, mapped, fallbacks by reason, errors), served as JSON."""

    def __init__(self):
        self.counts: Counter = Counter()
        self.fallbacks: Counter = Counter()
        self.errors: Counter = Counter()
        self.mapped_tokens = 0
        self.prefilled_tokens = 0

    def outcome(self, out: Outcome) -> None:
        """Count one request's outcome (its status, its fallback reason, its mapped and prefilled tokens)."""
        self.counts[out.status] += 1
        if out.status.startswith("fallback"):
            self.fallbacks[f"{out.status}:{out.reason.split(' ')[0]}"] += 1
        self.mapped_tokens += out.mapped or 0
        self.prefilled_tokens += out.prefilled or 0

    def as_dict(self) -> dict:
        """The counters as JSON-ready dicts (what `/kvtransfer/stats` serves)."""
        return {"counts": dict(self.counts), "fallbacks": dict(self.fallbacks), "errors": dict(self.errors),
                "mapped_tokens": self.mapped_tokens, "prefilled_tokens": self.prefilled_tokens}
