"""The dtype a map is applied in (kvtransfer.core.map_dtype): its names, the copy it makes, and serving's map
following the connector's `map_dtype` (the evaluation's side: tests/test_controls.py, the keys:
tests/test_artifact_keys.py, the bench's default: tests/test_core_fixes.py)."""
from __future__ import annotations

import pytest
import torch
from tiny_models import random_ids, tiny_model
from tolerance import assert_close, assert_far

from kvtransfer import Mapper, model_identity
from kvtransfer.core.cache import prefill
from kvtransfer.core.map_dtype import MAP_DTYPES, in_map_dtype, map_dtype, resolve_config, resolve_map_dtype
from kvtransfer.serve.mapping import ServeMap


def _mapper(src, tgt, seed=3):
    p, q = 2 * 2 * 8, 2 * 16  # k = 2 source layers x n_kv x d_s -> n_kv_t x d_t
    g = torch.Generator().manual_seed(seed)
    return Mapper(weight=0.3 * torch.randn(3, 2, p, q, generator=g), bias=0.1 * torch.randn(3, 2, q, generator=g),
                  selected_layers=torch.tensor([[0, 1], [1, 0], [1, 1]]), source=model_identity(src),
                  target=model_identity(tgt), calibration={"context_start": "prefix_token", "start_ids": [5]})


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("map_dtype")
    src = tiny_model("qwen3", seed=1, name="src", layers=2, head_dim=8)
    tgt = tiny_model("qwen3", seed=2, name="tgt", layers=3, head_dim=16, hidden=48)
    _mapper(src, tgt).save(root / "mapper")
    return root, src, tgt


def test_auto_is_bfloat16_on_cuda_and_float32_elsewhere_resolved_before_anything_keys_on_it():
    assert resolve_map_dtype("auto", "cuda") == "bfloat16" and resolve_map_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_map_dtype("auto", "cpu") == "float32" and resolve_map_dtype(None, "cpu") == "float32"
    assert resolve_map_dtype("float32", "cuda") == "float32" and resolve_map_dtype("torch.bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="not one of"):
        resolve_map_dtype("fp8", "cuda")
    with pytest.raises(ValueError, match="must be resolved"):
        map_dtype("auto")
    cfg = {"eval": {"map_dtype": "auto"}, "bench": {"mapper_dtypes": ["auto"]}}
    gpu, cpu = resolve_config(cfg, "cuda"), resolve_config(cfg, "cpu")
    assert gpu["eval"]["map_dtype"] == "bfloat16" and gpu["bench"]["mapper_dtypes"] == ["bfloat16", "float32"]
    assert cpu["eval"]["map_dtype"] == "float32" and cpu["bench"]["mapper_dtypes"] == ["float32"]
    assert cfg["eval"]["map_dtype"] == "auto"   # a new dict: the caller's config is untouched
    # an explicit choice is kept, and a list naming both is not doubled
    both = resolve_config({"eval": {"map_dtype": "float32"}, "bench": {"mapper_dtypes": ["auto", "float32"]}}, "cuda")
    assert both["eval"]["map_dtype"] == "float32" and both["bench"]["mapper_dtypes"] == ["bfloat16", "float32"]


def test_names_and_refusals():
    assert map_dtype("float32") is torch.float32 and map_dtype("torch.bfloat16") is torch.bfloat16
    assert map_dtype(torch.bfloat16) is torch.bfloat16 and sorted(MAP_DTYPES) == ["bfloat16", "float32"]
    for bad in ("float16", "fp32", torch.float16, None):
        with pytest.raises(ValueError, match=r"not one of \['bfloat16', 'float32'\].*eval.map_dtype"):
            map_dtype(bad)


def test_a_cast_is_a_copy_and_no_cast_is_the_map_itself(pair):
    _, src, tgt = pair
    mapper = _mapper(src, tgt)
    assert in_map_dtype(mapper, "float32") is mapper
    half = in_map_dtype(mapper, "bfloat16")
    assert half is not mapper and half.weight.dtype == half.bias.dtype == torch.bfloat16
    assert mapper.weight.dtype == torch.float32 and torch.equal(half.weight, mapper.weight.bfloat16())


def test_serving_applies_the_map_in_the_connectors_map_dtype(pair):
    """ServeMap(map_dtype=...): float32 by default (the fitted map), bfloat16 when asked, the output in the
    cache's dtype either way; the two differ by the map's rounding, not by a different map."""
    root, src, tgt = pair
    prompt = torch.tensor([[5] + random_ids(1, 19, seed=4)[0].tolist()])
    layers = [(k[0], v[0]) for k, v in prefill(src, prompt)]
    default = ServeMap(root / "mapper", src.config, tgt.config)
    half = ServeMap(root / "mapper", src.config, tgt.config, map_dtype="bfloat16")
    assert default.mapper.dtype == torch.float32 and half.mapper.dtype == torch.bfloat16
    a, b = default.map_range(layers, 0, 20), half.map_range(layers, 0, 20)
    assert all(k.dtype == torch.float32 for k, _ in b)  # the cache's dtype (ServeMap's `dtype`), not the map's
    w = default.mapper.weight.double()
    col_l1 = float(w.abs().sum(dim=2).max())  # max over outputs of sum_i |w_i|: the GEMM's sum of |products| / |x|max
    x_max = max(float(t.abs().max()) for kv in layers for t in kv)
    # RoPE (strip, then re-apply) moves a coordinate by at most sqrt(2) x its pair's max, once each way
    magnitude = 2 * col_l1 * x_max + float(default.mapper.bias.abs().max())
    for (ka, va), (kb, vb) in zip(a, b):
        assert_close(torch.stack([kb, vb]), torch.stack([ka, va]), dtype=torch.bfloat16, factor=6,
                     magnitude=magnitude, reason=(
                         "weights and features rounded to bfloat16 (eps_bf16 relative each: 2 per product, summed "
                         "in float32 <= 2 eps sum|w x|), the result and the re-rotation in bfloat16 (a few eps more)"))
    assert_far(torch.stack([b[0][0], b[0][1]]), torch.stack([a[0][0], a[0][1]]), atol=0.0,
               reason="a bfloat16 map is not the float32 one: the rounding shows")
    with pytest.raises(ValueError, match="not one of"):
        ServeMap(root / "mapper", src.config, tgt.config, map_dtype="int8")


# ---------------------------------------------------------------- experiments/map_dtype/collect.py on known inputs
def _collect_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "map_dtype" / "collect.py"
    spec = importlib.util.spec_from_file_location("map_dtype_collect", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _scores(docs, nll_by_set):
    return {"ppl_sets": {s: {"window_doc": docs[s], "window_nll": {"256": nll}} for s, nll in nll_by_set.items()}}


def test_collect_pairs_the_two_maps_on_the_confirmation_half_with_a_known_answer(tmp_path):
    """Synthetic runs whose answer is known: per window, no_context = target + 1 and the float32 map = target + 0.2
    (gap closed 80 %). On WikiText-2's confirmation half the bfloat16 map is worse by 0.005 nats everywhere (gap
    closed 79.5 %: loss 0.5 point, within a 1-point margin); on its selection half by 0.5 (which must not count);
    on the stdlib set by 0.05 (loss 5 points: outside)."""
    import json

    import yaml

    col = _collect_module()
    split = tmp_path / "split.yaml"
    split.write_text(yaml.safe_dump({"selection": [0, 1, 2], "confirmation": [3, 4, 5, 6]}))
    docs = {"wikitext2": [0, 3, 1, 4, 5, 2, 6], "python_stdlib": [0, 1, 2, 3]}
    runs = {}
    for name, shift in (("f32", None), ("bf16", "bf16")):
        by_set = {}
        for s, d in docs.items():
            target = [2.0 + 0.1 * i for i in range(len(d))]
            f32 = [t + 0.2 for t in target]
            if shift is None:
                mapped = f32
            elif s == "wikitext2":
                mapped = [x + (0.005 if doc >= 3 else 0.5) for x, doc in zip(f32, d)]
            else:
                mapped = [x + 0.05 for x in f32]
            by_set[s] = {"target": target, "no_context": [t + 1.0 for t in target], "transfer": mapped}
        runs[name] = _scores(docs, by_set)
    names = col.ENGINES["float32"]
    for key, run in zip(names, (runs["f32"], runs["bf16"])):
        (tmp_path / key).mkdir()
        (tmp_path / key / "scores.json").write_text(json.dumps(run))
    result = col.collect(tmp_path, margin={"margin": 0.01, "z": 1.645}, split=split)
    assert list(result) == ["float32"]  # the bfloat16-engine runs are not there: no row
    wiki, stdlib = result["float32"]["wikitext2/confirmation"], result["float32"]["python_stdlib/all"]
    assert wiki["windows"] == 4 and stdlib["windows"] == 4
    assert_close(wiki["gap_closed_float32"]["gap_closed"], 0.8, factor=32, reason=(
        "a ratio of two differences of means of 4 float64 values (~8 roundings); the differences cancel values of "
        "~3.3 down to 0.8 and 1.0, which scales each rounding's relative error by up to ~4"))
    assert_close(wiki["loss"], 0.005, factor=64, magnitude=1.0, reason=(
        "the difference of two such ratios, each 0.8 or 0.795 of magnitude <= 1: a few float64 roundings, x10"))
    assert_close(stdlib["loss"], 0.05, factor=64, magnitude=1.0, reason="as above")
    assert_close(wiki["nll_difference"], 0.005, factor=4, magnitude=2.7, reason=(
        "4 differences of float64 NLLs <= 2.7 (one rounding of that size each), then their mean"))
    assert wiki["verdict"] == "within" and stdlib["verdict"] == "outside"
    assert "| float32 | wikitext2/confirmation | 4 |" in col.markdown(result)
    # a changed draw is refused, not paired
    runs["bf16"]["ppl_sets"]["python_stdlib"]["window_doc"] = [3, 2, 1, 0]
    (tmp_path / names[1] / "scores.json").write_text(json.dumps(runs["bf16"]))
    with pytest.raises(ValueError, match="drew different windows"):
        col.collect(tmp_path, margin={"margin": 0.01, "z": 1.645}, split=split)


def test_the_margin_rule_decides_by_the_one_sided_bound():
    col = _collect_module()
    base = {"target": [2.0, 2.1, 2.2, 2.3], "no_context": [3.0, 3.1, 3.2, 3.3]}
    f32 = dict(base, transfer=[2.2, 2.3, 2.4, 2.5])
    noisy = dict(base, transfer=[2.2, 2.32, 2.38, 2.52])  # a loss near 0 with a spread: undecided at a tiny margin
    assert col.compare(f32, f32, margin=0.01, z=1.645)["verdict"] == "within"  # no loss at all
    assert col.compare(f32, noisy, margin=1e-6, z=1.645)["verdict"] == "undecided"
    assert col.load_margin()["margin"] > 0 and col.load_margin()["z"] > 0


def test_collect_pairs_hellaswag_item_by_item_and_decides_on_every_row(tmp_path):
    """Synthetic HellaSwag runs with a known answer: 20 items, the float32 map right on items 0-9, the bfloat16 map
    on items 0-8 and 10 (two items changed, accuracy equal: loss 0); on bfloat16 engines the bfloat16 map loses
    items 0-5 (loss 0.30: outside a 0.02 margin). The decision names the row that keeps float32 the default."""
    import json

    col = _collect_module()
    n = 20
    base = {"target": [1] * 15 + [0] * 5, "no_context": [1] * 5 + [0] * 15}
    right = lambda idx: [int(i in idx) for i in range(n)]  # noqa: E731
    runs = {"f32_engines_f32_map": right(range(10)), "f32_engines_bf16_map": right([*range(9), 10]),
            "bf16_engines_f32_map": right(range(10)), "bf16_engines_bf16_map": right(range(6, 10))}
    for name, transfer in runs.items():
        (tmp_path / f"{name}_hellaswag").mkdir()
        (tmp_path / f"{name}_hellaswag" / "scores.json").write_text(
            json.dumps({"tasks": {"hellaswag": dict(base, transfer=transfer)}}))
    margin = {"margin": 0.01, "z": 1.645, "hellaswag_margin": 0.02}
    result = col.collect(tmp_path, margin=margin)
    f32, bf16 = result["float32"]["hellaswag"], result["bfloat16"]["hellaswag"]
    assert f32["changed"] == 2 and f32["loss"] == 0.0 and f32["items"] == n
    assert (f32["only_float32_right"], f32["only_bfloat16_right"]) == (1, 1)
    # b = c = 1 in 20 items: SE = sqrt(1.5 + 1.5 - 0) / 20 (half an item added to each discordant count)
    assert_close(f32["loss_se"], 3 ** 0.5 / 20, factor=16, reason="a few float64 operations and a sqrt")
    assert f32["verdict"] == "undecided"   # 0 + 1.645 x 0.087 > 0.02
    # nothing changed is not an SE of 0: b = c = 0 gives sqrt(1) / n
    same = col.compare_items(dict(base, transfer=right(range(10))), dict(base, transfer=right(range(10))),
                             margin=0.02, z=1.645)
    assert same["changed"] == 0 and same["loss_se"] == 1 / n and same["verdict"] == "undecided"   # 1.645 / 20 > 0.02
    assert_close(bf16["loss"], 0.3, factor=8, reason="(6 - 0) / 20 in float64")
    # b = 6, c = 0: SE = sqrt(6.5 + 0.5 - 36 / 20) / 20; 0.3 - 1.645 x 0.114 > 0.02
    assert_close(bf16["loss_se"], (7 - 36 / 20) ** 0.5 / 20, factor=16, reason="a few float64 operations and a sqrt")
    assert bf16["verdict"] == "outside" and bf16["changed"] == 6
    assert f32["target"] == 0.75 and f32["no_context"] == 0.25 and f32["transfer_float32"] == 0.5
    text = col.markdown(result, {})
    assert "| float32 | 20 | 0.75 | 0.25 | 0.50 | 0.50 |" in text
    assert "float32 stays the default: float32 engines hellaswag: undecided; bfloat16 engines hellaswag: outside" \
        in text
    # no ppl runs and one engine missing: not decided
    assert col.decision({"float32": {"x": {"verdict": "within"}}}).startswith("not decided")
    assert col.decision({e: {"x": {"verdict": "within"}} for e in col.ENGINES}).startswith("every row is within")
    # a row one engine dtype has and the other lacks: not decided yet
    partial = {"float32": {"x": {"verdict": "within"}, "hellaswag": {"verdict": "within"}},
               "bfloat16": {"x": {"verdict": "within"}}}
    assert col.decision(partial) == "not decided: no runs yet for bfloat16 engines hellaswag"
    # a changed baseline is refused, not paired
    (tmp_path / "f32_engines_bf16_map_hellaswag" / "scores.json").write_text(
        json.dumps({"tasks": {"hellaswag": dict(base, target=[0] * n, transfer=runs["f32_engines_bf16_map"])}}))
    with pytest.raises(ValueError, match="different items or baselines"):
        col.collect(tmp_path, margin=margin)
