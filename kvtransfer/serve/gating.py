"""The per-request quality gate (kvtransfer.core.gate) as the vLLM connector serves it.

The consumer maps prompt tokens lo..hi-1 today and the target prefills the rest. With a gate
(kv_connector_extra_config "gate": the gate artifact written by kvtransfer.core.gate.save_gate, the
thresholds the harness's `gated` mode uses) the connector tells vLLM it has only lo..hi-tail-1
(`plan`), so the target computes the gate's `tail` tokens hi-tail..hi-1 itself on the mapped cache
before them -- exactly what kvtransfer.core.gate.tail_score runs. The worker maps all of lo..hi-1,
scatters lo..hi-tail-1, keeps the map's prediction at the tail positions, and after the forward
(wait_for_save) compares it with the native K/V vLLM wrote there (`score`: core.gate.tail_score_kv,
the harness's code) and decides (core.gate.decide). vLLM can only recompute a suffix of whole blocks:
the worker reports the blocks from `recompute_start` on as load errors, and with
kv_load_failure_policy="recompute" the scheduler drops the step's sampled token and recomputes from the
first such block (vllm/v1/core/sched/scheduler.py: _update_requests_with_invalid_blocks truncates
num_computed_tokens there; update_from_output skips the request's output). So the served actions are

    map        the target computed positions hi-tail.. itself (the map with a native tail of tail + native_tail)
    recompute  it recomputes from the block holding position hi - round(fraction x (hi - native_sink)):
               the `recent` rule (kvtransfer.core.recompute) at block granularity
    full       it recomputes from lo (a full prefill when nothing was cached)

and the harness reproduces each with `recompute_start` (experiments/serve/harness_side.py --gate).
A gate file that cannot be read never takes the engine down: every request is then prefilled normally
(what decide does with unreadable thresholds: a full prefill), counted as reason "gate_unusable".
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from ..core.gate import Decision, decide, load_gate

log = logging.getLogger(__name__)
DEFAULT_TAIL = 8  # conf/eval/default.yaml eval.gate.tail, where the artifact does not record one

@dataclass(frozen=True)
class ServedGate:
    """The engine's gate: thresholds (None when the file is unusable, with `error`), the tail, the file."""

    thresholds: dict | None
    tail: int
    path: str
    error: str = ""


def load_served_gate(path, tail=None) -> ServedGate | None:
    """The gate of kv_connector_extra_config (None when "gate" is not set); never raises: a missing, unreadable or
    invalid file gives a ServedGate with `error` set (every request is then prefilled normally)."""
    if path in (None, ""):
        return None
    fallback_tail = DEFAULT_TAIL if tail is None else tail
    try:
        data = load_gate(path)
        t = int(data.get("tail", fallback_tail) if tail is None else tail)
        score = data.get("score", "tail_kv")
        if score != "tail_kv":  # the worker computes tail_kv only: other thresholds would be read on the wrong scale
            raise ValueError(f"gate score {score!r}: the connector computes only 'tail_kv'; serve a gate fitted with "
                             "eval.gate.score=tail_kv")
        if t < 1:
            raise ValueError(f"gate tail {t}: at least one tail token")
        return ServedGate(dict(data["thresholds"]), t, str(path))
    except Exception as err:  # noqa: BLE001 -- never down: the engine serves every request with a normal prefill
        try:
            t = int(fallback_tail)
        except (TypeError, ValueError):
            t = DEFAULT_TAIL
        return ServedGate(None, t, str(path), f"{type(err).__name__}: {err}"[:500])


def plan(lo: int, hi: int, tail: int, native_sink: int) -> int | None:
    """The end of the range vLLM is told is loaded (hi - tail: the target computes the gate's tail itself), or None
    when no token before the tail is mapped (too short to score: the gate's decision is a full prefill)."""
    head_end = hi - int(tail)
    return head_end if head_end > max(lo, native_sink) else None


def recompute_start(decision: Decision, *, lo: int, head_end: int, hi: int, native_sink: int,
                    block_size: int) -> int:
    """The first prompt position the target computes itself under `decision`: head_end for map; for recompute the
    start of the block holding hi - round(fraction x (hi - native_sink)) (the `recent` rule over the candidates
    native_sink..hi-1, rounded down to a whole block), at most head_end; for full, lo's block start."""
    if decision.action == "map":
        return head_end
    if decision.action == "full" or decision.fraction >= 1.0:
        return max(0, lo // block_size * block_size)
    n = int(round(float(decision.fraction) * (hi - min(native_sink, hi))))
    first = (hi - n) // block_size * block_size
    return min(head_end, max(first, lo // block_size * block_size))


def invalid_blocks(block_ids: list[int], start: int, head_end: int, block_size: int) -> list[int]:
    """The request's blocks to report as load errors so vLLM recomputes from `start` (none when start >= head_end:
    those positions were computed natively already)."""
    if start >= head_end:
        return []
    return list(block_ids[start // block_size:(head_end - 1) // block_size + 1])


def served_cost(config, *, lo: int, head_end: int, start: int, prompt_len: int) -> float:
    """FLOPs the target spent on one gated prompt, as a fraction of one full prefill of it (core.recompute's count):
    the scored step computes every position vLLM was not told is loaded (0..lo-1 and head_end..prompt_len-1), and a
    recompute or full prefill (start < head_end) then computes start..prompt_len-1 again -- the first step's token is
    discarded, so a fallback costs more than a plain prefill."""
    from ..core.recompute import prefill_flops, range_flops

    full = prefill_flops(config, prompt_len)
    if not full:
        return 0.0
    first = range_flops(config, 0, min(lo, prompt_len)) + range_flops(config, max(head_end, 0), prompt_len)
    again = range_flops(config, start, prompt_len) if start < head_end else 0.0
    return float((first + again) / full)


def record(decision: Decision, *, start: int, lo: int, hi: int, prompt_len: int, tail: int, block_size: int = 0,
           cost: float | None = None) -> dict:
    """The JSON record of what the gate did for one request (stats and kv_transfer_params): the decision (action,
    fraction, score, reason), the tail, the first position the target computed (start), the tokens that stayed mapped
    and those the target computed, `recomputed`: the share of the prompt the target computed itself, vLLM's cache
    block size (the recompute's granularity) and `cost`: the target's FLOPs on the prompt over one full prefill of it
    (`served_cost`; None where the model config was not at hand)."""
    computed = prompt_len - start
    return decision.as_dict() | {"tail": int(tail), "start": int(start), "mapped": max(0, start - lo),
                                 "prefilled": computed, "recomputed": computed / prompt_len if prompt_len else 0.0,
                                 "lo": int(lo), "hi": int(hi), "block_size": int(block_size), "cost": cost}


def unscored(reason: str) -> Decision:
    """The decision for a request the gate cannot score (the file is unusable, the context too short, an error):
    a full prefill, with the reason (what core.gate.decide does with unreadable input)."""
    return Decision("full", 1.0, None, reason)


def score_and_decide(thresholds: dict, mapped, native) -> Decision:
    """core.gate.decide on core.gate.tail_score_kv of the map's tail (K, V) vs the native one; never raises (an error
    is a full prefill with the reason)."""
    from ..core.gate import tail_score_kv

    try:
        score = float(tail_score_kv(mapped, native))
    except Exception as err:  # noqa: BLE001 -- never down: an unscorable request is prefilled
        return unscored(f"gate error: {type(err).__name__}: {err}"[:500])
    return decide(score if math.isfinite(score) else math.nan, thresholds)


def after_forward(kept: dict, layers: list, layout, thresholds: dict, block_size: int,
                  config=None) -> tuple[dict, set]:
    """Worker, after the forward: ({request: record}, blocks to report as load errors) for the loads kept this step.

    kept: request -> (LoadSpec, the map's (K, V) [n_kv, tail, d] per layer at positions spec.hi..spec.gate_hi-1);
    layers: (decoder layer index, paged tensor) pairs. The native K/V vLLM wrote at those slots are read back
    (layout.gather) and scored against the map's (`score_and_decide`); a fault gives a full prefill. config: the
    target's model config, for each record's `cost` (`served_cost`)."""
    from . import paged

    records, failed = {}, set()
    for req_id, (spec, tail_kv) in kept.items():
        try:
            slots = paged.slot_mapping(spec.block_ids, block_size, spec.hi, spec.gate_hi)
            native: list = [None] * len(tail_kv)
            for idx, layer in layers:
                native[idx] = layout.gather(layer, slots)
            decision = score_and_decide(thresholds, [(k[None], v[None]) for k, v in tail_kv],
                                        [(k[None], v[None]) for k, v in native])
        except Exception as err:  # noqa: BLE001 -- never down
            decision = unscored(f"gate error: {type(err).__name__}: {err}"[:500])
        start = recompute_start(decision, lo=spec.lo, head_end=spec.hi, hi=spec.gate_hi,
                                native_sink=spec.native_sink, block_size=block_size)
        failed.update(invalid_blocks(spec.block_ids, start, spec.hi, block_size))
        cost = None
        if config is not None:
            try:
                cost = served_cost(config, lo=spec.lo, head_end=spec.hi, start=start, prompt_len=spec.prompt_len)
            except Exception as err:  # noqa: BLE001 -- a config it cannot read costs the record its cost, not the request
                log.warning("kvtransfer gate: no FLOPs count (%s)", err)
        records[req_id] = record(decision, start=start, lo=spec.lo, hi=spec.gate_hi, prompt_len=spec.prompt_len,
                                 tail=spec.gate_hi - spec.hi, block_size=block_size, cost=cost)
    return records, failed


def response(summary: dict, gate: dict | None) -> dict:
    """A request's kv_transfer_params "kvtransfer" summary with the gate's record under "gate" and, where the gate
    ran, mapped / prefilled (and their old names matched / tail) as the gate left them."""
    if gate is None:
        return summary
    out = summary | {"gate": gate}
    if gate.get("score") is not None or gate["action"] != "full":
        out |= {"mapped": gate["mapped"], "matched": gate["mapped"], "prefilled": gate["prefilled"],
                "tail": gate["prefilled"]}
    return out
