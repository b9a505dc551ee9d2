"""experiments/baselines/timing.py on the tiny pair: it times the eval's own pre-scoring work per mode (the map it
builds is the eval's prefix cache, bit for bit; a truncation prefills exactly the tokens it keeps), interleaved, and
never overwrites a measurement."""
from __future__ import annotations

import json

import pytest
import torch

from kvtransfer.core.recompute import prefill_flops
from scripts import load_script
from test_runner import _tiny_cfg, tiny_pair_dirs  # noqa: F401 (the module fixture)

timing = load_script("experiments/baselines/timing.py")


def test_timing_times_the_evals_work_interleaved_and_never_overwrites(tiny_pair_dirs, tmp_path, monkeypatch):  # noqa: F811
    from kvtransfer.runner.eval_stage import eval_lm
    from kvtransfer.runner.pipeline import Run, execute

    cfg = _tiny_cfg(tiny_pair_dirs, tmp_path, "stage=[calibrate,fit]", "eval.ppl.prefixes=[16]",
                    "eval.ppl.continuation=8", "eval.ppl.windows=5")
    execute(cfg, tmp_path / "run")
    maps, repairs = [], []
    real_transfer, real_repair = timing.transfer, timing.repair_prefix

    def spy_transfer(*a, **k):
        out = real_transfer(*a, **k)
        maps.append(out)
        return out

    def spy_repair(*a, **k):
        repairs.append(1)
        return real_repair(*a, **k)
    monkeypatch.setattr(timing, "transfer", spy_transfer)
    monkeypatch.setattr(timing, "repair_prefix", spy_repair)
    modes = "target,transfer,recompute_recent_0.3,no_context,truncate_tokens_4,truncate_tokens_16"
    timing.main(["--run", str(tmp_path / "run"), "--windows", "3", "--modes", modes, "--out", str(tmp_path / "t")])
    out = json.loads((tmp_path / "t" / "wikitext2_P16.json").read_text())
    t = out["timing"]
    # truncate_tokens_16 reads the whole P = 16 context: dropped, not timed as a curve point
    assert t["order"] == ["target", "transfer", "source", "recompute_recent_0.3", "no_context", "truncate_tokens_4"]
    assert t["repeats"] == 5 and all(len(v) == 5 for v in t["seconds"].values())
    assert t["relative"]["target"]["median"] == 1.0 and out["windows"] == 3 and out["provenance"]["commit"]
    # 6 rounds (a warm-up + 5) x 3 contexts: the map in transfer and in the repair mode, the repair in the latter
    assert len(maps) == 2 * 6 * 3 and len(repairs) == 6 * 3
    run = Run(json.loads((tmp_path / "run" / "config.json").read_text()), tmp_path / "run")
    lm, _ = eval_lm(run, ["target", "transfer"])
    start = lm._start_ids
    tcfg, scfg = lm.target_model.config, lm.source_model.config
    # FLOPs: a prefill of what each mode reads before scoring, context[:-1] (start ids + P - 1; + m - 1 for m)
    assert out["flops"]["target"] == 3 * prefill_flops(tcfg, len(start) + 15)
    assert out["flops"]["truncate_tokens_4"] == 3 * prefill_flops(tcfg, len(start) + 3)
    assert out["flops"]["source"] == 3 * prefill_flops(scfg, len(start) + 15)
    assert out["flops"]["transfer"] is None   # the map's FLOPs are the eval's
    # the timed map is the eval's prefix cache of the same context, bit for bit (same kernels, same shapes)
    from kvtransfer.eval.perplexity import draw_windows, prefix_pairs
    from kvtransfer.eval.sources import ppl_pages
    windows = draw_windows(lm.tokenizer, ppl_pages(run.cfg["eval"], "wikitext2"), max_prefix=16, cont_len=8,
                           n_windows=5, seed=0)
    ctx = prefix_pairs(windows, 16, 16, lm.prefix_token_id, start)[0][0]
    want, _ = lm.with_mode("transfer").prefix_cache([lm.cut(ctx)[0]])
    for (k, v), (wk, wv) in zip(maps[0], want):
        assert torch.equal(k, wk) and torch.equal(v, wv)
    with pytest.raises(SystemExit, match="never overwritten"):
        timing.main(["--run", str(tmp_path / "run"), "--windows", "3", "--out", str(tmp_path / "t")])
    # large -> small (pair.direction=reverse): its own file and key, and the target timed is the source's model
    rev = tmp_path / "run_reverse"
    rev.mkdir()
    cfg_rev = json.loads((tmp_path / "run" / "config.json").read_text())
    cfg_rev["pair"]["direction"] = "reverse"
    (rev / "config.json").write_text(json.dumps(cfg_rev))
    timing.main(["--run", str(rev), "--windows", "3", "--modes", "target,no_context", "--out", str(tmp_path / "t")])
    back = json.loads((tmp_path / "t" / "wikitext2_P16_reverse.json").read_text())
    assert back["set"] == "wikitext2@reverse" and back["timing"]["order"] == ["target", "no_context"]
    assert back["flops"]["target"] == 3 * prefill_flops(scfg, len(start) + 15)   # the small model reads it now
    assert out["set"] == "wikitext2"   # the forward file is untouched
