"""Diagnostics for a mapped vs native target cache on held-out text.

Per target layer: R² of the mapped keys (content space) and values against the target's own cache,
and the cosine between the attention outputs the target computes on a continuation when reading the
native vs the mapped cache. Over the continuation: next-token KL(native || mapped) and top-1
agreement. Attention outputs are taken end to end (errors of earlier layers propagate), which is
what the target actually experiences.
"""
from __future__ import annotations

import torch

from .cache import KVLayers, forward_on_cache
from .models import decoder
from .transfer import codec_for


def _r2(pred: torch.Tensor, true: torch.Tensor) -> float:
    true, pred = true.double(), pred.double()
    sst = ((true - true.mean(dim=(0, 2), keepdim=True)) ** 2).sum()
    return float(1 - ((pred - true) ** 2).sum() / sst.clamp_min(1e-300))


@torch.no_grad()
def _attention_outputs(model, layers, prefix_mask, continuation_ids):
    captured = []
    hooks = [layer.self_attn.register_forward_hook(lambda _m, _i, out: captured.append(out[0].detach().float()))
             for layer in decoder(model).layers]
    try:
        logits = forward_on_cache(model, layers, prefix_mask, continuation_ids)
    finally:
        for h in hooks:
            h.remove()
    return logits.float(), captured


@torch.no_grad()
def compare_caches(target_model, native: KVLayers, mapped: KVLayers, continuation_ids: torch.Tensor,
                   prefix_mask: torch.Tensor | None = None) -> dict:
    """Compare a mapped target cache with the native one; both [batch, n_kv, prefix, d] per layer.

    continuation_ids [batch, n]: tokens the target reads after the prefix. Returns
    {"key_r2": [L], "value_r2": [L], "attn_cosine": [L], "kl": float (nats/token),
    "top1_agreement": float in [0, 1]}.
    """
    codec = codec_for(target_model)
    positions = torch.arange(native[0][0].shape[2], device=native[0][0].device)
    key_r2 = [_r2(codec.strip(m[0], positions), codec.strip(n[0], positions)) for n, m in zip(native, mapped)]
    value_r2 = [_r2(m[1], n[1]) for n, m in zip(native, mapped)]
    logits_n, attn_n = _attention_outputs(target_model, native, prefix_mask, continuation_ids)
    logits_m, attn_m = _attention_outputs(target_model, mapped, prefix_mask, continuation_ids)
    cosine = [float(torch.nn.functional.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1).mean())
              for a, b in zip(attn_n, attn_m)]
    logp_n, logp_m = logits_n.log_softmax(-1), logits_m.log_softmax(-1)
    kl = float((logp_n.exp() * (logp_n - logp_m)).sum(-1).mean())
    top1 = float((logits_n.argmax(-1) == logits_m.argmax(-1)).float().mean())
    return {"key_r2": key_r2, "value_r2": value_r2, "attn_cosine": cosine, "kl": kl, "top1_agreement": top1}


POSITION_GROUPS = {"pos0": (0, 1), "pos1-3": (1, 4), "rest": (4, None)}


def _rel_err(pred: torch.Tensor, true: torch.Tensor) -> float:
    true, pred = true.double(), pred.double()
    return float(((pred - true) ** 2).sum() / (true ** 2).sum().clamp_min(1e-300))


@torch.no_grad()
def position_diagnostics(target_model, native: KVLayers, mapped: KVLayers, continuation_ids: torch.Tensor,
                         groups: dict[str, tuple[int, int | None]] | None = None) -> dict:
    """Where along the prefix a mapped cache goes wrong: position 0 (the sink), 1-3, and the rest.

    native / mapped: per target layer (K, V) [batch, n_kv, prefix, d], unpadded; continuation_ids
    [batch, n]. Per group of prefix positions [lo, hi): the relative squared error of the mapped
    keys (content space) and values, summed over layers; and the damage that group alone does: the
    native cache with only that group's positions swapped for the mapped ones, read by the target
    on the continuation -> attention-output cosine (mean over layers and tokens) and next-token
    KL(native || swapped) in nats/token. "all" swaps every position (the full transfer).
    Returns {group: {"key_rel_err", "value_rel_err", "attn_cosine", "kl"}}.
    """
    groups = groups or POSITION_GROUPS
    codec = codec_for(target_model)
    seq = native[0][0].shape[2]
    positions = torch.arange(seq, device=native[0][0].device)
    logits_n, attn_n = _attention_outputs(target_model, native, None, continuation_ids)
    logp_n = logits_n.log_softmax(-1)
    out = {}
    for name, (lo, hi) in {**groups, "all": (0, None)}.items():
        hi = seq if hi is None else min(hi, seq)
        if lo >= hi:
            continue
        sl = slice(lo, hi)
        k_err = sum(_rel_err(codec.strip(m[0], positions)[:, :, sl], codec.strip(n[0], positions)[:, :, sl])
                    for n, m in zip(native, mapped)) / len(native)
        v_err = sum(_rel_err(m[1][:, :, sl], n[1][:, :, sl]) for n, m in zip(native, mapped)) / len(native)
        swapped = []
        for (nk, nv), (mk, mv) in zip(native, mapped):
            k, v = nk.clone(), nv.clone()
            k[:, :, sl], v[:, :, sl] = mk[:, :, sl].to(k.dtype), mv[:, :, sl].to(v.dtype)
            swapped.append((k, v))
        logits_s, attn_s = _attention_outputs(target_model, swapped, None, continuation_ids)
        cosine = sum(float(torch.nn.functional.cosine_similarity(a.flatten(0, -2), b.flatten(0, -2), dim=-1).mean())
                     for a, b in zip(attn_n, attn_s)) / len(attn_n)
        logp_s = logits_s.log_softmax(-1)
        kl = float((logp_n.exp() * (logp_n - logp_s)).sum(-1).mean())
        out[name] = {"positions": [lo, hi], "key_rel_err": k_err, "value_rel_err": v_err, "attn_cosine": cosine,
                     "kl": kl}
    return out
