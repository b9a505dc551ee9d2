"""Offline benchmark tasks: the built-in lm-eval tasks reading the local JSONL samples."""
from __future__ import annotations

import shutil

import lm_eval
import pytest
import yaml
from lm_eval.api.model import LM

from kvtransfer.eval.tasks import MMLU_SUBJECTS, write_task_yamls


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
    """acc_norm on ARC-C/HellaSwag, acc on WinoGrande/MMLU; MMLU 5-shot from dev; GSM8K 8-shot from train."""
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
