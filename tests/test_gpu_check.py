"""experiments/gpu_check.py: its bounds and its table on known inputs (default suite), and its --smoke path as CI
runs it (slow: every part on this CPU at tiny sizes, a few minutes on 2 cores; .ci/run runs it)."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check_under_test", ROOT / "experiments" / "gpu_check.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_parts_are_chosen_by_name_and_a_wrong_name_is_refused_naming_the_choices():
    gc = _module()
    assert gc.parse_parts(None) == list(gc.PARTS)
    assert gc.parse_parts("bench, tiny") == ["tiny", "bench"]  # the check's own order
    with pytest.raises(ValueError, match=r"unknown \['gpu'\]; choose from tiny,mlp,trained,dryrun"):
        gc.parse_parts("tiny,gpu")
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--out", "/nonexistent/x",
                           "--parts", "benchh", "--smoke"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "choose from" in proc.stderr


def test_windows_are_held_to_two_forward_roundings_plus_the_maps_perturbation():
    """A baseline window may move by 2 x the per-token rounding; a mapped one also by 2 phi x its committed log-gap to
    the target. Ratios are observed / allowed; the inputs are binary fractions, so every ratio is exact."""
    gc = _module()
    u, phi = 2.0 ** -10, 2.0 ** -4
    ref = {"256": {"target": [2.0, 3.0], "transfer": [2.5, 3.0], "no_context": [4.0, 4.0]}}
    run = {"256": {"target": [2.0 + u, 3.0], "transfer": [2.5 + 2.0 ** -5, 3.0], "no_context": [4.0, 4.0 - 2 * u]},
           "32": {"target": [1.0, 1.0]}}                      # a prefix results/tiny lacks: not compared
    got = gc.compare_windows(run, ref, per_token=u, phi=phi)
    assert set(got) == {"target@256", "transfer@256", "no_context@256"}
    assert got["target@256"]["max_ratio"] == 0.5 and got["no_context@256"]["max_ratio"] == 1.0
    assert got["transfer@256"]["max_ratio"] == 2.0 ** -5 / (2 * u + 2 * phi * 0.5)  # the map's share counts
    with pytest.raises(ValueError, match="not the same draw"):
        gc.compare_windows({"256": {"target": [2.0]}}, ref, per_token=u, phi=0.0)


def test_an_item_may_change_its_answer_only_within_its_margins_bound():
    gc = _module()
    committed = {"target": [1.0, 0.0, 1.0], "transfer": [1.0, 1.0, 0.0]}
    records = {"target": [{"doc_id": 0, "score": 1.0, "margin": 0.5}, {"doc_id": 1, "score": 1.0, "margin": 3e-3},
                          {"doc_id": 2, "score": 0.0, "margin": -0.2}],
               "transfer": [{"doc_id": 0, "score": 1.0, "margin": 0.4}, {"doc_id": 1, "score": 0.0, "margin": -0.01},
                            {"doc_id": 2, "score": 0.0, "margin": -0.1}]}
    got = gc.compare_items(records, committed, per_token=1e-3, phi=0.1)
    # target: doc 1 flipped with margin 3e-3 <= 4e-3 (within), doc 2 flipped with margin 0.2 (beyond)
    assert got["target"] == {"items": 3, "changed": 2, "changed_beyond_bound": 1}
    # transfer: doc 1 flipped at margin 0.01 <= 4e-3 + 2 x 0.1 x |-0.01 - 3e-3| = 6.6e-3? no: beyond
    assert got["transfer"] == {"items": 3, "changed": 1, "changed_beyond_bound": 1}
    loose = gc.compare_items(records, committed, per_token=1e-3, phi=1.0)  # 4e-3 + 2 x 0.013 = 0.03 >= 0.01
    assert loose["transfer"]["changed_beyond_bound"] == 0


def test_the_table_has_one_row_per_part_that_ran():
    gc = _module()
    record = {"machine": {"gpu": "NVIDIA H200", "torch": "2.13.0", "commit": "abcdef123", "clean": True}, "smoke": False,
              "parts": {"bench": {"status": "ok", "seconds": 41.2, "key": {"float32@1024": 3.1}},
                        "tiny": {"status": "failed", "seconds": 200.0, "key": {"window_ratio_max": 2.0}}}}
    lines = gc.table(record).splitlines()
    assert lines[0].startswith("GPU check on NVIDIA H200 (torch 2.13.0, commit abcdef1)")
    assert lines[4] == "| tiny | failed | 200 | window_ratio_max 2.0 |"  # PARTS order, not the record's
    assert lines[5] == "| bench | ok | 41 | float32@1024 3.1 |"


@pytest.mark.slow
def test_smoke_path_runs_every_part_on_this_cpu(tmp_path):
    """`python experiments/gpu_check.py --smoke` as CI runs it: exit 0, the JSON and the table, every part ok."""
    out = tmp_path / "gpu_check"
    proc = subprocess.run([sys.executable, str(ROOT / "experiments" / "gpu_check.py"), "--smoke", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    record = json.loads((out / "gpu_check.json").read_text())
    _gc = _module()
    assert list(record["parts"]) and set(record["parts"]) == set(_gc.PARTS)
    assert {p: r["status"] for p, r in record["parts"].items()} == {p: "ok" for p in _gc.PARTS}
    assert (out / "gpu_check.md").read_text().count("| ok |") == len(_gc.PARTS)
    tiny = record["parts"]["tiny"]["details"]
    assert tiny["windows"] and tiny["items"]["tiny_cloze"]["target"]["items"] == 8
    print(f"gpu_check --smoke: {record['seconds']:.0f} s", {p: r["seconds"] for p, r in record["parts"].items()})


def test_the_dry_run_runs_its_stand_ins_on_dry_device(tmp_path):
    """dry.device (what the GPU check's dryrun part sets): the shrunk config runs there, maps train there; cpu stays
    the default, and a device name that is not one is refused naming the choices."""
    from kvtransfer.dryrun.run import shrink
    from run_configs import compose_config

    assert shrink(compose_config("pair=qwen3_14b_32b"), tmp_path)["device"] == "cpu"
    small = shrink(compose_config("pair=qwen3_14b_32b", "mapper=trained", "dry.device=cuda"), tmp_path)
    assert small["device"] == "cuda" and small["mapper"]["device"] == "cuda"
    with pytest.raises(ValueError, match="dry.device='gpu': use cpu"):
        shrink(compose_config("pair=qwen3_14b_32b", "dry.device=gpu"), tmp_path)
