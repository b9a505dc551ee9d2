"""Correctness fixes of the numerical core (issue 9, §3a-c, §3e): native sink on short rows, the
rank-revealing ridge solve, MLP artifacts through the public API, and the bench timing the dtype
evaluation maps with."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import kvtransfer as kt
from kvtransfer import bench
from kvtransfer.core.mapper import MLPMapper
from kvtransfer.core.ridge import IllConditionedWarning, solve_spd
from kvtransfer.runner import bench_stage
from tiny_models import random_ids, tiny_model
from tolerance import FORWARD, assert_close, assert_far, forward_factor

REPO = Path(__file__).resolve().parents[1]


# -- §3a native_sink on rows shorter than the sink ------------------------------------------------
@pytest.fixture(scope="module")
def sink_pair():
    source = tiny_model("qwen3", layers=2, seed=1, name="sink-src")
    target = tiny_model("llama", layers=3, seed=2, hidden=48, heads=6, name="sink-tgt")
    g = torch.Generator().manual_seed(0)
    n_s, n_t = 2 * 2 * 8, 2 * 8  # k=2 source layers x 2 kv heads x head_dim 8; 2 kv heads x 8
    mapper = kt.Mapper(weight=torch.randn(3, 2, n_s, n_t, generator=g) / n_s ** 0.5,
                       bias=torch.randn(3, 2, n_t, generator=g), selected_layers=torch.tensor([[0, 1], [1, 0], [0, 1]]),
                       source=kt.model_identity(source), target=kt.model_identity(target))
    return source, target, mapper


def test_native_sink_rows_shorter_than_the_sink_are_computed_by_the_target(sink_pair):
    """Left-padded batch, sink N=4: row 0 has 9 real tokens, row 1 three (< N), row 2 exactly four.

    Expected values are hand-built from separate, unpadded target prefills of each row. The old code
    clamped row 1's sink indices onto its last token and scattered four results into one slot."""
    source, target, mapper = sink_pair
    n_sink, seq = 4, 9
    real = [9, 3, 4]
    ids = random_ids(3, seq, seed=7)
    mask = torch.zeros(3, seq, dtype=torch.long)
    for b, r in enumerate(real):
        mask[b, seq - r:] = 1
        ids[b, :seq - r] = 0
    src = kt.prefill(source, ids, mask)
    plain = kt.transfer(src, mapper, source, target, attention_mask=mask, as_layers=True)
    sunk = kt.transfer(src, mapper, source, target, attention_mask=mask, input_ids=ids, native_sink=n_sink,
                       as_layers=True)
    for b, r in enumerate(real):
        own = kt.prefill(target, ids[b:b + 1, seq - r:])  # the target alone on the row's real tokens
        n = min(n_sink, r)
        for (k, v), (ok, ov), (pk, pv) in zip(sunk, own, plain):
            # fp32, and the batched sink prefill runs other shapes than the single-row one: not bitwise
            for got, want in ((k[b, :, seq - r:seq - r + n], ok[0, :, :n]), (v[b, :, seq - r:seq - r + n], ov[0, :, :n])):
                assert_close(got, want, factor=forward_factor(target, seq), reason=FORWARD)
            # everything else in the row is untouched: the mapped values, bit for bit
            rest = [i for i in range(seq) if not seq - r <= i < seq - r + n]
            assert torch.equal(k[b, :, rest], pk[b, :, rest]) and torch.equal(v[b, :, rest], pv[b, :, rest])
    # the short row really differs from its mapped version (the sink did something there)
    assert_far(sunk[0][0][1, :, -1], plain[0][0][1, :, -1], atol=1e-3, reason="native vs planted random map: O(1) apart")


# -- §3b rank-revealing ridge solve ---------------------------------------------------------------
def _rank_deficient(seed: int, dtype: torch.dtype, n: int = 500, p: int = 12, dup: int = 4):
    """Centred moments (a = XᵀX, b = XᵀY, λ = 0) of X whose last `dup` columns are combinations of
    others (rank p), in `dtype`; and the minimum-norm least-squares solution pinv(X) Y from fp64 X."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, p, generator=g, dtype=torch.float64)
    x = torch.cat([x, x[:, :dup] + 0.3 * x[:, dup:2 * dup]], 1)
    y = x[:, :p] @ torch.randn(p, 3, generator=g, dtype=torch.float64) + 0.1 * torch.randn(n, 3, generator=g,
                                                                                            dtype=torch.float64)
    xc, yc = x - x.mean(0), y - y.mean(0)
    min_norm = torch.linalg.pinv(xc, rtol=1e-10) @ yc
    return (xc.T @ xc).to(dtype), (xc.T @ yc).to(dtype), min_norm


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_deficient_fp32_moments_give_the_minimum_norm_solution_and_warn(seed):
    """λ=0 on fp32 moments (the ablation that broke on CUDA). The old fallback (lstsq on the fp64
    copy, whose cut-off suits fp64 entries) kept fp32 rounding noise as signal: errors ~10 on
    weights of size ~2. Tolerance: a's entries carry fp32 rounding (eps 1.2e-7 relative), which the
    solve on the kept subspace amplifies by its condition number (~10 here): 1e-5 relative."""
    a, b, min_norm = _rank_deficient(seed, torch.float32)
    with pytest.warns(IllConditionedWarning, match=r"condition number .* 12 directions"):
        w = solve_spd(a, b)
    assert w.dtype == torch.float64
    assert (w - min_norm).abs().max() <= 1e-5 * min_norm.abs().max()


def test_numerically_singular_system_is_caught_even_when_cholesky_succeeds():
    """fp64, p=5 with one column = a combination of two others: Cholesky runs to the end on rounding
    noise for this seed, and the old code returned its answer, with an arbitrary null-space part
    (0.07 off on weights of size 0.36). Tolerance: fp64 solve on a well-conditioned 4-dim
    subspace: 1e-10 relative."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 4, generator=g, dtype=torch.float64)
    x = torch.cat([x, x[:, :1] + 0.3 * x[:, 1:2]], 1)
    y = torch.randn(50, 2, generator=g, dtype=torch.float64)
    a, b = x.T @ x, x.T @ y
    assert int(torch.linalg.cholesky_ex(a).info) == 0  # the premise: Cholesky does not notice
    with pytest.warns(IllConditionedWarning):
        w = solve_spd(a, b)
    min_norm = torch.linalg.pinv(x, rtol=1e-10) @ y
    assert (w - min_norm).abs().max() <= 1e-10 * min_norm.abs().max()


def test_lambda_zero_fit_on_float64_moments_of_float32_products():
    """The GPU calibration setting: float64 moments merged from float32 batch products
    (compute_dtype, recorded in info as collect_moments does). Their entries are only float32
    accurate, so the cut-off must follow the compute dtype; the old lstsq fallback (and an fp64
    cut-off) kept the float32 noise: weights off by ~2.6 on a scale of 2.4. Tolerance: float32
    products amplified by the kept subspace's condition number (~10): 1e-5 relative."""
    from kvtransfer.core.moments import Moments
    from kvtransfer.core.ridge import fit_layer

    g = torch.Generator().manual_seed(0)
    n = 600
    x = torch.randn(n, 12, generator=g, dtype=torch.float64)
    x = torch.cat([x, x[:, :4] + 0.3 * x[:, 4:8]], 1)  # two source layers of width 8, rank 12
    y = x[:, :12] @ torch.randn(12, 4, generator=g, dtype=torch.float64) + 0.1 * torch.randn(n, 4, generator=g,
                                                                                              dtype=torch.float64)
    moments = Moments([0, 1], [0], 8, 4, info={"compute_dtype": "torch.float32"})
    for i in range(0, n, 200):
        moments.add({"k": x[i:i + 200], "v": x[i:i + 200]}, {"k": y[i:i + 200], "v": y[i:i + 200]},
                    compute_dtype=torch.float32)
    assert moments.dtype == torch.float64
    with pytest.warns(IllConditionedWarning):
        fit = fit_layer(moments, "k", [0, 1], 0, lam=0.0)
    min_norm = torch.linalg.pinv(x - x.mean(0), rtol=1e-10) @ (y - y.mean(0))
    assert (fit.weight - min_norm).abs().max() <= 1e-5 * min_norm.abs().max()


def test_well_conditioned_systems_take_cholesky_silently():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(400, 16, generator=g, dtype=torch.float64)
    a, b = x.T @ x + 0.01 * torch.eye(16, dtype=torch.float64), x.T @ torch.randn(400, 5, generator=g,
                                                                                     dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        w = solve_spd(a, b)
    # Cholesky vs LU: different factorisations of a cond~2 system, fp64: 1e-12 relative
    assert_close(w, torch.linalg.solve(a, b), factor=16 * float(torch.linalg.cond(a)) * 10, reason=(
        "two backward-stable float64 solves of a 16 x 16 system: each within ~n eps kappa of |w|; x10 since "
        "n eps kappa is already the typical (not worst) error of a small dense solve"))


# -- §3c every artifact kind loads through the public API -----------------------------------------
def _tiny_mlp_mapper() -> MLPMapper:
    g = torch.Generator().manual_seed(0)
    n_t, heads, p, hidden, d = 2, 2, 12, 5, 4
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    ident = {"model_id": "m", "config_hash": "abc", "n_layers": 2, "n_kv": heads, "head_dim": d}
    return MLPMapper(w1=r(n_t, 2, heads, p, hidden), b1=r(n_t, 2, heads, hidden), w2=r(n_t, 2, heads, hidden, hidden),
                     b2=r(n_t, 2, heads, hidden), w3=r(n_t, 2, heads, hidden, d), b3=r(n_t, 2, heads, d),
                     x_mean=r(n_t, 2, p), x_std=r(n_t, 2, p).abs() + 0.5, y_mean=r(n_t, 2, heads * d),
                     y_std=r(n_t, 2, heads * d).abs() + 0.5, selected_layers=torch.tensor([[0, 1], [1, 0]]),
                     source=ident, target=ident)


def test_mlp_artifact_loads_after_a_plain_import_kvtransfer(tmp_path):
    """A fresh interpreter that imports only `kvtransfer` loads an MLP artifact with Mapper.load and
    load_mapper (the old registry knew the mlp kind only after `kvtransfer.maps.mlp` had been imported)."""
    mapper = _tiny_mlp_mapper()
    mapper.save(tmp_path / "mlp")
    x = torch.randn(2, 7, 12, generator=torch.Generator().manual_seed(1))
    torch.save(x, tmp_path / "x.pt")
    script = f"""
import sys, json, torch
import kvtransfer
assert "kvtransfer.maps.mlp" not in sys.modules
a = kvtransfer.Mapper.load({str(tmp_path / "mlp")!r})
b = kvtransfer.load_mapper({str(tmp_path / "mlp")!r})
x = torch.load({str(tmp_path / "x.pt")!r})
torch.save(a.map_features(1, x), {str(tmp_path / "y.pt")!r})
print(json.dumps([a.kind, type(b).__name__, a.n_parameters]))
"""
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["mlp", "MLPMapper", mapper.n_parameters]
    # same kernels on the same shapes, but another process may use another thread count: fp32 tolerance
    assert_close(torch.load(tmp_path / "y.pt"), mapper.map_features(1, x), factor=10 * (12 + 5 + 5), reason=(
        "float32 MLP (widths 12 -> 5 -> 5 -> 4) in another process, maybe another thread count: GEMM reductions "
        "of 12 + 5 + 5 add ~n eps of the output scale; x10 as the three short reductions sit near their worst case"))


def test_unknown_kind_is_refused(tmp_path):
    mapper = _tiny_mlp_mapper()
    mapper.save(tmp_path / "m")
    manifest = json.loads((tmp_path / "m" / "mapper.json").read_text())
    (tmp_path / "m" / "mapper.json").write_text(json.dumps(manifest | {"kind": "conv"}))
    with pytest.raises(ValueError, match="unknown mapper kind 'conv'"):
        kt.load_mapper(tmp_path / "m")


# -- §3e the speed stage times the dtype evaluation maps with -------------------------------------
def test_eval_map_dtype_defaults_to_the_saved_mappers_and_the_bench_follows_it(tmp_path, sink_pair):
    """On a CPU the evaluation applies the map as saved (float32) unless eval.map_dtype says otherwise (the default
    `auto` resolves so; on CUDA it is bfloat16 with the float32 map timed beside it), and the bench times the
    dtype the evaluation uses unless bench.mapper_dtypes is set."""
    from run_configs import compose_config

    from kvtransfer.core.map_dtype import resolve_config

    _, _, mapper = sink_pair
    mapper.save(tmp_path / "m")
    composed = compose_config()
    assert composed["eval"]["map_dtype"] == "auto" and composed["bench"]["mapper_dtypes"] == ["auto"]
    default = resolve_config(composed, "cpu")
    assert str(kt.load_mapper(tmp_path / "m").dtype) == f"torch.{default['eval']['map_dtype']}" == "torch.float32"
    assert default["bench"]["mapper_dtypes"] == ["float32"]
    on_gpu = resolve_config(composed, "cuda")
    assert on_gpu["eval"]["map_dtype"] == "bfloat16" and on_gpu["bench"]["mapper_dtypes"] == ["bfloat16", "float32"]
    assert compose_config("eval.map_dtype=bfloat16")["bench"]["mapper_dtypes"] == ["bfloat16"]
    both = compose_config("eval.map_dtype=bfloat16", "bench.mapper_dtypes=[float32,bfloat16]")
    assert both["bench"]["mapper_dtypes"] == ["float32", "bfloat16"]


def test_bench_loaded_times_the_eval_dtype_on_bf16_models(sink_pair, monkeypatch):
    """bf16 models (as on GPU): the mapper is timed in float32 like evaluation, and the caller's mapper
    is not cast (the old stage cast it to the target's bf16 in place and timed that)."""
    source, target, mapper = sink_pair
    monkeypatch.setattr(bench.timing, "measure_device",
                        lambda *a, **k: {"matmul_flops_per_s": 1e9, "copy_bytes_per_s": 1e8})
    src16, tgt16 = (tiny_model(f, layers=n, seed=s, **kw).to(torch.bfloat16) for f, n, s, kw in
                    (("qwen3", 2, 1, {}), ("llama", 3, 2, dict(hidden=48, heads=6))))
    rows = bench_stage.bench_loaded(src16, tgt16, mapper, [8], warmup=0, repeats=1, n_inputs=1, log=lambda *a: None)
    assert rows[0]["dtype"] == "bfloat16" and rows[0]["mapper_dtype"] == "float32" and rows[0]["eval_dtype"]
    assert mapper.weight.dtype == torch.float32
    rows = bench_stage.bench_loaded(src16, tgt16, mapper, [8], mapper_dtype=torch.bfloat16, warmup=0, repeats=1,
                                    n_inputs=1, log=lambda *a: None)
    assert rows[0]["mapper_dtype"] == "bfloat16" and not rows[0]["eval_dtype"] and rows[0]["mapper_ms"] > 0
    assert mapper.weight.dtype == torch.float32


def test_shapes_only_bench_defaults_to_the_eval_dtype(monkeypatch):
    small = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    monkeypatch.setitem(bench.MODELS, "tiny_src", dict(small, num_hidden_layers=3))
    monkeypatch.setitem(bench.MODELS, "tiny_tgt", dict(small, num_hidden_layers=2))
    monkeypatch.setitem(bench.PAIRS, "tiny", ("tiny_src", "tiny_tgt", 2))
    caps = {"matmul_flops_per_s": 1e9, "copy_bytes_per_s": 1e8}
    kw = dict(repeats=1, warmup=0, caps=caps, run_prefill=False, log=lambda *a: None)
    row = bench.bench_pair("tiny", [8], dtype=torch.bfloat16, **kw)[0]
    assert row["dtype"] == "bfloat16" and row["mapper_dtype"] == "float32"
    row16 = bench.bench_pair("tiny", [8], dtype=torch.bfloat16, mapper_dtype=torch.bfloat16, **kw)[0]
    assert row16["mapper_dtype"] == "bfloat16" and row16["mapper_bytes"] < row["mapper_bytes"]
    assert "float32 mapper" in bench.table_markdown([row]) and "bfloat16 mapper" in bench.table_markdown([row16])


def test_bench_loaded_times_the_native_tail_on_the_mapped_rest(sink_pair, monkeypatch):
    """bench.native_tails=[m]: the timed forward runs the last m tokens on a mapped cache of the first n - m
    (not of all n, which would time attention over a cache holding the tail twice); tails >= n are skipped."""
    source, target, mapper = sink_pair
    monkeypatch.setattr(bench.timing, "measure_device",
                        lambda *a, **k: {"matmul_flops_per_s": 1e9, "copy_bytes_per_s": 1e8})
    seen = []
    real = bench_stage.forward_on_cache

    def recording(model, layers, mask, ids, *a, **k):
        seen.append((layers[0][0].shape[-2], ids.shape[-1]))
        return real(model, layers, mask, ids, *a, **k)

    monkeypatch.setattr(bench_stage, "forward_on_cache", recording)
    rows = bench_stage.bench_loaded(source, target, mapper, [8, 12], warmup=0, repeats=2, n_inputs=1,
                                    native_tails=[3, 8], log=lambda *a: None)
    assert sorted(set(seen)) == [(4, 8), (5, 3), (9, 3)]
    assert rows[0]["tail3_ms"] > 0 and "tail8_ms" not in rows[0] and rows[1]["tail8_ms"] > 0
    assert_close(rows[1]["tail3_speedup"], rows[1]["prefill_ms"] / (rows[1]["mapper_ms"] + rows[1]["tail3_ms"]),
                 factor=10 * 3, reason="float64 sum and division, maybe grouped otherwise: <= 3 roundings; x10 (few ops)")
