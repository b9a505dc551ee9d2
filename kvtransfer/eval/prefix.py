"""The prefix cache the target scores on, built per mode by the lm-eval adapter (kvtransfer.eval.adapter): the
scoring model's own prefill, the target's round-tripped through cache I/O, the source's unmapped, or mapped -- and
then, under the per-request gate or a fixed recompute fraction (kvtransfer.core.gate, kvtransfer.core.recompute),
repaired before the target reads it."""
from __future__ import annotations

import math
import time
from collections import defaultdict

import torch

from ..core.cache import cache_to_layers, layers_to_cache, prefill
from ..core.gate import Decision, decide
from ..core.hidden import prefill_with_hidden, used_layers
from ..core.recompute import recompute_cost, selective_recompute
from ..core.signals import ENTROPIES, request_signals, signal_costs, signal_flops
from ..core.transfer import transfer
from .decode import pad


def build_prefix_cache(lm, prefixes: list[list[int]]):
    """Target-format cache of left-padded `prefixes`, built per mode: (layers, mask [G, P]) or (None, None).

    layers: per target layer (K, V) [G, n_kv, P, d]. In `target` / `source` mode this is the
    scoring model's own prefill (used by the multi-turn protocol; lm-eval scoring runs one pass).
    """
    if not prefixes or max(len(p) for p in prefixes) == 0:
        return None, None
    if min(len(p) for p in prefixes) == 0:
        raise ValueError("prefix_cache: mix of empty and non-empty prefixes; batch them separately")
    ids, mask = pad(prefixes, lm.pad_token_id, "left", lm.scoring_model.device)
    if lm.mode in ("target", "source", "truncate"):  # the scorer's own prefill (truncate: of the context it keeps)
        return prefill(lm.scoring_model, ids, mask), mask
    if lm.mode == "native_injected":
        layers = prefill(lm.target_model, ids, mask)
        return cache_to_layers(layers_to_cache(layers, lm.target_model.config)), mask
    src_ids, src_mask = ids.to(lm.source_model.device), mask.to(lm.source_model.device)
    hidden = None
    started = time.perf_counter()
    if lm.mode == "transfer" and getattr(lm.mapper, "needs_hidden", False):
        # a hidden-state map (kvtransfer.core.hidden) also reads the source's normed layer inputs: the same prefill
        src, hidden = prefill_with_hidden(lm.source_model, src_ids, src_mask,
                                          layers=used_layers(lm.mapper.selected_layers))
    else:
        src = prefill(lm.source_model, src_ids, src_mask)
    if getattr(lm, "timing", None) is not None:  # the source's prefill: done already when a handoff maps its cache
        lm.timing["source_seconds"] += time.perf_counter() - started
    if lm.mode == "identity":
        dev, dt = lm.target_model.device, lm.target_model.dtype
        return [(k.to(dev, dt), v.to(dev, dt)) for k, v in src], mask
    layers = transfer(src, lm.mapper, lm.source_model, lm.target_model, attention_mask=src_mask,
                      input_ids=src_ids, native_sink=lm.native_sink, as_layers=True,
                      rope_at_inference=lm.rope_at_inference, source_hidden=hidden)
    if lm.mode == "transfer" and (lm.repair or lm.gate is not None or lm.recompute_fraction > 0):
        layers = repair_prefix(lm, layers, ids.to(lm.target_model.device), mask.to(lm.target_model.device))
    return layers, mask.to(lm.target_model.device)


def repair_prefix(lm, layers, ids: torch.Tensor, mask: torch.Tensor):
    """The mapped prefix cache after the gate's decision per row (or the fixed recompute fraction); one record
    per row appended to `events` (see the class doc)."""
    target = lm.target_model
    started = time.perf_counter()
    n_real = mask.long().sum(-1).tolist()
    if lm.gate is None:
        decisions = [Decision("recompute", lm.recompute_fraction, None, "eval.recompute_fraction")] * len(n_real)
        scores = [None] * len(n_real)
        gate_flops = [0.0] * len(n_real)
    else:  # the gate decides by its score (a signal of kvtransfer.core.signals; tail_kv unless the artifact says)
        names, clock = [lm.gate_score, *lm.gate_signals], time.perf_counter()
        values = request_signals(target, layers, ids, mask, tail=lm.gate_tail, start_ids=lm._start_ids,
                                 native_sink=lm.native_sink, names=names)
        score, signal_seconds = values[lm.gate_score], (time.perf_counter() - clock) / max(1, len(n_real))
        scores = [None if math.isnan(x) else float(x) for x in score.tolist()]
        decisions = [decide(x, lm.gate) for x in score.tolist()]
        spec = {"tail": lm.gate_tail, "n_start": len(lm._start_ids)}
        gate_flops = [signal_flops(target.config, n, names=[lm.gate_score], **spec)[lm.gate_score] for n in n_real]
        costs = [signal_costs(target.config, n, names=lm.gate_signals, **spec) for n in n_real]
        recorded = {k: v.tolist() for k, v in values.items()
                    if k in lm.gate_signals or (k in ENTROPIES and "tail_kl" in lm.gate_signals)}
        signals = [{k: None if math.isnan(v[b]) else float(v[b]) for k, v in recorded.items()}
                   for b in range(len(n_real))]
    out = [(k.clone(), v.clone()) for k, v in layers]
    rows_by_fraction: dict[float, list[int]] = defaultdict(list)
    for b, d in enumerate(decisions):
        if d.action != "map":
            rows_by_fraction[d.fraction].append(b)
    positions: dict[int, list[int]] = {}
    for fraction, rows in rows_by_fraction.items():
        sel = torch.tensor(rows, device=ids.device)
        if fraction >= 1.0 and lm.gate is not None:  # the gate's fall-back: the target's own prefill
            new = prefill(target, ids.index_select(0, sel), mask.index_select(0, sel))
            for b, n in zip(rows, [n_real[b] for b in rows]):
                positions[b] = list(range(n))
        else:
            sub = [(k.index_select(0, sel.to(k.device)), v.index_select(0, sel.to(v.device))) for k, v in layers]
            new, recs = selective_recompute(target, ids.index_select(0, sel), sub, fraction,
                                            select=lm.recompute_select, attention_mask=mask.index_select(0, sel),
                                            native_sink=lm.native_sink, seed=lm.recompute_seed)
            for b, rec in zip(rows, recs):
                positions[b] = rec["positions"]
        for (k, v), (nk, nv) in zip(out, new):
            k[sel.to(k.device)] = nk.to(k.device, k.dtype)
            v[sel.to(v.device)] = nv.to(v.device, v.dtype)
    seconds = (time.perf_counter() - started) / max(1, len(n_real))
    for b, d in enumerate(decisions):
        pos = positions.get(b, [])
        select = "full" if d.action == "full" else lm.recompute_select
        cost = recompute_cost(target.config, n_real[b], pos, select, lm.native_sink)
        full = cost["prefill_flops"]
        event = {**d.as_dict(), "key": hash(tuple(ids[b, len(ids[b]) - n_real[b]:].tolist())),
                 "tokens": n_real[b], "recomputed": len(pos), "score": scores[b],
                 "cost": (cost["flops"] + gate_flops[b]) / full if full else 0.0, "seconds": seconds}
        if lm.gate is not None and lm.gate_signals:  # measurements beside the decision (eval.gate.signals)
            event["signals"] = signals[b]
            event["signal_costs"], event["signal_seconds"] = costs[b], signal_seconds  # seconds: all signals
        lm.events.append(event)
    return out
