"""The embedded tiny family and the default pipeline, end to end on a reduced budget."""
import json
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoConfig

from kvtransfer.runner import execute
from test_runner import _compose
from tolerance import assert_close, assert_within, forward_factor

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "models" / "tiny"

FEW = "float64 hand arithmetic, a handful of roundings: x10 their count, since a few ops sit near their worst case"
# the tiny target; the windows are 64-token prefixes + continuations (under 256 positions)
TARGET_FACTOR = forward_factor(AutoConfig.from_pretrained(ROOT / "models/tiny/qwen3-tiny-7m"), 256)
PPL_REASON = ("ppl = exp(mean NLL): its relative error is the NLL's absolute error, a float32 forward's (FORWARD "
              "bound, forward_factor) on log-probs up to ~log(vocab) = 8")



def test_checksums_of_the_committed_family():
    lines = (TINY / "SHA256SUMS").read_text().split("\n")
    assert len([line for line in lines if line.strip()]) >= 3 * 3  # config, weights, tokenizer per model at least
    result = subprocess.run(["sha256sum", "--quiet", "-c", "SHA256SUMS"], cwd=TINY, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _reduced(tmp_path, *extra):
    return _compose("stage=[calibrate,fit,eval,report]", "calib.n_sequences=40", "eval.limit=12",
                    "eval.ppl.prefixes=[0,64]", "eval.ppl.windows=4", "eval.coqa.conversations=2",
                    "eval.coqa.turns=3", "report.rotated_heatmap=false", "report.variance_k=[1,all]",
                    "eval.bootstrap=50", f"cache_dir={tmp_path / 'artifacts'}", "progress=false", *extra)


def test_default_pipeline_reduced_budget_schema_and_invariants(tmp_path):
    summary = execute(_reduced(tmp_path), tmp_path / "run")
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    for key in ("pair", "source", "target", "mapper", "calibration", "r2", "tasks", "ppl", "drift", "environment"):
        assert key in on_disk, key
    assert on_disk["pair"] == "tiny" and on_disk["source"].endswith("qwen3-tiny-1m")
    for kind in ("k", "v"):
        for split in ("train", "heldout"):
            value = on_disk["r2"][kind][split]
            assert isinstance(value, float) and -1 < value <= 1
    for task, row in summary["tasks"].items():
        assert row["native_injected"] == row["target"], task  # the control must be exact
        assert row["n"] == 12
    for row in summary["ppl"]:
        assert_close(row["native_injected"], row["target"], dtype=torch.float32, factor=TARGET_FACTOR,
                     magnitude=row["target"] * 8, reason=PPL_REASON)


def test_self_map_of_the_target_equals_the_target(tmp_path):
    target = str(ROOT / "models/tiny/qwen3-tiny-7m")
    summary = execute(_reduced(tmp_path, f"pair.source.path={target}", "pair.k=1", "mapper.lam=1e-6",
                               "eval.coqa.enabled=false"), tmp_path / "self")
    assert summary["r2"]["k"]["heldout"] > 0.999 and summary["r2"]["v"]["heldout"] > 0.999
    for task, row in summary["tasks"].items():
        assert row["transfer"] == row["target"], task
    for row in summary["ppl"]:
        assert_within(row["transfer"], row["target"], atol=2e-3 * row["target"], reason=(
            "a self-map fitted at lam 1e-6 (held-out R^2 > 0.999) is an approximation, not a rounding: "
            "0.2 % of the perplexity"))


def test_readme_api_example_runs(tmp_path):
    readme = (ROOT / "docs" / "api.md").read_text()
    code = readme.split("# The Python API")[1].split("```python")[1].split("```")[0]
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "HOME": str(tmp_path),
                                                         "PATH": "/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr[-3000:]
