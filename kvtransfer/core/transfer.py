"""Source KV cache -> target KV cache through a Mapper.

    K_t = RoPE_t( RoPE_s^-1(K_s) @ W_K + b_K ),   V_t = V_s @ W_V + b_V
with the source features of every target layer's selected source layers concatenated (layer,
head, dim). `map_layers_reference` says it plainly (gather -> strip -> map -> rotate, per target
layer); `map_layers` is the fast path tested against it: one pass over the used source layers per
chunk of tokens, the map itself dispatched to the mapper kind's `map_blocks`. RoPE comes from
`rope.rotate` only. Optionally the target computes the first `native_sink` positions itself.
"""
from __future__ import annotations

import math
import weakref

import torch

from . import rope
from .cache import KVLayers, layers_to_cache, positions_from_mask, prefill
from .mapper import MapperBase
from .models import kv_shape, layer_devices
from .rope import RopeCodec

_CODECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def codec_for(model) -> RopeCodec:
    """The model's RopeCodec, built once per model (its cos/sin table is reused across calls)."""
    codec = _CODECS.get(model)
    if codec is None:
        codec = _CODECS[model] = RopeCodec(model)
    return codec


@torch.no_grad()
def map_layers_reference(source_layers: KVLayers, mapper: MapperBase, positions: torch.Tensor, *,
                         source_codec: RopeCodec | None, target_codec: RopeCodec | None, target_n_kv: int,
                         out_dtype: torch.dtype | None = None, rope_at_inference: bool = True,
                         source_hidden: dict[int, torch.Tensor] | None = None) -> KVLayers:
    """What `map_layers` computes, written plainly (its tests compare against this); same arguments.

    Per target layer t: gather its selected source layers in feature order, strip the source RoPE
    from their keys, map the [K | V] features through the mapper, re-apply the target RoPE to the
    mapped keys. Rounding follows calibration: stripped keys come back in the cache dtype
    (`RopeCodec.strip`), features are mapped in the mapper's dtype, outputs are stored in `out_dtype`.
    """
    batch, _, seq, _ = source_layers[0][0].shape
    rotate = mapper.key_space == "stripped" and rope_at_inference
    out_dtype = out_dtype or source_layers[0][0].dtype
    out = []
    if mapper.needs_hidden:
        _check_hidden(source_hidden, sorted({s for row in mapper.selected_layers.tolist() for s in row}), batch, seq,
                      mapper)
    for t, row in enumerate(mapper.selected_layers.tolist()):
        keys, values = [], []
        for s in row:  # gather (and strip): per layer [batch * seq, width] blocks
            k, v = source_layers[s]
            k = source_codec.strip(k, positions) if rotate else k
            k, v = (z.transpose(1, 2).reshape(batch * seq, -1) for z in (k, v))  # (head, dim) columns
            if mapper.needs_hidden:  # [normed input] or [normed input | K or V] (kvtransfer.core.hidden)
                h = source_hidden[s].reshape(batch * seq, -1).to(k.dtype)
                k, v = (h, h) if mapper.features == "hidden" else (torch.cat([h, k], 1), torch.cat([h, v], 1))
            keys.append(k)
            values.append(v)
        x = torch.stack([torch.cat(part, dim=1) for part in (keys, values)])  # [2, batch * seq, (layer, feature)]
        y = mapper.map_features(t, x.to(mapper.device, mapper.dtype))  # GEMM: [2, batch * seq, n_kv_t * d_t]
        k_t, v_t = y.view(2, batch, seq, target_n_kv, -1).transpose(2, 3)  # [batch, n_kv_t, seq, d_t] each
        if rotate:
            k_t = target_codec.apply(k_t, positions)  # rotate
        out.append((k_t.to(out_dtype).contiguous(), v_t.to(out_dtype).contiguous()))
    return out


@torch.no_grad()
def map_layers(source_layers: KVLayers, mapper: MapperBase, positions: torch.Tensor, *,
               source_codec: RopeCodec | None, target_codec: RopeCodec | None, target_n_kv: int,
               out_dtype: torch.dtype | None = None, rope_at_inference: bool = True,
               chunk_tokens: int = 8192, check_finite: bool | str = True,
               source_hidden: dict[int, torch.Tensor] | None = None,
               workspace: "Workspace | None" = None) -> KVLayers:
    """Map per-layer source (keys, values) [batch, n_kv_s, seq, d_s] to target layers.

    positions: int64 [batch, seq] (or [seq]) true token positions used to strip and re-apply RoPE.
    Keys are stripped/re-rotated when the mapper works in content space and `rope_at_inference`
    (False = the "no re-rotation at inference" ablation: the content-space map is applied to
    rotated keys and its output stored unrotated). Returns [batch, n_kv_t, seq, d_t] per target
    layer in `out_dtype` (default: the source cache dtype). Raises FloatingPointError on NaN/Inf.

    check_finite: True (default) checks a sample the apply already holds: per target layer and chunk, the
    mapped rows' first column of every target head and the chunk's first row. Every kind here maps each
    row through sums of products of all the features a head reads (GEMMs, per-head MLPs), so a NaN/Inf in
    a source feature makes that whole row of the head non-finite and one in a weight or bias that whole
    column in every row: the sample catches both without reading the whole output. What it cannot see
    is an overflow of single finite values; when `out_dtype` has a narrower range than the map's dtype
    (float16), where the final cast can overflow, True also runs "full". "full": an isfinite pass over
    the whole output (+ the sample). False: no check.

    Computes what `map_layers_reference` computes (to rounding), faster: per chunk of tokens the
    source layers any target reads are copied once into a buffer [2, rows, used layers * n_kv_s *
    d_s] and their keys stripped in one pass; each target's selection goes to the mapper as column
    blocks of that buffer (runs of consecutive used layers), so a kind can map straight from the
    views (`MapperBase.map_blocks`); results go into one preallocated [L_t, 2, batch, n_kv_t, seq,
    d_t] output, keys re-rotated on the way. Bytes beyond the floor's (source read once, weights, output
    written once): the used-layer buffer (written once per chunk), the GEMM output per target layer
    (written and read once), and for a reduced-precision key path a float32 tile that stays in cache.

    source_hidden: {source layer: [batch, seq, H]} normed layer inputs (`hidden.prefill_with_hidden`), needed
    (for every used source layer) by a mapper whose `needs_hidden` (the hidden kind); ignored otherwise. Each
    used layer's feature block is then [hidden] or [hidden | K stripped] / [hidden | V] (kvtransfer.core.hidden).

    workspace: a `Workspace` a caller mapping request after request keeps and passes to every call, so the
    used-layer buffer and the map's scratch are reused across calls, not allocated fresh; the result is the same.
    """
    batch, _, seq, _ = source_layers[0][0].shape
    if positions.dim() == 1:
        positions = positions[None].expand(batch, -1)
    rotate = mapper.key_space == "stripped" and rope_at_inference
    if rotate and (source_codec is None or target_codec is None):
        raise ValueError("content-space mapping needs source_codec and target_codec")
    out_dtype = out_dtype or source_layers[0][0].dtype
    device, dtype = mapper.device, mapper.dtype
    sel = mapper.selected_layers.tolist()
    used = sorted({s for row in sel for s in row})
    slot = {s: i for i, s in enumerate(used)}
    width = source_layers[used[0]][0].shape[1] * source_layers[used[0]][0].shape[3]  # n_kv_s * d_s
    features = mapper.features
    if mapper.needs_hidden:
        _check_hidden(source_hidden, used, batch, seq, mapper)
        width = mapper.feature_width  # H (+ n_kv_s * d_s) per used layer
    runs = [_runs([slot[s] for s in row]) for row in sel]  # per target: [(first slot, first feature, n layers)]
    full_check = check_finite == "full" or (check_finite and torch.finfo(out_dtype).max < torch.finfo(dtype).max)
    out = None  # [L_t, 2, batch, n_kv_t, seq, d_t], allocated once d_t is known
    # per-chunk buffers reused across target layers and chunks (and across calls, with a workspace)
    work = workspace.buffers(device) if workspace is not None else _Gather(device=device)
    finite = None  # the sampled check over targets and chunks, a 0-dim bool read once at the end (one host sync)
    chunk = max(1, chunk_tokens // batch)
    for start in range(0, seq, chunk):
        sl = slice(start, min(seq, start + chunk))
        pos, rows = positions[:, sl], batch * (sl.stop - sl.start)
        with _serial_elementwise(device):  # memory-bound: copy the used source layers, strip keys
            if features == "kv":
                flat = _gather_stripped(source_layers, used, sl, pos, source_codec if rotate else None, device, dtype,
                                        work=work)
            else:
                flat = _gather_hidden(source_layers, source_hidden, used, sl, pos, source_codec if rotate else None,
                                      device, dtype, with_kv=features == "hidden_kv")
        work.shape = (2, rows, len(sel[0]) * width)  # for a kind that needs x whole (`MapperBase.map_blocks`)
        if rotate:
            cos, sin = (x.to(device) for x in target_codec.cos_sin(pos))  # [batch|1, 1, chunk, d_t]
        for t, r in enumerate(runs):
            blocks = [(j * width, flat[:, :, s * width:(s + n) * width]) for s, j, n in r]
            y = mapper.map_blocks(t, blocks, work)  # [2, rows, n_kv_t * d_t]
            if out is None:
                d_t = y.shape[-1] // target_n_kv
                out = torch.empty(len(sel), 2, batch, target_n_kv, seq, d_t, device=device, dtype=out_dtype)
            if check_finite:
                ok = _sample_finite(y, d_t)
                finite = ok if finite is None else finite & ok
            k_t, v_t = y.view(2, batch, -1, target_n_kv, d_t).transpose(2, 3)  # [batch, n_kv_t, chunk, d_t]
            dest = out[t, :, :, :, sl]
            with _serial_elementwise(device):  # memory-bound: re-rotate keys, store
                if not rotate:
                    dest[0].copy_(k_t)
                else:  # RopeCodec.apply's rounding: float32, then the mapper dtype, then out_dtype
                    _rotate_tiled(k_t, cos, sin, dest[0], work)
                dest[1].copy_(v_t)
    if finite is not None and not bool(finite):
        _raise_non_finite()
    if full_check:
        with _serial_elementwise(device):
            if not bool(torch.isfinite(out).all()):
                _raise_non_finite()
    return [(out[t, 0], out[t, 1]) for t in range(len(sel))]


_TILE_BYTES = 1 << 19  # float32 values of one RoPE tile (512 KiB): it and its operands stay in a 1 MiB L2


def _tile(n: int, bytes_per_token: int, device) -> int:
    """Tokens per RoPE tile: on a CPU, _TILE_BYTES of float32 (cache-sized); elsewhere the whole chunk (a GPU
    pays a launch per tile and streams whole passes at its bandwidth)."""
    if torch.device(device).type != "cpu":
        return n
    return max(1, min(n, _TILE_BYTES // bytes_per_token))


def _raise_non_finite():
    raise FloatingPointError("mapped cache contains NaN/Inf: check the mapper (refit with larger lambda) "
                             "and the source cache dtype")


def _sample_finite(y: torch.Tensor, d_t: int) -> torch.Tensor:
    """Whether the sample of a mapped chunk y [2, rows, n_kv_t * d_t] is finite (a 0-dim bool on y's device):
    every row's first column of each target head, and the first row whole (see `map_layers`' check_finite).
    Reads ~rows cache lines per head, not the chunk."""
    return torch.isfinite(y[:, :, ::d_t]).all() & torch.isfinite(y[:, 0]).all()


def _rotate_tiled(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dest: torch.Tensor, work) -> None:
    """dest = RoPE(k) for mapped keys k [batch, heads, chunk, d], rounded as `RopeCodec.apply` then the cast
    to dest's dtype round (float32, then k's dtype, then dest's). Tiles of tokens, so RoPE's passes over its
    output and the float32 scratch of a reduced-precision k stay in cache instead of whole-chunk float32
    copies. Elementwise: bit-identical to the whole-chunk pass."""
    batch, heads, n, d = k.shape
    tile = _tile(n, 4 * batch * heads * d, k.device)
    direct = k.dtype == dest.dtype == torch.float32
    scratch = None if direct else work.scratch((batch, heads, tile, d), torch.float32)
    for a in range(0, n, tile):
        b = min(n, a + tile)
        if direct:
            rope.rotate(k[:, :, a:b], cos[:, :, a:b], sin[:, :, a:b], out=dest[:, :, a:b])
            continue
        tmp = scratch[:, :, :b - a]  # RoPE reads k's dtype and computes in float32 (exact widening)
        rope.rotate(k[:, :, a:b], cos[:, :, a:b], sin[:, :, a:b], out=tmp)
        dest[:, :, a:b].copy_(tmp if k.dtype in (dest.dtype, torch.float32) else tmp.to(k.dtype))


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive buffer slots in one selection: [(first slot, index in row, length)]."""
    runs = []
    for j, s in enumerate(slots):
        if runs and s == runs[-1][0] + runs[-1][2]:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, j, 1))
    return runs


class _Gather:
    """`gather` for `MapperBase.map_blocks`, and the apply's reused buffers. Called: copies column blocks
    into one buffer [2, rows, p] (`shape`, set per chunk), as a memory-bound step, for a kind that needs
    x whole. `output` / `scratch`: a buffer of that shape and dtype, reused while the shape holds (a fresh
    large allocation is a fresh mmap, whose pages the kernel zeroes: bytes moved for nothing)."""

    def __init__(self, *, device):
        self.device, self.shape, self._buffers = device, None, {}

    def _get(self, name: str, shape, dtype) -> torch.Tensor:
        """A contiguous `shape` view of buffer `name`, reallocated only when it is too small or of another dtype:
        a shorter request (a smaller chunk, a shorter prompt) reuses the pages already held."""
        need = math.prod(shape)
        buf = self._buffers.get(name)
        if buf is None or buf.numel() < need or buf.dtype != dtype:
            buf = self._buffers[name] = torch.empty(need, device=self.device, dtype=dtype)
        return buf[:need].view(shape)

    def feats(self, shape, dtype) -> torch.Tensor:
        """The used-layer feature buffer of one chunk (`_gather_stripped`)."""
        return self._get("feats", shape, dtype)

    def output(self, shape, dtype) -> torch.Tensor:
        """The map's output buffer (one target layer's chunk: read out before the next map_blocks)."""
        return self._get("output", shape, dtype)

    def scratch(self, shape, dtype) -> torch.Tensor:
        return self._get("scratch", shape, dtype)

    def __call__(self, blocks: list[tuple[int, torch.Tensor]]) -> torch.Tensor:
        buffer = self._get("gather", self.shape, blocks[0][1].dtype)
        with _serial_elementwise(self.device):
            for j, x in blocks:
                buffer[:, :, j:j + x.shape[-1]].copy_(x)
        return buffer


class Workspace:
    """The buffers `map_layers` reuses across calls, per device: the used-layer feature buffer, the map's
    output and gather buffers and the RoPE scratch. A caller mapping request after request (a serving worker, a
    timing loop) keeps one and passes it to each call: on a CPU a fresh large allocation is a fresh mmap whose
    pages the kernel zeroes on first touch (at Qwen3-14B -> 32B shapes, 2 target layers, about 100 MB a call
    at 1,024 tokens), bytes no floor counts. It holds the largest buffers it has served until dropped; the
    returned layers are never in it. Not for concurrent calls: one per thread."""

    def __init__(self):
        self._per_device: dict[str, _Gather] = {}

    def buffers(self, device) -> "_Gather":
        """The reused buffers on `device` (created on first use)."""
        key = str(torch.device(device))
        if key not in self._per_device:
            self._per_device[key] = _Gather(device=device)
        return self._per_device[key]

    def nbytes(self) -> int:
        """Bytes the workspace holds (all devices)."""
        return sum(b.numel() * b.element_size() for g in self._per_device.values() for b in g._buffers.values())


def _check_hidden(source_hidden, used: list[int], batch: int, seq: int, mapper) -> None:
    """Raise a ValueError naming the fix when a hidden-feature mapper is not given the hidden states it reads."""
    fix = ("prefill the source with kvtransfer.core.hidden.prefill_with_hidden(source, input_ids, attention_mask, "
           "layers=kvtransfer.core.hidden.used_layers(mapper.selected_layers)) and pass its hidden states as "
           "source_hidden=")
    if source_hidden is None:
        raise ValueError(f"this mapper (kind {mapper.kind!r}, features {mapper.features!r}) maps from the source's "
                         f"hidden states, and none were given: {fix}")
    missing = [s for s in used if s not in source_hidden]
    if missing:
        raise ValueError(f"source_hidden lacks source layers {missing} that this mapper reads: {fix}")
    for s in used:
        shape = tuple(source_hidden[s].shape)
        if shape != (batch, seq, mapper.hidden_size):
            raise ValueError(f"source_hidden[{s}] is {shape}, expected (batch, seq, H) = "
                             f"{(batch, seq, mapper.hidden_size)} (the cache's batch and length, the mapper's H)")


def _gather_hidden(source_layers: KVLayers, source_hidden: dict, used: list[int], sl: slice, pos: torch.Tensor,
                   codec: RopeCodec | None, device, dtype, *, with_kv: bool) -> torch.Tensor:
    """Tokens `sl` of source layers `used` as hidden-state features [2, batch * chunk, len(used) * width] in
    `dtype`: per layer the normed input [H] (the same for K and V targets) and, `with_kv`, then its stripped
    keys (K targets) / values (V targets) as `_gather_stripped` makes them."""
    h0 = source_hidden[used[0]]
    batch, _, hid = h0.shape
    n = sl.stop - sl.start
    kv = _gather_stripped(source_layers, used, sl, pos, codec, device, dtype) if with_kv else None
    width = hid + (kv.shape[-1] // len(used) if with_kv else 0)
    feats = torch.empty(2, batch * n, len(used), width, device=device, dtype=dtype)
    for i, s in enumerate(used):
        feats[:, :, i, :hid].copy_(source_hidden[s][:, sl].reshape(1, batch * n, hid).expand(2, -1, -1))
    if with_kv:
        feats[:, :, :, hid:].copy_(kv.view(2, batch * n, len(used), -1))
    return feats.view(2, batch * n, len(used) * width)


def _gather_stripped(source_layers: KVLayers, used: list[int], sl: slice, pos: torch.Tensor,
                     codec: RopeCodec | None, device, dtype, *, work: "_Gather | None" = None) -> torch.Tensor:
    """Tokens `sl` of source layers `used` as features [2, batch * chunk, len(used) * n_kv * d] in
    `dtype`, keys RoPE-stripped at `pos` when a codec is given (rounded as `RopeCodec.strip` rounds:
    float32, then the cache dtype, then `dtype`). Written into `work`'s feature buffer when given."""
    k0 = source_layers[used[0]][0]
    batch, n_kv, _, d = k0.shape
    n = sl.stop - sl.start
    shape = (2, batch, n, len(used), n_kv, d)
    feats = work.feats(shape, dtype) if work is not None else torch.empty(shape, device=device, dtype=dtype)
    for i, s in enumerate(used):
        feats[1, :, :, i].copy_(source_layers[s][1][:, :, sl].transpose(1, 2))
        if codec is None:
            feats[0, :, :, i].copy_(source_layers[s][0][:, :, sl].transpose(1, 2))
    if codec is None:
        return feats.view(2, batch * n, len(used) * n_kv * d)
    # strip tile by tokens, so the passes RoPE makes over its output (and a float32 scratch for a reduced-precision
    # cache or map) stay in cache: elementwise, so bit-identical to one whole-chunk pass
    cos, sin = (x.to(device)[:, 0, :, None, :] for x in codec.cos_sin(pos))  # [batch|1, chunk, 1, d]
    direct = dtype == k0.dtype == torch.float32  # no rounding step between strip and map: straight into feats
    tile = _tile(n, 4 * batch * n_kv * d, device)
    scratch = None if direct else torch.empty(batch, tile, n_kv, d, device=device)
    twice = k0.dtype not in (torch.float32, dtype)  # RopeCodec.strip returns the cache dtype: round there first
    for i, s in enumerate(used):
        for a in range(0, n, tile):
            b = min(n, a + tile)
            src = source_layers[s][0][:, :, sl.start + a:sl.start + b].transpose(1, 2)
            if direct:
                rope.rotate(src, cos[:, a:b], sin[:, a:b], inverse=True, out=feats[0, :, a:b, i])
                continue
            tmp = scratch[:, :b - a]  # RoPE reads the cache dtype and computes in float32 (exact widening)
            rope.rotate(src, cos[:, a:b], sin[:, a:b], inverse=True, out=tmp)
            feats[0, :, a:b, i].copy_(tmp.to(k0.dtype) if twice else tmp)
    return feats.view(2, batch * n, len(used) * n_kv * d)


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


@torch.no_grad()
def transfer(source_cache, mapper: MapperBase, source_model, target_model, *, attention_mask=None,
             positions: torch.Tensor | None = None, input_ids: torch.Tensor | None = None,
             native_sink: int | None = None, rope_at_inference: bool = True, chunk_tokens: int = 8192,
             as_layers: bool = False, check_pair: bool = True, source_hidden: dict[int, torch.Tensor] | None = None):
    """Map a source model's prefilled cache into a fresh target `DynamicCache`.

    source_cache: a `DynamicCache` or per-layer (keys, values) [batch, n_kv_s, seq, d_s].
    attention_mask: [batch, seq] 0/1 for left-padded batches (positions derived from it), or give
    `positions` [batch, seq] directly; default positions 0..seq-1. native_sink=N (default: the
    mapper artifact's `native_sink`): the target prefills the first N real tokens of each row itself
    (all of a row with fewer; needs `input_ids` [batch, seq]) and only later positions keep their
    mapped values. Returns a
    DynamicCache (or layers with `as_layers=True`) in the target model's dtype, each layer's keys
    and values on the device that target layer runs on (`place_on_layers`: the mapper's device
    unless the target is spread by a `device_map`).
    source_hidden: {source layer: [batch, seq, H]} the source's normed layer inputs from the same prefill
    (`hidden.prefill_with_hidden`); required by a mapper that `needs_hidden` (ValueError naming the fix).
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
                        out_dtype=target_model.dtype, rope_at_inference=rope_at_inference, chunk_tokens=chunk_tokens,
                        source_hidden=source_hidden)
    native_sink = mapper.native_sink if native_sink is None else native_sink
    if native_sink > 0:
        if input_ids is None:
            raise ValueError(f"native_sink={native_sink} (the mapper's) needs input_ids: the target computes the "
                             "first tokens itself")
        mapped = _with_native_sink(mapped, target_model, input_ids, attention_mask, native_sink)
    mapped = place_on_layers(mapped, target_model)
    return mapped if as_layers else layers_to_cache(mapped, target_model.config)


def place_on_layers(layers: KVLayers, model) -> KVLayers:
    """Each layer's (keys, values) on the device `model` reads that layer's cache on (`models.layer_devices`).

    A model loaded whole keeps every layer on one device and nothing moves; one spread by a
    `device_map` reads layer t's cache where layer t's k_proj weight lives, so the mapped cache
    (built on the mapper's device) is moved there layer by layer. Tensors already in place are
    returned as they are (no copy).
    """
    devices = layer_devices(model)
    if len(devices) != len(layers):
        raise ValueError(f"{len(layers)} cache layers for a model with {len(devices)} decoder layers")
    return [(k.to(d), v.to(d)) for (k, v), d in zip(layers, devices)]


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
