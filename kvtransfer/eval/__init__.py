"""Evaluation on top of the core: the lm-eval model `kvtransfer`, offline benchmark tasks, the
prefix-conditioned perplexity and CoQA multi-turn protocols, and retention statistics.

Importing this package registers the `kvtransfer` model with lm-eval.
"""
from .adapter import MODES, KVTransferLM
from .decode import greedy_decode
from .tasks import MMLU_SUBJECTS, PAPER_TASKS, task_manager, write_task_yamls

__all__ = ["KVTransferLM", "MODES", "greedy_decode", "task_manager", "write_task_yamls", "PAPER_TASKS",
           "MMLU_SUBJECTS"]
