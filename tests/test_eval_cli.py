"""`python -m kvtransfer.eval`: lm-eval's CLI with the kvtransfer model and local benchmark data."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvtransfer.eval.__main__ as cli

REPO = Path(__file__).resolve().parents[1]


def test_kv_data_dir_becomes_include_path(monkeypatch, bench_dir):
    """--kv_data_dir is replaced by --include_path to generated YAMLs; other args pass through unchanged."""
    import lm_eval.__main__

    seen = {}
    monkeypatch.setattr(lm_eval.__main__, "cli_evaluate", lambda: seen.setdefault("argv", list(sys.argv)))
    cli.main(["--model", "kvtransfer", "--model_args", "mode=target,target=x", "--tasks", "arc_challenge",
              "--kv_data_dir", str(bench_dir), "--limit", "2"])
    argv = seen["argv"]
    assert argv[1:7] == ["--model", "kvtransfer", "--model_args", "mode=target,target=x", "--tasks", "arc_challenge"]
    inc = Path(argv[argv.index("--include_path") + 1])
    arc = yaml.safe_load((inc / "arc_challenge.yaml").read_text())
    assert arc["dataset_path"] == "json" and arc["dataset_kwargs"]["data_files"]["test"].endswith("arc_challenge.jsonl")
    from lm_eval.api.registry import get_model

    assert get_model("kvtransfer").__name__ == "KVTransferLM"


@pytest.mark.slow
def test_cli_end_to_end(eval_model, eval_tokenizer, eval_mapper, bench_dir, tmp_path):
    """The real CLI run (indexes all built-in lm-eval tasks, ~40 s) on saved tiny models."""
    for name in ("src", "tgt"):
        eval_model.save_pretrained(tmp_path / name)
        eval_tokenizer.save_pretrained(tmp_path / name)
    eval_mapper.save(tmp_path / "mapper")
    args = f"source={tmp_path / 'src'},target={tmp_path / 'tgt'},mapper={tmp_path / 'mapper'},mode=transfer,dtype=float32"
    out = subprocess.run([sys.executable, "-m", "kvtransfer.eval", "--model", "kvtransfer", "--model_args", args,
                          "--tasks", "winogrande", "--limit", "3", "--batch_size", "2", "--kv_data_dir", str(bench_dir),
                          "--output_path", str(tmp_path / "out")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(next((tmp_path / "out").rglob("results*.json")).read_text())
    assert result["config"]["kvtransfer_mode"] == "transfer" and "acc,none" in result["results"]["winogrande"]
