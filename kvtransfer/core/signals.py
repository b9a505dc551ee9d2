"""Per-request signals of a mapped prefix cache, recorded beside the gate's score (issue 30 §1: one measurement each).

Each signal is float64 [batch] over the rows of a left-padded batch of mapped prefix caches (per-layer (K, V)
[batch, n_kv, P, d], what `transfer` returns, its native sink included), NaN where a row is too short for it.
`SIGNALS`:

    tail_kv        the gate's score (kvtransfer.core.gate.tail_score): the target runs the last `tail` prefix
                   tokens on the mapped cache of the rest; relative squared error of the mapped K/V there against
                   the target's own, mean over layers. NaN with fewer than tail + 1 real tokens.
    first_layer    the target's own layer-0 K/V over the row's real tokens (one layer of prefill,
                   kvtransfer.core.recompute.first_layer_kv, what the deviation rule reads) against the mapped
                   layer-0 K/V over the real tokens after the native sink: |K_m - K_n|^2 / |K_n|^2 and the same
                   for V, averaged (kvtransfer.core.gate.layer_errors). NaN with no real token after the sink.
    tail_kl        KL(p_mapped || p_nocontext) (nats) of the target's next-token distribution at each of the
                   `tail` positions, mean over them; p_mapped from the logits of tail_kv's own tail forward,
                   p_nocontext from the target running the same tail tokens with no context (below). Recorded
                   with tail_entropy_mapped and tail_entropy_nocontext: the two entropies (nats) at the last
                   tail position. Larger is not obviously "worse": a mapped context that carries content moves
                   the distribution away from the no-context one too.
    tail_nll_gain  mean NLL (nats/token) of tail tokens 2..m (m = tail) predicted under the mapped context minus
                   under no context: negative = the mapped context helps predict the request's own tail, positive
                   = worse than no context (the no-context floor condition, measured on the tail). NaN for m < 2.

No context is what the harness's `no_context` mode gives the target (kvtransfer.eval.adapter, `_floor_context`):
only the context's start ids (kvtransfer.core.context.start_ids under the run's context_start: BOS, else EOS, or
what the tokenizer adds, possibly nothing) and then the tokens it scores. Here the target runs start ids + the
`tail` tail tokens, positions from 0. The tail signals are NaN where the tail would reach into the start ids
(fewer than len(start ids) + tail real tokens) or where tail_kv is NaN.

Cost (`signal_costs`): FLOPs of computing one signal alone as a fraction of a re-prefill of the row's context
(kvtransfer.core.recompute.prefill_flops / token_flops), plus the LM head (2 x hidden x vocab per token) where a
signal reads logits, which a prefill does not compute: tail_kv = the tail tokens on the mapped cache; first_layer
= one layer of prefill over the context; tail_kl and tail_nll_gain = the tail forward + its LM head + the
no-context forward of start + tail tokens + its LM head at the tail. `request_signals` runs the tail forward once
for every tail signal and the no-context forward once for the last two.

A numerical core module: no Hydra, lm-eval or W&B.
"""
from __future__ import annotations

import math

import torch

from .cache import KVLayers, forward_on_cache
from .gate import layer_errors, tail_score
from .models import text_config
from .recompute import first_layer_kv, prefill_flops, token_flops

SIGNALS = ("tail_kv", "first_layer", "tail_kl", "tail_nll_gain")
ENTROPIES = ("tail_entropy_mapped", "tail_entropy_nocontext")  # recorded with tail_kl
DEFAULT_SCORE = "tail_kv"  # what the gate decides by when nothing says otherwise (artifacts before eval.gate.score)


def check_signals(names) -> list[str]:
    """`names` (a list of SIGNALS names, or None = none) as a list in the given order without repeats; ValueError
    naming the valid names for an unknown one or a value that is not a list."""
    if names is None:
        return []
    if isinstance(names, str) or not isinstance(names, (list, tuple)):
        raise ValueError(f"eval.gate.signals={names!r}: give a list of signal names from {list(SIGNALS)}")
    unknown = [n for n in names if n not in SIGNALS]
    if unknown:
        raise ValueError(f"eval.gate.signals: unknown {unknown}; valid signals are {list(SIGNALS)}")
    return list(dict.fromkeys(names))


def check_score(name) -> str:
    """The name of the signal the gate decides by (one of SIGNALS), or ValueError naming the valid ones."""
    if name not in SIGNALS:
        raise ValueError(f"gate score {name!r} (eval.gate.score): use one of {list(SIGNALS)}")
    return name


@torch.no_grad()
def nocontext_logits(model, tail_ids: torch.Tensor, start_ids: list[int]) -> torch.Tensor:
    """Logits [batch, m, vocab] (model dtype) of the target running start ids + `tail_ids` [batch, m] with nothing
    else before them (the no_context mode's context; module doc), at the m tail positions."""
    start = torch.tensor(list(start_ids), dtype=tail_ids.dtype, device=tail_ids.device)
    ids = torch.cat([start[None].expand(tail_ids.shape[0], -1), tail_ids], dim=1).to(model.device)
    return forward_on_cache(model, None, None, ids)[:, len(start_ids):]


def tail_kl(mapped_logits: torch.Tensor, nocontext_logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """{"tail_kl": mean over the m positions of KL(p_mapped || p_nocontext), "tail_entropy_mapped",
    "tail_entropy_nocontext": entropies at the last position}, each float64 [batch] in nats, from logits
    [batch, m, vocab] of the same tail tokens under the mapped context and under no context."""
    lp = torch.log_softmax(mapped_logits.double(), dim=-1)
    lq = torch.log_softmax(nocontext_logits.double().to(lp.device), dim=-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).mean(-1)
    return {"tail_kl": kl.cpu(), "tail_entropy_mapped": -(lp[:, -1].exp() * lp[:, -1]).sum(-1).cpu(),
            "tail_entropy_nocontext": -(lq[:, -1].exp() * lq[:, -1]).sum(-1).cpu()}


def tail_nll_gain(mapped_logits: torch.Tensor, nocontext_logits: torch.Tensor, tail_ids: torch.Tensor) -> torch.Tensor:
    """float64 [batch]: mean NLL (nats/token) of tail tokens 2..m (`tail_ids` [batch, m]) under the mapped-context
    logits minus under the no-context logits (both [batch, m, vocab]; position j predicts token j + 1); NaN
    for m < 2."""
    m = tail_ids.shape[1]
    if m < 2:
        return torch.full((tail_ids.shape[0],), math.nan, dtype=torch.float64)  # device: host-side, as the result below
    target = tail_ids[:, 1:, None].to(mapped_logits.device)

    def nll(logits):
        lp = torch.log_softmax(logits[:, :-1].double().to(target.device), dim=-1)
        return -lp.gather(-1, target)[..., 0].mean(-1)

    return (nll(mapped_logits) - nll(nocontext_logits)).cpu()


@torch.no_grad()
def first_layer_error(model, mapped_layer0: tuple[torch.Tensor, torch.Tensor], prefix_ids: torch.Tensor,
                      prefix_mask: torch.Tensor | None, native_sink: int = 0) -> torch.Tensor:
    """float64 [batch]: per row, `layer_errors` of the mapped layer-0 (K, V) [batch, n_kv, P, d] against the
    target's own (`first_layer_kv` of the row's real tokens, unpadded) over the real tokens after the first
    `native_sink`; NaN where none remains. prefix_ids [batch, P] left-padded, prefix_mask 0/1 (None: all real)."""
    batch, seq = prefix_ids.shape
    mk, mv = mapped_layer0
    out = torch.full((batch,), math.nan, dtype=torch.float64)  # device: host-side scores, as layer_errors returns them
    for b in range(batch):
        n = seq if prefix_mask is None else int(prefix_mask[b].sum())
        sink = min(max(0, int(native_sink)), n)
        if n - sink < 1:
            continue
        nk, nv = first_layer_kv(model, prefix_ids[b:b + 1, seq - n:].to(model.device))
        first = seq - n + sink
        out[b] = layer_errors([(mk[b:b + 1, :, first:], mv[b:b + 1, :, first:])],
                              [(nk[:, :, sink:], nv[:, :, sink:])])[0, 0]
    return out


def lm_head_flops(config, n_tokens: int) -> float:
    """FLOPs (2 per multiply-add) of the LM head over `n_tokens` positions: 2 x hidden x vocab each."""
    c = text_config(config)
    return float(2 * c.hidden_size * c.vocab_size * int(n_tokens))


def signal_flops(config, n_tokens: int, *, tail: int, n_start: int, names) -> dict[str, float]:
    """{name: FLOPs (2 per multiply-add) of computing that signal alone for an `n_tokens` context} (module doc).
    tail: the gate tail; n_start: len(start ids)."""
    n, tail = int(n_tokens), int(tail)
    forward = sum(token_flops(config, p + 1) for p in range(max(0, n - tail), n))  # the tail on the mapped cache
    m = min(tail, n)
    logits = forward + lm_head_flops(config, m) + prefill_flops(config, int(n_start) + m) + lm_head_flops(config, m)
    flops = {"tail_kv": forward, "first_layer": prefill_flops(config, n, layers=1), "tail_kl": logits,
             "tail_nll_gain": logits}
    return {name: flops[name] for name in check_signals(names)}


def signal_costs(config, n_tokens: int, *, tail: int, n_start: int, names) -> dict[str, float]:
    """{name: `signal_flops` as a fraction of a re-prefill of the `n_tokens` context
    (kvtransfer.core.recompute.prefill_flops); 0 for an empty context}."""
    full = prefill_flops(config, int(n_tokens))
    flops = signal_flops(config, n_tokens, tail=tail, n_start=n_start, names=names)
    return {name: f / full if full else 0.0 for name, f in flops.items()}


@torch.no_grad()
def request_signals(target_model, mapped: KVLayers, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor | None, *,
                    tail: int, start_ids: list[int], native_sink: int, names) -> dict[str, torch.Tensor]:
    """{name: float64 [batch]} for each of `names` (SIGNALS; tail_kl adds ENTROPIES) of the mapped prefix cache
    `mapped` of left-padded `prefix_ids` [batch, P] (`prefix_mask` 0/1, None: all real); module doc. The tail
    forward runs once (kvtransfer.core.gate.tail_score, so tail_kv is the gate's score exactly), the no-context
    forward once when a logit signal is asked for."""
    names = check_signals(names)
    out: dict[str, torch.Tensor] = {}
    tail = int(tail)
    if {"tail_kv", "tail_kl", "tail_nll_gain"} & set(names):
        score, _, logits = tail_score(target_model, mapped, prefix_ids, prefix_mask, tail, return_logits=True)
        if "tail_kv" in names:
            out["tail_kv"] = score
        logit_names = [n for n in names if n in ("tail_kl", "tail_nll_gain")]
        if logit_names:
            batch = prefix_ids.shape[0]
            nan = torch.full((batch,), math.nan, dtype=torch.float64)  # device: host-side scores, as tail_kl's
            if logits is None:
                values = {n: nan for n in (*logit_names, *(ENTROPIES if "tail_kl" in logit_names else ()))}
            else:
                ids = prefix_ids[:, -tail:]
                free = nocontext_logits(target_model, ids, start_ids)
                values = tail_kl(logits, free) if "tail_kl" in logit_names else {}
                if "tail_nll_gain" in logit_names:
                    values["tail_nll_gain"] = tail_nll_gain(logits, free, ids)
                mask = torch.ones_like(prefix_ids) if prefix_mask is None else prefix_mask
                bad = torch.isnan(score) | (mask.long().sum(-1).cpu() < tail + len(start_ids))
                values = {k: v.masked_fill(bad, math.nan) for k, v in values.items()}
            out.update(values)
    if "first_layer" in names:
        out["first_layer"] = first_layer_error(target_model, mapped[0], prefix_ids, prefix_mask, native_sink)
    return {k: out[k] for k in (*names, *ENTROPIES) if k in out}
