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
