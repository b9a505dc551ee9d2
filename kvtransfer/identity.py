"""Identity of what a run reads: a model is its architecture *and* its weights; a data file is its bytes.

Cached artifacts are keyed by these (kvtransfer.runner.artifacts), so new weights at the same path,
a new hub revision under the same id, or an edited calibration file never reuse old results.

- A model loaded by hub id is identified by the snapshot commit it resolves to (the revision the
  HF cache's `refs/<revision>` names, i.e. what `from_pretrained` read).
- A local directory is identified by a digest of, per weights file: its name and size, its
  safetensors header (every tensor's name, dtype, shape and offsets), and a fixed sample of bytes of
  every tensor (`SAMPLE_BYTES` at its start, middle and end). Weights that differ anywhere but in
  unsampled interior bytes of a tensor whose header is unchanged change the digest; the cost is the
  headers plus 3 small reads per tensor, never a full read: 57 ms for a 60 GiB, 1,008-tensor, 14-shard
  checkpoint on the 2-core EPYC dev machine without device I/O (experiments/identity_cost.py), plus
  ~3,000 random 64-byte reads on a real disk (~0.3 s on an SSD at ~0.1 ms each).
  A local directory's identity also holds the sha256 of every file that decides what the model computes or
  reads besides its weights (`MODEL_FILES`: config.json, generation_config.json, the tokenizer's files, a
  remote-code module): an edited `layer_types` or `tokenizer_config.json` is a new identity.
- A data file is identified by its name, size and sha256 (calibration text and benchmark samples are small),
  never by the directory it sits in: moving a checkout keeps every key (issue 32). A local model likewise is
  its bytes, not its path (the runner keys a hub model by id + revision, a local one by its files only).
- A hub dataset is identified by the revision the hub resolves it to (`hub_dataset_revision`).
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path

SAMPLE_BYTES = 64
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
# files besides the weights that change what a loaded model computes (config) or reads (tokenizer)
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt",
               "chat_template.jinja", "chat_template.json")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()[:16]


def model_files_digest(directory: str | Path) -> dict:
    """{file name: sha256[:16]} of the MODEL_FILES and remote-code modules (*.py) present in a model directory."""
    directory = Path(directory)
    return {p.name: _sha256(p) for p in sorted(directory.iterdir())
            if p.is_file() and (p.name in MODEL_FILES or p.suffix == ".py")}


def _safetensors_digest(path: Path, h) -> int:
    """Feed `path`'s header and per-tensor byte samples into hash `h`; returns the number of tensors."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = f.read(n)
        h.update(header)
        tensors = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        base = 8 + n
        for name in sorted(tensors):
            start, end = tensors[name]["data_offsets"]
            for at in sorted({start, max(start, (start + end) // 2 - SAMPLE_BYTES // 2), max(start, end - SAMPLE_BYTES)}):
                f.seek(base + at)
                h.update(f.read(min(SAMPLE_BYTES, end - at)))
    return len(tensors)


def _other_digest(path: Path, h) -> None:
    """Non-safetensors weights (pickled .bin, GGUF): size plus the first, middle and last MiB."""
    size = path.stat().st_size
    chunk = 1 << 20
    with path.open("rb") as f:
        for at in sorted({0, max(0, size // 2 - chunk // 2), max(0, size - chunk)}):
            f.seek(at)
            h.update(f.read(chunk))


def directory_weights_digest(directory: str | Path) -> dict:
    """{"kind": "files", "digest", "files", "bytes", "tensors"} of the weights files under a model directory.

    Raises FileNotFoundError when the directory holds no weights file (nothing to identify the model by)."""
    directory = Path(directory)
    files = sorted(p for p in directory.iterdir() if p.is_file() and p.suffix in _WEIGHT_SUFFIXES) if directory.is_dir() else []
    if not files:
        raise FileNotFoundError(f"{directory} holds no weights file ({', '.join(_WEIGHT_SUFFIXES)}): "
                                "point pair.<side>.path at a model directory saved with save_pretrained")
    h = hashlib.sha256()
    tensors = total = 0
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.relative_to(directory).as_posix()}\0{size}\0".encode())
        total += size
        if p.suffix == ".safetensors":
            tensors += _safetensors_digest(p, h)
        else:
            _other_digest(p, h)
    return {"kind": "files", "digest": h.hexdigest()[:16], "files": len(files), "bytes": total, "tensors": tensors}


def hub_revision(repo_id: str, revision: str | None = None) -> str | None:
    """Commit sha the HF cache resolves `repo_id`@`revision` (default main) to, or None when the cache
    holds nothing for it. Reads the cache the way `from_pretrained` does (HF_HOME / HF_HUB_CACHE)."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, "config.json", revision=revision)
    if not isinstance(found, str):
        return None
    parts = Path(found).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


def weights_identity(ref: str, revision: str | None = None) -> dict:
    """Identity of the weights behind a model reference: a local directory's digest (weights, plus the
    `model_files` digest of its config and tokenizer files), or the hub snapshot commit an id resolves to. Call after the model's config was read (that fills the HF cache).

    Raises ValueError when a hub id resolves to no snapshot (offline and never downloaded)."""
    if os.path.isdir(ref):
        return {**directory_weights_digest(ref), "model_files": model_files_digest(ref)}
    commit = hub_revision(ref, revision)
    if commit is None:
        raise ValueError(f"cannot tell which weights {ref!r} is: the HF cache holds no snapshot of it. Run once "
                         "with hub access (it downloads the config), or set pair.<side>.path to a local copy")
    return {"kind": "hub", "revision": commit}


def file_identity(path: str | Path) -> dict:
    """{"name", "bytes", "sha256"} of a data file: its bytes and file name, not where it lies (raises
    FileNotFoundError with the path when missing)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"data file {path} does not exist")
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def hub_dataset_revision(repo_id: str, revision: str | None = None) -> str | None:
    """Commit sha a hub dataset `repo_id`@`revision` (default main) resolves to: asked of the hub, or, offline,
    read from the HF cache's refs (what `datasets` read). None, with a warning naming the fix, when neither knows it
    (a datasets-only offline cache): the keys then carry the id and config name only."""
    try:
        from huggingface_hub import HfApi

        sha = HfApi().dataset_info(repo_id, revision=revision).sha
        if sha:
            return sha
    except Exception:  # offline, or an unreachable hub: fall back to the cache
        pass
    from huggingface_hub import constants

    ref = Path(constants.HF_HUB_CACHE) / f"datasets--{repo_id.replace('/', '--')}" / "refs" / (revision or "main")
    if ref.is_file():
        return ref.read_text().strip()
    import warnings

    warnings.warn(f"cannot tell which revision of hub dataset {repo_id!r} a run reads (the hub is unreachable and the "
                  "HF cache holds no ref of it): its artifacts are keyed without a revision. Run once with hub access, "
                  "or point the run at local files (calib.files / eval.data_dir)", stacklevel=2)
    return None


DATA_SUFFIXES = (".jsonl", ".json", ".txt", ".csv", ".parquet")


def data_identity(files=(), directory: str | Path | None = None) -> list[dict]:
    """Identities of data files: each of `files`, plus every data file (DATA_SUFFIXES) directly under
    `directory`, sorted (a benchmark directory's README and licence notes are not read as data)."""
    out = [file_identity(f) for f in files or ()]
    if directory is not None and Path(directory).is_dir():
        out += [file_identity(p) for p in sorted(Path(directory).iterdir()) if p.is_file() and p.suffix in DATA_SUFFIXES]
    return out
