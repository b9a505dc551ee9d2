"""The consumer's scheduler-side decision: how many prompt tokens a request takes from the map, and why not.

Everything is checked before vLLM is promised a token (a promise the worker then cannot keep would
fail the request under kv_load_failure_policy="fail", or cost a recompute under "recompute"):
the mapper is usable for this engine, the prompt starts with the mapper's position-0 tokens
(its context_start), a store entry exists for this prompt from the mapper's source model and
its header, shapes and token ids check out. Any failure -> 0 matched tokens and a normal
prefill, with a reason that is logged and counted (`Counters`).
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from ..core.io import atomic_write_json
from .store import BadEntry, EntryHeader, KVStore

log = logging.getLogger("kvtransfer.serve")

MAPPED = "mapped"


@dataclass(frozen=True)
class Decision:
    """matched = hi - lo tokens loaded from the map (0 unless reason == "mapped"); tail = prompt - hi."""

    reason: str
    matched: int = 0
    lo: int = 0
    hi: int = 0
    tail: int = 0
    entry: EntryHeader | None = None
    detail: str = ""


@dataclass(frozen=True)
class MapSpec:
    """What the scheduler knows of the mapper: source model hash, position-0 tokens, sink and tail sizes.
    `unusable` holds the reason the mapper cannot serve this engine at all (every request falls back)."""

    source_hash: str
    start_ids: tuple[int, ...] = ()
    native_sink: int = 0
    native_tail: int = 1
    unusable: str = ""


def decide(prompt: list[int], num_computed: int, store: KVStore, spec: MapSpec, *, prefix_caching: bool = False,
           salted: bool = False, source_len: int | None = None, off: bool = False) -> Decision:
    """The decision for one request whose first `num_computed` prompt tokens are already in the cache.

    prefix_caching / salted: with vLLM's prefix cache on, only requests carrying the connector's cache
    salt are mapped, so mapped blocks are hashed apart from every unsalted request's. source_len:
    the request names the length of the prompt prefix the source read (default: the whole prompt).
    off: the request asked for a normal prefill (kv_transfer_params {"kvtransfer": "off"}).
    """
    if off:
        return Decision("off", detail="the request asked for a normal prefill")
    if spec.unusable:
        return Decision("wrong_pair", detail=spec.unusable)
    if prefix_caching and not salted:
        return Decision("unsalted", detail="prefix caching is on and the request lacks the mapped cache salt")
    n_start = len(spec.start_ids)
    if tuple(prompt[:n_start]) != spec.start_ids:
        return Decision("context_start", detail=f"the prompt does not start with the mapper's position-0 ids "
                                                f"{list(spec.start_ids)}")
    key_ids = prompt if source_len is None else prompt[:source_len]
    path = store.path(key_ids, spec.source_hash)
    if not path.is_file():
        other = store.others(key_ids, spec.source_hash)
        if other:
            return Decision("wrong_pair", detail=f"{other[0].name} was written by another source model")
        return Decision("no_entry")
    try:
        entry = store.read_header(path, key_ids)
    except BadEntry as err:
        return Decision(err.reason, detail=str(err))
    if entry.model.get("config_hash") != spec.source_hash:
        return Decision("wrong_pair", detail=f"{path.name}: header names model {entry.model.get('config_hash')}")
    hi = min(entry.n_tokens, len(prompt) - spec.native_tail)
    lo = num_computed
    if hi <= max(lo, spec.native_sink):
        return Decision("too_short", detail=f"nothing to map beyond {lo} cached tokens with a tail of "
                                            f"{spec.native_tail} (prompt {len(prompt)})")
    return Decision(MAPPED, hi - lo, lo, hi, len(prompt) - hi, entry)


class Counters:
    """Fallback reasons and per-request records, logged and (with a path) written as JSON after each decision."""

    def __init__(self, path: str | Path | None = None, keep: int = 1000):
        self.path, self.keep = (Path(path) if path else None), keep
        self.reasons: Counter = Counter()
        self.requests: dict[str, dict] = {}

    def record(self, request_id: str, prompt_len: int, decision: Decision) -> None:
        self.reasons[decision.reason] += 1
        self.requests[request_id] = {"prompt": prompt_len, "reason": decision.reason, "matched": decision.matched,
                                     "lo": decision.lo, "tail": decision.tail if decision.matched else prompt_len,
                                     "detail": decision.detail}
        while len(self.requests) > self.keep:
            self.requests.pop(next(iter(self.requests)))
        if decision.reason == MAPPED:
            log.info("kvtransfer: request %s maps tokens %d..%d, target computes %d", request_id, decision.lo,
                     decision.hi, decision.tail)
        else:
            log.warning("kvtransfer: request %s falls back to a normal prefill (%s) %s", request_id,
                        decision.reason, decision.detail)
        self.flush()

    def flush(self) -> None:
        if self.path is not None:
            atomic_write_json(self.path, {"reasons": dict(self.reasons), "requests": self.requests})

    @staticmethod
    def load(path: str | Path) -> dict:
        """The JSON a Counters with this path last wrote."""
        return json.loads(Path(path).read_text())
