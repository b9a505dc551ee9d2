"""Offline benchmark tasks: the built-in lm-eval tasks reading the local JSONL samples."""
from __future__ import annotations

import shutil

import lm_eval
import pytest
import yaml
from lm_eval.api.model import LM

from kvtransfer.eval.tasks import MMLU_SUBJECTS, PAPER_TASKS, task_manager, write_task_yamls
from kvtransfer.report import tables


@pytest.fixture(scope="module")
def loaded(local_tasks):
    return local_tasks.load(["arc_challenge", "hellaswag", "winogrande", "mmlu", "gsm8k", "gsm8k_cot"])


def test_local_tasks_read_the_samples(loaded):
    """Every paper task loads offline with the sample's item count and lm-eval's own processing."""
    tasks = loaded["tasks"]
    assert len(tasks["arc_challenge"].eval_docs) == 200
    hs = tasks["hellaswag"].eval_docs
    assert len(hs) == 200 and {"query", "choices", "gold"} <= set(hs[0])  # process_docs ran
    assert len(tasks["winogrande"].eval_docs) == 200
    assert len(tasks["gsm8k"].eval_docs) == 200 and len(tasks["gsm8k_cot"].eval_docs) == 200
    assert loaded["group_map"]["mmlu"] == [f"mmlu_{s}" for s in MMLU_SUBJECTS]
    assert all(len(tasks[f"mmlu_{s}"].eval_docs) == 20 for s in MMLU_SUBJECTS)
    assert {d["subject"] for d in tasks["mmlu_anatomy"].eval_docs} == {"anatomy"}


def test_paper_protocol_settings(loaded):
    """acc_norm on ARC-C/HellaSwag, acc on WinoGrande/MMLU; MMLU 5-shot from dev; GSM8K 8-shot (CoT: fixed
    exemplars; plain: from train)."""
    t = loaded["tasks"]
    metrics = lambda name: {m["metric"] for m in t[name].config.metric_list}  # noqa: E731
    assert "acc_norm" in metrics("arc_challenge") and "acc_norm" in metrics("hellaswag")
    assert "acc" in metrics("winogrande") and "acc" in metrics("mmlu_anatomy")
    assert t["mmlu_anatomy"].config.num_fewshot == 5 and len(t["mmlu_anatomy"].fewshot_docs()) == 5
    assert t["gsm8k"].config.num_fewshot == 8 and len(t["gsm8k"].fewshot_docs()) == 20
    assert len(t["arc_challenge"].fewshot_docs()) == 25
    gen = t["gsm8k"].config.generation_kwargs
    assert "Question:" in gen["until"] and gen["do_sample"] is False
    assert [f["name"] for f in t["gsm8k"].config.filter_list] == ["strict-match", "flexible-extract"]
    cot = t["gsm8k_cot"].config
    assert cot.num_fewshot == 8 and cot.fewshot_config.sampler == "first_n" and len(cot.fewshot_config.samples) == 8
    assert "Q:" in cot.generation_kwargs["until"] and cot.generation_kwargs["do_sample"] is False
    assert [f["name"] for f in cot.filter_list] == ["strict-match", "flexible-extract"]


class GoldLM(LM):
    """Answers every gsm8k request with the doc's gold solution (tests answer extraction end to end)."""

    def generate_until(self, requests, disable_tqdm=False):
        return [" " + r.doc["answer"] for r in requests]

    def loglikelihood(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError


def test_gsm8k_answer_extraction(local_tasks):
    """The stock strict-match filter ('#### N') and exact_match score a gold solution as correct."""
    out = lm_eval.simple_evaluate(model=GoldLM(), tasks=["gsm8k"], limit=5, task_manager=local_tasks,
                                  bootstrap_iters=0, num_fewshot=0)
    assert out["results"]["gsm8k"]["exact_match,strict-match"] == 1.0


def test_without_data_dir_uses_hf_datasets(tmp_path):
    """No data_dir: only the few-shot counts are overridden; dataset paths stay the HF ones."""
    write_task_yamls(tmp_path, None)
    gsm = yaml.safe_load((tmp_path / "gsm8k.yaml").read_text())
    assert gsm["num_fewshot"] == 8 and "dataset_path" not in gsm
    cot = yaml.safe_load((tmp_path / "gsm8k_cot.yaml").read_text())
    assert cot["num_fewshot"] == 8 and "dataset_path" not in cot and cot["include"].endswith("gsm8k-cot.yaml")
    mmlu = yaml.safe_load((tmp_path / "mmlu_anatomy.yaml").read_text())
    assert mmlu["num_fewshot"] == 5 and "dataset_path" not in mmlu
    assert not (tmp_path / "_mmlu_local.yaml").exists()  # the stock 57-subject group stays


def test_missing_or_empty_data_file(bench_dir, tmp_path):
    """A missing or empty benchmark file is a clear error naming the file and the fix."""
    data = tmp_path / "data"
    shutil.copytree(bench_dir, data)
    (data / "winogrande.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="winogrande.jsonl is missing"):
        write_task_yamls(tmp_path / "a", data, tasks=("winogrande",))
    (data / "hellaswag.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="hellaswag.jsonl has no records"):
        write_task_yamls(tmp_path / "b", data, tasks=("hellaswag",))
    with pytest.raises(KeyError, match="no local override"):
        write_task_yamls(tmp_path / "c", data, tasks=("piqa",))


def test_empty_task_list_is_refused(local_tasks):
    """Asking for no task fails loudly (lm-eval's own check) instead of returning empty results."""
    with pytest.raises(ValueError, match="No tasks"):
        lm_eval.simple_evaluate(model=GoldLM(), tasks=[], task_manager=local_tasks)


# -- GSM8K protocol: the paper's 8-shot CoT with fixed exemplars is the default ------------------------

FIRST_COT_EXEMPLAR = "Q: There are 15 trees in the grove."  # lm-eval gsm8k-cot.yaml, exemplar 1 of 8


def _paper_eval_configs():
    from test_runner import PAIRS, _compose

    return {pair: _compose(f"pair={pair}")["eval"] for pair in PAIRS if pair != "tiny"}


def _gsm8k_prompts(task, doc, seeds=(0, 1, 2)):
    """The rendered 8-shot prompt of `doc` under several few-shot seeds."""
    out = []
    for seed in seeds:
        task.set_fewshot_seed(seed)
        out.append(task.fewshot_context(doc, num_fewshot=task.config.num_fewshot))
    return out


def test_default_gsm8k_is_8_shot_cot_with_fixed_exemplars(bench_dir, tmp_path):
    """Every paper pair's eval config runs GSM8K as lm-eval's gsm8k_cot: the same 8 CoT exemplars
    whatever the seed, answers scored on 'The answer is N.' (was: gsm8k, random train exemplars)."""
    for pair, ecfg in _paper_eval_configs().items():
        gsm = [t for t in ecfg["tasks"] if "gsm8k" in t]
        assert gsm == ["gsm8k_cot"], (pair, ecfg["tasks"])
    name, metric, _, shots = PAPER_TASKS["gsm8k_cot"]
    assert (name, metric, shots) == ("gsm8k_cot", "exact_match,strict-match", 8)
    task = task_manager(bench_dir, include_defaults=False, out_dir=tmp_path).load([name])["tasks"][name]
    doc = task.eval_docs[0]
    prompts = _gsm8k_prompts(task, doc)
    assert prompts[0] == prompts[1] == prompts[2]  # fixed exemplars: no dependence on the few-shot seed
    prompt = prompts[0]
    assert prompt.startswith(FIRST_COT_EXEMPLAR) and prompt.endswith(f"Q: {doc['question']}\nA:")
    assert prompt.count("\nA: ") == 8 and prompt.count("The answer is") == 8  # 8 worked CoT exemplars


def test_plain_gsm8k_stays_selectable_with_sampled_train_exemplars(loaded):
    """`gsm8k` is still a paper task: 8 exemplars drawn from the train file, which differ by seed."""
    assert PAPER_TASKS["gsm8k"][:2] == ("gsm8k", "exact_match,strict-match")
    task = loaded["tasks"]["gsm8k"]
    doc = task.eval_docs[0]
    prompts = _gsm8k_prompts(task, doc)
    assert len(set(prompts)) > 1 and not any(p.startswith(FIRST_COT_EXEMPLAR) for p in prompts)
    train = {d["question"] for d in task.fewshot_docs()}
    for p in prompts:
        shots = [block.split("\nAnswer:")[0].removeprefix("Question: ") for block in p.split("\n\n")[:-1]
                 if block.startswith("Question: ")]
        assert len(shots) == 8 and set(shots) <= train


def test_gsm8k_cot_runs_offline_without_a_train_file(bench_dir, tmp_path):
    """gsm8k_cot needs only the test file (its exemplars live in lm-eval's YAML); plain gsm8k needs train."""
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(bench_dir / "gsm8k.jsonl", data)
    with pytest.raises(FileNotFoundError, match="gsm8k_train.jsonl is missing"):
        write_task_yamls(tmp_path / "plain", data, tasks=("gsm8k",))
    write_task_yamls(tmp_path / "cot", data, tasks=("gsm8k_cot",))
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(tmp_path / "cot"), include_defaults=False)

    class CotLM(GoldLM):
        """Ends a worked answer the CoT way ('The answer is N.'), or the train way ('#### N')."""
        style = "cot"

        def generate_until(self, requests, disable_tqdm=False):
            golds = [r.doc["answer"].split("####")[-1].strip() for r in requests]
            return [f" So {g} it is. The answer is {g}." if self.style == "cot" else f" So.\n#### {g}" for g in golds]

    kw = dict(tasks=["gsm8k_cot"], limit=4, task_manager=tm, bootstrap_iters=0)
    out = lm_eval.simple_evaluate(model=CotLM(), **kw)
    assert out["results"]["gsm8k_cot"]["exact_match,strict-match"] == 1.0
    assert out["configs"]["gsm8k_cot"]["num_fewshot"] == 8
    CotLM.style = "hashes"
    out = lm_eval.simple_evaluate(model=CotLM(), **kw)
    assert out["results"]["gsm8k_cot"]["exact_match,strict-match"] == 0.0  # strict-match reads the CoT ending only


def test_every_table_header_names_the_gsm8k_variant(tmp_path):
    """Retention, per-task and ablation tables label both GSM8K variants with how exemplars were chosen."""
    gsm_tasks = [t for t in PAPER_TASKS if "gsm8k" in t]
    assert sorted(gsm_tasks) == ["gsm8k", "gsm8k_cot"] and set(tables.TASK_LABELS) == set(gsm_tasks)
    row = {"metric": "exact_match,strict-match", "target": 0.5, "transfer": 0.4, "retention": 0.8,
           "retention_vs_chance": 0.8, "n": 10}
    summary = {"pair": "p", "mapper": {"k": 4}, "ablation": {"name": "full"},
               "tasks": {"gsm8k": dict(row), "gsm8k_cot": dict(row), "arc_challenge": dict(row)}}
    cot, plain = "gsm8k_cot (CoT, fixed exemplars)", "gsm8k (train exemplars, sampled)"
    retention = tables.retention_table([summary])
    ablation = tables.ablation_table([summary])
    for df in (retention, ablation):
        gsm_headers = [c for c in df.columns if "gsm8k" in c]
        assert gsm_headers == [cot, plain] and "arc_challenge" in df.columns
    assert [t for t in tables.task_table(summary)["task"] if "gsm8k" in t] == [cot, plain]
    md = tables.write_table(retention, tmp_path, "retention")[1].read_text()
    assert cot in md.splitlines()[0] and plain in md.splitlines()[0]
