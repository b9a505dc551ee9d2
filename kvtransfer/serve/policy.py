"""The consumer's scheduler-side decision: how many prompt tokens a request takes from the map, and why not.

Everything is checked before vLLM is promised a token (a promise the worker then cannot keep costs a
recompute under kv_load_failure_policy="recompute"): the request's fields have the right types, the
mapper is usable for this engine, the prompt starts with the mapper's position-0 tokens (its
context_start), and the store holds a prefix of the prompt written by the mapper's source model (same
architecture *and* weights: kvtransfer.serve.ident), in the request's namespace (`kvtransfer_ns`), whose block
headers check out. Any failure -> 0
matched tokens and a normal prefill, with a reason that is logged and counted (`Counters`).

`decide` is a pure function of (prompt, num_computed, store contents, spec, request fields); `safe_decide`
wraps it so that nothing -- a malformed field, a block header of any shape, a bug -- raises out of it.
"""
from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass
from pathlib import Path

from ..core.io import atomic_write_json
from .blockstore import BlockStore
from .store import BadEntry, Prefix, check_namespace

log = logging.getLogger("kvtransfer.serve")

MAPPED = "mapped"
CACHED = "cached"  # nothing to map: vLLM's own prefix cache (this session's earlier turns) holds the stored prefix
LOAD_FAILED = "load_failed"
WORKER_UNUSABLE = "worker_unusable"  # the worker reported that it cannot map (Decider.worker_error)
FINAL = (LOAD_FAILED, "gate_unusable", "gate_no_score")  # reasons a request keeps once given (never mapped again)


class BadRequest(ValueError):
    """A request field of the wrong type or value (reason "bad_request")."""


@dataclass(frozen=True)
class Decision:
    """matched = hi - lo tokens loaded from the map (0 unless reason == "mapped"); tail = prompt - hi, the tokens
    the target prefills itself beyond the lo it already had cached."""

    reason: str
    matched: int = 0
    lo: int = 0
    hi: int = 0
    tail: int = 0
    prefix: Prefix | None = None
    detail: str = ""

    def summary(self, prompt_len: int) -> dict:
        """JSON-ready {"reason", "mapped", "cached", "prefilled", "prompt", "detail", "matched", "lo", "tail"}:
        mapped = tokens taken from the map, cached = tokens vLLM already held (its prefix cache), prefilled = tokens
        the target computed; matched / lo / tail are the earlier records' names of the same three numbers."""
        mapped = self.matched if self.reason == MAPPED else 0
        cached = self.lo  # vLLM's prefix cache (Decider.get records it on every decision)
        prefilled = prompt_len - mapped - cached
        return {"reason": self.reason, "mapped": mapped, "cached": cached, "prefilled": prefilled,
                "prompt": prompt_len, "detail": self.detail[:500], "matched": mapped, "lo": cached, "tail": prefilled}


@dataclass(frozen=True)
class MapSpec:
    """What the scheduler knows of the mapper: the source model's store key (architecture + weights), position-0
    tokens, sink and tail sizes. `unusable` holds the reason the mapper cannot serve this engine at all."""

    source_hash: str
    start_ids: tuple[int, ...] = ()
    native_sink: int = 0
    native_tail: int = 1
    unusable: str = ""


def salted_by(cache_salt, salt: str) -> bool:
    """Whether a request's vLLM cache_salt marks it for mapping: the connector's salt itself, or a per-session salt
    "<salt>:<session part>" (the handoff proxy's; vLLM caps a salt at 128 characters)."""
    return isinstance(cache_salt, str) and (cache_salt == salt or cache_salt.startswith(salt + ":"))


NS_FIELD = "kvtransfer_ns"  # kv_transfer_params field: the request's store namespace (the handoff proxy sets it)


def request_namespace(params) -> str:
    """The store namespace of a request's kv_transfer_params ("" when it names none); BadRequest for a value that is
    not "" or 1..64 lowercase hex characters."""
    ns = params.get(NS_FIELD) if isinstance(params, dict) else None
    if ns is None:
        return ""
    try:
        return check_namespace(ns)
    except ValueError as err:
        raise BadRequest(f"kv_transfer_params.{NS_FIELD}: {err}") from None


def unkeyed_input(request) -> tuple[str, str] | None:
    """(reason, detail) when a vLLM request's K/V depends on an input the store's chain key does not carry -- a LoRA
    adapter ("lora"), multimodal inputs ("multimodal"), prompt embeddings ("prompt_embeds") -- else None: such a
    request is neither stored nor mapped (the same token ids would name another K/V)."""
    lora = getattr(request, "lora_request", None)
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "name", None) or "?"
        return "lora", (f"LoRA adapter {name!r}: the store's key holds the token ids and the base model's weights, "
                        f"not the adapter")
    features = getattr(request, "mm_features", None)
    if features:
        return "multimodal", (f"{len(features)} multimodal input(s): the store's key holds the token ids, not the "
                              f"inputs' hashes")
    if getattr(request, "prompt_embeds", None) is not None:
        return "prompt_embeds", "prompt embeddings: the store's key holds token ids only"
    return None


def parse_params(params) -> tuple[bool, int | None, str]:
    """(off, source_len, ns) from a request's kv_transfer_params; BadRequest naming the field on a wrong type.

    {"kvtransfer": "off"} asks for a normal prefill ("on"/absent: map when possible); {"kvtransfer_source_len": n}
    (an int >= 0) limits the lookup to the first n prompt tokens; {"kvtransfer_ns": ns} ("" or 1..64 lowercase hex,
    set by the handoff proxy) is the store namespace looked up (default "", the shared one). Unknown keys are
    ignored (other connectors' and the proxy's fields travel in the same dict).
    """
    if params is None:
        return False, None, ""
    if not isinstance(params, dict):
        raise BadRequest(f"kv_transfer_params must be an object, not {type(params).__name__}")
    mode = params.get("kvtransfer")
    if mode not in (None, "on", "off"):
        raise BadRequest(f"kv_transfer_params.kvtransfer={mode!r}: use \"off\" (normal prefill) or \"on\"")
    n = params.get("kvtransfer_source_len")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 0):
        raise BadRequest(f"kv_transfer_params.kvtransfer_source_len={n!r}: a non-negative integer number of tokens")
    return mode == "off", n, request_namespace(params)


def decide(prompt: list[int], num_computed: int, store: BlockStore, spec: MapSpec, *,
           prefix_caching: bool = False, salted: bool = False, source_len: int | None = None, off: bool = False,
           ns: str = "", unkeyed: tuple[str, str] | None = None) -> Decision:
    """The decision for one request whose first `num_computed` prompt tokens are already in the cache.

    prefix_caching / salted: with vLLM's prefix cache on, only requests carrying the connector's cache
    salt (or a per-session salt under it, `salted_by`) are mapped, so mapped (lossy) blocks are hashed apart from
    every other request's and session's and never serve another's exact prefix-cache hit. A request whose
    first num_computed tokens vLLM's prefix cache already holds (this session's earlier turns) and that the store
    cannot extend is reason "cached": its summary counts those tokens as cached, not mapped. source_len: map at most the first source_len prompt tokens. off: the request asked
    for a normal prefill. ns: the store namespace looked up (the request's; another namespace's blocks are never
    seen). unkeyed: (reason, detail) of an input the store's key does not carry (`unkeyed_input`): never mapped.
    The mapped range is tokens lo..hi-1 with lo = num_computed and hi = the longest stored
    prefix, capped to leave the last `native_tail` prompt tokens to the target.
    """
    if off:
        return Decision("off", detail="the request asked for a normal prefill")
    if unkeyed:
        return Decision(unkeyed[0], detail=unkeyed[1])
    if spec.unusable:
        return Decision("wrong_pair", detail=spec.unusable)
    if prefix_caching and not salted:
        return Decision("unsalted", detail="prefix caching is on and the request lacks the mapped cache salt")
    n_start = len(spec.start_ids)
    if tuple(prompt[:n_start]) != spec.start_ids:
        return Decision("context_start", detail=f"the prompt does not start with the mapper's position-0 ids "
                                                f"{list(spec.start_ids)}")
    key_ids = prompt if source_len is None else prompt[:source_len]
    prefix = store.lookup(key_ids, spec.source_hash, ns)
    lo = num_computed
    if lo > 0 and min(prefix.n_tokens, len(prompt) - spec.native_tail) <= lo:
        return Decision(CACHED, lo=lo, hi=lo, tail=len(prompt) - lo,
                        detail=f"vLLM's prefix cache holds {lo} tokens; the store holds {prefix.n_tokens} "
                               f"{prefix.detail}".strip())
    if prefix.n_blocks == 0:
        if prefix.detail:
            reason, _, detail = prefix.detail.partition(": ")
            return Decision(reason, detail=detail)
        other = store.others(key_ids, spec.source_hash, ns)
        if other:
            return Decision("wrong_pair", detail=f"the store holds this prompt from model {other[0]}, not the "
                                                 f"mapper's source {spec.source_hash} (other weights or architecture)")
        return Decision("no_entry", detail=f"no stored block of the first {store.block_size} tokens")
    hi = min(prefix.n_tokens, len(prompt) - spec.native_tail)
    if hi <= max(lo, spec.native_sink):
        return Decision("too_short", detail=f"nothing to map beyond {lo} cached tokens: {prefix.n_tokens} stored, "
                                            f"tail {spec.native_tail}, prompt {len(prompt)}")
    return Decision(MAPPED, hi - lo, lo, hi, len(prompt) - hi, prefix, prefix.detail)


def safe_decide(prompt, num_computed, store: BlockStore, spec: MapSpec, *, params=None,
                prefix_caching: bool = False, salted: bool = False, unkeyed: tuple[str, str] | None = None) -> Decision:
    """`decide` for a request as vLLM hands it (its raw kv_transfer_params): never raises. A malformed field is
    reason "bad_request"; any other exception (a store or code fault) is reason "error", with the exception named."""
    try:
        off, source_len, ns = parse_params(params)
        if not isinstance(prompt, list) or not all(isinstance(t, int) for t in prompt):
            raise BadRequest("the request has no prompt token ids")
        if not isinstance(num_computed, int) or num_computed < 0:
            raise BadRequest(f"num_computed_tokens={num_computed!r}")
        return decide(prompt, num_computed, store, spec, prefix_caching=prefix_caching, salted=salted,
                      source_len=source_len, off=off, ns=ns, unkeyed=unkeyed)
    except BadRequest as err:
        return Decision("bad_request", detail=str(err))
    except BadEntry as err:
        return Decision(err.reason, detail=str(err))
    except Exception as err:  # noqa: BLE001 -- never down: the scheduler must not see it
        return Decision("error", detail=f"{type(err).__name__}: {err}")


class _TimedJSON:
    """A JSON file (`snapshot()`) written at most every `flush_s` seconds by a timer thread after a change, and at
    exit; atomic, errors logged, never raised. No path: nothing is written."""

    what = "file"

    def __init__(self, path: str | Path | None, flush_s: float):
        self.path, self.flush_s = (Path(path) if path else None), flush_s
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._dirty = False
        if self.path is not None:
            atexit.register(self.flush)

    def snapshot(self) -> dict:
        raise NotImplementedError

    def _schedule(self) -> None:
        if self.path is None:
            return
        with self._lock:
            self._dirty = True
            if self._timer is not None:
                return
            self._timer = threading.Timer(self.flush_s, self.flush)
            self._timer.daemon = True
            self._timer.start()

    def flush(self) -> None:
        """Write the JSON now if anything changed since the last write (atomic; errors logged, never raised)."""
        with self._lock:
            self._timer = None
            if self.path is None or not self._dirty:
                return
            self._dirty = False
        try:
            atomic_write_json(self.path, self.snapshot())
        except (OSError, ValueError, TypeError) as err:
            log.error("kvtransfer: cannot write %s %s: %s", self.what, self.path, err)


def _store_part(store_stats) -> dict:
    """{"store": the store tier's counters} when there are any (never raises: a stats file is not worth a fault)."""
    try:
        stats = store_stats() if store_stats is not None else {}
    except Exception as err:  # noqa: BLE001
        stats = {"error": f"{type(err).__name__}"}
    return {"store": stats} if stats else {}


class Counters(_TimedJSON):
    """Fallback reasons and the last `keep` per-request records (bounded), logged per decision and written as JSON
    (with a path) at most every `flush_s` seconds by a timer thread, and at exit.

    File: {"reasons": {reason: count}, "requests": {request id: Decision.summary | {"tag"}}, "tags": {tag: id}}.
    """

    what = "stats"

    def __init__(self, path: str | Path | None = None, keep: int = 1000, flush_s: float = 0.5):
        super().__init__(path, flush_s)
        self.keep = keep
        self.reasons: Counter = Counter()
        self.requests: OrderedDict[str, dict] = OrderedDict()
        self.tags: OrderedDict[str, str] = OrderedDict()
        self.gates: Counter = Counter()  # the gate's actions (kvtransfer.serve.gating), one per gated request
        self.store_stats = None  # a callable: the store tier's counters (BlockStore.tier_stats), written as "store"

    def count(self, reason: str) -> None:
        """Count a reason that has no request record (a hook's fault)."""
        with self._lock:
            self.reasons[reason] += 1
        self._schedule()

    def record(self, request_id: str, prompt_len: int, decision: Decision, tag: str | None = None, *,
               count: bool = True) -> None:
        """Count one request's decision (count=False: only replace its record) and keep its summary."""
        with self._lock:
            tag = tag or (self.requests.get(request_id) or {}).get("tag")
            row = decision.summary(prompt_len) | ({"tag": tag} if tag else {})
            if "gate" in (self.requests.get(request_id) or {}):
                row["gate"] = self.requests[request_id]["gate"]
            if count:
                self.reasons[decision.reason] += 1
            self.requests[request_id] = row
            self.requests.move_to_end(request_id)
            while len(self.requests) > self.keep:
                self.requests.popitem(last=False)
            if tag:
                self.tags[tag] = request_id
                while len(self.tags) > self.keep:
                    self.tags.popitem(last=False)
        if decision.reason == MAPPED:
            log.info("kvtransfer: request %s maps tokens %d..%d, target computes %d", request_id, decision.lo,
                     decision.hi, decision.tail)
        else:
            log.warning("kvtransfer: request %s falls back to a normal prefill (%s) %s", request_id,
                        decision.reason, decision.detail)
        self._schedule()

    def annotate(self, request_id: str, gate: dict) -> None:
        """Add the gate's record to a request's record (under "gate", with mapped / prefilled as the gate left them:
        kvtransfer.serve.gating.response) and count its action ("gates")."""
        from .gating import response

        with self._lock:
            row = self.requests.get(request_id)
            if row is not None and "gate" not in row:
                self.gates[gate["action"]] += 1
            if row is not None:
                self.requests[request_id] = response(row, gate)
        log.info("kvtransfer: request %s gate %s (fraction %s, score %s: %s)", request_id, gate["action"],
                 gate["fraction"], gate["score"], gate["reason"])
        self._schedule()

    def move(self, request_id: str, prompt_len: int, old_reason: str, decision: Decision) -> None:
        """Re-classify a request counted as `old_reason` (a mapped request whose load then failed)."""
        with self._lock:
            if self.reasons.get(old_reason, 0) > 0:
                self.reasons[old_reason] -= 1
                if not self.reasons[old_reason]:
                    del self.reasons[old_reason]
        self.record(request_id, prompt_len, decision)

    def snapshot(self) -> dict:
        with self._lock:
            out = {"reasons": dict(self.reasons), "requests": dict(self.requests), "tags": dict(self.tags),
                   "gates": dict(self.gates)}
        return out | _store_part(self.store_stats)

    @staticmethod
    def load(path: str | Path, wait_s: float = 2.0) -> dict:
        """The JSON a Counters with this path last wrote (waits up to wait_s for a first write)."""
        path = Path(path)
        deadline = time.monotonic() + wait_s
        while not path.is_file() and time.monotonic() < deadline:
            time.sleep(0.05)
        return json.loads(path.read_text())


class Timings(_TimedJSON):
    """The worker's per-load timings: the last `keep` kept (bounded), written like Counters' (timer, at exit)."""

    what = "timings"

    def __init__(self, path: str | Path | None = None, keep: int = 1000, flush_s: float = 0.5):
        super().__init__(path, flush_s)
        self.loads: deque = deque(maxlen=keep)
        self.writer: dict | None = None  # a producer's StoreWriter.stats (writes, blocks, bytes, failures, seconds)
        self.store_stats = None  # a callable: the store tier's counters (BlockStore.tier_stats), written as "store"

    def add(self, row: dict) -> None:
        """Keep one load's timings (the oldest beyond `keep` dropped) and schedule a write."""
        with self._lock:
            self.loads.append(row)
        self._schedule()

    def snapshot(self) -> dict:
        with self._lock:
            out = {"loads": list(self.loads)} | ({"writer": dict(self.writer)} if self.writer is not None else {})
        return out | _store_part(self.store_stats)

    def touch(self) -> None:
        """Schedule a write (a producer's writer counters changed)."""
        self._schedule()


class Decider:
    """The connector's scheduler-side decisions, memoised: `get` computes a request's decision once (vLLM may ask
    get_num_new_matched_tokens several times for one request) and counts it once; a later call with another
    num_computed (a preempted request re-queued) recomputes the range without counting again.

    Bounded: at most `keep` requests are remembered (`forget` on request_finished frees one sooner).
    `worker_error`: set once the worker reports it cannot map (the connector's WorkerMeta): from then on every new
    decision is reason "worker_unusable", so the scheduler stops promising tokens the worker would only recompute.
    """

    def __init__(self, store: BlockStore, spec: MapSpec, counters: Counters, *, prefix_caching: bool = False,
                 salt: str = "kvtransfer-mapped", keep: int = 4096):
        self.store, self.spec, self.counters = store, spec, counters
        self.prefix_caching, self.salt, self.keep = prefix_caching, salt, keep
        self.worker_error = ""
        self._memo: OrderedDict[str, tuple[int, int, Decision]] = OrderedDict()

    def get(self, request_id: str, prompt, num_computed: int, params=None, cache_salt=None,
            unkeyed: tuple[str, str] | None = None) -> Decision:
        """The decision for one request (never raises; see safe_decide)."""
        prompt = list(prompt) if isinstance(prompt, (list, tuple)) else prompt
        n = len(prompt) if isinstance(prompt, list) else 0
        known = self._memo.get(request_id)
        if known is not None and (known[:2] == (n, num_computed) or known[2].reason in FINAL):
            return known[2]  # a failed load (or the gate's fall-back) stays: the request is prefilled, never mapped
        if self.worker_error:
            decision = Decision(WORKER_UNUSABLE, detail=f"the worker cannot map: {self.worker_error}")
        else:
            decision = safe_decide(prompt, num_computed, self.store, self.spec, params=params,
                                   prefix_caching=self.prefix_caching, salted=salted_by(cache_salt, self.salt),
                                   unkeyed=unkeyed)
        if decision.reason != MAPPED and isinstance(num_computed, int) and decision.lo != num_computed:
            decision = dataclasses.replace(decision, lo=num_computed)  # a fallback still reports vLLM's own hits
        tag = params.get("kvtransfer_tag") if isinstance(params, dict) else None
        tag = tag if isinstance(tag, str) else None
        if known is None:
            self.counters.record(request_id, n, decision, tag=tag)
        else:  # the same request again: its record follows the new range, its reason is not counted twice
            self.counters.record(request_id, n, decision, tag=tag, count=False)
        self._memo[request_id] = (n, num_computed, decision)
        self._memo.move_to_end(request_id)
        while len(self._memo) > self.keep:
            self._memo.popitem(last=False)
        return decision

    def fail(self, request_id: str, detail: str, reason: str = LOAD_FAILED) -> None:
        """The worker could not load a mapped request's blocks (vLLM recomputes them), or the gate sent it to a
        normal prefill: its reason becomes `reason` (one of FINAL) -- in the counts (moved from "mapped"), its
        record and the response field."""
        known = self._memo.get(request_id)
        if known is None or known[2].reason != MAPPED:
            return
        failed = Decision(reason, detail=detail)
        self._memo[request_id] = (known[0], known[1], failed)
        self.counters.move(request_id, known[0], MAPPED, failed)

    def forget(self, request_id: str) -> Decision | None:
        """Drop a finished request; returns its last decision (None if unknown)."""
        known = self._memo.pop(request_id, None)
        return known[2] if known else None
