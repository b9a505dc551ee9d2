"""Source KV cache -> target KV cache through a Mapper.

    K_t = RoPE_t( RoPE_s^-1(K_s) @ W_K + b_K ),   V_t = V_s @ W_V + b_V
with the source features of every target layer's selected source layers concatenated (layer,
head, dim). Per target layer K and V are one batched GEMM. Tokens are mapped in chunks so long
contexts fit in memory. Optionally the target computes the first `native_sink` positions itself.
"""
from __future__ import annotations

import weakref

import torch

from .cache import KVLayers, layers_to_cache, positions_from_mask, prefill
from .mapper import Mapper
from .models import kv_shape
from .rope import RopeCodec

_CODECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def codec_for(model) -> RopeCodec:
    """The model's RopeCodec, built once per model (its cos/sin table is reused across calls)."""
    codec = _CODECS.get(model)
    if codec is None:
        codec = _CODECS[model] = RopeCodec(model)
    return codec


def _flat(t: torch.Tensor) -> torch.Tensor:
    """[batch, heads, seq, dim] -> [batch * seq, heads * dim]."""
    b, h, s, d = t.shape
    return t.permute(0, 2, 1, 3).reshape(b * s, h * d)


def _unflat(t: torch.Tensor, batch: int, heads: int) -> torch.Tensor:
    """[batch * seq, heads * dim] -> [batch, heads, seq, dim]."""
    seq = t.shape[0] // batch
    return t.view(batch, seq, heads, -1).permute(0, 2, 1, 3)


@torch.no_grad()
def map_layers(source_layers: KVLayers, mapper: Mapper, positions: torch.Tensor, *,
               source_codec: RopeCodec | None, target_codec: RopeCodec | None, target_n_kv: int,
               out_dtype: torch.dtype | None = None, rope_at_inference: bool = True,
               chunk_tokens: int = 8192, check_finite: bool = True) -> KVLayers:
    """Map per-layer source (keys, values) [batch, n_kv_s, seq, d_s] to target layers.

    positions: int64 [batch, seq] (or [seq]) true token positions used to strip and re-apply RoPE.
    Keys are stripped/re-rotated when the mapper works in content space and `rope_at_inference`
    (False = the "no re-rotation at inference" ablation: the content-space map is applied to
    rotated keys and its output stored unrotated). Returns [batch, n_kv_t, seq, d_t] per target
    layer in `out_dtype` (default: the source cache dtype). Raises FloatingPointError on NaN/Inf.
    """
    batch, _, seq, _ = source_layers[0][0].shape
    if positions.dim() == 1:
        positions = positions[None].expand(batch, -1)
    rotate = mapper.key_space == "stripped" and rope_at_inference
    if rotate and (source_codec is None or target_codec is None):
        raise ValueError("content-space mapping needs source_codec and target_codec")
    out_dtype = out_dtype or source_layers[0][0].dtype
    w, b = mapper.weight, mapper.bias
    device, dtype = w.device, w.dtype
    selected = mapper.selected_layers.to(device)
    used = sorted(set(mapper.selected_layers.flatten().tolist()))
    n_t = w.shape[0]
    chunk = max(1, chunk_tokens // batch)
    outputs = [([], []) for _ in range(n_t)]
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for start in range(0, seq, chunk):
        sl = slice(start, min(seq, start + chunk))
        pos = positions[:, sl]
        # stacked features [2, batch*chunk, L_s, W]; unused source layers stay zero (never read)
        feats = None
        for s in used:
            k, v = source_layers[s][0][:, :, sl], source_layers[s][1][:, :, sl]
            if rotate:
                k = source_codec.strip(k, pos)
            kf, vf = _flat(k).to(device, dtype), _flat(v).to(device, dtype)
            if feats is None:
                feats = torch.zeros(2, kf.shape[0], len(source_layers), kf.shape[1], device=device, dtype=dtype)
            feats[0, :, s], feats[1, :, s] = kf, vf
        rows = feats.shape[1]
        for t in range(n_t):
            x = feats[:, :, selected[t]].reshape(2, rows, -1)
            y = torch.baddbmm(b[t][:, None, :], x, w[t])  # [2, rows, q]
            if check_finite:
                bad |= ~torch.isfinite(y).all()
            k_t, v_t = _unflat(y[0], batch, target_n_kv), _unflat(y[1], batch, target_n_kv)
            if rotate:
                k_t = target_codec.apply(k_t, pos.to(k_t.device))
            outputs[t][0].append(k_t.to(out_dtype))
            outputs[t][1].append(v_t.to(out_dtype))
    if check_finite and bool(bad):
        raise FloatingPointError("mapped cache contains NaN/Inf: check the mapper (refit with larger lambda) "
                                 "and the source cache dtype")
    return [(torch.cat(ks, dim=2).contiguous(), torch.cat(vs, dim=2).contiguous()) for ks, vs in outputs]


@torch.no_grad()
def transfer(source_cache, mapper: Mapper, source_model, target_model, *, attention_mask=None,
             positions: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
             native_sink: int = 0, rope_at_inference: bool = True, chunk_tokens: int = 8192,
             as_layers: bool = False, check_pair: bool = True):
    """Map a source model's prefilled cache into a fresh target `DynamicCache`.

    source_cache: a `DynamicCache` or per-layer (keys, values) [batch, n_kv_s, seq, d_s].
    attention_mask: [batch, seq] 0/1 for left-padded batches (positions derived from it), or give
    `positions` [batch, seq] directly; default positions 0..seq-1. native_sink=N: the target
    prefills the first N real tokens itself (needs `input_ids` [batch, seq]) and only later
    positions are mapped. Returns a DynamicCache (or layers with `as_layers=True`) in the target
    model's dtype on the mapper's device.
    """
    if check_pair:
        mapper.check_pair(source_model, target_model)
    layers = source_cache if isinstance(source_cache, list) else [(l.keys, l.values) for l in source_cache.layers]
    batch, _, seq, _ = layers[0][0].shape
    if positions is None:
        positions = (positions_from_mask(attention_mask) if attention_mask is not None
                     else torch.arange(seq, device=layers[0][0].device)[None].expand(batch, -1))
    tgt = kv_shape(target_model)
    mapped = map_layers(layers, mapper, positions, source_codec=codec_for(source_model),
                        target_codec=codec_for(target_model), target_n_kv=tgt.n_kv,
                        out_dtype=target_model.dtype, rope_at_inference=rope_at_inference, chunk_tokens=chunk_tokens)
    if native_sink > 0:
        if input_ids is None:
            raise ValueError("native_sink needs input_ids (the target computes the first tokens itself)")
        mapped = _with_native_sink(mapped, target_model, input_ids, attention_mask, native_sink)
    return mapped if as_layers else layers_to_cache(mapped, target_model.config)


def _with_native_sink(mapped: KVLayers, target_model, input_ids, attention_mask, n_sink: int) -> KVLayers:
    """Overwrite the first `n_sink` real positions of each row with the target's own prefill."""
    batch, seq = input_ids.shape
    n_sink = min(n_sink, seq)
    first = torch.zeros(batch, dtype=torch.long, device=input_ids.device) if attention_mask is None \
        else (attention_mask.shape[1] - attention_mask.long().sum(-1))  # left padding: first real index
    idx = (first[:, None] + torch.arange(n_sink, device=input_ids.device)).clamp(max=seq - 1)
    sink_cache = prefill(target_model, input_ids.gather(1, idx))
    out = []
    for (k, v), (sk, sv) in zip(mapped, sink_cache):
        k, v = k.clone(), v.clone()
        gather_idx = idx.to(k.device)[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])
        k.scatter_(2, gather_idx, sk.to(k.device, k.dtype))
        v.scatter_(2, gather_idx, sv.to(v.device, v.dtype))
        out.append((k, v))
    return out
