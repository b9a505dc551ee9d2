"""experiments/map_dtype/cache_diff.py on the tiny pair: its distances are those between the eval's own prefix caches
(the map in float32, the map in bfloat16, the target's prefill), computed here independently, and it never
overwrites a measurement."""
from __future__ import annotations

import json

import pytest
import torch

from scripts import load_script
from test_runner import _tiny_cfg, tiny_pair_dirs  # noqa: F401 (the module fixture)
from tolerance import assert_close, assert_far

cache_diff = load_script("experiments/map_dtype/cache_diff.py")


def _frobenius(a, b, start: int, kind: int) -> tuple[float, float]:
    """(|a - b|_F, |b|_F) over every layer's positions start.. of caches `a`, `b` (float64, one concatenation)."""
    x = torch.cat([la[kind][:, :, start:].double().reshape(-1) for la in a])
    y = torch.cat([lb[kind][:, :, start:].double().reshape(-1) for lb in b])
    return float(torch.linalg.vector_norm(x - y)), float(torch.linalg.vector_norm(y))


def test_cache_diff_measures_the_evals_caches(tiny_pair_dirs, tmp_path):  # noqa: F811
    from kvtransfer.eval.perplexity import ppl_contexts
    from kvtransfer.runner.eval_stage import eval_lm
    from kvtransfer.runner.pipeline import Run, execute

    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[calibrate,fit]", "eval.ppl.prefixes=[16]",
                    "eval.ppl.continuation=8", "eval.ppl.windows=5")
    execute(cfg, tmp_path / "run")
    cache_diff.main(["--run", str(tmp_path / "run"), "--prefix", "16", "--windows", "2", "--out", str(tmp_path)])
    out = json.loads((tmp_path / "cache_diff_float32.json").read_text())
    assert out["windows"] == 2 and out["engines"] == "float32" and out["provenance"]["commit"]

    run = Run(json.loads((tmp_path / "run" / "config.json").read_text()), tmp_path / "run")
    lm, _ = eval_lm(run, ["transfer"])
    contexts, _ = ppl_contexts(lm, run.cfg["eval"], "wikitext2", 16, 2, 0)
    target = lm.with_mode("target")
    for c, ctx in enumerate(contexts):
        prefix = [lm.cut(ctx)[0]]
        f32, _ = lm.with_mode("transfer").prefix_cache(prefix)
        bf16, _ = lm.with_mode("transfer", mapper=lm.mapper, map_dtype=torch.bfloat16).prefix_cache(prefix)
        own, _ = target.prefix_cache(prefix)
        start = lm.native_sink
        for i, kind in enumerate(cache_diff.KINDS):
            d_dtype, n_f32 = _frobenius(bf16, f32, start, i)
            d_map, n_own = _frobenius(f32, own, start, i)
            row = out["per_context"][kind]
            # the same float32 tensors on both sides; float64 sums of ~1e4 squares in a different grouping
            # (per layer, then over layers): a few eps64 of relative error, 1,000 eps allowed (10x headroom)
            reason = "float64 Frobenius norms of identical tensors summed in another order"
            assert_close(row["rel_dtype"][c], d_dtype / n_f32, factor=1000, dtype=torch.float64, reason=reason)
            assert_close(row["rel_map"][c], d_map / n_own, factor=1000, dtype=torch.float64, reason=reason)
            assert_close(row["share"][c], d_dtype / d_map, factor=1000, dtype=torch.float64, reason=reason)
            # the bfloat16 apply moved the cache (a map in float32 twice would give exactly 0)
            assert_far(row["rel_dtype"][c], 0.0, atol=0.0, reason="bfloat16 rounding changes the mapped cache")
    # collect.py puts the measurement into the README's table
    col = load_script("experiments/map_dtype/collect.py")
    diffs = col.cache_diffs(tmp_path)
    k = out["summary"]["keys"]["rel_dtype"]
    assert list(diffs) == ["float32"] and f"| float32 | 2 (wikitext2, P = 16) | keys | {k['mean']:.2e}" in \
        col.markdown({}, diffs)
    with pytest.raises(SystemExit, match="never overwritten"):
        cache_diff.main(["--run", str(tmp_path / "run"), "--prefix", "16", "--windows", "2", "--out", str(tmp_path)])
