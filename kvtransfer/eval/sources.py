"""Where each part of the evaluation reads its data, and reading it: local files under `eval.data_dir`,
or, with `eval.data_dir: null`, the Hugging Face datasets the stock lm-eval tasks name.

    benchmarks   data_dir: kvtransfer.eval.tasks' JSONL files | null: each lm-eval task's own
                 dataset_path / dataset_name / splits (read from its YAML, the task's own loader reads them)
    perplexity   one set per name in eval.ppl.sets (`PPL_SETS`):
                 wikitext2: data_dir/<eval.ppl.file> | null: eval.ppl.dataset (EleutherAI/wikitext_document_level,
                 wikitext-2-raw-v1, test, field `page`: the documents lm-eval's wikitext task scores)
                 python_stdlib: data_dir/python_stdlib.jsonl if there, else the repository's
                 data/benchmarks/python_stdlib.jsonl (CPython 3.11.7 Lib/*.py, PSF licence; no hub copy)
    CoQA         data_dir/<eval.coqa.file> | null: eval.coqa.dataset (EleutherAI/coqa, validation: the
                 conversations lm-eval's coqa task reads)

`eval_sources(ecfg)` lists them (the preflight resolves each before anything loads); `ppl_pages` and
`coqa_docs` read them for the eval stage.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..config.hub import data_access
from .coqa import load_conversations
from .tasks import _LOCAL, PAPER_TASKS, _builtin_dir


# the repository's own benchmark samples: where a set with no hub dataset is read when data_dir lacks it
BUNDLED_DIR = Path(__file__).resolve().parents[2] / "data" / "benchmarks"
# perplexity sets by name: None = described by the eval.ppl keys (file / dataset / dataset_name / split / field);
# a dict = a set shipped with the repository (file under data_dir or BUNDLED_DIR, its text field)
PPL_SETS: dict[str, dict | None] = {
    "wikitext2": None,
    "python_stdlib": {"file": "python_stdlib.jsonl", "field": "text"},
}


def ppl_set_names(ecfg: dict) -> list[str]:
    """The perplexity sets the eval config names (eval.ppl.sets; default the one set `wikitext2`), checked."""
    names = list((ecfg.get("ppl") or {}).get("sets") or ["wikitext2"])
    unknown = [n for n in names if n not in PPL_SETS]
    if unknown or len(set(names)) != len(names):
        raise ValueError(f"eval.ppl.sets={names}: each name once, from {sorted(PPL_SETS)}")
    return names


def ppl_set_file(ecfg: dict, name: str) -> Path | None:
    """The local JSONL a perplexity set reads: data_dir/<file> (wikitext2: eval.ppl.file), or for a bundled set
    the repository's copy when data_dir lacks it; None for wikitext2 read from the hub (data_dir null)."""
    spec, data_dir = PPL_SETS[name], ecfg.get("data_dir")
    if spec is None:
        return Path(data_dir) / ecfg["ppl"]["file"] if data_dir else None
    if data_dir and (Path(data_dir) / spec["file"]).is_file():
        return Path(data_dir) / spec["file"]
    return BUNDLED_DIR / spec["file"]


def ppl_bundled_files(ecfg: dict) -> list[str]:
    """Files the perplexity sets read from outside data_dir (keyed apart: data_dir's identity misses them)."""
    if not (ecfg.get("ppl") or {}).get("enabled"):
        return []
    data_dir = ecfg.get("data_dir")
    out = []
    for name in ppl_set_names(ecfg):
        path = ppl_set_file(ecfg, name)
        if path is not None and (not data_dir or Path(data_dir).resolve() not in path.resolve().parents):
            out.append(str(path))
    return out


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
        for name in ppl_set_names(ecfg):
            path, spec = ppl_set_file(ecfg, name), PPL_SETS[name]
            if spec is not None:
                out.append(Source(f"perplexity set {name}", files=(str(path),), fields=(spec["field"],),
                                  fix=f"eval.ppl.sets without {name}, or put {spec['file']} under eval.data_dir"))
            elif data_dir:
                out.append(Source("perplexity set wikitext2", files=(str(path),), fields=(pcfg.get("field", "page") + "|text",),
                                  fix="eval.data_dir / eval.ppl.file, or eval.ppl.enabled=false"))
            else:
                out.append(Source("perplexity set wikitext2", dataset=pcfg["dataset"], name=pcfg.get("dataset_name"),
                                  splits=(pcfg["split"],), fields=(pcfg.get("field", "page"),),
                                  fix="eval.ppl.dataset / split / field"))
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


def ppl_pages(ecfg: dict, name: str = "wikitext2") -> list[str]:
    """The documents of perplexity set `name` (`PPL_SETS`): wikitext2 = `page` of each record of
    data_dir/ppl.file, else of the hub dataset; a bundled set = its field of each record of its file."""
    pcfg = ecfg["ppl"]
    spec = PPL_SETS[name]
    key = pcfg.get("field", "page") if spec is None else spec["field"]
    path = ppl_set_file(ecfg, name)
    if path is not None:
        if not path.is_file():
            raise FileNotFoundError(f"perplexity text {path} (set {name}) is missing: set eval.data_dir / eval.ppl.file, "
                                    "eval.data_dir=null (the hub dataset eval.ppl.dataset), drop it from eval.ppl.sets, "
                                    "or eval.ppl.enabled=false")
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

