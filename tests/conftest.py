"""Shared fixtures for the evaluation tests: a tiny offline tokenizer trained on the benchmark text,
tiny models with that vocabulary, and a self-calibrated (near-identity) mapper."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from skip_guard import pytest_addoption, pytest_sessionfinish, pytest_terminal_summary  # noqa: F401 (hooks)

pytest_plugins = ("pytester", "headroom_guard")  # pytester: test_repo.py runs the guards on throwaway suites

BENCH = Path(__file__).resolve().parents[1] / "data" / "benchmarks"


@pytest.fixture
def git_repo(tmp_path):
    """A throw-away git repository in tmp_path (user set): returns git(*args), run there, failing on error."""
    import subprocess

    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True)

    git("init", "-q")
    git("config", "user.email", "t@t")
    git("config", "user.name", "t")
    return git


@pytest.fixture(scope="session")
def bench_dir() -> Path:
    """The offline benchmark samples shipped in the repo (data/benchmarks, see its README).

    They are part of the repository, so a missing file is an error, never a reason to skip.
    """
    missing = [f for f in ("arc_challenge.jsonl", "wikitext2.jsonl", "coqa.jsonl") if not (BENCH / f).is_file()]
    if missing:
        raise FileNotFoundError(f"{BENCH} lacks {missing}: the benchmark samples are part of the repository "
                                "(restore data/benchmarks from git)")
    return BENCH


@pytest.fixture(scope="session")
def eval_tokenizer(bench_dir):
    return build_tokenizer(bench_dir)


def build_tokenizer(bench_dir):
    """Byte-level BPE (vocab 320, BOS prepended like Llama) trained on the benchmark text itself."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    def texts():
        for f in sorted(bench_dir.glob("*.jsonl")):
            for line in f.open():
                yield " ".join(str(v) for v in json.loads(line).values())

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(texts(), trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<pad>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   name_or_path="tiny-bpe")


def make_model(tokenizer, family="qwen3", seed=0, name=None, init=0.5, **shape):
    """A tiny float32 model (tests/tiny_models configs) with the tokenizer's vocab and special ids."""
    from tiny_models import _CLASSES, CONFIGS

    config = CONFIGS[family](**shape)
    config.vocab_size = len(tokenizer)
    config.initializer_range = init  # peaky logits: fewer exact ties in argmax / multiple choice
    config.bos_token_id, config.eos_token_id, config.pad_token_id = (tokenizer.bos_token_id, tokenizer.eos_token_id,
                                                                     tokenizer.pad_token_id)
    torch.manual_seed(seed)
    model = _CLASSES[config.model_type](config).float().eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.name_or_path = name or f"tiny-{family}-{seed}"
    return model


def self_mapper(model, tokenizer, bench_dir, k="all", lam=1e-4):
    """Near-identity mapper model -> model, fitted on benchmark text (the calibration recipe)."""
    from kvtransfer import Mapper, collect_moments, fit_ridge, kv_shape, r2_matrix, select_topk

    text = "\n".join(json.loads(line)["page"] for line in (bench_dir / "wikitext2.jsonl").open())
    ids = torch.tensor(tokenizer.encode(text)[: 24 * 128]).view(24, 128)
    d = kv_shape(model).head_dim
    cm = collect_moments(model, model, ids, stride=2, heldout_fraction=0.2)
    r2 = r2_matrix(cm.train, heldout=cm.heldout, head_dim=d)
    fit = fit_ridge(cm.train, select_topk(r2["train"], k), heldout=cm.heldout, head_dim=d, lam=lam)
    return Mapper.from_ridge(fit, model, model)


@pytest.fixture(scope="session")
def eval_model(eval_tokenizer):
    return make_model(eval_tokenizer)


@pytest.fixture(scope="session")
def eval_mapper(eval_model, eval_tokenizer, bench_dir):
    return self_mapper(eval_model, eval_tokenizer, bench_dir)


@pytest.fixture(scope="session")
def local_tasks(bench_dir, tmp_path_factory):
    """lm-eval TaskManager over the local benchmark files (built-in tasks not indexed: fast)."""
    from kvtransfer.eval.tasks import task_manager

    return task_manager(bench_dir, include_defaults=False, out_dir=tmp_path_factory.mktemp("tasks"))


@pytest.fixture(scope="session")
def redis_server():
    """A redis-server for the whole session (tests/redis_server.py): fails, naming the install, when it is missing."""
    from redis_server import RedisServer

    server = RedisServer()
    yield server
    server.stop()
