"""The paper's five lm-eval benchmarks, optionally read from local JSONL files (fully offline).

`task_manager(data_dir)` writes small task YAMLs into a directory: each `include`s the built-in
lm-eval task YAML by absolute path (so prompts, `process_docs`, filters and metrics stay stock) and
overrides only the dataset (`dataset_path: json`, `data_files` per split) and the paper's few-shot
counts. lm-eval itself is not modified. Local files (the repo ships them in data/benchmarks, see
its README):

    arc_challenge  test: arc_challenge.jsonl   few-shot (train): arc_challenge_train.jsonl
    hellaswag      validation: hellaswag.jsonl (0-shot; no train split shipped)
    winogrande     validation: winogrande.jsonl (0-shot; no train split shipped)
    mmlu           test: mmlu.jsonl split per subject, few-shot (dev): mmlu_dev.jsonl   5-shot
    gsm8k_cot      test: gsm8k.jsonl   8-shot CoT, lm-eval's fixed exemplars (in its YAML; no
                   train file needed). The paper's protocol and the default GSM8K.
    gsm8k          test: gsm8k.jsonl   8-shot, exemplars drawn from train (gsm8k_train.jsonl)
                   with the run's few-shot seed; selectable as eval.tasks=[..., gsm8k]

MMLU is a group of 57 subject tasks in lm-eval; the local sample has 10 subjects, so with a
data_dir the `mmlu` group is redefined over those 10 (`MMLU_SUBJECTS`), aggregated by size.
"""
from __future__ import annotations

import json
import tempfile
from collections import defaultdict
from pathlib import Path

import yaml

MMLU_SUBJECTS = ("abstract_algebra", "anatomy", "astronomy", "college_biology", "computer_security",
                 "high_school_mathematics", "high_school_us_history", "marketing", "philosophy",
                 "world_religions")

# benchmark -> (lm-eval task or group, metric as reported, chance level, few-shot count)
# GSM8K comes in two variants, named by their lm-eval task so that every table says which ran:
# gsm8k_cot (the paper's 8-shot CoT with fixed exemplars, the default) and gsm8k (8 exemplars
# sampled from train). Both score the strict-match answer ("The answer is N." / "#### N").
# Table headers name the variant (report/tables.TASK_LABELS).
PAPER_TASKS = {
    "arc_challenge": ("arc_challenge", "acc_norm", 0.25, 0),
    "hellaswag": ("hellaswag", "acc_norm", 0.25, 0),
    "winogrande": ("winogrande", "acc", 0.50, 0),
    "mmlu": ("mmlu", "acc", 0.25, 5),
    "gsm8k_cot": ("gsm8k_cot", "exact_match,strict-match", 0.0, 8),
    "gsm8k": ("gsm8k", "exact_match,strict-match", 0.0, 8),
}

# local task -> (built-in yaml relative to lm_eval/tasks, {split: file}, overrides)
_LOCAL = {
    "arc_challenge": ("arc/arc_challenge.yaml", {"test": "arc_challenge.jsonl", "train": "arc_challenge_train.jsonl"},
                      {"dataset_name": None, "validation_split": None}),
    "hellaswag": ("hellaswag/hellaswag.yaml", {"validation": "hellaswag.jsonl"},
                  {"training_split": None}),
    "winogrande": ("winogrande/default.yaml", {"validation": "winogrande.jsonl"},
                   {"dataset_name": None, "training_split": None}),
    "gsm8k": ("gsm8k/gsm8k.yaml", {"test": "gsm8k.jsonl", "train": "gsm8k_train.jsonl"},
              {"dataset_name": None, "num_fewshot": 8}),
    # the 8 CoT exemplars are fixed in lm-eval's YAML (fewshot_config.samples): no train file
    "gsm8k_cot": ("gsm8k/gsm8k-cot.yaml", {"test": "gsm8k.jsonl"}, {"dataset_name": None, "num_fewshot": 8}),
}


def _builtin_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _check_jsonl(path: Path) -> int:
    """Number of records in a JSONL file; raises with the fix if it is missing or empty."""
    if not path.is_file():
        raise FileNotFoundError(f"benchmark file {path} is missing: point data_dir at the benchmark samples "
                                "(the repo's data/benchmarks, see its README) or pass data_dir=None to use "
                                "the Hugging Face datasets")
    n = sum(1 for line in path.open() if line.strip())
    if n == 0:
        raise ValueError(f"benchmark file {path} has no records: regenerate it or remove the task from --tasks")
    return n


def write_task_yamls(out_dir: str | Path, data_dir: str | Path | None = None,
                     tasks: tuple[str, ...] = ("arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k",
                                               "gsm8k_cot")) -> Path:  # = ALL_TASKS
    """Write override YAMLs for `tasks` into `out_dir`; local data when `data_dir` is given.

    Without data_dir only the paper's few-shot counts are set (mmlu 5, gsm8k/gsm8k_cot 8) and the normal HF
    datasets are used. Raises FileNotFoundError / ValueError naming a missing or empty data file.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    builtin = _builtin_dir()
    data_dir = None if data_dir is None else Path(data_dir).resolve()
    for task in tasks:
        if task == "mmlu":
            _write_mmlu(out_dir, builtin, data_dir)
            continue
        if task not in _LOCAL:
            raise KeyError(f"no local override for task {task!r}; known: {sorted(_LOCAL) + ['mmlu']}")
        base, files, overrides = _LOCAL[task]
        cfg = {"include": str(builtin / base), "task": task}
        if data_dir is None:
            cfg.update({k: v for k, v in overrides.items() if k == "num_fewshot"})
        else:
            for f in files.values():
                _check_jsonl(data_dir / f)
            cfg.update(overrides)
            cfg.update({"dataset_path": "json",
                        "dataset_kwargs": {"data_files": {s: str(data_dir / f) for s, f in files.items()}}})
        (out_dir / f"{task}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return out_dir


def _write_mmlu(out_dir: Path, builtin: Path, data_dir: Path | None) -> None:
    """Per-subject task YAMLs (5-shot from dev) plus an `mmlu` group over the available subjects."""
    subjects = MMLU_SUBJECTS
    split_dir = out_dir / "mmlu_data"
    if data_dir is not None:
        by_split = {}
        for split, fname in (("test", "mmlu.jsonl"), ("dev", "mmlu_dev.jsonl")):
            _check_jsonl(data_dir / fname)
            rows = defaultdict(list)
            for line in (data_dir / fname).open():
                if line.strip():
                    rec = json.loads(line)
                    rows[rec["subject"]].append(line.strip())
            by_split[split] = rows
        subjects = tuple(s for s in MMLU_SUBJECTS if by_split["test"].get(s))
        if not subjects:
            raise ValueError(f"{data_dir / 'mmlu.jsonl'} holds none of the MMLU subjects {MMLU_SUBJECTS}")
        split_dir.mkdir(exist_ok=True)
        for split, rows in by_split.items():
            for subject in subjects:
                (split_dir / f"{subject}_{split}.jsonl").write_text("\n".join(rows[subject]) + "\n")
    for subject in subjects:
        cfg = {"include": str(builtin / "mmlu" / "default" / f"mmlu_{subject}.yaml"), "task": f"mmlu_{subject}",
               "num_fewshot": 5}
        if data_dir is not None:
            cfg.update({"dataset_path": "json", "dataset_name": None, "dataset_kwargs": {"data_files": {
                split: str(split_dir / f"{subject}_{split}.jsonl") for split in ("test", "dev")}}})
        (out_dir / f"mmlu_{subject}.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    if data_dir is not None:
        group = {"group": "mmlu", "task": [f"mmlu_{s}" for s in subjects],
                 "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
                 "metadata": {"version": 2, "note": f"local sample: {len(subjects)} of 57 subjects"}}
        (out_dir / "_mmlu_local.yaml").write_text(yaml.safe_dump(group, sort_keys=False))


ALL_TASKS = ("arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k", "gsm8k_cot")


def task_manager(data_dir: str | Path | None = None, *, include_defaults: bool = True,
                 out_dir: str | Path | None = None, tasks: tuple[str, ...] | None = None):
    """An lm-eval `TaskManager` whose paper tasks read `data_dir`'s JSONL files (None: HF datasets).

    tasks: the paper tasks to write overrides for (default: all); a run passes the ones it evaluates, so it
    needs only their files (eval.tasks=[hellaswag] reads hellaswag.jsonl, never mmlu.jsonl).

    include_defaults=False indexes only the override tasks (fast: indexing all built-in YAMLs takes
    ~20 s). The YAMLs go to `out_dir` (default: a fresh temp dir, kept for the process lifetime).
    """
    from lm_eval.tasks import TaskManager

    out_dir = Path(out_dir) if out_dir is not None else Path(tempfile.mkdtemp(prefix="kvtransfer_tasks_"))
    write_task_yamls(out_dir, data_dir, tasks=ALL_TASKS if tasks is None else tuple(tasks))
    return TaskManager(include_path=str(out_dir), include_defaults=include_defaults)
