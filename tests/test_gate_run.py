"""Selective recompute and the gate in the harness (issue 30): tiny-pair runs with eval.recompute_fraction and
eval.gate on write one row per fraction (r = 0 the transfer, r = 1 the target) and gated rows with action counts."""
from __future__ import annotations

import json

import pytest

from kvtransfer.core.gate import decide, load_gate
from kvtransfer.eval.repair import parse_repair_mode, repair_mode, repair_modes
from kvtransfer.core.gate import fit_thresholds
from kvtransfer.core.signals import ENTROPIES, SIGNALS, first_layer_error
from kvtransfer.core.transfer import transfer
from kvtransfer.runner.eval_stage import gated_label
from kvtransfer.runner.pipeline import Run, execute
from test_runner import _tiny_cfg, tiny_pair_dirs  # noqa: F401 (the module fixture)
from tolerance import assert_close

COMMON = ("stage=[calibrate,fit,eval]", "eval.limit=6", "eval.tasks=[tiny_cloze]", "eval.ppl.prefixes=[0,16]",
          "eval.ppl.continuation=8", "eval.ppl.windows=5", "eval.coqa.enabled=false", "eval.fidelity.enabled=false",
          "eval.bootstrap=50", "eval.controls=[]", "eval.modes=[target,transfer,no_context]")


def test_repair_mode_names():
    assert repair_modes({"recompute_fraction": [0, 0.15, 1]}) == ["recompute_0", "recompute_0.15", "recompute_1"]
    assert repair_modes({"recompute_fraction": [0.3], "recompute_select": ["deviation", "random"],
                         "gate": {"enabled": True}}) == ["recompute_0.3", "recompute_random_0.3", "gated"]
    assert parse_repair_mode(repair_mode(0.05, "recent")) == (0.05, "recent")
    assert parse_repair_mode("recompute_0.15") == (0.15, "deviation")
    with pytest.raises(ValueError, match=r"not in \[0, 1\]"):
        repair_modes({"recompute_fraction": [1.5]})
    with pytest.raises(ValueError, match="unknown"):
        repair_modes({"recompute_fraction": [0.1], "recompute_select": ["worst"]})


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """One cache_dir for the runs below: the calibration, the map and the baseline modes are computed once."""
    return tmp_path_factory.mktemp("gate_runs")


def test_recompute_fractions_write_one_row_each_r0_is_transfer_r1_is_target(tiny_pair_dirs, shared, tmp_path):  # noqa: F811
    cfg = _tiny_cfg(tiny_pair_dirs, shared, *COMMON, "eval.recompute_fraction=[0,0.15,1]")
    summary = execute(cfg, tmp_path / "eval")
    ppl = {r["prefix"]: r for r in summary["ppl"]}[16]
    for mode in ("recompute_0", "recompute_0.15", "recompute_1"):
        assert ppl[mode] > 0 and f"{mode}_gap_closed" in ppl and ppl[f"{mode}_gap_closed_se"] is not None
        assert 0 <= summary["tasks"]["tiny_cloze"][mode] <= 1
    nll = json.loads((tmp_path / "eval" / summary["scores_file"]).read_text())["ppl_sets"]["wikitext2"]["window_nll"]
    assert nll["16"]["recompute_0"] == nll["16"]["transfer"]  # r = 0 is the map: the same kernels on the same shapes
    assert summary["tasks"]["tiny_cloze"]["recompute_0"] == summary["tasks"]["tiny_cloze"]["transfer"]
    target = Run(cfg, tmp_path / "x").model("target")[0]
    # r = 1: the target's own prefix cache (recomputed row by row) then the continuation, vs its one pass
    assert_close(nll["16"]["recompute_1"], nll["16"]["target"], factor=2 * (30 + 96), dtype=__import__("torch").float32,
                 magnitude=max(nll["16"]["target"]) + 1,
                 reason="a mean NLL from float32 logits: two float32 forwards over 25 positions of a 3-layer width-48 "
                        "model (forward_factor ~ 30 per position-chain x 2 paths) + log-softmax over 96 ids")
    # every prefix token but the native sink recomputed: one re-prefill less the sink's token
    sink = Run(cfg, tmp_path / "x").native_sink()
    from kvtransfer.core.recompute import recompute_cost

    want = recompute_cost(target.config, 16, list(range(sink, 16)), "deviation", sink)["fraction"]
    assert_close(ppl["recompute_1_cost"], want, dtype=__import__("torch").float64, factor=8,
                 reason="the mean over windows of one float64 FLOP ratio (all windows hold 16 prefix tokens)")
    assert (want == 1.0) == (sink == 0)
    assert ppl["recompute_0_cost"] == 0.0
    assert 0 < ppl["recompute_0.15_cost"] < ppl["recompute_1_cost"]   # 15 % of the tokens cost less than all of them
    gate = summary["gate"]["recompute_0.15"]["ppl.wikitext2"]["16"]
    assert gate["recompute"] == gate["requests"] == 5 and gate["map"] == gate["full"] == 0
    assert_close(gate["recompute_rate"], 0.15, factor=10, reason="a float64 mean of 5 equal terms")
    assert summary["tasks"]["tiny_cloze"]["recompute_1_gate"]["requests"] > 0


def test_gated_rows_record_the_gates_actions(tiny_pair_dirs, shared, tmp_path):  # noqa: F811
    cfg = _tiny_cfg(tiny_pair_dirs, shared, *COMMON, "eval.gate.enabled=true", "eval.gate.tail=4",
                    "eval.gate.recompute_rate=0.4", "eval.gate.full_rate=0.2")
    summary = execute(cfg, tmp_path / "eval")
    run = Run(cfg, tmp_path / "x")
    artifact = load_gate(run.mapper_dir() / f"gate_{run.key('gate')}.json")
    t = artifact["thresholds"]
    assert t["rates"] == {"recompute": 0.4, "full": 0.2} and artifact["tail"] == 4
    assert artifact["sequences"] == run.split()[1][:32]  # held-out calibration text, never evaluation items
    calib = [decide(s, t).action for s in artifact["scores"]]
    assert calib.count("full") >= 1 and calib.count("map") >= 1
    ppl = {r["prefix"]: r for r in summary["ppl"]}[16]
    assert sum(ppl["gated_actions"].values()) == 5 and ppl["gated"] > 0 and "gated_gap_closed" in ppl
    counts = summary["gate"]["gated"]["ppl.wikitext2"]["16"]
    want = (counts["recompute"] * t["fraction"] + counts["full"]) / counts["requests"]
    assert_close(counts["recompute_rate"], want, factor=20, reason="a float64 mean of 5 terms, two ways")
    row = summary["tasks"]["tiny_cloze"]
    assert 0 <= row["gated"] <= 1 and row["gated_gate"]["requests"] > 0
    assert sum(row["gated_gate"][a] for a in ("map", "recompute", "full")) == row["gated_gate"]["requests"]
    assert "gated_minus_no_context_se" in row
    # the gated files carry the gate's key: other rates are other files, the transfer's stay shared
    other = Run(_tiny_cfg(tiny_pair_dirs, shared, *COMMON, "eval.gate.enabled=true", "eval.gate.full_rate=0.3"), "y")
    assert other.key("gate") != run.key("gate") and other.key("eval_ppl_mapped") == run.key("eval_ppl_mapped")
    # per item (kvtransfer.eval.items): every mode holds the same doc ids, in per_item_scores' order, with its
    # correctness and gold margin; the gated items carry their own prefix's gate event
    scores = json.loads((tmp_path / "eval" / "scores.json").read_text())
    items = scores["task_items"]["tiny_cloze"]
    assert set(items) == {"target", "transfer", "no_context", "gated"}
    for mode, recs in items.items():
        assert [r["score"] for r in recs] == scores["tasks"]["tiny_cloze"][mode]
        assert [(r["task"], r["doc_id"]) for r in recs] == [(r["task"], r["doc_id"]) for r in items["target"]]
        assert all((r["margin"] > 0) == (r["score"] == 1) for r in recs)
    gates = [r["gate"] for r in items["gated"]]
    assert all(g is not None and g["score"] is not None for g in gates)
    assert all(decide(g["score"], t).action == g["action"] for g in gates)
    assert all(r["gate"] is None for r in items["transfer"])
    acts = [g["action"] for g in gates]
    assert sum(acts.count(a) for a in ("map", "recompute", "full")) == row["gated_gate"]["requests"]
    # the per-request signals (eval.gate.signals, all by default) beside the score, per item and per window
    assert artifact["score"] == "tail_kv" and summary["gate_artifact"]["score"] == "tail_kv"
    assert all(list(g["signals"]) == [*SIGNALS, *ENTROPIES] and g["signals"]["tail_kv"] == g["score"] for g in gates)
    assert all(set(g["signal_costs"]) == set(SIGNALS) for g in gates)
    windows = scores["ppl_sets"]["wikitext2"]["events"]["gated"]["16"]
    assert len(windows) == 5 and all(e["signals"]["tail_kv"] == e["score"] and "first_layer" in e["signal_costs"]
                                     for e in windows)
    # the gated files' names carry the signals list: files cached without signals are not read as ones with them
    none = Run(_tiny_cfg(tiny_pair_dirs, shared, *COMMON, "eval.gate.enabled=true", "eval.gate.tail=4",
                         "eval.gate.recompute_rate=0.4", "eval.gate.full_rate=0.2", "eval.gate.signals=[]"), "z")
    assert gated_label(none) == f"gated-{none.key('gate')[:16]}" and gated_label(run).startswith(gated_label(none) + "-")


def test_a_gate_fitted_on_another_signal_decides_by_it(tiny_pair_dirs, shared, tmp_path):  # noqa: F811
    cfg = _tiny_cfg(tiny_pair_dirs, shared, *COMMON, "eval.gate.enabled=true", "eval.gate.tail=4",
                    "eval.gate.recompute_rate=0.4", "eval.gate.full_rate=0.2", "eval.gate.score=first_layer",
                    "eval.gate.signals=[tail_kv]")
    summary = execute(cfg, tmp_path / "eval")
    run = Run(cfg, tmp_path / "x")
    default = Run(_tiny_cfg(tiny_pair_dirs, shared, *COMMON, "eval.gate.enabled=true", "eval.gate.tail=4",
                            "eval.gate.recompute_rate=0.4", "eval.gate.full_rate=0.2"), tmp_path / "y")
    assert run.key("gate") != default.key("gate")  # another score: another artifact
    artifact = load_gate(run.mapper_dir() / f"gate_{run.key('gate')}.json")
    assert artifact["score"] == "first_layer" and summary["gate_artifact"]["score"] == "first_layer"
    t = artifact["thresholds"]
    items = json.loads((tmp_path / "eval" / "scores.json").read_text())["task_items"]["tiny_cloze"]["gated"]
    gates = [r["gate"] for r in items]
    assert all(decide(g["score"], t).action == g["action"] for g in gates)
    # the score is the first-layer signal, not the tail score recorded beside it
    assert all(list(g["signals"]) == ["tail_kv"] for g in gates)
    assert any(g["score"] != g["signals"]["tail_kv"] for g in gates)
    # the thresholds are quantiles of the first-layer signal on the held-out calibration sequences
    assert {k: t[k] for k in ("recompute", "full")} == {k: fit_thresholds(
        artifact["scores"], recompute_rate=0.4, full_rate=0.2, fraction=t["fraction"])[k] for k in ("recompute", "full")}
    mapper = run.mapper()
    rows = run.token_ids()[artifact["sequences"][:1]]
    source, target = run.model("source")[0], run.model("target")[0]
    src, hidden = run.source_prefill(rows, mapper)
    mapped = transfer(src, mapper, source, target, input_ids=rows, native_sink=run.native_sink(mapper),
                      rope_at_inference=run.rope_at_inference, as_layers=True, source_hidden=hidden)
    assert artifact["scores"][0] == float(first_layer_error(target, mapped[0], rows, None, run.native_sink(mapper))[0])
    with pytest.raises(ValueError, match="tail_nll_gain"):
        repair_modes({"gate": {"enabled": True, "score": "first"}})
