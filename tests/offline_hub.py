"""An offline Hugging Face cache holding, under the REAL ids the configs use, the datasets a run reads.

Built at test time from the repository's samples (data/benchmarks, data/tiny), in the layout `datasets`
reads with HF_HUB_OFFLINE=1 / HF_DATASETS_OFFLINE=1: offline, a hub dataset id resolves only from the
datasets Arrow cache, <HF_HOME>/datasets/<org>___<name>/<config>/0.0.0/<hash>/ with `dataset_info.json`
naming the config and one `<name>-<split>.arrow` per split (datasets' packaged `cache` builder reads it;
measured with datasets 5.2). Model ids resolve offline from <HF_HOME>/hub/models--<org>--<name>/ (the
dry run writes its stand-ins to such a cache itself; `fake_model_config` puts a config.json there).

Splits the stock lm-eval tasks read but the samples lack (the training split of ARC validation,
HellaSwag and WinoGrande, which lm-eval loads even at 0-shot; 47 of the 57 MMLU subjects) are filled with
schema-correct PLACEHOLDER rows (a sample row with its text replaced), listed in `manifest.json` with
`placeholder: true` -- never results. A field or split a stock task reads that is not here fails the
test that reads it: nothing is patched around.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "data" / "benchmarks"
TINY = ROOT / "data" / "tiny"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.open() if line.strip()]


def _placeholders(rows: list[dict], text_fields: tuple[str, ...], n: int, tag: str) -> list[dict]:
    """n rows with the schema (and labels) of `rows`, their text fields replaced by a marked placeholder."""
    out = []
    for i in range(n):
        row = copy.deepcopy(rows[i % len(rows)])
        for key in text_fields:
            row[key] = f"[offline-hub placeholder {tag} {i}: not benchmark data] _ ."  # "_": WinoGrande's blank
        out.append(row)
    return out


def write_dataset(home: Path, repo: str, config: str | None, splits: dict[str, list[dict]]) -> Path:
    """One (repo, config) of the datasets Arrow cache under `home`, as `datasets` writes and reads it offline."""
    from datasets import Dataset, DatasetInfo, SplitDict, SplitInfo
    from datasets.arrow_writer import ArrowWriter
    from datasets.naming import camelcase_to_snakecase

    org, name = repo.split("/")
    builder = camelcase_to_snakecase(name)
    directory = home / "datasets" / f"{org}___{builder}" / (config or "default") / "0.0.0" / "0000000000000000"
    directory.mkdir(parents=True, exist_ok=True)
    split_dict, features = SplitDict(dataset_name=builder), None
    for split, rows in splits.items():
        table = Dataset.from_list(rows, features=features)  # every split of one config shares its features
        features = table.features
        with ArrowWriter(path=str(directory / f"{builder}-{split}.arrow"), features=features) as writer:
            writer.write_table(table.data.table)
            n, nbytes = writer.finalize()
        split_dict.add(SplitInfo(name=split, num_examples=n, num_bytes=nbytes, dataset_name=builder))
    DatasetInfo(features=features, config_name=config or "default", dataset_name=builder, builder_name=builder,
                splits=split_dict, version="0.0.0").write_to_directory(str(directory))
    return directory


def _mmlu_subjects() -> list[str]:
    import lm_eval.tasks

    base = Path(lm_eval.tasks.__file__).parent / "mmlu" / "default"
    return sorted(p.stem.removeprefix("mmlu_") for p in base.glob("mmlu_*.yaml"))


def hub_contents() -> dict:
    """{(repo, config): {split: (rows, placeholder?)}} of every dataset the default configs name."""
    arc = _rows(BENCH / "arc_challenge.jsonl")
    hellaswag, winogrande = _rows(BENCH / "hellaswag.jsonl"), _rows(BENCH / "winogrande.jsonl")
    mmlu, mmlu_dev = _rows(BENCH / "mmlu.jsonl"), _rows(BENCH / "mmlu_dev.jsonl")
    calib = _rows(TINY / "calib.jsonl") + _rows(TINY / "heldout.jsonl")
    out = {
        ("HuggingFaceFW/fineweb-edu", "sample-10BT"): {
            "train": ([{"text": r["text"], "id": f"tiny-{i}"} for i, r in enumerate(calib)], False)},
        ("allenai/ai2_arc", "ARC-Challenge"): {
            "train": (_rows(BENCH / "arc_challenge_train.jsonl"), False),
            "validation": (_placeholders(arc, ("question",), 4, "arc"), True), "test": (arc, False)},
        ("Rowan/hellaswag", None): {
            "train": (_placeholders(hellaswag, ("ctx_a", "ctx_b", "ctx"), 4, "hellaswag"), True),
            "validation": (hellaswag, False)},
        ("allenai/winogrande", "winogrande_xl"): {
            "train": (_placeholders(winogrande, ("sentence",), 4, "winogrande"), True),
            "validation": (winogrande, False)},
        ("openai/gsm8k", "main"): {"train": (_rows(BENCH / "gsm8k_train.jsonl"), False),
                                   "test": (_rows(BENCH / "gsm8k.jsonl"), False)},
        ("EleutherAI/wikitext_document_level", "wikitext-2-raw-v1"): {"test": (_rows(BENCH / "wikitext2.jsonl"), False)},
        ("EleutherAI/coqa", None): {"validation": (_rows(BENCH / "coqa.jsonl"), False)},
    }
    for subject in _mmlu_subjects():
        test = [r for r in mmlu if r["subject"] == subject]
        dev = [r for r in mmlu_dev if r["subject"] == subject]
        fill = [dict(r, subject=subject) for r in mmlu[:5]]
        out[("cais/mmlu", subject)] = {
            "test": (test, False) if test else (_placeholders(fill, ("question",), 4, subject), True),
            "dev": (dev, False) if dev else (_placeholders(fill, ("question",), 5, subject), True)}
    return out


def build_offline_hub(home: Path) -> dict:
    """Write every dataset of `hub_contents` under `home` (an HF_HOME); returns the manifest (also written
    to home/manifest.json): {"repo[config]/split": {"rows", "placeholder"}}."""
    manifest = {}
    for (repo, config), splits in hub_contents().items():
        write_dataset(home, repo, config, {split: rows for split, (rows, _) in splits.items()})
        for split, (rows, placeholder) in splits.items():
            manifest[f"{repo}[{config}]/{split}"] = {"rows": len(rows), "placeholder": placeholder}
    (home / "hub").mkdir(parents=True, exist_ok=True)
    (home / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def offline_env(home: Path) -> dict:
    """Environment variables of a process that reads only `home` (no network)."""
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HUB_DISABLE_TELEMETRY": "1"}


def use_offline_hub(monkeypatch, home: Path) -> None:
    """Point this process's huggingface_hub and datasets at `home`, offline (their settings are read at import)."""
    import datasets
    from huggingface_hub import constants

    for key, value in offline_env(home).items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(home / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


def fake_model_config(home: Path, hub_id: str, config: dict, rev: str = "f" * 40) -> Path:
    """A config.json of `hub_id` in the hub cache under `home` (models--<org>--<name>/snapshots/<rev>/, refs/main)."""
    repo = home / "hub" / ("models--" + hub_id.replace("/", "--"))
    (repo / "snapshots" / rev).mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    path = repo / "snapshots" / rev / "config.json"
    path.write_text(json.dumps(config))
    return path
