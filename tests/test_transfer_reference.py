"""The fast `map_layers` against the plain `map_layers_reference` (gather -> strip -> GEMM -> rotate):
every RoPE kind (default, llama3, YaRN), matched and mismatched KV shapes, every run pattern of the
selection, both mapper kinds, several chunks, the RoPE ablations, and the bf16 production path
against the fp32 reference (issue 9, §3e and §4)."""
from __future__ import annotations

import pytest
import torch

from kvtransfer.core.mapper import Mapper, MapperBase, MLPMapper
from kvtransfer.core.rope import RopeCodec, rotate, rotate_half
from kvtransfer.core.transfer import map_layers, map_layers_reference
from tiny_models import tiny_model

FP32_EPS = torch.finfo(torch.float32).eps   # 1.19e-7
BF16_U = torch.finfo(torch.bfloat16).eps / 2  # unit roundoff 2^-8 = 3.9e-3 (8-bit significand)
FP32_TOL = 32 * FP32_EPS  # fast vs reference in fp32; see test_fast_path_matches_reference
SEL = torch.tensor([[0, 1, 2], [4, 2, 0], [1, 2, 4], [2, 3, 4]])  # one run, reversed, two runs, band
FAMILIES = {"default": "qwen3", "llama3": "llama", "yarn": "ministral3"}


def _source(batch, seq, kv, d, n_layers=5, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(3 * torch.randn(batch, kv, seq, d, generator=g).to(dtype), torch.randn(batch, kv, seq, d, generator=g)
             .to(dtype)) for _ in range(n_layers)]


def _ridge(p, q, sel=SEL, seed=1, key_space="stripped"):
    g = torch.Generator().manual_seed(seed)
    return Mapper(weight=torch.randn(len(sel), 2, p, q, generator=g) / p ** 0.5,
                  bias=torch.randn(len(sel), 2, q, generator=g), selected_layers=sel, source={}, target={},
                  key_space=key_space)


def _mlp(p, heads, d, sel=SEL, hidden=6, seed=2):
    g = torch.Generator().manual_seed(seed)
    n = len(sel)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return MLPMapper(w1=r(n, 2, heads, p, hidden) / p ** 0.5, b1=r(n, 2, heads, hidden),
                     w2=r(n, 2, heads, hidden, hidden) / hidden ** 0.5, b2=r(n, 2, heads, hidden),
                     w3=r(n, 2, heads, hidden, d), b3=r(n, 2, heads, d), x_mean=r(n, 2, p), x_std=r(n, 2, p).abs() + .5,
                     y_mean=r(n, 2, heads * d), y_std=r(n, 2, heads * d).abs() + .5, selected_layers=sel,
                     source={}, target={})


def _positions(batch, seq):
    """Per-row positions, one row shifted far out (llama3 and YaRN scale the low frequencies)."""
    return torch.stack([torch.arange(seq) + 20_000 * b for b in range(batch)])


def _rel_err(got, want) -> float:
    """max |got - want| over the scale of `want` (max |want|, at least 1)."""
    return float((got.double() - want.double()).abs().max() / max(1.0, float(want.abs().max())))


def _compare(fast, ref, tol):
    assert len(fast) == len(ref)
    worst = 0.0
    for (fk, fv), (rk, rv) in zip(fast, ref):
        assert fk.shape == rk.shape and fk.dtype == rk.dtype and fk.is_contiguous() and fv.is_contiguous()
        worst = max(worst, _rel_err(fk, rk), _rel_err(fv, rv))
    assert worst <= tol, worst
    return worst


@pytest.mark.parametrize("kind", ["ridge", "mlp"])
@pytest.mark.parametrize("shapes", [(2, 8, 2, 8), (2, 8, 4, 16)], ids=["matched", "mismatched"])
@pytest.mark.parametrize("rope", [("default", "default"), ("llama3", "llama3"), ("yarn", "yarn"), ("default", "yarn")],
                         ids=lambda r: "->".join(r))
def test_fast_path_matches_reference(rope, shapes, kind):
    """fp32 throughout. Not bitwise: the fast path splits each GEMM into column blocks (or gathers
    them), so its sums run in another order than the reference's one GEMM, and BLAS blocks other
    shapes differently; sums of p <= 48 O(1) products then differ by a few eps32 of the output
    scale (measured: <= 2.9 eps32). Bound: 32 eps32 = 3.8e-6 relative to max |output|."""
    kv_s, d_s, kv_t, d_t = shapes
    src = tiny_model(FAMILIES[rope[0]], seed=1, layers=5, kv_heads=kv_s, head_dim=d_s)
    tgt = tiny_model(FAMILIES[rope[1]], seed=2, layers=4, kv_heads=kv_t, head_dim=d_t)
    batch, seq = 2, 23
    layers = _source(batch, seq, kv_s, d_s)
    p, q = 3 * kv_s * d_s, kv_t * d_t
    mapper = _ridge(p, q) if kind == "ridge" else _mlp(p, kv_t, d_t)
    kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=kv_t)
    positions = _positions(batch, seq)
    ref = map_layers_reference(layers, mapper, positions, **kw)
    _compare(map_layers(layers, mapper, positions, chunk_tokens=10, **kw), ref, FP32_TOL)  # chunks of 5 tokens
    _compare(map_layers(layers, mapper, positions, **kw), ref, FP32_TOL)  # one chunk


@pytest.mark.parametrize("variant", ["no_rerotation", "rotated_key_space"])
def test_fast_path_matches_reference_without_rope_handling(variant):
    src, tgt = tiny_model("ministral3", seed=1, layers=5), tiny_model("llama", seed=2, layers=4)
    layers = _source(2, 11, 2, 8)
    mapper = _ridge(48, 16, key_space="rotated" if variant == "rotated_key_space" else "stripped")
    kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=2,
              rope_at_inference=variant != "no_rerotation")
    positions = _positions(2, 11)
    ref = map_layers_reference(layers, mapper, positions, **kw)
    _compare(map_layers(layers, mapper, positions, chunk_tokens=6, **kw), ref, FP32_TOL)  # fp32, as above
    # and the keys really were left rotated / unrotated: differs from the content-space result
    full = map_layers_reference(layers, _ridge(48, 16), positions, **dict(kw, rope_at_inference=True))
    assert _rel_err(ref[0][0], full[0][0]) > 1e-2


@pytest.mark.parametrize("family", list(FAMILIES.values()))
def test_reference_is_the_identity_for_an_identity_map(family):
    """Sanity of the reference itself: same model on both sides, each target layer reads its own
    source layer through W = I, b = 0 -> the source cache back (strip then apply at the same
    positions). An fp32 round trip (with YaRN's division by cos²+sin²) and an exact GEMM with I:
    a few eps32 of max |k| (measured 0.9 eps32); bound 8 eps32."""
    model = tiny_model(family, seed=3, layers=3)
    codec = RopeCodec(model)
    layers = _source(2, 9, 2, 8, n_layers=3)
    eye = torch.eye(16).expand(3, 2, 16, 16).clone()
    mapper = Mapper(weight=eye, bias=torch.zeros(3, 2, 16), selected_layers=torch.tensor([[0], [1], [2]]),
                    source={}, target={})
    positions = _positions(2, 9)
    for fn in (map_layers_reference, map_layers):
        out = fn(layers, mapper, positions, source_codec=codec, target_codec=codec, target_n_kv=2)
        for (k, v), (sk, sv) in zip(out, layers):
            assert _rel_err(k, sk) <= 8 * FP32_EPS and torch.equal(v, sv)


@pytest.mark.parametrize("family", list(FAMILIES.values()))
def test_rope_rotate_is_hf_apply_rotary_and_its_inverse(family):
    """`rope.rotate` (the one RoPE formula) against transformers' own k * cos + rotate_half(k) * sin
    with the model's cos/sin; in place and out of place. Same products, but the two halves are
    combined by addcmul instead of separate mul and add: not bitwise, within a few eps32."""
    model = tiny_model(family)
    pos = torch.tensor([[0, 5, 999, 20_000, 70_000]])
    cos, sin = model.model.rotary_emb(torch.zeros(1), pos)
    cos, sin = cos[:, None], sin[:, None]  # [1, 1, seq, d]
    k = 3 * torch.randn(2, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    hf = k * cos + rotate_half(k) * sin
    assert _rel_err(rotate(k, cos, sin), hf) <= 4 * FP32_EPS
    inplace = k.clone()
    assert rotate(inplace, cos, sin, out=inplace) is inplace and torch.equal(inplace, rotate(k, cos, sin))
    assert _rel_err(rotate(hf, cos, sin, inverse=True), k) <= 16 * FP32_EPS


class _Recording(MapperBase):
    """A kind with its own map_blocks (which records what it was given); maps like the ridge mapper."""

    kind = "recording_test"
    _FLOAT_TENSORS = ("weight", "bias")

    def __init__(self, ridge: Mapper):
        super().__init__(selected_layers=ridge.selected_layers, source={}, target={})
        self.weight, self.bias, self.calls = ridge.weight, ridge.bias, []

    def map_features(self, layer, x):
        return torch.baddbmm(self.bias[layer][:, None], x, self.weight[layer])

    def map_blocks(self, layer, blocks, gather=None):
        self.calls.append((layer, [(j, x.shape[-1]) for j, x in blocks]))
        return super().map_blocks(layer, blocks, gather)


def test_map_layers_dispatches_through_the_mappers_own_method():
    src, tgt = tiny_model("qwen3", seed=1, layers=5), tiny_model("qwen3", seed=2, layers=4)
    layers = _source(1, 8, 2, 8)
    ridge = _ridge(48, 16)
    rec = _Recording(ridge)
    kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=2)
    out = map_layers(layers, rec, torch.arange(8), chunk_tokens=4, **kw)
    # 2 chunks x 4 target layers; blocks cover columns 0..48 in order: [[0,1,2]] one run, [4,2,0] three,
    # [1,2,4] two (slots 1-2 and 4), [2,3,4] one
    blocks = {0: [(0, 48)], 1: [(0, 16), (16, 16), (32, 16)], 2: [(0, 32), (32, 16)], 3: [(0, 48)]}
    assert rec.calls == [(t, blocks[t]) for _ in range(2) for t in range(4)]
    # fp32, block-split vs gathered GEMMs: as in test_fast_path_matches_reference
    _compare(out, map_layers_reference(layers, ridge, torch.arange(8), **kw), FP32_TOL)


# -- the bf16 production path ---------------------------------------------------------------------
@pytest.mark.parametrize("mapper_dtype", [torch.float32, torch.bfloat16], ids=["fp32_mapper", "bf16_mapper"])
@pytest.mark.parametrize("family", ["qwen3", "ministral3"])
def test_bf16_production_path_against_the_fp32_reference(family, mapper_dtype):
    """bf16 source cache -> bf16 target cache (the GPU path: non-in-place strip rounded to bf16,
    bf16 store), with the fp32 mapper evaluation uses and with a bf16 mapper (bench option).

    Reference: everything in fp32 from the same (bf16-valued) source cache. Rounding steps of the
    production path, each a relative error <= u = 2^-8 of what it rounds: the stripped keys, the
    mapper's weights (bf16 mapper only), partial GEMM sums (bf16 mapper, two-block selections),
    the output. The GEMM sums p = 48 products whose errors are independent, so the mapped error
    stays a few u of the output scale; bound: 4u (fp32 mapper) and 8u (bf16 mapper) of max
    |output|. Measured: <= 1.0u and <= 1.5u. Also checked, with the same bounds: the path against
    the reference run in the same dtypes (summation order flips a bf16 rounding of the output,
    <= 2u; the bf16 partial sums of two-block selections, measured 1.6u)."""
    kv, d = 2, 8
    src = tiny_model(family, seed=1, layers=5, kv_heads=kv, head_dim=d)
    tgt = tiny_model(family, seed=2, layers=4, kv_heads=kv, head_dim=d)
    batch, seq = 2, 40
    layers16 = _source(batch, seq, kv, d, dtype=torch.bfloat16)
    layers32 = [(k.float(), v.float()) for k, v in layers16]
    mapper32 = _ridge(3 * kv * d, kv * d)
    mapper = _ridge(3 * kv * d, kv * d).to(dtype=mapper_dtype)
    kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=kv)
    positions = _positions(batch, seq)
    ref32 = map_layers_reference(layers32, mapper32, positions, out_dtype=torch.float32, **kw)
    fast = map_layers(layers16, mapper, positions, out_dtype=torch.bfloat16, chunk_tokens=32, **kw)
    assert fast[0][0].dtype == torch.bfloat16
    bound = (4 if mapper_dtype == torch.float32 else 8) * BF16_U
    worst = max(max(_rel_err(fk, rk), _rel_err(fv, rv)) for (fk, fv), (rk, rv) in zip(fast, ref32))
    assert worst <= bound, (worst, bound)
    assert worst > 0  # it is a reduced-precision path: identical results would mean fp32 ran
    same = map_layers_reference(layers16, mapper, positions, out_dtype=torch.bfloat16, **kw)
    _compare(fast, same, bound)


# -- any selection from views, the sampled finiteness check (issue 48) ---------------------------------------
SCATTERED = torch.tensor([[0, 5, 2, 7], [7, 1, 4, 3]])  # no two neighbours consecutive: four blocks per target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_scattered_selection_matches_reference(dtype):
    """A selection with no runs ([0, 5, 2, 7]): four blocks per target, each mapped from its strided view and
    accumulated into one output in fp32: the split sums differ from one GEMM by a few eps32 (as in
    test_fast_path_matches_reference): FP32_TOL. bf16 (bf16 cache, bf16 mapper) against the reference in the same
    dtypes: the blocks are gathered and mapped by one GEMM as the reference does, from features stripped with the
    reference's rounding: the output roundings differ at most where BLAS blocks the sum differently (<= 2u, as in
    the bf16 production test); bound 8u, that test's."""
    kv, d = 2, 8
    src = tiny_model("qwen3", seed=1, layers=8, kv_heads=kv, head_dim=d)
    tgt = tiny_model("llama", seed=2, layers=2, kv_heads=kv, head_dim=d)
    layers = _source(2, 37, kv, d, n_layers=8, dtype=dtype)
    mapper = _ridge(4 * kv * d, kv * d, sel=SCATTERED).to(dtype=dtype)
    kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=kv)
    positions = _positions(2, 37)
    ref = map_layers_reference(layers, mapper, positions, **kw)
    tol = FP32_TOL if dtype == torch.float32 else 8 * BF16_U
    _compare(map_layers(layers, mapper, positions, chunk_tokens=20, **kw), ref, tol)  # 2 chunks of 10 rows x 2


def test_any_selection_maps_without_copying_its_blocks():
    """fp32: the ridge kind maps every block from its view; bf16: one GEMM over the gathered blocks (see
    Mapper.map_blocks). Either way no clone, contiguous or cat inside the apply (a batched bf16 GEMM would clone
    strided operands; the 2-D addmm reads them in place)."""
    from torch.profiler import profile

    src, tgt = tiny_model("qwen3", seed=1, layers=8), tiny_model("qwen3", seed=2, layers=2)
    for dtype in (torch.float32, torch.bfloat16):
        layers = _source(1, 64, 2, 8, n_layers=8, dtype=dtype)
        mapper = _ridge(64, 16, sel=SCATTERED).to(dtype=dtype)
        kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=2)
        map_layers(layers, mapper, torch.arange(64), **kw)  # warm (codec tables)
        with profile() as prof:
            map_layers(layers, mapper, torch.arange(64), **kw)
        names = {e.name for e in prof.events()}
        assert not names & {"aten::clone", "aten::contiguous", "aten::cat", "aten::isfinite_full"}, (dtype, names)
        gemms = [e for e in prof.events() if e.name in ("aten::addmm", "aten::addmm_")]
        # fp32: targets x kinds x blocks, from the views; bf16: gathered (one rounding), targets x kinds
        assert len(gemms) == 2 * 2 * (4 if dtype == torch.float32 else 1)


def test_reduced_precision_rope_passes_are_bit_identical_to_the_codec():
    """The tiled float32 strip (source keys) and re-rotation (mapped keys) run the same elementwise ops as
    RopeCodec.strip / apply on the whole tensor: equal bitwise, tile boundaries included (tiles of 1 MiB / (4 B
    x heads x d) tokens: a 3000-token chunk spans several)."""
    from kvtransfer.core import transfer as tr

    model = tiny_model("ministral3", seed=1, layers=2, kv_heads=2, head_dim=64)
    codec = RopeCodec(model)
    seq = 3000
    k = (3 * torch.randn(1, 2, seq, 64, generator=torch.Generator().manual_seed(0))).bfloat16()
    pos = torch.arange(seq)[None] + 7
    for dtype in (torch.bfloat16, torch.float32):  # bf16 mapper; fp32 mapper over a bf16 cache (rounds twice)
        feats = tr._gather_stripped([(k, k)], [0], slice(0, seq), pos, codec, "cpu", dtype)
        want = codec.strip(k, pos).to(dtype).transpose(1, 2).reshape(seq, -1)
        assert torch.equal(feats[0], want)
    cos, sin = codec.cos_sin(pos)
    for out_dtype in (torch.bfloat16, torch.float32):
        dest = torch.empty(1, 2, seq, 64, dtype=out_dtype)
        tr._rotate_tiled(k, cos, sin, dest, tr._Gather(device="cpu"))
        assert torch.equal(dest, codec.apply(k, pos).to(out_dtype))


def _nan_case(where):
    src, tgt = tiny_model("qwen3", seed=1, layers=8), tiny_model("qwen3", seed=2, layers=2)
    layers = [(k.clone(), v.clone()) for k, v in _source(1, 40, 2, 8, n_layers=8)]
    mapper = _ridge(64, 16, sel=SCATTERED)
    if where == "source key":
        layers[5][0][0, 1, 33, 3] = float("nan")  # layer 5, head 1, a late token in the second chunk
    elif where == "source value":
        layers[4][1][0, 0, 17, 6] = float("inf")
    elif where == "weight":
        mapper.weight[1, 1, 37, 11] = float("nan")  # target 1, values, a middle feature and column
    elif where == "bias":
        mapper.bias[1, 0, 9] = float("-inf")
    return layers, mapper, dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=2)


@pytest.mark.parametrize("where", ["source key", "source value", "weight", "bias"])
def test_sampled_check_catches_any_non_finite_input(where):
    """The default check reads a sample (each head's first column in every row, and the first row): a NaN/Inf
    anywhere in the features or parameters reaches it, in a chunk that is not the first."""
    layers, mapper, kw = _nan_case(where)
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        map_layers(layers, mapper, torch.arange(40), chunk_tokens=16, **kw)
    out = map_layers(layers, mapper, torch.arange(40), chunk_tokens=16, check_finite=False, **kw)
    assert not all(bool(torch.isfinite(z).all()) for kv in out for z in kv)  # the input really broke the output


def test_full_check_catches_an_overflow_the_sample_cannot_see():
    """An overflow of single finite values (here one weight large enough that one output column overflows float16
    in its last rows only) escapes the sample; the float16 output (narrower than the fp32 map) runs the full check
    by default, and check_finite="full" asks for it anywhere."""
    layers, mapper, kw = _nan_case("none")
    for t in range(2):
        mapper.weight[t, 1, :, 13] = 0
        mapper.weight[t, 1, 17, 13] = 1.0  # column 13 of values copies feature 17 (layer 1st of block, head 1, dim 1)
    for s in range(8):
        layers[s][1][0, 1, 30:, 1] = 1e6  # late tokens only: the first row stays finite
    with pytest.raises(FloatingPointError, match="NaN/Inf"):
        map_layers(layers, mapper, torch.arange(40), out_dtype=torch.float16, **kw)
    map_layers(layers, mapper, torch.arange(40), out_dtype=torch.float32, **kw)  # fp32: 1e6 is finite, no raise
    big = [(k, v * 1e33) for k, v in layers]
    with pytest.raises(FloatingPointError, match="NaN/Inf"):  # fp32 overflow in one column: only the full pass
        map_layers(big, mapper, torch.arange(40), check_finite="full", **kw)


# -- buffers kept across calls (core.transfer.Workspace) -------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_workspace_changes_no_value_and_reuses_its_buffers_across_calls(dtype):
    """Calls sharing one Workspace give bit-identical layers to calls without one (the same kernels on the same
    shapes: only where the buffers live differs), for a long call, a shorter one after it (served from the larger
    buffers already held) and a longer one again; the workspace's buffers stay put until a call needs more, and no
    returned layer lives in them (a later call must not overwrite what an earlier one returned)."""
    from kvtransfer.core.transfer import Workspace

    kv, d = 2, 8
    src = tiny_model("qwen3", seed=1, layers=8, kv_heads=kv, head_dim=d)
    tgt = tiny_model("llama", seed=2, layers=2, kv_heads=kv, head_dim=d)
    mapper = _ridge(4 * kv * d, kv * d, sel=SCATTERED).to(dtype=dtype)
    kw = dict(source_codec=RopeCodec(src), target_codec=RopeCodec(tgt), target_n_kv=kv, chunk_tokens=20)
    ws = Workspace()
    kept, held = [], None
    for seq in (37, 11, 37):
        layers = _source(2, seq, kv, d, n_layers=8, dtype=dtype, seed=seq)
        positions = _positions(2, seq)
        fresh = map_layers(layers, mapper, positions, **kw)
        reused = map_layers(layers, mapper, positions, workspace=ws, **kw)
        for (fk, fv), (rk, rv) in zip(fresh, reused):
            assert torch.equal(fk, rk) and torch.equal(fv, rv)
        ptrs = {n: b.data_ptr() for n, b in ws.buffers("cpu")._buffers.items()}
        assert "feats" in ptrs and ws.nbytes() > 0
        if held is not None:
            assert ptrs == held                     # the shorter call and the equal one reuse what the first took
        held = ptrs
        kept.append((reused, fresh))
    spans = [(b.data_ptr(), b.data_ptr() + b.numel() * b.element_size()) for b in ws.buffers("cpu")._buffers.values()]
    for reused, fresh in kept:                      # earlier results untouched by later calls, and not in the buffers
        for (rk, rv), (fk, fv) in zip(reused, fresh):
            assert torch.equal(rk, fk) and torch.equal(rv, fv)
            assert not any(a <= rk.data_ptr() < b or a <= rv.data_ptr() < b for a, b in spans)
