"""The KV store a producer writes and a consumer reads: one safetensors file per (prompt, source model).

    <root>/<key[:2]>/<key>.<config_hash>.safetensors
        key          sha256 (hex) of the prompt's token ids as little-endian int64
        config_hash  kvtransfer.core.models.config_hash of the model that computed the cache
    tensors   token_ids int64 [n]; layers.<i>.k / layers.<i>.v [n_kv, n, head_dim] (keys post-RoPE,
              as the model caches them); extra.<name> any further per-prompt tensors (e.g. hidden states)
    header    (safetensors metadata "kvtransfer", JSON) {"format": "kvtransfer.kv_entry", "version",
              "model": identity, "n_tokens", "positions": [first, stop), "dtype", "extras": [names]}

Entries are written atomically (kvtransfer.core.io) and never overwritten: the same prompt through the
same model gives the same cache, so a second write is skipped. `read_header` checks an entry
without reading its tensors (the scheduler validates with it before promising tokens).
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ..core.io import atomic_save_tensors, load_tensors
from ..core.models import config_hash, kv_shape, rope_type, text_config

FORMAT, VERSION = "kvtransfer.kv_entry", 1
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class BadEntry(ValueError):
    """An entry that exists but cannot be used; `reason` is a short counter name (corrupt, mis-shaped, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def identity_from_config(config, model_id: str = "") -> dict:
    """The `model_identity` dict of a model known only by its config (no weights needed)."""
    shape = kv_shape(config)
    return {"model_id": model_id, "config_hash": config_hash(text_config(config)), "n_layers": shape.n_layers,
            "n_kv": shape.n_kv, "head_dim": shape.head_dim, "rope_type": rope_type(config)}


def prompt_key(token_ids) -> str:
    """sha256 hex of the token ids (int64, little-endian): the store key of a prompt."""
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
    return hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest()


@dataclass(frozen=True)
class EntryHeader:
    """What `read_header` checked: the entry's path, header dict and tensor shapes."""

    path: Path
    header: dict

    @property
    def n_tokens(self) -> int:
        return int(self.header["n_tokens"])

    @property
    def model(self) -> dict:
        return self.header["model"]

    @property
    def dtype(self) -> torch.dtype:
        return _DTYPES[self.header["dtype"]]


class KVStore:
    """A directory of entries; `write` (producer side), `find` / `read_header` / `read` (consumer side)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)

    def path(self, token_ids, model_hash: str) -> Path:
        key = prompt_key(token_ids)
        return self.root / key[:2] / f"{key}.{model_hash}.safetensors"

    def others(self, token_ids, model_hash: str) -> list[Path]:
        """Entries for these token ids written by models other than `model_hash` (for a clear reason)."""
        key = prompt_key(token_ids)
        return [p for p in sorted((self.root / key[:2]).glob(f"{key}.*.safetensors"))
                if p.name != f"{key}.{model_hash}.safetensors"]

    def write(self, token_ids, layers: list[tuple[torch.Tensor, torch.Tensor]], model: dict, *,
              extras: dict[str, torch.Tensor] | None = None) -> Path | None:
        """Store per-layer (keys, values) [n_kv, n, head_dim] of prompt `token_ids` (n ids) computed by `model`.

        model: an identity dict (`identity_from_config` / `model_identity`). Returns the path, or
        None when the entry already exists (never overwritten).
        """
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)
        n = ids.numel()
        k0 = layers[0][0]
        dtype = next((name for name, dt in _DTYPES.items() if dt == k0.dtype), None)
        if dtype is None:
            raise ValueError(f"cache dtype {k0.dtype} is not storable; use one of {sorted(_DTYPES)}")
        want = (model["n_kv"], n, model["head_dim"])
        if len(layers) != model["n_layers"] or any(tuple(t.shape) != want for kv in layers for t in kv):
            raise ValueError(f"{len(layers)} layers of {tuple(k0.shape)} do not match the model's "
                             f"{model['n_layers']} layers of {want}")
        path = self.path(ids.tolist(), model["config_hash"])
        if path.exists():
            return None
        tensors = {"token_ids": ids}
        for i, (k, v) in enumerate(layers):
            tensors[f"layers.{i}.k"], tensors[f"layers.{i}.v"] = k, v
        for name, t in (extras or {}).items():
            tensors[f"extra.{name}"] = t
        header = {"format": FORMAT, "version": VERSION, "model": model, "n_tokens": n, "positions": [0, n],
                  "dtype": dtype, "extras": sorted(extras or {})}
        atomic_save_tensors(path, tensors, header)
        return path

    def read_header(self, path: Path, token_ids) -> EntryHeader:
        """Check the entry at `path` without loading its tensors; raises BadEntry(reason, message).

        Checks: readable safetensors (not truncated), format/version, positions 0..n-1, a storable
        dtype, and every tensor's shape and dtype against the header's model and `token_ids`
        (the prompt prefix it claims to hold).
        """
        try:
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("kvtransfer", "{}"))
                shapes = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                          for name in f.keys()}
        except (SafetensorError, OSError, ValueError) as err:
            raise BadEntry("corrupt", f"{path}: unreadable ({err})") from err
        if header.get("format") != FORMAT or header.get("version") != VERSION:
            raise BadEntry("corrupt", f"{path}: not a {FORMAT} v{VERSION} entry")
        n = header.get("n_tokens")
        if header.get("positions") != [0, n]:
            raise BadEntry("positions", f"{path}: positions {header.get('positions')} are not 0..{n}-1")
        if header.get("dtype") not in _DTYPES:
            raise BadEntry("corrupt", f"{path}: dtype {header.get('dtype')!r} unknown")
        m = header.get("model") or {}
        want = (m.get("n_kv"), n, m.get("head_dim"))
        st_dtype = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}[header["dtype"]]
        for i in range(int(m.get("n_layers") or 0)):
            for kind in ("k", "v"):
                if shapes.get(f"layers.{i}.{kind}") != (want, st_dtype):
                    raise BadEntry("mis-shaped", f"{path}: layers.{i}.{kind} is {shapes.get(f'layers.{i}.{kind}')}, "
                                                 f"header says {want} {st_dtype}")
        if not m.get("n_layers") or shapes.get("token_ids") != ((n,), "I64"):
            raise BadEntry("mis-shaped", f"{path}: no layers or no token_ids of {n}")
        with safe_open(str(path), framework="pt") as f:
            stored = f.get_tensor("token_ids").tolist()
        if stored != list(token_ids)[:n]:
            raise BadEntry("corrupt", f"{path}: stored token ids differ from the prompt (hash collision or corrupt)")
        return EntryHeader(Path(path), header)

    @staticmethod
    def read(entry: EntryHeader, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [n_kv, hi - lo, head_dim] of tokens lo..hi-1 of a checked entry."""
        try:
            tensors, _ = load_tensors(entry.path)
        except (FileNotFoundError, ValueError) as err:
            raise BadEntry("corrupt", str(err)) from err
        n_layers = entry.model["n_layers"]
        return [(tensors[f"layers.{i}.k"][:, lo:hi], tensors[f"layers.{i}.v"][:, lo:hi]) for i in range(n_layers)]


def save_prefill(store: KVStore, model, token_ids: list[int]) -> Path | None:
    """The project's own HF prefill of `token_ids` as a store entry (what a vLLM producer writes)."""
    from ..core.models import model_identity
    from .hf import prefill_layers

    return store.write(token_ids, prefill_layers(model, token_ids), model_identity(model))
