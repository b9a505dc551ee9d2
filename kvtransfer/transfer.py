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
    # Fast path. Per chunk of tokens: the source layers any target reads are copied once into a
    # buffer [2, batch, chunk, U, W] (U used layers ascending, W = n_kv_s * d_s; never zero-filled)
    # and their keys stripped in one batched pass (cos/sin looked up once per chunk). Each target
    # layer's selection is split into runs of consecutive buffer slots; with at most two runs the
    # ridge map is one baddbmm per run on strided views of the buffer (no gather copy; a band of
    # layers is one GEMM), otherwise the runs are gathered and mapped in one GEMM. Results are
    # written into one preallocated output [L_t, 2, batch, n_kv_t, seq, d_t] (keys re-rotated on
    # the way) and checked for NaN/Inf once at the end. Memory-bound steps run single-threaded on
    # small CPU hosts (see _serial_elementwise).
    batch, _, seq, _ = source_layers[0][0].shape
    if positions.dim() == 1:
        positions = positions[None].expand(batch, -1)
    rotate = mapper.key_space == "stripped" and rope_at_inference
    if rotate and (source_codec is None or target_codec is None):
        raise ValueError("content-space mapping needs source_codec and target_codec")
    out_dtype = out_dtype or source_layers[0][0].dtype
    ref = next(v for v in vars(mapper).values() if isinstance(v, torch.Tensor) and v.is_floating_point())
    device, dtype = ref.device, ref.dtype
    ridge = getattr(mapper, "kind", "ridge") == "ridge" and hasattr(mapper, "weight")
    sel = mapper.selected_layers.tolist()
    n_t = len(sel)
    used = sorted({s for row in sel for s in row})
    slot = {s: i for i, s in enumerate(used)}
    src_dtype = source_layers[used[0]][0].dtype
    n_kv_s, d_s = source_layers[used[0]][0].shape[1], source_layers[used[0]][0].shape[3]
    width, n_used = n_kv_s * d_s, len(used)
    runs = []  # per target: [(first slot, first feature block, n layers)] maximal consecutive runs
    for row in sel:
        r = []
        for j, s in enumerate(row):
            if r and slot[s] == r[-1][0] + r[-1][2]:
                r[-1] = (r[-1][0], r[-1][1], r[-1][2] + 1)
            else:
                r.append((slot[s], j, 1))
        runs.append(r)
    out = None  # [L_t, 2, batch, n_kv_t, seq, d_t], allocated once q is known
    chunk = max(1, chunk_tokens // batch)
    for start in range(0, seq, chunk):
        sl = slice(start, min(seq, start + chunk))
        c = sl.stop - sl.start
        rows = batch * c
        with _serial_elementwise(device):  # memory-bound: copy used source layers, strip keys
            feats = torch.empty(2, batch, c, n_used, n_kv_s, d_s, device=device, dtype=dtype)
            in_place = rotate and dtype == torch.float32 and src_dtype == torch.float32
            raw_k = feats[0] if (in_place or not rotate) else torch.empty(feats.shape[1:], device=device)
            for s in used:
                raw_k[:, :, slot[s]].copy_(source_layers[s][0][:, :, sl].transpose(1, 2))
                feats[1, :, :, slot[s]].copy_(source_layers[s][1][:, :, sl].transpose(1, 2))
            pos = positions[:, sl]
            if rotate:
                cs, ss = (x.to(device)[:, 0, :, None, None, :] for x in source_codec.cos_sin(pos))  # [B|1, c, 1, 1, d]
                den = cs * cs + ss * ss
                if in_place:
                    _rope_(raw_k, cs, ss, den)
                else:  # RopeCodec.strip's rounding: float32, then the source dtype, then the mapper dtype
                    feats[0].copy_(_rope(raw_k, cs, ss, den).to(src_dtype))
                ct, st = (x.to(device) for x in target_codec.cos_sin(pos))  # [B|1, 1, c, d_t]
        flat = feats.view(2, rows, n_used * width)
        gathered = None
        for t in range(n_t):
            r = runs[t]
            if ridge and len(r) <= 2:  # one baddbmm per run, straight on the buffer
                w, b = mapper.weight[t], mapper.bias[t]
                y = None
                for s0, j0, n in r:
                    x, wj = flat[:, :, s0 * width:(s0 + n) * width], w[:, j0 * width:(j0 + n) * width]
                    y = torch.baddbmm(b[:, None, :], x, wj) if y is None else y.baddbmm_(x, wj)
            else:
                if len(r) == 1:
                    x = flat[:, :, r[0][0] * width:(r[0][0] + r[0][2]) * width]
                else:  # scattered selection: gather run by run, then one GEMM (faster than many thin ones)
                    if gathered is None:
                        gathered = torch.empty(2, rows, len(sel[t]) * width, device=device, dtype=dtype)
                    with _serial_elementwise(device):
                        for s0, j0, n in r:
                            gathered[:, :, j0 * width:(j0 + n) * width].copy_(flat[:, :, s0 * width:(s0 + n) * width])
                    x = gathered
                y = (torch.baddbmm(mapper.bias[t][:, None, :], x, mapper.weight[t]) if ridge
                     else mapper.map_features(t, x))  # [2, rows, q]
            if out is None:
                d_t = y.shape[-1] // target_n_kv
                out = torch.empty(n_t, 2, batch, target_n_kv, seq, d_t, device=device, dtype=out_dtype)
            k_t, v_t = y.view(2, batch, c, target_n_kv, d_t).transpose(2, 3)  # [batch, n_kv_t, c, d_t] each
            with _serial_elementwise(device):
                _store(out[t], sl, k_t, v_t, ct if rotate else None, st if rotate else None)
    with _serial_elementwise(device):
        finite = not check_finite or bool(torch.isfinite(out).all())
    if not finite:
        raise FloatingPointError("mapped cache contains NaN/Inf: check the mapper (refit with larger lambda) "
                                 "and the source cache dtype")
    return [(out[t, 0], out[t, 1]) for t in range(n_t)]


def _store(out: torch.Tensor, sl: slice, k: torch.Tensor, v: torch.Tensor, cos, sin) -> None:
    """out [2, batch, n_kv, seq, d][:, :, :, sl] <- (RopeCodec.apply(k) if cos is given else k, v)."""
    if cos is None:
        out[0, :, :, sl].copy_(k)
    elif k.dtype == torch.float32 and out.dtype == torch.float32:
        _rope_(k, cos, sin, out=out[0, :, :, sl])
    else:  # RopeCodec.apply's rounding: float32, then the mapper dtype, then the cache dtype
        out[0, :, :, sl].copy_(_rope(k.float(), cos, sin).to(k.dtype))
    out[1, :, :, sl].copy_(v)


class _serial_elementwise:
    """On small CPU hosts run memory-bound steps on one thread: there a copy or RoPE pass is
    bandwidth-bound, and fork/join of the thread pool costs more than it gains (a 2 MB copy took
    12 ms on 2 threads vs 0.6 ms on 1 on a loaded 2-core host). No-op elsewhere."""

    def __init__(self, device):
        self.active = torch.device(device).type == "cpu" and 1 < torch.get_num_threads() <= 4

    def __enter__(self):
        if self.active:
            self.threads = torch.get_num_threads()
            torch.set_num_threads(1)
        return self

    def __exit__(self, *exc):
        if self.active:
            torch.set_num_threads(self.threads)


def _rope(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, den: torch.Tensor | None = None) -> torch.Tensor:
    """RopeCodec.apply (den None) or .strip (den = cos^2 + sin^2) on float32 keys [..., d], same formula."""
    h = k.shape[-1] // 2
    rot = torch.cat((-k[..., h:], k[..., :h]), dim=-1)
    return k * cos + rot * sin if den is None else (k * cos - rot * sin) / den


def _rope_(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, den: torch.Tensor | None = None, *,
           out: torch.Tensor | None = None) -> None:
    """`_rope` on float32 keys [..., d] written into `out` (default: in place into k), half by half:
    strip (k1 c + k2 s, k2 c - k1 s) / den; apply (k1 c - k2 s, k2 c + k1 s). No rotate_half temporaries."""
    h = k.shape[-1] // 2
    sign = 1.0 if den is not None else -1.0
    k1, k2 = k[..., :h], k[..., h:]
    if out is None:
        k1_orig = k1.clone()
        k1.mul_(cos[..., :h]).addcmul_(k2, sin[..., :h], value=sign)
        k2.mul_(cos[..., h:]).addcmul_(k1_orig, sin[..., h:], value=-sign)
        out = k
    else:
        torch.mul(k1, cos[..., :h], out=out[..., :h]).addcmul_(k2, sin[..., :h], value=sign)
        torch.mul(k2, cos[..., h:], out=out[..., h:]).addcmul_(k1, sin[..., h:], value=-sign)
    if den is not None:
        out.div_(den)


@torch.no_grad()
def transfer(source_cache, mapper: Mapper, source_model, target_model, *, attention_mask=None,
             positions: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
             native_sink: int = 0, rope_at_inference: bool = True, chunk_tokens: int = 8192,
             as_layers: bool = False, check_pair: bool = True):
    """Map a source model's prefilled cache into a fresh target `DynamicCache`.

    source_cache: a `DynamicCache` or per-layer (keys, values) [batch, n_kv_s, seq, d_s].
    attention_mask: [batch, seq] 0/1 for left-padded batches (positions derived from it), or give
    `positions` [batch, seq] directly; default positions 0..seq-1. native_sink=N: the target
    prefills the first N real tokens of each row itself (all of a row with fewer; needs
    `input_ids` [batch, seq]) and only later positions keep their mapped values. Returns a
    DynamicCache (or layers with `as_layers=True`) in the target model's dtype on the mapper's
    device.
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
    """Overwrite the first `n_sink` real positions of each row with the target's own prefill.

    Rows are left-padded; a row with r <= n_sink real tokens gets all r of them from the target
    (the target computed the whole row itself). One batched target prefill of each row's first
    n_sink real tokens serves all rows: a shorter row is filled up with its last token, and under
    causal attention those trailing fillers change nothing at its r real positions; only the r
    real positions are written back.
    """
    batch, seq = input_ids.shape
    n_sink = min(n_sink, seq)
    device = input_ids.device
    real = (torch.full((batch,), seq, dtype=torch.long, device=device) if attention_mask is None
            else attention_mask.to(device).long().sum(-1))
    first = seq - real  # left padding: index of the first real token
    j = torch.arange(n_sink, device=device)
    idx = (first[:, None] + j).clamp(max=seq - 1)  # [batch, n_sink] cache slots of the sink tokens
    sink_cache = prefill(target_model, input_ids.gather(1, idx))
    rows, cols = (j[None] < real[:, None]).nonzero(as_tuple=True)  # real sink tokens only
    slots = idx[rows, cols]
    out = []
    for (k, v), (sk, sv) in zip(mapped, sink_cache):
        k, v = k.clone(), v.clone()
        r, c, sl = rows.to(k.device), cols.to(k.device), slots.to(k.device)
        k[r, :, sl] = sk.to(k.device, k.dtype)[r, :, c]
        v[r, :, sl] = sv.to(v.device, v.dtype)[r, :, c]
        out.append((k, v))
    return out
