"""kvtransfer.bench: cost formulas, timing harness, shapes-only builders, rows/writers, and the fast
`map_layers` path against a straightforward reference implementation."""
from __future__ import annotations

import json

import pytest
import torch

from kvtransfer import bench
from kvtransfer.core.mapper import Mapper, MapperBase
from kvtransfer.core.rope import RopeCodec
from kvtransfer.core.transfer import map_layers
from tiny_models import qwen3_config, tiny_model
from tolerance import assert_close

CAPS = {"matmul_flops_per_s": 1e9, "copy_bytes_per_s": 1e8}


# -- cost formulas (hand-computed) -------------------------------------------------------------
def test_body_params_matches_model_and_hand_count():
    cfg = qwen3_config(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8)  # intermediate 64
    # per layer: q 32*32 + k,v 2*32*16 + o 32*32 + mlp 3*32*64 + 2 norms 2*32 + q/k norms 2*8 = 9296
    assert bench.body_params(cfg) == 2 * 9296 + 32
    model = tiny_model("qwen3", layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8)
    body = model.model
    n = sum(p.numel() for name, p in body.named_parameters() if "embed_tokens" not in name)
    assert bench.body_params(cfg) == n


def test_prefill_cost_hand_computed():
    cfg = qwen3_config(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=8)
    c = bench.prefill_cost(cfg, 10, dtype_bytes=4)
    # 2 * 18624 * 10 + attention 4 * 2 layers * 10^2 * (4 heads * 8) / 2
    assert c["flops"] == 372_480 + 12_800
    # weights (18624 + 10 embedding rows * 32) * 4 + KV 2 layers * 2 * 10 * 16 * 4
    assert c["bytes"] == 75_776 + 2_560


def test_mapper_cost_hand_computed():
    src = qwen3_config(kv_heads=2, head_dim=8)   # W_s = 16
    tgt = qwen3_config(kv_heads=4, head_dim=16)  # q = 64
    c = bench.mapper_cost(src, tgt, 2, 10, n_target_layers=3, n_source_used=4)
    assert c["gemm_flops"] == 3 * 2 * 2 * 10 * 32 * 64                       # p = 2 * 16 = 32
    assert c["flops"] == 245_760 + 3 * 2 * 10 * 64 + (4 * 10 * 16 * 4 + 3 * 10 * 64 * 3)
    assert c["bytes"] == 3 * 2 * (32 * 64 + 64) * 4 + 4 * 2 * 10 * 16 * 4 + 3 * 2 * 10 * 64 * 4  # 71,168
    # float64 division and product are correctly rounded (IEEE 754) on every machine, and these land exactly
    assert bench.floor_ms(2e9, 1e6, CAPS) == 2000.0
    assert bench.floor_ms(1e6, 1e9, CAPS) == 10_000.0


def test_paper_mapper_size_from_real_configs():
    src, tgt = bench.real_config("qwen3_14b"), bench.real_config("qwen3_32b")
    c = bench.mapper_cost(src, tgt, 8, 1, n_target_layers=64, n_source_used=40)
    assert c["gemm_flops"] == 2 * 1_073_741_824  # = 2 FLOPs x the paper's 1.07B weights, per token


# -- timing harness ------------------------------------------------------------------------------
def test_time_fn_rotates_and_reports_spread():
    inputs = [torch.randn(3) + 10 for _ in range(3)]
    seen = []
    r = bench.time_fn(lambda x: seen.append(id(x)), inputs, warmup=2, repeats=7)
    assert seen == [id(inputs[i % 3]) for i in range(2)] + [id(inputs[i % 3]) for i in range(7)]
    assert r["n"] == 7 and len(r["times_ms"]) == 7
    assert r["min_ms"] <= r["q1_ms"] <= r["median_ms"] <= r["q3_ms"] <= r["max_ms"]


def test_time_fn_rejects_zero_inputs():
    with pytest.raises(ValueError, match="all-zero"):
        bench.time_fn(lambda x: None, [torch.randn(4), [torch.zeros(2, 2)]], repeats=1)
    with pytest.raises(ValueError):
        bench.time_fn(lambda x: None, [], repeats=1)


# -- shapes-only builders ------------------------------------------------------------------------
def test_real_configs_and_shapes_only_body():
    from transformers import LlamaConfig, Ministral3Config, Qwen3Config

    assert isinstance(bench.real_config("qwen3_32b"), Qwen3Config)
    assert isinstance(bench.real_config("llama31_70b"), LlamaConfig)
    cfg = bench.real_config("ministral3_3b", layers=1)
    assert isinstance(cfg, Ministral3Config) and cfg.num_hidden_layers == 1 and cfg.hidden_size == 3072
    assert bench.real_config("llama31_70b").num_hidden_layers == 80
    model = bench.build_shapes_only(cfg, dtype=torch.bfloat16)
    assert type(model.model).__name__ == "Ministral3Model" and len(model.model.layers) == 1
    n_body = sum(p.numel() for name, p in model.model.named_parameters() if "embed_tokens" not in name)
    assert n_body == bench.body_params(cfg)
    assert model.model.embed_tokens.weight.shape == (131072, 3072)
    w = model.model.layers[0].mlp.up_proj.weight
    assert bool(w.any()) and float(w.float().std()) > 0.01
    codec = RopeCodec(model)  # works through the causal-LM surface
    assert codec.rope_type == "yarn"
    del model


def test_random_mapper_has_real_per_layer_size():
    src, tgt = bench.real_config("qwen3_14b"), bench.real_config("qwen3_32b", layers=1)
    m = bench.random_mapper(src, tgt, 8, n_target_layers=1)
    assert m.weight.shape == (1, 2, 8192, 1024) and m.bias.shape == (1, 2, 1024)
    assert m.weight[0].numel() == 2 * 8192 * 1024
    assert m.selected_layers.shape == (1, 8) and int(m.selected_layers.max()) < 40
    band = bench.random_mapper(src, tgt, 8, n_target_layers=1, selection="band")
    row = band.selected_layers[0].tolist()
    assert row == list(range(row[0], row[0] + 8))


# -- rows and writers ------------------------------------------------------------------------------
@pytest.fixture
def tiny_pair(monkeypatch):
    small = dict(model_type="qwen3", vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=8, max_position_embeddings=4096,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    monkeypatch.setitem(bench.MODELS, "tiny_src", dict(small, num_hidden_layers=3))
    monkeypatch.setitem(bench.MODELS, "tiny_tgt", dict(small, num_hidden_layers=4, num_key_value_heads=4,
                                                        head_dim=16))
    monkeypatch.setitem(bench.PAIRS, "tiny", ("tiny_src", "tiny_tgt", 2))
    return "tiny"


def test_bench_rows_schema_and_writers(tiny_pair, tmp_path):
    rows = bench.bench_pair(tiny_pair, [8, 32], layers=2, repeats=3, warmup=1, caps=CAPS, log=lambda *a: None)
    assert [r["tokens"] for r in rows] == [8, 32]
    for r in rows:
        for key in ("mapper_ms", "mapper_ms_min", "mapper_ms_max", "prefill_ms", "prefill_ms_min", "prefill_ms_max",
                    "speedup", "mapper_flops", "mapper_bytes", "mapper_floor_ms", "prefill_flops", "prefill_bytes",
                    "prefill_floor_ms", "flop_ratio", "mapper_gemm_frac", "mapper_ms_full_est", "prefill_ms_full_est"):
            assert isinstance(r[key], float | int), key
        assert r["mode"] == "shapes_only" and r["layers_run"] == 2 and r["layers_full"] == 4
        assert r["mapper_ms_min"] <= r["mapper_ms"] <= r["mapper_ms_max"]
        assert r["speedup"] == r["prefill_ms"] / r["mapper_ms"]   # the same float64 expression: bit for bit
        assert r["mapper_ms_full_est"] == 2 * r["mapper_ms"]      # x (4 / 2 layers) = x 2.0, exact
    paths = bench.write_outputs(rows, tmp_path / "out", caps=CAPS)
    data = json.loads(paths["json"].read_text())
    assert len(data["rows"]) == 2 and "times_ms" not in data["rows"][0]
    md = paths["md"].read_text()
    assert "SHAPES-ONLY" in md and "| 32 |" in md
    assert paths["csv"].read_text().splitlines()[0].startswith("pair,")
    assert paths["png"].stat().st_size > 1000
    with pytest.raises(FileExistsError):
        bench.write_outputs(rows, tmp_path / "out", caps=CAPS)


def test_bench_skips_what_does_not_fit(tiny_pair):
    rows = bench.bench_pair(tiny_pair, [8], layers=1, repeats=1, warmup=0, caps=CAPS, memory_fraction=1e-15,
                            log=lambda *a: None)
    assert "skipped" in rows[0] and "mapper_ms" not in rows[0] and "speedup" not in rows[0]
    assert "skipped" in bench.table_markdown(rows)


def test_cli_writes_outputs_and_refuses_to_overwrite(tiny_pair, tmp_path, monkeypatch):
    monkeypatch.setattr(bench.timing, "measure_device", lambda *a, **k: dict(CAPS))
    argv = ["--pair", tiny_pair, "--tokens", "8,16", "--layers", "1", "--repeats", "2", "--warmup", "0",
            "--device", "cpu", "--out", str(tmp_path / "run")]
    paths = bench.main(argv)
    rows = json.loads(open(paths["json"]).read())["rows"]
    assert [r["tokens"] for r in rows] == [8, 16] and all("speedup" in r for r in rows)
    with pytest.raises(FileExistsError):
        bench.main(argv)


# -- fast map_layers vs a straightforward reference ------------------------------------------------
def _reference(layers, mapper, positions, sc, tc, n_kv_t):
    """Per target layer: concat RoPE-stripped source features, x @ W + b, re-rotate."""
    out = []
    for t, row in enumerate(mapper.selected_layers.tolist()):
        feats = {0: [], 1: []}
        for s in row:
            k, v = layers[s]
            k = sc.strip(k, positions)
            for i, x in ((0, k), (1, v)):
                b, h, n, d = x.shape
                feats[i].append(x.permute(0, 2, 1, 3).reshape(b * n, h * d))
        res = []
        for i in (0, 1):
            y = torch.cat(feats[i], dim=1) @ mapper.weight[t, i] + mapper.bias[t, i]
            b, n = layers[0][0].shape[0], layers[0][0].shape[2]
            res.append(y.view(b, n, n_kv_t, -1).permute(0, 2, 1, 3))
        out.append((tc.apply(res[0], positions), res[1]))
    return out


class _Generic(MapperBase):
    """A mapper kind that only offers map_features (exercises the gather path)."""

    kind = "generic_test"
    _FLOAT_TENSORS = ("weight_", "bias_")

    def __init__(self, ridge: Mapper):
        self.weight_, self.bias_ = ridge.weight, ridge.bias
        self.selected_layers, self.key_space = ridge.selected_layers, ridge.key_space

    def map_features(self, layer, x):
        return x @ self.weight_[layer] + self.bias_[layer][:, None, :]


@pytest.mark.parametrize("family", ["qwen3", "llama", "ministral3"])
@pytest.mark.parametrize("shapes", [(2, 8, 2, 8), (2, 8, 4, 16)], ids=["matched", "mismatched"])
def test_map_layers_matches_reference(family, shapes):
    kv_s, d_s, kv_t, d_t = shapes
    src = tiny_model(family, seed=1, layers=5, kv_heads=kv_s, head_dim=d_s)
    tgt = tiny_model(family, seed=2, layers=4, kv_heads=kv_t, head_dim=d_t)
    g = torch.Generator().manual_seed(0)
    batch, seq = 2, 23
    layers = [(3 * torch.randn(batch, kv_s, seq, d_s, generator=g), torch.randn(batch, kv_s, seq, d_s, generator=g))
              for _ in range(5)]
    sel = torch.tensor([[0, 1, 2], [4, 2, 0], [1, 2, 4], [2, 3, 4]])  # runs, reversed, split, band
    p, q = 3 * kv_s * d_s, kv_t * d_t
    mapper = Mapper(weight=torch.randn(4, 2, p, q, generator=g) / p ** 0.5, bias=torch.randn(4, 2, q, generator=g),
                    selected_layers=sel, source={}, target={})
    positions = torch.stack([torch.arange(seq) + 3, (torch.arange(seq) - 4).clamp(min=0)])
    sc, tc = RopeCodec(src), RopeCodec(tgt)
    ref = _reference(layers, mapper, positions, sc, tc, kv_t)
    kw = dict(source_codec=sc, target_codec=tc, target_n_kv=kv_t, chunk_tokens=10)
    fast = map_layers(layers, mapper, positions, **kw)
    generic = _Generic(mapper)
    via_kind = map_layers(layers, generic, positions, **kw)
    for (rk, rv), (fk, fv), (gk, gv) in zip(ref, fast, via_kind):
        assert fk.shape == rk.shape == (batch, kv_t, seq, d_t) and fk.is_contiguous() and fv.is_contiguous()
        for got, want in ((fk, rk), (fv, rv), (gk, rk), (gv, rv)):
            assert_close(got, want, factor=10 * (p + 6), magnitude=1 + float(want.abs().max()), reason=(
                "fast (chunked, fused) vs reference float32 map of p features plus RoPE strip / apply (~6 "
                "roundings): a length-p GEMM within p eps of the output scale (+1 for the bias); x10 as one "
                "short GEMM sits near its worst case"))


def test_map_layers_still_detects_nan():
    src, tgt = tiny_model("qwen3", seed=1), tiny_model("qwen3", seed=2)
    layers = [(torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)) for _ in range(2)]
    w = torch.randn(2, 2, 16, 16)
    w[1, 1, 0, 0] = float("nan")
    mapper = Mapper(weight=w, bias=torch.zeros(2, 2, 16), selected_layers=torch.tensor([[0], [1]]), source={}, target={})
    with pytest.raises(FloatingPointError):
        map_layers(layers, mapper, torch.arange(5), source_codec=RopeCodec(src), target_codec=RopeCodec(tgt),
                   target_n_kv=2)


def test_breakdown_bytes_hand_counted():
    """Bytes beyond the floor, by construction: used-layer buffer 2 x 3 layers x 10 tokens x 8 values x 4 B = 1,920;
    GEMM output written and read, 2 targets x 2 kinds x 10 x 16 x 4 x 2 = 5,120; sample 2 x 2 x 10 x 2 heads x 64 =
    5,120; a bf16 gather of p = 24 for one target: 2 kinds x 10 x 24 x 2 B x 2 = 1,920."""
    from kvtransfer.bench.breakdown import extra_bytes

    b = extra_bytes(tokens=10, n_used=3, width_s=8, n_target=2, q=16, n_kv_t=2, map_bytes=4)
    assert (b["buffer"], b["gemm_out"], b["check"], b["gather"], b["total"]) == (1920, 5120, 5120, 0, 12160)
    assert extra_bytes(tokens=10, n_used=3, width_s=8, n_target=2, q=16, n_kv_t=2, map_bytes=2,
                       gathered_features=24)["gather"] == 1920


def test_breakdown_row_reports_where_the_time_goes():
    """One small real-shape row: every part is there, the GEMM share and rate are fractions of the same rounds,
    and the machine names its instruction set and whether bf16 is native."""
    from kvtransfer.bench.breakdown import breakdown_row

    r = breakdown_row("qwen3_14b_32b", layers=1, tokens=32, dtype=torch.float32, selection="random")
    from kvtransfer.bench.shapes import bench_selection
    from kvtransfer.core.transfer import _runs

    row = bench_selection(40, 64, 8, 1).tolist()[0]  # what the row mapped: 8 of 14B's 40 layers, in any order
    slot = {x: i for i, x in enumerate(sorted(row))}
    assert r["n_used"] == 8 and r["blocks_per_target"] == [len(_runs([slot[x] for x in row]))]
    assert r["blocks_per_target"][0] > 1  # not one run: the multi-block path was what ran
    assert 0 < r["gemm_share"] and 0 < r["gemm_rate_of_matmul"] and 0 < r["floor_fraction"]
    assert r["full_ms"]["median"] <= r["full_ms"]["p95"] <= r["full_ms"]["max"]
    assert r["machine"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert r["machine"]["bf16"] == (" ".join(r["machine"]["bf16_flags"]) or "no native bf16")
    assert set(r["load_avg"]) == {"before", "after"}
