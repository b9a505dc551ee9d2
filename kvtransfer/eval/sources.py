"""Where each part of the evaluation reads its data, and reading it: local files under `eval.data_dir`,
or, with `eval.data_dir: null`, the Hugging Face datasets the stock lm-eval tasks name.

    benchmarks   data_dir: kvtransfer.eval.tasks' JSONL files | null: each lm-eval task's own
                 dataset_path / dataset_name / splits (read from its YAML, the task's own loader reads them)
    perplexity   data_dir/<eval.ppl.file> | null: eval.ppl.dataset (EleutherAI/wikitext_document_level,
                 wikitext-2-raw-v1, test, field `page`: the documents lm-eval's wikitext task scores)
    CoQA         data_dir/<eval.coqa.file> | null: eval.coqa.dataset (EleutherAI/coqa, validation: the
                 conversations lm-eval's coqa task reads)

`eval_sources(ecfg)` lists them (the preflight resolves each before anything loads); `ppl_pages` and
`coqa_docs` read them for the eval stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..hub import data_access
from .coqa import load_conversations
from .tasks import _LOCAL, PAPER_TASKS, _builtin_dir


@dataclass
class Source:
    """One data source of a run: a hub dataset (`dataset`, `name`, `splits` it must have, `fields` its rows
    must have; "a|b": either) or local `files`. `what` names the part of the run that reads it; `fix` the key to change."""

    what: str
    dataset: str | None = None
    name: str | None = None
    splits: tuple[str, ...] = ()
    fields: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    fix: str = ""
    streaming: bool = False
    extra: dict = field(default_factory=dict)

    def describe(self) -> str:
        """One line: the hub id (name, splits) or the files."""
        if self.dataset:
            return f"{self.dataset}" + (f" [{self.name}]" if self.name else "") + f" splits {list(self.splits)}"
        return ", ".join(self.files)


# fields each stock task's own code reads (doc_to_text / process_docs), so a source lacking one fails up front
TASK_FIELDS = {
    "arc_challenge": ("question", "choices", "answerKey"),
    "hellaswag": ("activity_label", "ctx_a", "ctx_b", "endings", "label"),
    "winogrande": ("sentence", "option1", "option2", "answer"),
    "mmlu": ("question", "choices", "answer", "subject"),
    "gsm8k": ("question", "answer"),
    "gsm8k_cot": ("question", "answer"),
}
COQA_FIELDS = ("story", "questions", "answers")


def _stock_yaml(task: str) -> list[Path]:
    """The built-in lm-eval YAML(s) of a paper task (MMLU: its 57 subject tasks)."""
    builtin = _builtin_dir()
    if task == "mmlu":
        return sorted((builtin / "mmlu" / "default").glob("mmlu_*.yaml"))
    return [builtin / _LOCAL[task][0]]


def stock_task_sources(task: str) -> list[Source]:
    """The hub datasets the stock lm-eval task `task` loads: (dataset_path, dataset_name) with every split its
    YAML names (lm-eval reads the training split of HellaSwag and WinoGrande even at 0-shot)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    out = []
    for path in _stock_yaml(task):
        cfg = load_yaml(path, resolve_func=False, recursive=True)
        splits = tuple(dict.fromkeys(cfg[k] for k in ("training_split", "validation_split", "test_split",
                                                      "fewshot_split") if cfg.get(k)))
        fields = tuple(f for f in TASK_FIELDS[task] if not (task == "mmlu" and f == "subject"))
        out.append(Source(f"eval task {task}" + (f" ({cfg['task']})" if task == "mmlu" else ""),
                          dataset=cfg["dataset_path"], name=cfg.get("dataset_name"), splits=splits, fields=fields,
                          fix=f"eval.tasks (drop {task}) or eval.data_dir"))
    return out


def local_task_sources(task: str, data_dir: str | Path) -> list[Source]:
    """The JSONL files of `task` under `data_dir` (kvtransfer.eval.tasks)."""
    files = {"test": "mmlu.jsonl", "dev": "mmlu_dev.jsonl"} if task == "mmlu" else _LOCAL[task][1]
    return [Source(f"eval task {task}", files=tuple(str(Path(data_dir) / f) for f in files.values()),
                   fields=TASK_FIELDS[task], fix=f"eval.data_dir, or eval.tasks without {task}")]


def eval_sources(ecfg: dict) -> list[Source]:
    """Every data source the eval config reads (tasks, perplexity, CoQA), nothing it does not run."""
    data_dir = ecfg.get("data_dir")
    out = []
    for task in ecfg.get("tasks") or []:
        if task not in PAPER_TASKS:  # the tiny suite (its files are checked when its YAMLs are written)
            continue
        out += local_task_sources(task, data_dir) if data_dir else stock_task_sources(task)
    pcfg, ccfg = ecfg.get("ppl") or {}, ecfg.get("coqa") or {}
    if pcfg.get("enabled"):
        out.append(Source("perplexity", files=(str(Path(data_dir) / pcfg["file"]),), fields=(pcfg.get("field", "page") + "|text",),
                          fix="eval.data_dir / eval.ppl.file, or eval.ppl.enabled=false") if data_dir else
                   Source("perplexity", dataset=pcfg["dataset"], name=pcfg.get("dataset_name"), splits=(pcfg["split"],),
                          fields=(pcfg.get("field", "page"),), fix="eval.ppl.dataset / split / field"))
    if ccfg.get("enabled"):
        out.append(Source("CoQA", files=(str(Path(data_dir) / ccfg["file"]),), fields=COQA_FIELDS,
                          fix="eval.data_dir / eval.coqa.file, or eval.coqa.enabled=false") if data_dir else
                   Source("CoQA", dataset=ccfg["dataset"], name=ccfg.get("dataset_name"), splits=(ccfg["split"],),
                          fields=COQA_FIELDS, fix="eval.coqa.dataset / split"))
    return out


def hf_split(dataset: str, name: str | None, split: str) -> list[dict]:
    """All rows of one split of a hub dataset (online, or the datasets cache offline)."""
    import datasets

    with data_access():
        return list(datasets.load_dataset(dataset, name, split=split))


def _field(rows: list[dict], key: str, where: str, fix: str) -> list:
    if rows and key not in rows[0]:
        raise KeyError(f"{where} has no field {key!r} (fields: {sorted(rows[0])}): set {fix}")
    return [r[key] for r in rows]


def ppl_pages(ecfg: dict) -> list[str]:
    """The perplexity documents: `page` of each record of data_dir/ppl.file, else of the hub dataset."""
    pcfg = ecfg["ppl"]
    key = pcfg.get("field", "page")
    if ecfg.get("data_dir"):
        path = Path(ecfg["data_dir"]) / pcfg["file"]
        if not path.is_file():
            raise FileNotFoundError(f"perplexity text {path} is missing: set eval.data_dir / eval.ppl.file, "
                                    "eval.data_dir=null (the hub dataset eval.ppl.dataset), or eval.ppl.enabled=false")
        rows = [json.loads(line) for line in path.open() if line.strip()]
        return [r.get(key) or r.get("text") or "" for r in rows]
    rows = hf_split(pcfg["dataset"], pcfg.get("dataset_name"), pcfg["split"])
    return _field(rows, key, f"{pcfg['dataset']} [{pcfg.get('dataset_name')}] {pcfg['split']}", "eval.ppl.field")


def coqa_docs(ecfg: dict) -> list[dict]:
    """The first eval.coqa.conversations CoQA records (EleutherAI/coqa layout), from data_dir or the hub."""
    ccfg = ecfg["coqa"]
    if ecfg.get("data_dir"):
        docs = load_conversations(Path(ecfg["data_dir"]) / ccfg["file"])
    else:
        docs = hf_split(ccfg["dataset"], ccfg.get("dataset_name"), ccfg["split"])
        for key in COQA_FIELDS:
            _field(docs[:1], key, f"{ccfg['dataset']} {ccfg['split']}", "eval.coqa.dataset")
        if not docs:
            raise ValueError(f"{ccfg['dataset']} {ccfg['split']} holds no conversations")
    return docs[: ccfg["conversations"]]

