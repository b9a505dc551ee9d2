"""Selective recompute of a mapped cache (CacheBlend-style repair), its token choice and its cost.

The target recomputes the KV of a fraction r of the context tokens itself, attending to the mapped KV of the
rest: the chosen tokens' hidden states go through every target layer, each layer's attention reading the
mapped K/V of the tokens kept and the recomputed K/V of the chosen ones (causally, by true position), and
their K/V replace the mapped ones in the cache. r = 0 is the map itself (the mapped cache returned as it
is); r = 1 is the target's own prefill (every token recomputed; up to kernel rounding). The native sink
(the first `native_sink` real positions, which `transfer` already has the target compute itself) is never
chosen: it is native already.

Token choice (`SELECTIONS`):
    deviation   CacheBlend's rule: the tokens whose mapped K/V deviate most from the target's own at the
                first layer (one layer of prefill over the context: `first_layer_kv`), squared error
                relative to the native K (and V) energy of that row, K and V weighted equally;
    random      a seeded uniform choice;
    recent      the most recent tokens (the native tail made longer).

Cost (`recompute_cost`): FLOPs of the recompute (+ the first-layer prefill the deviation rule reads) as a
fraction of a full re-prefill of the context, counted from the model config (projections, MLP, attention
over the tokens each query reads; the LM head is not part of a prefill's cache and is not counted).

A numerical core module: no Hydra, lm-eval or W&B.
"""
from __future__ import annotations

import math

import torch
from transformers import DynamicCache

from .cache import KVLayers, layers_to_cache, prefill
from .models import decoder, text_config

SELECTIONS = ("deviation", "random", "recent")


class _StopForward(Exception):
    """Raised by a forward hook to end a prefill after the layers it needs."""


@torch.no_grad()
def first_layer_kv(model, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's own layer-0 (keys, values) [batch, n_kv, seq, d] of unpadded `input_ids` [batch, seq]
    (keys post-RoPE, as the cache holds them): one layer of prefill, the rest of the model skipped."""
    body = decoder(model)
    cache = DynamicCache(config=model.config)

    def stop(*_):
        raise _StopForward

    handle = body.layers[1].register_forward_pre_hook(stop) if len(body.layers) > 1 else None
    try:
        body(input_ids=input_ids, position_ids=torch.arange(input_ids.shape[1], device=input_ids.device)[None]
             .expand(input_ids.shape[0], -1), cache=cache, use_cache=True)
    except _StopForward:
        pass
    finally:
        if handle is not None:
            handle.remove()
    return cache.layers[0].keys, cache.layers[0].values


def choose_tokens(n_tokens: int, fraction: float, select: str, *, native_sink: int = 0, seed: int = 0,
                  deviation: torch.Tensor | None = None) -> torch.Tensor:
    """Sorted int64 positions (in 0..n_tokens-1) the target recomputes: round(fraction x candidates) of the
    candidates native_sink..n_tokens-1, chosen by `select` (deviation: the largest `deviation` [n_tokens]).
    ValueError naming the fix for a fraction outside [0, 1], an unknown rule or a missing deviation."""
    if not 0.0 <= float(fraction) <= 1.0 or math.isnan(float(fraction)):
        raise ValueError(f"recompute fraction {fraction!r} must be in [0, 1] (0 = the map, 1 = re-prefill)")
    if select not in SELECTIONS:
        raise ValueError(f"recompute selection {select!r}: use one of {SELECTIONS}")
    sink = min(max(0, int(native_sink)), n_tokens)
    cand = torch.arange(sink, n_tokens)  # device: host-side positions (records list them; recompute_row moves them)
    n = int(round(float(fraction) * len(cand)))
    if n == 0:
        return cand[:0]
    if n == len(cand):  # every candidate: no rule to apply
        return cand
    if select == "recent":
        return cand[-n:]
    if select == "random":
        g = torch.Generator().manual_seed(int(seed))  # device: draws host-side positions
        return cand[torch.randperm(len(cand), generator=g)[:n]].sort().values  # device: host-side positions
    if deviation is None or deviation.shape != (n_tokens,):
        raise ValueError(f"selection 'deviation' needs a deviation per token [{n_tokens}] (token_deviation)")
    # ranked on the CPU: the deviation lives with the mapped cache, and a CUDA index cannot index host positions
    order = torch.argsort(deviation[sink:].double().cpu(), descending=True, stable=True)[:n]
    return cand[order].sort().values


def token_deviation(mapped: tuple[torch.Tensor, torch.Tensor], native: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Per-token deviation [seq] (float64) of one row's mapped layer-0 (K, V) [n_kv, seq, d] from the native
    ones: sum over heads and dims of the squared error of K over the row's mean native K energy per token,
    plus the same for V."""
    out = 0.0
    for m, n in zip(mapped, native):
        m, n = m.double(), n.double().to(m.device)
        err = (m - n).pow(2).sum(dim=(0, 2))  # [seq]
        out = out + err / n.pow(2).sum(dim=(0, 2)).mean().clamp_min(1e-30)
    return out


@torch.no_grad()
def recompute_row(model, input_ids: torch.Tensor, mapped: KVLayers, chosen: torch.Tensor) -> KVLayers:
    """One unpadded row: ids [seq], mapped per-layer (K, V) [1, n_kv, seq, d]; the target recomputes the KV at
    positions `chosen` (sorted) attending causally to the mapped KV of the others and to the recomputed KV
    of the chosen; returns new layers [1, n_kv, seq, d] (the mapped tensors are not modified)."""
    seq = input_ids.shape[-1]
    if len(chosen) == 0:
        return mapped
    device = mapped[0][0].device
    chosen = chosen.to(device)
    keep_mask = torch.ones(seq, dtype=torch.bool, device=device)
    keep_mask[chosen] = False
    kept = keep_mask.nonzero(as_tuple=True)[0]
    dtype = model.dtype
    # additive mask [1, 1, n_chosen, n_kept + n_chosen]: a chosen token reads kept tokens before it, chosen ones up to it
    allow = torch.cat([kept[None, :] < chosen[:, None], chosen[None, :] <= chosen[:, None]], dim=1)
    mask = torch.zeros(allow.shape, dtype=dtype, device=device).masked_fill(~allow, torch.finfo(dtype).min)[None, None]
    if len(kept):
        cache = layers_to_cache([(k[:, :, kept], v[:, :, kept]) for k, v in mapped], model.config)
    else:
        cache = DynamicCache(config=model.config)
    decoder(model)(input_ids=input_ids.reshape(1, -1)[:, chosen.to(input_ids.device)].to(model.device),
                   attention_mask=mask, position_ids=chosen[None].to(model.device), cache=cache, use_cache=True)
    out = []
    n_kept = len(kept)
    for (k, v), layer in zip(mapped, cache.layers):
        k2, v2 = k.clone(), v.clone()
        k2[:, :, chosen] = layer.keys[:, :, n_kept:].to(k.device, k.dtype)
        v2[:, :, chosen] = layer.values[:, :, n_kept:].to(v.device, v.dtype)
        out.append((k2, v2))
    return out


def recompute_rows(model, input_ids: torch.Tensor, mapped: KVLayers, chosen: torch.Tensor) -> KVLayers:
    """recompute_row for a batch of unpadded rows of one length that recompute as many tokens each, in one forward:
    ids [batch, seq], mapped per-layer (K, V) [batch, n_kv, seq, d], chosen [batch, c] (each row sorted). The same
    computation as recompute_row on each row (one target pass, not one per row; equal up to the kernels' rounding
    at another batch size)."""
    batch, seq = input_ids.shape
    device = mapped[0][0].device
    chosen = chosen.to(device)
    rows = torch.arange(batch, device=device)[:, None]
    keep_mask = torch.ones(batch, seq, dtype=torch.bool, device=device)
    keep_mask[rows, chosen] = False
    kept = keep_mask.nonzero(as_tuple=True)[1].view(batch, seq - chosen.shape[1])  # row-major: each row sorted
    dtype = model.dtype
    # per row, as recompute_row: a chosen token reads kept tokens before it and chosen ones up to it
    allow = torch.cat([kept[:, None, :] < chosen[:, :, None], chosen[:, None, :] <= chosen[:, :, None]], dim=2)
    mask = torch.zeros(allow.shape, dtype=dtype, device=device).masked_fill(~allow, torch.finfo(dtype).min)[:, None]

    def at(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:  # x [batch, n_kv, seq, d] at positions idx [batch, n]
        return x.gather(2, idx[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3]))
    if kept.shape[1]:
        cache = layers_to_cache([(at(k, kept), at(v, kept)) for k, v in mapped], model.config)
    else:
        cache = DynamicCache(config=model.config)
    ids = input_ids.to(device).gather(1, chosen)
    decoder(model)(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                   position_ids=chosen.to(model.device), cache=cache, use_cache=True)
    out = []
    n_kept = kept.shape[1]
    for (k, v), layer in zip(mapped, cache.layers):
        idx = chosen[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        out.append((k.scatter(2, idx, layer.keys[:, :, n_kept:].to(k.device, k.dtype)),
                    v.scatter(2, idx, layer.values[:, :, n_kept:].to(v.device, v.dtype))))
    return out


@torch.no_grad()
def selective_recompute(model, input_ids: torch.Tensor, mapped: KVLayers, fraction: float, *,
                        select: str = "deviation", attention_mask: torch.Tensor | None = None, native_sink: int = 0,
                        seed: int = 0) -> tuple[KVLayers, list[dict]]:
    """(layers, per-row records) after the target recomputes a fraction of each row's context tokens.

    input_ids [batch, seq] (left-padded, `attention_mask` 0/1 [batch, seq]) and `mapped` per-layer (K, V)
    [batch, n_kv, seq, d] of those tokens (what `transfer` returns, its native sink included). Each row
    recomputes round(fraction x (real tokens - native_sink)) tokens chosen by `select` (see module doc);
    fraction = 0 returns `mapped` itself. Records: {"tokens": real tokens, "recomputed": n, "positions":
    chosen positions (real-token positions)}. The mapped tensors are never modified."""
    if fraction == 0:
        choose_tokens(1, fraction, select)  # validates the rule
        real = input_ids.shape[1] if attention_mask is None else None
        return mapped, [{"tokens": int(real if real is not None else attention_mask[b].sum()), "recomputed": 0,
                         "positions": []} for b in range(input_ids.shape[0])]
    batch, seq = input_ids.shape
    records, picks = [], []
    for b in range(batch):
        n_real = seq if attention_mask is None else int(attention_mask[b].sum())
        first = seq - n_real
        ids = input_ids[b, first:]
        dev = None
        n_cand = n_real - min(native_sink, n_real)
        if select == "deviation" and 0 < int(round(fraction * n_cand)) < n_cand:  # all or none: nothing to rank
            nk, nv = first_layer_kv(model, ids[None].to(model.device))
            dev = token_deviation((mapped[0][0][b, :, first:], mapped[0][1][b, :, first:]), (nk[0], nv[0]))
        chosen = choose_tokens(n_real, fraction, select, native_sink=native_sink, seed=seed, deviation=dev)
        picks.append(chosen)
        records.append({"tokens": n_real, "recomputed": int(len(chosen)), "positions": chosen.tolist()})
    if len({r["tokens"] for r in records}) == 1 and len({len(c) for c in picks}) == 1:
        # rows of one length (perplexity windows, a served batch of equal prompts): one target pass for the batch,
        # not one per row (a CPU forward's time is mostly reading the weights)
        first = seq - records[0]["tokens"]
        if not len(picks[0]):
            return [(k.clone(), v.clone()) for k, v in mapped], records
        rows = [(k[:, :, first:], v[:, :, first:]) for k, v in mapped]
        new = recompute_rows(model, input_ids[:, first:], rows, torch.stack(picks))
        return [(torch.cat([k[:, :, :first], nk], dim=2), torch.cat([v[:, :, :first], nv], dim=2))
                for (k, v), (nk, nv) in zip(mapped, new)], records
    out = [(k.clone(), v.clone()) for k, v in mapped]
    for b, (rec, chosen) in enumerate(zip(records, picks)):
        first = seq - rec["tokens"]
        row = [(k[b:b + 1, :, first:], v[b:b + 1, :, first:]) for k, v in mapped]
        new = recompute_row(model, input_ids[b, first:], row, chosen)
        for (k, v), (nk, nv) in zip(out, new):
            k[b:b + 1, :, first:] = nk
            v[b:b + 1, :, first:] = nv
    return out, records


def full_prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> KVLayers:
    """The target's own cache of left-padded `input_ids` (what r = 1 approximates): `cache.prefill`."""
    return prefill(model, input_ids, attention_mask)


def _dims(config) -> dict:
    c = text_config(config)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return {"hidden": c.hidden_size, "heads": heads, "kv": c.num_key_value_heads, "head_dim": head_dim,
            "inter": c.intermediate_size, "layers": c.num_hidden_layers}


def token_flops(config, attended: int, layers: int | None = None) -> float:
    """FLOPs (2 per multiply-add) of one token through `layers` (default all) decoder layers, attending to
    `attended` tokens: q/k/v/o projections, the gated MLP (3 matrices), QK^T and softmax x V."""
    d = _dims(config)
    h, qd, kvd = d["hidden"], d["heads"] * d["head_dim"], d["kv"] * d["head_dim"]
    linear = 2 * (h * qd + 2 * h * kvd + qd * h + 3 * h * d["inter"])
    attention = 2 * 2 * qd * attended
    return float((d["layers"] if layers is None else layers) * (linear + attention))


def prefill_flops(config, n_tokens: int, layers: int | None = None) -> float:
    """FLOPs of a causal prefill of `n_tokens` (token i attends to i + 1 tokens) through `layers` layers."""
    d = _dims(config)
    n = int(n_tokens)
    per_linear = token_flops(config, 0, 1)
    attn_per_key = 2 * 2 * d["heads"] * d["head_dim"]
    total = n * per_linear + attn_per_key * n * (n + 1) / 2
    return float((d["layers"] if layers is None else layers) * total)


def range_flops(config, start: int, end: int) -> float:
    """FLOPs of the tokens at positions start..end-1 through every layer, each attending to the tokens up to it: the
    closed form of sum(token_flops(config, p + 1) for p in range(start, end)); 0 for an empty range."""
    a, b = int(start), int(end)
    if b <= a:
        return 0.0
    d = _dims(config)
    attn_per_key = 2 * 2 * d["heads"] * d["head_dim"]
    return float(d["layers"] * (token_flops(config, 0, 1) * (b - a) + attn_per_key * (b * (b + 1) - a * (a + 1)) / 2))


def recompute_cost(config, n_tokens: int, positions: list[int], select: str, native_sink: int = 0) -> dict:
    """{"flops", "prefill_flops", "fraction"}: FLOPs of recomputing the tokens at `positions` of an
    `n_tokens` context (each reads the tokens up to it), plus the deviation rule's one layer of prefill over
    all n_tokens when it ranked anything (not all or none of the n_tokens - native_sink candidates), against a
    full prefill of n_tokens (fraction = flops / prefill_flops; 0 for an empty
    context)."""
    flops = sum(token_flops(config, int(p) + 1) for p in positions)
    if select == "deviation" and 0 < len(positions) < n_tokens - min(native_sink, n_tokens):  # a ranking was read
        flops += prefill_flops(config, n_tokens, layers=1)
    full = prefill_flops(config, n_tokens)
    return {"flops": flops, "prefill_flops": full, "fraction": flops / full if full else 0.0}
