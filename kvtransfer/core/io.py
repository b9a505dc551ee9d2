"""Atomic, never-overwriting file output and safetensors helpers (no pickles anywhere)."""
from __future__ import annotations

import contextlib

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def atomic_write_bytes(path: str | Path, data, *, sync_dir: bool = False) -> int:
    """Write `data` (bytes or any buffer, e.g. a memoryview) to `path` atomically: a temporary file beside it,
    fsynced, then renamed (never a torn file under `path`; see `atomic_save_tensors`). sync_dir=True also fsyncs the
    directory (the rename durable now). Returns the bytes written."""
    return _atomic(path, lambda tmp: write_file(tmp, data), sync_dir)


def write_file(path: str | Path, data) -> None:
    """Write a buffer to a new file (the step of `atomic_write_bytes` that fills its temporary file)."""
    with open(path, "wb") as f:
        f.write(data)


def _atomic(path: str | Path, fill, sync_dir: bool) -> int:
    """Create `path` through `fill(temporary path)`, the fsync of the temporary file, its rename and (sync_dir) the
    directory's fsync; the temporary file is removed on any error. Returns the file's size."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        fill(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:  # fsync flushes the file's data whatever mode the descriptor was opened in
            os.fsync(fd)
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)
    return size


def atomic_write_json(path: str | Path, obj) -> None:
    """Write `obj` as indented JSON to `path` atomically."""
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n").encode())


def atomic_save_tensors(path: str | Path, tensors: dict[str, torch.Tensor], metadata: dict | None = None, *,
                        sync_dir: bool = True) -> int:
    """Save tensors as safetensors at `path` atomically and durably; `metadata` (JSON-able) goes in the header.
    Returns the file's size in bytes.

    The temporary file (`.<name>.*.tmp` beside `path`) is fsynced before the rename, and the directory after it, so a
    crash or power loss leaves the old file, the whole new one or an orphaned temporary file -- never a torn file
    under `path` (a rename without the fsync can reach the disk before the data does). The directory fsync is
    best effort: filesystems that refuse it (some network mounts) are not an error. sync_dir=False leaves it to the
    caller (`fsync_dir`), who may sync each directory once after many files: the rename is then durable later,
    but the file is never torn.
    """
    header = {"kvtransfer": json.dumps(metadata or {}, default=str)}
    return _atomic(path, lambda tmp: save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, tmp,
                                               metadata=header), sync_dir)


def fsync_dir(directory: str | Path) -> None:
    """fsync a directory (makes a rename inside it durable); an OSError (a filesystem that refuses) is ignored."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def load_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Load a safetensors file written by `atomic_save_tensors`: (tensors, metadata)."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            header = f.metadata() or {}
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as err:
        raise ValueError(f"{path} is not a readable safetensors file (truncated or corrupt?): {err}") from err
    return tensors, json.loads(header.get("kvtransfer", "{}"))


def sha256_file(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fresh_dir(path: str | Path) -> Path:
    """Create and return `path`, refusing to reuse a non-empty directory (results are never overwritten)."""
    path = Path(path)
    if path.exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} already holds results; choose a new directory (runs never overwrite)")
    path.mkdir(parents=True, exist_ok=True)
    return path


# -- tensor directories: rewritten in place, one piece at a time -------------------------------------------
PIECE_BYTES = 1 << 30   # largest piece file of a tensor directory (a 2-D tensor is split by rows)
MANIFEST = "manifest.json"


def _pieces(name: str, t: torch.Tensor, piece_bytes: int):
    """(file stem, row slice) pieces of one tensor: whole when small or 1-D, else row blocks of <= piece_bytes
    (at least one row)."""
    if t.dim() < 2 or t.numel() * t.element_size() <= piece_bytes:
        return [(name, slice(None))]
    row = t[0].numel() * t.element_size()
    step = max(1, piece_bytes // row)
    return [(f"{name}@{i // step:05d}", slice(i, i + step)) for i in range(0, t.shape[0], step)]


def save_tensor_dir(directory: str | Path, tensors: dict[str, torch.Tensor], manifest: dict, *,
                    piece_bytes: int = PIECE_BYTES) -> None:
    """Write `tensors` into `directory` so that the disk never holds more than the old content + one piece.

    The manifest goes first (a crash from then on leaves a directory without manifest, which
    `load_tensor_dir` refuses instead of reading a mix of two states); then each piece (a tensor, or a
    block of <= piece_bytes rows of a large one) replaces its old file by an atomic rename, in turn; files
    of pieces that no longer exist are removed; the manifest (shapes, dtypes, pieces, a stamp every piece
    carries, plus `manifest`) is written last."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)
    stamp = hashlib.sha256(os.urandom(16)).hexdigest()[:16]
    layout, keep = {}, set()
    for name, t in tensors.items():
        if "/" in name or name.startswith("."):
            raise ValueError(f"bad tensor name {name!r}")
        t = t.detach()
        pieces = _pieces(name, t, piece_bytes)
        layout[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."),
                        "pieces": [stem for stem, _ in pieces]}
        for stem, rows in pieces:
            atomic_save_tensors(directory / f"{stem}.safetensors", {"t": t[rows]}, {"stamp": stamp})
            keep.add(f"{stem}.safetensors")
    for f in directory.glob("*.safetensors"):
        if f.name not in keep:
            f.unlink()
    atomic_write_json(directory / MANIFEST, {"stamp": stamp, "tensors": layout, **manifest})


def read_tensor_manifest(directory: str | Path) -> dict | None:
    """The manifest of a tensor directory, or None when there is none (never written, or a write was cut)."""
    path = Path(directory) / MANIFEST
    return json.loads(path.read_text()) if path.is_file() else None


def load_tensor_dir(directory: str | Path, device="cpu") -> tuple[dict[str, torch.Tensor], dict]:
    """Read a directory written by `save_tensor_dir`: (tensors, manifest). Each tensor is allocated once and
    filled piece by piece, so reading needs the tensors + one piece of memory."""
    from safetensors import safe_open

    directory = Path(directory)
    manifest = read_tensor_manifest(directory)
    if manifest is None:
        raise ValueError(f"{directory} has no {MANIFEST}: not a complete tensor directory (an interrupted write?)")
    out = {}
    for name, spec in manifest["tensors"].items():
        t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=device)
        row = 0
        for stem in spec["pieces"]:
            path = directory / f"{stem}.safetensors"
            with safe_open(str(path), framework="pt") as f:
                if json.loads((f.metadata() or {}).get("kvtransfer", "{}")).get("stamp") != manifest["stamp"]:
                    raise ValueError(f"{path} belongs to another write than {directory / MANIFEST}")
                piece = f.get_tensor("t")
            if len(spec["pieces"]) == 1:
                t.copy_(piece)
            else:
                t[row:row + piece.shape[0]] = piece
                row += piece.shape[0]
            del piece
        out[name] = t
    return out, manifest


@contextlib.contextmanager
def exclusive_lock(path: str | Path):
    """Hold an exclusive advisory lock (fcntl.flock) on the file `path` for the block; other processes
    taking the same lock wait. For jobs of one sweep that would otherwise compute one artifact twice."""
    import fcntl

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
