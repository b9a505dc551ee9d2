"""Issue 10 §5: sweeps past one process on existing engines -- hydra-submitit-launcher presets
(`hydra/launcher=slurm`, `hydra/launcher=submitit_local`) valid against the plugin's own schema, and a
real 2-job multirun through submitit_local on CPU that leaves both runs' summaries and the sweep table."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra_plugins.hydra_submitit_launcher.config import LocalQueueConf, SlurmQueueConf
from omegaconf import OmegaConf

from test_runner import tiny_pair_dirs  # noqa: F401 (the runner tests' tiny pair, a fixture)

ROOT = Path(__file__).resolve().parents[1]
LAUNCHERS = ROOT / "conf" / "hydra" / "launcher"


def _hydra_launcher(name):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=[f"hydra/launcher={name}"], return_hydra_config=True)
    return cfg.hydra.launcher


@pytest.mark.filterwarnings(r"ignore:\s*'hydra/launcher/submitit_local' is validated against ConfigStore schema")
def test_launcher_presets_match_the_plugin_schema():
    for name, schema in (("slurm", SlurmQueueConf), ("submitit_local", LocalQueueConf)):
        raw = yaml.safe_load((LAUNCHERS / f"{name}.yaml").read_text())
        own = {k: v for k, v in raw.items() if k != "defaults"}
        fields = set(OmegaConf.structured(schema))
        assert set(own) <= fields, f"{name}.yaml has keys the plugin does not know: {set(own) - fields}"
        OmegaConf.merge(OmegaConf.structured(schema), own)  # types checked by the plugin's dataclass
        composed = _hydra_launcher(name)
        assert composed._target_ == schema._target_ and set(composed) == fields  # the real plugin, every field
        for key, value in own.items():
            if not (isinstance(value, str) and "${" in value):
                assert composed[key] == value, (name, key)
    slurm = _hydra_launcher("slurm")
    assert slurm.gpus_per_node == 8 and slurm.tasks_per_node == 1  # one job = one node's GPUs
    local = _hydra_launcher("submitit_local")
    assert local.gpus_per_node == 0 and local.nodes == 1 and local.timeout_min >= 60  # CPU, one machine


def test_submitit_local_multirun_writes_both_runs_and_the_sweep_table(tiny_pair_dirs, tmp_path):
    """`python run.py -m hydra/launcher=submitit_local ... mapper.k=1,2`: two jobs as submitit subprocesses,
    each writing its summary.json; the CollectSweep callback then writes sweep.csv/md over both."""
    overrides = ["stage=fit", "calib.n_sequences=24", "calib.seq_len=32", "calib.batch_size=8", "progress=false",
                 "plan.enforce=false", f"pair.source.path={tiny_pair_dirs['small']}",
                 f"pair.target.path={tiny_pair_dirs['large']}", f"cache_dir={tmp_path / 'artifacts'}"]
    # no calibration beforehand: both jobs start together and need it; the lock lets one calibrate
    sweep = tmp_path / "sweep"
    cmd = [sys.executable, str(ROOT / "run.py"), "-m", "hydra/launcher=submitit_local",
           "hydra.launcher.cpus_per_task=1", "hydra.launcher.timeout_min=10", f"hydra.sweep.dir={sweep}",
           # paths would nest the job directories (override_dirname keeps their slashes)
           "hydra.job.config.override_dirname.exclude_keys=[pair.source.path,pair.target.path,cache_dir]",
           *overrides, "mapper.k=1,2"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "disabled"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    summaries = {json.loads(p.read_text())["mapper"]["k"]: p for p in sorted(sweep.glob("*/summary.json"))}
    assert set(summaries) == {1, 2}, sorted(sweep.iterdir())
    for k, path in summaries.items():
        s = json.loads(path.read_text())
        assert path.parent.name.startswith(f"{k - 1}_") and f",mapper.k={k}," in path.parent.name
        assert s["source"] == tiny_pair_dirs["small"] and s["target"] == tiny_pair_dirs["large"]
        assert s["mapper"]["kind"] == "ridge" and all(len(row) == k for row in s["mapper"]["selected_layers"])
        assert len(s["mapper"]["selected_layers"]) == 3 and s["mapper"]["path"].startswith(str(tmp_path / "artifacts"))
        assert (path.parent / "config.json").exists() and (path.parent / "plan.json").exists()
    assert len(list((tmp_path / "artifacts" / "moments").iterdir())) == 1  # both jobs read the one calibration
    # both jobs really ran through submitit, each in its own process with the threads asked for
    logs = sorted((sweep / ".submitit").glob("*/*_log.out"))
    assert len(logs) == 2 and len(list((sweep / ".submitit").glob("*/*_result.pkl"))) == 2
    for log in logs:
        assert "[kvtransfer] torch threads: 1 (hydra.launcher.cpus_per_task)" in log.read_text()
    # the sweep table the multirun callback writes: one row per job
    table = pd.read_csv(sweep / "sweep.csv").sort_values("k")
    assert list(table["k"]) == [1, 2] and list(table["pair"]) == ["tiny", "tiny"]
    assert sorted(table["run"]) == sorted(p.parent.name for p in summaries.values())
    for k, path in summaries.items():
        r2 = json.loads(path.read_text())["r2"]
        row = table[table["k"] == k].iloc[0]
        assert row["r2_k_heldout"] == r2["k"]["heldout"] and row["r2_v_train"] == r2["v"]["train"]
    assert table["r2_k_train"].iloc[1] >= table["r2_k_train"].iloc[0]  # more source layers fit train no worse
    assert "mapper.k=2" in (sweep / "sweep.md").read_text()
    assert "sweep tables:" in proc.stdout + proc.stderr
