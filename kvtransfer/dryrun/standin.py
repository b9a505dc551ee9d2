"""Stand-in models for a dry run: random weights, the real architecture, widths shrunk.

`standin_config(hub_id)` is the real transformers config class (Qwen3Config, LlamaConfig, Qwen2Config,
or Mistral3Config around a Ministral3Config text stack, as the checkpoint is) filled from the model table
(kvtransfer.resources.model_configs) with the real layer count, attention and KV-head counts, RoPE
type and scaling, norm eps, tie and vocabulary, and only `hidden_size`, `intermediate_size` and
`head_dim` shrunk (at the real KV layout one float64 covariance is ~13 GB). The stand-in tokenizer is a
byte-level BPE trained on the repository's benchmark samples (data/benchmarks, 8,000 tokens: ~3.8
characters per token on MMLU, near a real tokenizer's ~4), padded to the real vocabulary size with the
real special-token ids at their real ids; it is NOT the model's tokenizer (which cannot be fetched
offline). Its token counts matter: the stand-ins keep the real layer and head counts, so attention cost
grows with the square of the prompt length, and a byte-level tokenizer (4x the tokens) made one MMLU
pass of the Qwen3-32B stand-in take 11 minutes instead of about one. `write_standins` saves model + tokenizer into an HF hub cache layout under the REAL id
(models--<org>--<name>/snapshots/<rev>/, refs/main), so the run loads them with the ordinary
`from_pretrained(hub_id)` (kvtransfer.config.hub.standin_models).
"""
from __future__ import annotations

import functools
import hashlib
import json
import shutil
import tempfile
from pathlib import Path

import torch

from ..resources.model_configs import CHECKPOINT_TYPE, MODEL_CONFIGS, TOKENIZERS

STANDIN_NOTE = ("stand-in: random weights of the real architecture with shrunk widths, and a byte-level BPE "
                "tokenizer trained on the repository's benchmark samples, with the real vocabulary size and "
                "special-token ids (not the model's tokenizer)")
BPE_TOKENS = 8_000  # learned tokens of the stand-in tokenizer (the rest of the real vocabulary is never produced)
BPE_CORPUS = Path(__file__).resolve().parents[2] / "data" / "benchmarks"


def _require(hub_id: str) -> None:
    if hub_id not in MODEL_CONFIGS:
        raise KeyError(f"no table row for {hub_id!r}: a dry run builds stand-ins of the models in "
                       f"kvtransfer/resources/model_configs.py ({', '.join(MODEL_CONFIGS)}); add its row")


def standin_config(hub_id: str, *, hidden_size: int = 64, intermediate_size: int = 128, head_dim: int = 8):
    """The stand-in config of `hub_id` (see module doc): a transformers config object, `mistral3` with a
    tiny vision tower for the Ministral 3 checkpoints (their loading path drops it, as for the real ones)."""
    from transformers import AutoConfig

    _require(hub_id)
    fields = {k: v for k, v in MODEL_CONFIGS[hub_id].items() if k != "load_extra_params"}
    tok = TOKENIZERS[hub_id]
    model_type = fields.pop("model_type")
    fields.update(hidden_size=hidden_size, intermediate_size=intermediate_size, head_dim=head_dim,
                  bos_token_id=tok["bos_token_id"], eos_token_id=tok["eos_token_id"], pad_token_id=tok["pad_token_id"])
    if model_type == "qwen2":  # Qwen2 has no head_dim field: head_dim = hidden / heads
        fields["hidden_size"] = fields.pop("head_dim") * fields["num_attention_heads"]
    text = AutoConfig.for_model(model_type, **fields)
    if CHECKPOINT_TYPE.get(hub_id) != "mistral3":
        text.architectures = [type(text).__name__.replace("Config", "ForCausalLM")]
        return text
    from transformers import Mistral3Config, PixtralVisionConfig

    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 head_dim=8, image_size=56, patch_size=14)
    config = Mistral3Config(text_config=text, vision_config=vision, tie_word_embeddings=text.tie_word_embeddings)
    config.architectures = ["Mistral3ForConditionalGeneration"]
    return config


def _strings(obj):
    """Every string inside a JSON value."""
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


def corpus_files() -> list[Path]:
    """The stand-in tokenizer's training text: the repository's benchmark samples (a clear error without them)."""
    files = sorted(BPE_CORPUS.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no benchmark samples in {BPE_CORPUS}: the dry run's stand-in tokenizer is trained "
                                "on them; run it from a clone of the repository (python run.py ... dry_run=true)")
    return files


@functools.lru_cache(maxsize=4)
def trained_bpe(n_tokens: int = BPE_TOKENS) -> tuple[list[str], list[tuple[str, str]]]:
    """(tokens in learned order, merges) of a byte-level BPE trained on `corpus_files()`; deterministic for a
    given corpus and tokenizers version (both are in the stand-in's revision)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    texts = [t for f in corpus_files() for line in f.open() if line.strip() for t in _strings(json.loads(line))]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=n_tokens, show_progress=False,
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model = json.loads(bpe.to_str())["model"]
    tokens = [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    return tokens, [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model["merges"]]


def standin_tokenizer(hub_id: str):
    """Stand-in tokenizer of `hub_id` (see module doc): vocabulary size = the model's vocab_size, the table's
    special tokens at their real ids, the trained BPE's tokens in the other ids from 0 up, BOS prepended exactly
    when the real tokenizer prepends it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    _require(hub_id)
    tok = TOKENIZERS[hub_id]
    size = MODEL_CONFIGS[hub_id]["vocab_size"]
    special = dict(tok["special"])
    taken = set(special.values())
    free = (i for i in range(size) if i not in taken)
    tokens, merges = trained_bpe(min(BPE_TOKENS, size - len(special)))
    vocab = dict(special)
    for token in tokens:
        vocab[token] = next(free)
    for i in free:  # never produced: they only give the vocabulary its real size
        vocab[f"<standin_{i}>"] = i
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    names = {v: k for k, v in special.items()}
    bos = names.get(tok["bos_token_id"])
    if tok["add_bos"]:
        backend.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A $B",
                                                               special_tokens=[(bos, tok["bos_token_id"])])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=names.get(tok["eos_token_id"]),
                                   pad_token=names.get(tok["pad_token_id"]), unk_token=names.get(0) if 0 in names else None,
                                   additional_special_tokens=sorted(set(special) - {bos}), name_or_path=hub_id)


def _revision(hub_id: str, shrink: dict) -> str:
    """40-hex revision of a stand-in: the table row, the shrink and the library versions it was written with."""
    import tokenizers
    import transformers

    corpus = hashlib.sha1(b"".join(f.read_bytes() for f in corpus_files())).hexdigest()
    spec = {"id": hub_id, "config": MODEL_CONFIGS[hub_id], "tok": TOKENIZERS[hub_id], "shrink": shrink,
            "bpe": [BPE_TOKENS, corpus], "versions": [transformers.__version__, tokenizers.__version__,
                                                      torch.__version__], "format": 3}
    return hashlib.sha1(json.dumps(spec, sort_keys=True, default=str).encode()).hexdigest()


def write_standin(hub_id: str, cache: str | Path, *, seed: int = 0, **shrink) -> Path:
    """Save the stand-in of `hub_id` into the HF hub cache `cache` under its real id; returns the snapshot
    directory. Reused when already there (the revision names the stand-in's spec); written atomically."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    repo = Path(cache) / ("models--" + hub_id.replace("/", "--"))
    rev = _revision(hub_id, shrink)
    snapshot = repo / "snapshots" / rev
    if not (snapshot / "STANDIN.json").exists():
        config = standin_config(hub_id, **shrink)
        torch.manual_seed(seed)
        auto = AutoModelForImageTextToText if config.model_type == "mistral3" else AutoModelForCausalLM
        model = auto.from_config(config, dtype=torch.float32)
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{rev}.", dir=snapshot.parent))
        model.save_pretrained(tmp)
        standin_tokenizer(hub_id).save_pretrained(tmp)
        (tmp / "STANDIN.json").write_text(json.dumps({"id": hub_id, "note": STANDIN_NOTE, "shrink": shrink}))
        try:
            tmp.rename(snapshot)
        except OSError:  # written meanwhile by another process: theirs is the same stand-in
            shutil.rmtree(tmp, ignore_errors=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(rev)
    return snapshot


def check_standin_cache(cache: str | Path) -> None:
    """Refuse a model cache that holds any snapshot which is not a stand-in (no STANDIN.json): dry.model_cache
    pointed at a real HF cache would get stand-in revisions written into its refs/main, and later real runs would
    load random weights (issue 32). Raises ValueError naming the fix."""
    cache = Path(cache)
    real = sorted(str(snap.relative_to(cache)) for repo in cache.glob("models--*") for snap in (repo / "snapshots").glob("*")
                  if snap.is_dir() and not (snap / "STANDIN.json").exists()) if cache.is_dir() else []
    if real:
        raise ValueError(f"dry.model_cache={cache} holds real (non-stand-in) model snapshots ({', '.join(real[:3])}"
                         f"{' ...' if len(real) > 3 else ''}): a dry run would point their refs/main at random stand-in "
                         "weights. Leave dry.model_cache unset (stand-ins go under cache_dir/standins) or point it at "
                         "an empty directory")


def write_standins(hub_ids, cache: str | Path, **shrink) -> dict[str, Path]:
    """`write_standin` for each id (each once); {id: snapshot dir}. Refuses a cache holding real snapshots
    (`check_standin_cache`)."""
    check_standin_cache(cache)
    return {hub_id: write_standin(hub_id, cache, seed=i, **shrink) for i, hub_id in enumerate(dict.fromkeys(hub_ids))}
