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
    def _rope_into(dst: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   den: torch.Tensor | None = None) -> None:
        """dst [b, h, s, d] <- RopeCodec.apply(keys) (den None) or RopeCodec.strip(keys) (den = cos²+sin²).

        Same arithmetic as RopeCodec: float32, rounded to `keys.dtype`, then stored in `dst.dtype`; all
        float32 keys and dst are written in place half by half, without rotate_half's temporaries.
        """
        h = keys.shape[-1] // 2
        # strip: (k1 c + k2 s, k2 c - k1 s) / den;  apply: (k1 c - k2 s, k2 c + k1 s)
        sign = 1.0 if den is not None else -1.0
        if keys.dtype == torch.float32 and dst.dtype == torch.float32:
            k1, k2, o1, o2 = keys[..., :h], keys[..., h:], dst[..., :h], dst[..., h:]
            torch.mul(k1, cos[..., :h], out=o1)
            o1.addcmul_(k2, sin[..., :h], value=sign)
            torch.mul(k2, cos[..., h:], out=o2)
            o2.addcmul_(k1, sin[..., h:], value=-sign)
            if den is not None:
                dst.div_(den)
            return
        k = keys.float()
        rot = torch.cat((-k[..., h:], k[..., :h]), dim=-1)
        res = k * cos + rot * sin if den is None else (k * cos - rot * sin) / den
        dst.copy_(res.to(keys.dtype))

    batch, _, seq, _ = source_layers[0][0].shape
    if positions.dim() == 1:
        positions = positions[None].expand(batch, -1)
    rotate = mapper.key_space == "stripped" and rope_at_inference
    if rotate and (source_codec is None or target_codec is None):
        raise ValueError("content-space mapping needs source_codec and target_codec")
    out_dtype = out_dtype or source_layers[0][0].dtype
    w, b = mapper.weight, mapper.bias
    device, dtype = w.device, w.dtype
    n_t, _, p, q = w.shape
    rows_sel = mapper.selected_layers.tolist()
    # Only the source layers some target reads are stripped, once per chunk, into a buffer
    # [2, batch, chunk, U, W] (U used layers in ascending order, W = n_kv_s * d_s; fully written, never zeroed).
    used = sorted({s for row in rows_sel for s in row})
    slot = {s: i for i, s in enumerate(used)}
    n_kv_s, d_s = source_layers[used[0]][0].shape[1], source_layers[used[0]][0].shape[3]
    width = n_kv_s * d_s
    d_t = q // target_n_kv
    # a target whose sources are consecutive slots reads a strided view of the buffer (no gather copy)
    runs = [slot[row[0]] if [slot[s] for s in row] == list(range(slot[row[0]], slot[row[0]] + len(row))) else None
            for row in rows_sel]
    gather_idx = [None if r is not None else torch.tensor([slot[s] for s in row], device=device)
                  for r, row in zip(runs, rows_sel)]
    outputs = [(torch.empty(batch, target_n_kv, seq, d_t, device=device, dtype=out_dtype),
                torch.empty(batch, target_n_kv, seq, d_t, device=device, dtype=out_dtype)) for _ in range(n_t)]
    chunk = max(1, chunk_tokens // batch)
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for start in range(0, seq, chunk):
        sl = slice(start, min(seq, start + chunk))
        c = sl.stop - sl.start
        rows = batch * c
        pos = positions[:, sl]
        if rotate:  # cos/sin once per chunk, shared by every layer
            cs, ss = (t.to(device) for t in source_codec.cos_sin(pos))
            den = cs * cs + ss * ss
            ct, st = (t.to(device) for t in target_codec.cos_sin(pos))
        feats = torch.empty(2, batch, c, len(used), width, device=device, dtype=dtype)
        for s in used:
            k, v = source_layers[s][0][:, :, sl], source_layers[s][1][:, :, sl]
            dst_k, dst_v = (feats[i, :, :, slot[s]].view(batch, c, n_kv_s, d_s).transpose(1, 2) for i in (0, 1))
            if rotate:
                _rope_into(dst_k, k.to(device), cs, ss, den)
            else:
                dst_k.copy_(k)
            dst_v.copy_(v)
        flat = feats.view(2, rows, len(used) * width)
        gathered = None
        for t in range(n_t):
            if runs[t] is not None:
                x = flat[:, :, runs[t] * width: runs[t] * width + p]
            else:
                if gathered is None:
                    gathered = torch.empty(2, rows, p // width, width, device=device, dtype=dtype)
                torch.index_select(feats.view(2, rows, len(used), width), 2, gather_idx[t], out=gathered)
                x = gathered.view(2, rows, p)
            y = torch.baddbmm(b[t][:, None, :], x, w[t])  # [2, rows, q]
            if check_finite:
                bad |= ~torch.isfinite(y).all()
            k_t, v_t = y.view(2, batch, c, target_n_kv, d_t).transpose(2, 3)  # [batch, n_kv_t, c, d_t] each
            if rotate:
                _rope_into(outputs[t][0][:, :, sl], k_t, ct, st)
            else:
                outputs[t][0][:, :, sl].copy_(k_t)
            outputs[t][1][:, :, sl].copy_(v_t)
    if check_finite and bool(bad):
        raise FloatingPointError("mapped cache contains NaN/Inf: check the mapper (refit with larger lambda) "
                                 "and the source cache dtype")
    return outputs


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
