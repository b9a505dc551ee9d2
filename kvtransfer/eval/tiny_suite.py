"""The tiny suite (data/tiny): lm-eval tasks over the tiny family's held-out text.

    tiny_cloze       HellaSwag schema and prompt (the built-in hellaswag YAML, local file), acc_norm
    tiny_completion  generate the next words of a held-out passage (greedy, stops at newline);
                     exact match and token F1 of the prediction cut to the target's word count
Multi-turn (CoQA schema, data/tiny/multiturn.jsonl) and prefix-conditioned perplexity
(data/tiny/eval.jsonl) run through the same protocols as the real benchmarks.
"""
from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import yaml

from .tasks import _builtin_dir, _check_jsonl

TINY_TASKS = {"tiny_cloze": ("acc_norm", 0.25), "tiny_completion": ("f1", 0.0)}


def _words(text: str) -> list[str]:
    return re.sub(r"[^\w\s]", " ", text.lower()).split()


def process_completion(doc: dict, results: list[str]) -> dict:
    """lm-eval process_results: {"exact_match", "f1"} of the first len(target) words generated."""
    gold = _words(doc["target"])
    pred = _words(results[0])[: len(gold)]
    common = sum((Counter(pred) & Counter(gold)).values())
    f1 = 0.0 if common == 0 else 2 * common / (len(pred) + len(gold))
    return {"exact_match": float(pred == gold), "f1": f1}


def write_tiny_yamls(out_dir: str | Path, data_dir: str | Path, *, max_gen_toks: int = 16) -> Path:
    """Write tiny_cloze / tiny_completion task YAMLs reading `data_dir`'s files into `out_dir`."""
    out_dir, data_dir = Path(out_dir), Path(data_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_jsonl(data_dir / "cloze.jsonl")
    _check_jsonl(data_dir / "completion.jsonl")
    cloze = {"include": str(_builtin_dir() / "hellaswag" / "hellaswag.yaml"), "task": "tiny_cloze",
             "tag": [], "dataset_path": "json", "dataset_name": None, "training_split": None,
             "dataset_kwargs": {"data_files": {"validation": str(data_dir / "cloze.jsonl")}}}
    completion = {
        "task": "tiny_completion", "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data_dir / "completion.jsonl")}}, "test_split": "test",
        "output_type": "generate_until", "doc_to_text": "{{context}}", "doc_to_target": "{{target}}",
        "target_delimiter": " ",
        "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": max_gen_toks},
        "process_results": "!function tiny_utils.process_results",
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True},
                        {"metric": "f1", "aggregation": "mean", "higher_is_better": True}],
        "metadata": {"version": 1}}
    (out_dir / "tiny_cloze.yaml").write_text(yaml.safe_dump(cloze, sort_keys=False))
    text = yaml.safe_dump(completion, sort_keys=False).replace("'!function tiny_utils.process_results'",
                                                                "!function tiny_utils.process_results")
    (out_dir / "tiny_completion.yaml").write_text(text)
    (out_dir / "tiny_utils.py").write_text(
        "from kvtransfer.eval.tiny_suite import process_completion as process_results  # noqa: F401\n")
    return out_dir
