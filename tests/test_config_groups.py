"""A single value typed where the config has a group of keys (`eval.gate=true` for `eval.gate.enabled=true`) is
refused before anything loads, by run.py (runs and dry runs) and the planner, with an error naming the group's keys
(kvtransfer.config.runconfig.check_groups)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtransfer.config.paths import conf_dir
from kvtransfer.config.runconfig import check_groups, group_overrides
from run_configs import ROOT, compose_config


def _check(*overrides: str) -> None:
    """check_groups of the composed overrides against the same group choices without the key overrides."""
    check_groups(compose_config(*overrides), compose_config(*group_overrides(overrides, conf_dir())))


def test_group_overrides_are_the_group_choices():
    typed = ["pair=qwen3_14b_32b", "mapper=mlp", "+experiment=baselines_cpu", "eval.gate=true", "pair.k=2",
             "hydra/launcher=slurm", "out_dir=x", "~eval.limits"]
    assert group_overrides(typed, conf_dir()) == ["pair=qwen3_14b_32b", "mapper=mlp", "+experiment=baselines_cpu"]


@pytest.mark.parametrize("typed,key,spelling", [
    ("eval.gate=true", "eval.gate", "eval.gate.enabled=true"),
    ("wandb=true", "wandb", "wandb.enabled=true"),
    ("eval.fidelity=false", "eval.fidelity", "eval.fidelity.enabled=false"),
    ("pair.target=Qwen/Qwen3-32B", "pair.target", "pair.target.id=Qwen/Qwen3-32B"),
])
def test_a_single_value_for_a_group_names_the_group_and_its_keys(typed, key, spelling):
    with pytest.raises(ValueError) as err:
        _check("pair=qwen3_14b_32b", typed)
    msg = str(err.value)
    assert f"{key} is a group of keys (" in msg and f"e.g. {spelling}" in msg, msg
    if key == "eval.gate":
        assert "(enabled, tail, recompute_rate, full_rate, fraction, select, sequences, score, signals)" in msg


def test_every_offending_key_is_named_and_an_empty_mapping_says_what_it_takes():
    with pytest.raises(ValueError) as err:
        _check("eval.limits=5", "eval.gate=true", "eval.coqa=false")
    msg = str(err.value)
    assert "eval.limits is a mapping (empty by default)" in msg and "e.g. +eval.limits.<name>=5" in msg
    assert "eval.gate.enabled=true" in msg and "eval.coqa.enabled=false" in msg


@pytest.mark.parametrize("overrides", [
    (),
    ("pair=qwen3_14b_32b", "mapper=mlp", "mapper.hidden=64", "eval.gate.enabled=true"),
    ("+eval.limits.mmlu=3", "dry.node={gpus: 2, gpu_gib: 80}", "pair.target.max_memory={0: 87GiB}"),
    ("mapper=trained", "ablation=no_rope_k1"),
])
def test_configs_that_keep_the_structure_pass(overrides):
    _check(*overrides)


def test_the_planner_refuses_before_planning(tmp_path):
    from kvtransfer.plan.cli import main

    with pytest.raises(ValueError, match=r"eval\.gate is a group of keys .* e\.g\. eval\.gate\.enabled=true"):
        main(["pair=qwen3_14b_32b", "eval.gate=true", "--node", "dgx-h100", "--out", str(tmp_path / "plan")])
    assert not (tmp_path / "plan").exists()


@pytest.mark.parametrize("mode", ["run", "dry_run"])
def test_run_py_refuses_before_anything_loads(tmp_path, mode):
    extra = ["dry_run=true"] if mode == "dry_run" else []
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "eval.gate=true", *extra, "progress=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "eval.gate is a group of keys (enabled, " in out and "e.g. eval.gate.enabled=true" in out, out
    assert "AttributeError" not in out
    # nothing planned, loaded or written: Hydra's run directory holds its own logs only
    assert not list(tmp_path.rglob("plan.json")) and not list(tmp_path.rglob("summary.json"))
