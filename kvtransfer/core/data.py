"""Calibration text -> equal-length token sequences.

Sources: local files (.jsonl with a text field, or .txt with blank-line-separated documents) or
an HF dataset streamed by name (e.g. FineWeb-Edu sample-10BT, the paper's calibration set).
Documents with at least `seq_len` tokens give one sequence each (their first `seq_len` tokens, so
every sequence starts at a document start, where the attention sink forms); if there are too few,
the remaining documents are packed end to end, separated by EOS. Every sequence starts with the
start ids of the run's position-0 convention (`kvtransfer.core.context`), exactly as evaluation
contexts do.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import torch


def read_documents(files: list[str | Path], text_field: str = "text") -> Iterator[str]:
    """Yield documents from .jsonl (one JSON object per line, `text_field`) or .txt files."""
    if not files:
        raise ValueError("no calibration files given: set calib.files or calib.dataset")
    for path in map(Path, files):
        if not path.is_file():
            raise FileNotFoundError(f"calibration file {path} does not exist")
        if path.suffix == ".jsonl":
            with path.open() as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        record = json.loads(line)
                        if text_field not in record:
                            raise KeyError(f"{path}:{lineno} has no field {text_field!r}; set calib.text_field")
                        yield record[text_field]
        else:
            yield from (doc for doc in path.read_text().split("\n\n") if doc.strip())


def stream_hf_documents(dataset: str, name: str | None, split: str, text_field: str = "text") -> Iterator[str]:
    """Yield documents from a Hugging Face dataset in streaming mode (needs network or a local cache).

    Raises KeyError naming calib.text_field when a record lacks `text_field`."""
    from datasets import load_dataset

    from ..config.hub import data_access

    # a dry run: the data stays real while the models are stand-ins. Each read is wrapped on its own, so the
    # hub settings are never left switched while this generator is suspended (or abandoned) between records.
    with data_access():
        rows = iter(load_dataset(dataset, name, split=split, streaming=True))
    while True:
        with data_access():
            record = next(rows, None)
        if record is None:
            return
        if text_field not in record:
            raise KeyError(f"{dataset} [{name}] {split} has no field {text_field!r} (fields: {sorted(record)}): "
                           "set calib.text_field")
        yield record[text_field]


def token_sequences(documents: Iterable[str], tokenizer, n_sequences: int, seq_len: int,
                    max_documents: int = 1_000_000, context_start: str = "tokenizer") -> torch.Tensor:
    """int64 [n_sequences, seq_len] token ids built from `documents` as described in the module doc.

    context_start: position-0 convention (`kvtransfer.core.context.CONTEXT_STARTS`); packed sequences
    made of leftovers start with the same start ids. Raises ValueError naming how much text is
    missing when the documents run out.
    """
    from .context import encode, start_ids

    start = start_ids(tokenizer, context_start)
    long_docs, leftovers = [], []
    for i, doc in enumerate(documents):
        if len(long_docs) >= n_sequences or i >= max_documents:
            break
        ids = encode(tokenizer, doc, context_start)
        (long_docs if len(ids) >= seq_len else leftovers).append(ids[:seq_len] if len(ids) >= seq_len else ids)
    sequences = long_docs[:n_sequences]
    if len(sequences) < n_sequences:
        eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
        stream = [t for ids in leftovers for t in ids[len(start):] + [eos]]
        body = seq_len - len(start)
        while len(sequences) < n_sequences and len(stream) >= body:
            sequences.append(start + stream[:body])
            stream = stream[body:]
    if len(sequences) < n_sequences:
        raise ValueError(f"calibration text yields only {len(sequences)} sequences of {seq_len} tokens, "
                         f"{n_sequences} requested: add text, or lower calib.n_sequences / calib.seq_len "
                         "(a calib.draw d asks for (d + 1) x calib.n_sequences)")
    return torch.tensor(sequences, dtype=torch.long)  # device: host-side ids, each batch moved to its model
