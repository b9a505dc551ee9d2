"""The equal-cost baseline's context (the `truncate` mode of kvtransfer.eval.adapter: the target reads the start ids
and only the last context tokens, nothing mapped) and the per-mode context timing (KVTransferLM.timing).

Timing (`time_contexts=True`): split modes time their prefix cache -- the map and any repair; the source's prefill
is kept apart as `source_seconds` (a handoff finds the source's cache made) -- and target / truncate with
share_prefix their own prefill of context[:-1]; one-pass modes (target, truncate, no_context) run an extra, timed
prefill of the context[:-1] they read, whose result is not scored. FLOPs are counted from the model config
(kvtransfer.core.recompute.prefill_flops), against a re-prefill of each whole context[:-1].
"""
from __future__ import annotations

import time

from ..core.cache import prefill
from ..core.recompute import prefill_flops
from .decode import chunks, pad

OWN_PREFILL_MODES = ("target", "source", "truncate")  # the scorer reads its own prefill of the context it keeps


def check_truncate(tokens, fraction) -> None:
    """ValueError naming the fix unless exactly one of truncate_tokens (>= 1) / truncate_fraction (in [0, 1])."""
    if (tokens is None) == (fraction is None):
        raise ValueError(f"mode=truncate needs exactly one of truncate_tokens (got {tokens}) and truncate_fraction "
                         f"(got {fraction})")
    if tokens is not None and int(tokens) < 1:
        raise ValueError(f"truncate_tokens={tokens}: the target reads at least the last context token (1 = no_context)")
    if fraction is not None and not 0.0 <= float(fraction) <= 1.0:
        raise ValueError(f"truncate_fraction={fraction} must be in [0, 1]")


def truncate_keep(n_body: int, *, tokens: int | None = None, fraction: float | None = None) -> int:
    """Context tokens (after the start ids) the truncate mode keeps of `n_body`: min(tokens, n_body), or
    round(fraction x (n_body - 1)) + 1 -- the count `recompute_select=recent` at that fraction recomputes of a
    prefix whose native sink is the start ids, plus the last context token (at least 1, at most n_body)."""
    check_truncate(tokens, fraction)
    if n_body <= 0:
        return 0
    keep = int(tokens) if tokens is not None else int(round(float(fraction) * (n_body - 1))) + 1
    return max(1, min(keep, n_body))


def truncated_context(ctx: list[int], start: list[int], tokens: int | None, fraction: float | None) -> list[int]:
    """The truncate mode's context: the start ids, then the last `tokens` context tokens (or the count `fraction`
    gives: truncate_keep); the context itself when it is not longer."""
    check_truncate(tokens, fraction)
    has_start = ctx[:len(start)] == start
    body = ctx[len(start):] if has_start else ctx
    keep = truncate_keep(len(body), tokens=tokens, fraction=fraction)
    return (list(start) if has_start else []) + body[len(body) - keep:]


def new_timing() -> dict:
    """A mode's context-timing accumulator (KVTransferLM.timing): seconds the target spent reading contexts
    (map + repair in split modes; its own prefill in target / truncate / no_context), source_seconds (the
    source's prefill, split modes), contexts, tokens read, reference_tokens / reference_flops (a re-prefill of
    every whole context[:-1]), flops (own-prefill modes' target FLOPs), map_flops (transfer: the map's)."""
    return {"seconds": 0.0, "source_seconds": 0.0, "contexts": 0, "tokens": 0, "reference_tokens": 0,
            "reference_flops": 0.0, "flops": 0.0, "map_flops": 0.0}


def timed_prefix_cache(lm, prefixes: list[list[int]], reference: list[int]):
    """prefix_cache, timed into `timing` when time_contexts (the source's prefill apart: build_prefix_cache
    adds it to source_seconds); reference: tokens of each context's full re-prefill (context[:-1])."""
    if not lm.time_contexts:
        return lm.prefix_cache(prefixes)
    source_before = lm.timing["source_seconds"]
    started = time.perf_counter()
    out = lm.prefix_cache(prefixes)
    seconds = time.perf_counter() - started - (lm.timing["source_seconds"] - source_before)
    own = lm.mode in OWN_PREFILL_MODES
    add_timing(lm, seconds, [len(p) for p in prefixes], reference, own=own)
    return out


def time_one_pass(lm, pairs) -> None:
    """One-pass modes: an extra prefill of the context[:-1] each distinct context has the scorer read, timed
    (batched as the scoring is); nothing it computes is scored."""
    read: dict[tuple, list[int]] = {}
    for ctx, cont in pairs:
        ctx = list(ctx)[-max(1, lm.max_length + 1 - len(cont)):]
        used = lm._floor_context(ctx) if lm.mode == "no_context" else \
            lm.truncated_context(ctx) if lm.mode == "truncate" else ctx
        read.setdefault(tuple(ctx), used)
    rows = sorted(read.items(), key=lambda kv: -len(kv[1]))
    for part in ([r for r in rows if len(r[1]) > 1], [r for r in rows if len(r[1]) <= 1]):
        for chunk in chunks(part, lm.batch_size):
            prefixes = [used[:-1] for _, used in chunk]
            seconds = 0.0
            if prefixes[0]:  # a 1-token context has no prefix to prefill
                ids, mask = pad(prefixes, lm.pad_token_id, "left", lm.scoring_model.device)
                started = time.perf_counter()
                prefill(lm.scoring_model, ids, mask)
                seconds = time.perf_counter() - started
            add_timing(lm, seconds, [len(p) for p in prefixes], [len(c) - 1 for c, _ in chunk], own=True)


def add_timing(lm, seconds: float, tokens: list[int], reference: list[int], *, own: bool) -> None:
    """Accumulate one timed batch: seconds, contexts, tokens read, and the target FLOPs of reading them
    (own prefill modes) against those of re-prefilling every whole context[:-1]."""
    cfg = lm.target_model.config
    t = lm.timing
    t["seconds"] += float(seconds)
    t["contexts"] += len(tokens)
    t["tokens"] += int(sum(tokens))
    t["reference_tokens"] += int(sum(reference))
    t["reference_flops"] += float(sum(prefill_flops(cfg, n) for n in reference))
    if own:
        t["flops"] += float(sum(prefill_flops(cfg, n) for n in tokens if n > 0))
    elif lm.mapper is not None and lm.mode == "transfer":
        t["map_flops"] += float(lm.mapper.apply_flops_per_token) * int(sum(tokens))
