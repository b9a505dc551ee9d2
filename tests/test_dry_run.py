"""The dry run (`python run.py pair=P dry_run=true`) against an offline hub, the preflight, the stand-ins,
and the hub data paths of the evaluation (issue 19).

The offline hub (tests/offline_hub.py) holds the run's datasets under their real ids, built from the
repository's samples; runs read it with HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1, exactly as `datasets`
and `transformers` read a user's cache. The dry-run tests type the command a GPU user types -- a pair,
`dry_run=true`, no data paths -- in a subprocess whose HF_HOME is that hub.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from offline_hub import BENCH, build_offline_hub, fake_model_config, hub_contents, offline_env, use_offline_hub

ROOT = Path(__file__).resolve().parents[1]
# one pair of each family first, so a partial run of the slow test still covers every architecture
PAPER_PAIRS = ("ministral3_3b_8b", "llama31_8b_70b", "qwen3_14b_32b", "qwen3_8b_32b", "ministral3_3b_14b",
               "ministral3_8b_14b")


@pytest.fixture(scope="session")
def offline_hub(tmp_path_factory) -> Path:
    """An HF_HOME holding every dataset the default configs name (see tests/offline_hub.py)."""
    home = tmp_path_factory.mktemp("hf_home")
    build_offline_hub(home)
    return home


def dry_run(home: Path, cwd: Path, *overrides: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """`python run.py <overrides>` in `cwd`, offline against `home`, output captured."""
    # one thread: on a shared, loaded CI machine OpenMP's spin-waits cost a tiny model 10x its compute
    env = {**os.environ, **offline_env(home), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(ROOT / "run.py"), *overrides, "progress=false"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_dir(cwd: Path, pair: str) -> Path:
    (out,) = list((cwd / "runs" / pair).iterdir())
    return out


def check_run(out: Path, pair: str, tasks: list[str]) -> dict:
    """Every stage's outputs of a dry run in `out`; returns its summary."""
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    record = json.loads((out / "dry_run.json").read_text())
    plan = json.loads((out / "plan.json").read_text())
    assert summary["pair"] == pair and summary["stages"] == ["calibrate", "fit", "eval", "bench", "report"]
    # the data came from the hub ids, with no path anywhere
    assert config["eval"]["data_dir"] is None and config["calib"]["files"] == []
    assert summary["calibration"]["data"] == "HuggingFaceFW/fineweb-edu/sample-10BT"
    # the plan is the REAL run's (real widths), not the stand-ins'
    assert plan["protocol"]["dx"] > 10_000 and plan["protocol"]["n_sequences"] == 500
    assert summary["mapper"]["k"] >= 1 and summary["r2"]["k"]["train"] == summary["r2"]["k"]["train"]
    assert sorted(summary["tasks"]) == sorted(tasks)
    for row in summary["tasks"].values():
        assert row["n"] >= 1 and row["target"] is not None and row["transfer"] is not None
    assert {r["prefix"] for r in summary["ppl"]} == {0, 4, 16, 64}
    assert {r["protocol"] for r in summary["drift"]} == {"every_turn", "once"}
    assert summary["fidelity"]["sequences"] >= 1
    assert summary["speed"] and all("mapper_ms" in r for r in summary["speed"])
    assert summary["outputs"] and (out / "summary.json").is_file()
    assert record["standins"] and all(Path(p, "STANDIN.json").is_file() for p in record["standins"].values())
    assert any("multi-GPU" in line for line in record["cannot_show"])
    return summary


def test_default_dry_run_reads_the_hub_ids(offline_hub, tmp_path):
    """The command a user types before booking a node -- a pair and dry_run=true, no data paths -- runs every
    stage on stand-ins with the data read from the hub ids (here: the offline cache); sizes are the only
    overrides (this machine has 2 cores)."""
    tasks = ["arc_challenge", "hellaswag", "winogrande"]  # gsm8k_cot (256 greedy tokens per mode) and MMLU: slow test
    started = time.perf_counter()
    proc = dry_run(offline_hub, tmp_path, "pair=qwen3_0.6b_1.7b", "dry_run=true", "dry.eval_limit=1",
                   f"eval.tasks=[{','.join(tasks)}]", "report.rotated_heatmap=false")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    summary = check_run(run_dir(tmp_path, "qwen3_0.6b_1.7b"), "qwen3_0.6b_1.7b", tasks)
    assert summary["source"] == "Qwen/Qwen3-0.6B"  # loaded by hub id
    assert "What a dry run cannot show" in proc.stdout and "stand-in" in proc.stdout
    assert "resource plan of the REAL run" in proc.stdout
    print(f"dry run: {time.perf_counter() - started:.0f} s")


@pytest.mark.slow
@pytest.mark.parametrize(("pair", "direction"), [(p, d) for d in ("forward", "reverse") for p in PAPER_PAIRS])
def test_dry_run_every_paper_pair(offline_hub, tmp_path, pair, direction):
    """`python run.py pair=P dry_run=true` as typed (every task, perplexity, CoQA, bench, report) for the six
    paper pairs, both directions."""
    proc = dry_run(offline_hub, tmp_path, f"pair={pair}", "dry_run=true", f"pair.direction={direction}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    check_run(run_dir(tmp_path, pair), pair, ["arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k_cot"])


def test_offline_hub_serves_every_split_the_readers_take(offline_hub, monkeypatch):
    """Every (id, config) of the fixture loads by hub id offline with the splits the stock tasks read, and the
    placeholders are the only rows not from the samples (each listed in the manifest)."""
    import datasets

    use_offline_hub(monkeypatch, offline_hub)
    manifest = json.loads((offline_hub / "manifest.json").read_text())
    for (repo, config), splits in list(hub_contents().items())[:12]:
        loaded = datasets.load_dataset(repo, config)
        assert set(loaded) == set(splits)
        for split, (rows, placeholder) in splits.items():
            assert loaded[split].num_rows == len(rows)
            assert manifest[f"{repo}[{config}]/{split}"]["placeholder"] == placeholder
            if placeholder:
                assert all("placeholder" in json.dumps(r) for r in loaded[split])
    with pytest.raises(ValueError, match="Couldn't find cache"):
        datasets.load_dataset("allenai/ai2_arc", "ARC-Easy")  # a config not written does not resolve


def _cfg(**eval_overrides) -> dict:
    from run_configs import compose_config

    cfg = compose_config("pair=qwen3_0.6b_1.7b", "eval.tasks=[hellaswag]")
    cfg["eval"].update(eval_overrides)
    return cfg


def test_perplexity_and_coqa_read_the_hub_when_data_dir_is_null(offline_hub, monkeypatch):
    """data_dir: null means the hub for perplexity (EleutherAI/wikitext_document_level, wikitext-2-raw-v1, test,
    `page`) and CoQA (EleutherAI/coqa, validation), not ./wikitext2.jsonl; a wrong field is refused by name."""
    from kvtransfer.eval.sources import coqa_docs, ppl_pages

    use_offline_hub(monkeypatch, offline_hub)
    monkeypatch.chdir(offline_hub)  # no wikitext2.jsonl / coqa.jsonl here
    ecfg = _cfg()["eval"]
    assert ecfg["data_dir"] is None
    pages = [json.loads(line)["page"] for line in (BENCH / "wikitext2.jsonl").open()]
    assert ppl_pages(ecfg) == pages
    docs = coqa_docs(dict(ecfg, coqa=dict(ecfg["coqa"], conversations=2)))
    assert [d["story"] for d in docs] == [json.loads(line)["story"] for line in (BENCH / "coqa.jsonl").open()][:2]
    with pytest.raises(KeyError, match="eval.ppl.field"):
        ppl_pages(dict(ecfg, ppl=dict(ecfg["ppl"], field="text")))


def test_preflight_fails_in_seconds_naming_the_fix(offline_hub, monkeypatch):
    """A dataset id, split or field that does not resolve fails the preflight before anything loads, with the
    key that fixes it; every problem is listed at once."""
    from kvtransfer.runner.preflight import PreflightError, preflight

    use_offline_hub(monkeypatch, offline_hub)
    cfg = _cfg()
    started = time.perf_counter()
    report = preflight(cfg, ["calibrate", "eval"], log=lambda *_: None)
    assert {s["what"] for s in report["sources"]} == {"calibration", "eval task hellaswag", "perplexity set wikitext2",
                                                      "perplexity set python_stdlib", "CoQA"}
    cfg["calib"]["dataset"] = "HuggingFaceFW/fineweb-edu-typo"
    cfg["eval"]["ppl"]["split"] = "validation"
    cfg["eval"]["coqa"]["dataset"] = "EleutherAI/coqa-missing"
    with pytest.raises(PreflightError) as err:
        preflight(cfg, ["calibrate", "eval"], log=lambda *_: None)
    msg = str(err.value)
    assert "calib.dataset" in msg and "eval.ppl.dataset / split / field" in msg and "eval.coqa.dataset" in msg
    assert time.perf_counter() - started < 60
    # a run asks only for the data of what it runs
    assert preflight(_cfg(), ["bench"], log=lambda *_: None)["sources"][0]["what"] == "calibration"


def test_local_data_dir_asks_only_for_the_tasks_run(tmp_path, monkeypatch):
    """eval.tasks=[hellaswag] with a local data_dir needs hellaswag.jsonl only (not mmlu.jsonl nor GSM8K's), in the
    preflight and in the task YAMLs the eval stage writes; a task whose file is missing fails the preflight."""
    from kvtransfer.eval.tasks import task_manager
    from kvtransfer.runner.preflight import PreflightError, preflight

    data = tmp_path / "data"
    data.mkdir()
    (data / "hellaswag.jsonl").write_text((BENCH / "hellaswag.jsonl").read_text())
    cfg = _cfg(data_dir=str(data), ppl=dict(_cfg()["eval"]["ppl"], enabled=False),
               coqa=dict(_cfg()["eval"]["coqa"], enabled=False))
    cfg["calib"].update(dataset=None, files=[str(ROOT / "data" / "tiny" / "calib.jsonl")])
    preflight(cfg, ["calibrate", "eval"], log=lambda *_: None)
    task_manager(data, include_defaults=False, out_dir=tmp_path / "tasks", tasks=["hellaswag"])
    assert sorted(p.name for p in (tmp_path / "tasks").iterdir()) == ["hellaswag.yaml"]
    cfg["eval"]["tasks"] = ["hellaswag", "mmlu"]
    with pytest.raises(PreflightError, match="mmlu.jsonl does not exist"):
        preflight(cfg, ["eval"], log=lambda *_: None)


def test_preflight_compares_the_model_table_with_config_json(offline_hub, monkeypatch):
    """Where a model's real config.json can be had (here: the offline cache), the preflight compares it with the
    model table the plan sizes the run with, and stops on a difference."""
    from transformers import AutoConfig

    from kvtransfer.runner.preflight import PreflightError, model_config_differences, preflight
    from kvtransfer.resources.model_configs import MODEL_CONFIGS

    use_offline_hub(monkeypatch, offline_hub)
    cfg = _cfg()
    fields = {k: v for k, v in MODEL_CONFIGS["Qwen/Qwen3-0.6B"].items() if k != "load_extra_params"}
    real = AutoConfig.for_model(fields.pop("model_type"), **fields).to_dict()
    fake_model_config(offline_hub, "Qwen/Qwen3-0.6B", real)
    diffs, notes = model_config_differences(cfg)
    assert diffs == [] and "Qwen/Qwen3-0.6B: table agrees with config.json" in notes
    assert any("Qwen/Qwen3-1.7B" in n and "not compared" in n for n in notes)
    fake_model_config(offline_hub, "Qwen/Qwen3-0.6B", dict(real, num_key_value_heads=4), rev="e" * 40)
    with pytest.raises(PreflightError, match="num_key_value_heads table 8 != config.json 4"):
        preflight(cfg, ["bench"], log=lambda *_: None)
    fake_model_config(offline_hub, "Qwen/Qwen3-0.6B", real, rev="d" * 40)  # leave the cache agreeing


@pytest.mark.parametrize("hub_id", ["Qwen/Qwen3-14B", "meta-llama/Llama-3.1-70B",
                                    "mistralai/Ministral-3-14B-Reasoning-2512", "Qwen/Qwen2.5-Coder-0.5B-Instruct"])
def test_standin_keeps_the_real_layout(hub_id):
    """A stand-in is the real config class with the real layers, heads, KV heads, RoPE, eps, tie and vocab; only
    hidden/intermediate/head_dim shrink. Its tokenizer has the real vocab size and special ids."""
    from kvtransfer.dryrun import standin_config, standin_tokenizer
    from kvtransfer.core.models import kv_shape, text_config
    from kvtransfer.resources.model_configs import MODEL_CONFIGS, TOKENIZERS

    row, tok_row = MODEL_CONFIGS[hub_id], TOKENIZERS[hub_id]
    config = standin_config(hub_id, hidden_size=64, intermediate_size=128, head_dim=8)
    text = text_config(config)
    assert config.model_type == ("mistral3" if hub_id.startswith("mistralai/") else row["model_type"])
    assert text.model_type == row["model_type"]
    for key in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "vocab_size", "rms_norm_eps",
                "rope_parameters", "tie_word_embeddings", "max_position_embeddings"):
        if key in row:
            assert getattr(text, key) == row[key], key
    assert kv_shape(config).head_dim == 8 and text.intermediate_size == 128
    tok = standin_tokenizer(hub_id)
    assert len(tok) == row["vocab_size"]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (
        tok_row["bos_token_id"], tok_row["eos_token_id"], tok_row["pad_token_id"])
    ids = tok("Hello world").input_ids
    assert (ids[0] == tok_row["bos_token_id"]) == tok_row["add_bos"]
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    # a real tokenizer's token counts (~4 characters per English token), not a byte-level one's (~1): the stand-ins
    # keep the real layer and head counts, so a prompt 4x too long costs ~16x in attention
    text = " ".join(json.loads(line)["ctx"] for line in list((BENCH / "hellaswag.jsonl").open())[:50])
    assert 3.0 <= len(text) / len(tok(text, add_special_tokens=False).input_ids) <= 6.0
    odd = "Ünïcödé ∑ 漢字 \t tabs\n  and  spaces 12345.678 <|not special|>"
    assert tok.decode(tok(odd, add_special_tokens=False).input_ids) == odd  # byte-level: every string round-trips
    assert max(tok(text + odd, add_special_tokens=False).input_ids) < row["vocab_size"]


def test_a_model_cache_holding_real_snapshots_is_refused(tmp_path):
    """Issue 32: dry.model_cache pointed at a real HF cache wrote stand-in revisions into its refs/main (later real
    runs would load random weights). A cache with any non-stand-in snapshot is refused before anything is written."""
    from kvtransfer.dryrun.standin import check_standin_cache, write_standins

    real = tmp_path / "hub" / "models--Qwen--Qwen3-14B"
    (real / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (real / "snapshots" / ("a" * 40) / "config.json").write_text("{}")
    (real / "refs").mkdir()
    (real / "refs" / "main").write_text("a" * 40)
    with pytest.raises(ValueError, match="non-stand-in"):
        write_standins(["Qwen/Qwen3-14B"], tmp_path / "hub")
    assert (real / "refs" / "main").read_text() == "a" * 40  # untouched
    # a cache of stand-ins only, or an empty one, is accepted
    standin = tmp_path / "dry" / "models--Qwen--Qwen3-14B" / "snapshots" / ("b" * 40)
    standin.mkdir(parents=True)
    (standin / "STANDIN.json").write_text("{}")
    check_standin_cache(tmp_path / "dry")
    check_standin_cache(tmp_path / "empty")


@pytest.mark.slow
@pytest.mark.parametrize("node", ["dgx-h100", "dgx-h200"])
def test_the_headline_command_dry_runs_on_an_8_gpu_preset(offline_hub, tmp_path, node):
    """`python run.py pair=qwen3_14b_32b dry_run=true dry.node=<8-GPU preset>` as typed: the real run's plan on
    that node says "fits, as typed" (its number-neutral knobs applied and printed), and every stage then runs on
    the stand-ins, the two-level moments included."""
    proc = dry_run(offline_hub, tmp_path, "pair=qwen3_14b_32b", "dry_run=true", f"dry.node={node}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "verdict: fits, as typed" in proc.stdout
    out = run_dir(tmp_path, "qwen3_14b_32b")
    plan = json.loads((out / "plan.json").read_text())
    assert plan["verdict"] == "fits, as typed" and plan["node"]["name"].startswith("DGX")
    assert all(e["changes"] is None for e in plan["applied"])
    summary = check_run(out, "qwen3_14b_32b", ["arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k_cot"])
    assert json.loads((out / "config.json").read_text())["calib"]["accumulate"] == "twolevel"
    assert summary["calibration"]["observations"] > 0
    # the plan at the stand-in shapes against what the stand-in run wrote: the moments directory holds the stripped
    # and the rotated calibration (report.rotated_heatmap), each the plan's calibration (+ 15 % for headers)
    check = json.loads((out / "dry_run.json").read_text())["standin_check"]
    assert 0 < check["measured"]["moments_disk_gib"] <= 2 * 1.15 * check["predicted"]["calibration_disk_gib"] + 0.001
