"""The prefix store a producer writes and a consumer reads: fixed-size token blocks, chained hashes.

    <root>/store.json                              {"format": "kvtransfer.kv_store", "block_size": B}
    <root>/<model key>/<h[:2]>/<h>.safetensors     one block: tokens j*B .. (j+1)*B - 1 of some prompt

    model key  kvtransfer.serve.ident: the producer's architecture *and* weights (16 hex)
    h          chained hash, as vLLM's prefix cache: h_0 = sha256("kvtransfer.kv_store/<model key>/<B>"),
               h_{j+1} = sha256(h_j || token ids of block j as little-endian int64); block j is named h_{j+1}.
               A block therefore stands for the whole prefix 0 .. (j+1)*B - 1, through that model.
    tensors    token_ids int64 [B]; k, v [n_layers, n_kv, B, head_dim] (keys post-RoPE, as the model caches them)
    header     (safetensors metadata "kvtransfer", JSON) {"format": "kvtransfer.kv_block", "version": 2,
               "model": identity, "block": j, "parent": h_j, "hash": h_{j+1}, "block_size": B, "dtype",
               "checksum": sha256 of the token_ids, k and v bytes}

Only full blocks are stored (a prompt's last n % B tokens are the target's to compute), and no block is
stored twice: turn t + 1 of a conversation writes only the blocks turn t did not, and a consumer maps the
longest stored prefix of any prompt (`lookup`). Blocks are written atomically (temporary file + rename,
kvtransfer.core.io) and never overwritten. A write or read stamps the mtimes of the prompt's whole chain, block 0
the newest, so least-recently-used eviction (`max_bytes`) takes a chain's tail before its head and never leaves a
block unreachable behind a missing one; `retention_s` removes blocks nobody used for that long, and `delete_chain`
a session's chain.

Several processes may share one directory (two engines, or engines on two nodes that mount the same
shared filesystem with atomic rename, e.g. NFSv4 / Lustre / CephFS): a reader sees a whole block or none;
a block evicted between the scheduler's `lookup` and the worker's `read` is a `BadEntry("evicted")`, which the
connector turns into a recompute. Every block's checksum is verified, and its token ids compared with the
request's prompt, before it is returned (`read`); `lookup` checks headers only.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.io import atomic_save_tensors
from .ident import identity_from_config  # noqa: F401 -- re-exported (older imports)

FORMAT, VERSION, STORE_FORMAT = "kvtransfer.kv_block", 2, "kvtransfer.kv_store"
DEFAULT_BLOCK_SIZE = 16
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}


class BadEntry(ValueError):
    """A block that exists but cannot be used; `reason` is a short counter name (corrupt, mis-shaped, checksum,
    evicted, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _ids_bytes(token_ids) -> bytes:
    return torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()  # device: host bytes for a key


def prompt_key(token_ids) -> str:
    """sha256 hex of the token ids (int64, little-endian)."""
    return hashlib.sha256(_ids_bytes(token_ids)).hexdigest()


def checksum(token_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """sha256 hex of a block's bytes: token ids, then keys, then values (each contiguous, native byte order)."""
    h = hashlib.sha256()
    for t in (token_ids, k, v):
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass(frozen=True)
class Prefix:
    """The longest stored prefix of a prompt: `n_blocks` consecutive blocks (hashes in order) of `block_size`."""

    model_key: str
    block_size: int
    hashes: tuple[str, ...] = ()
    model: dict = field(default_factory=dict)
    detail: str = ""  # why the chain stopped before the prompt's last full block (a bad block), if it did

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)

    @property
    def n_tokens(self) -> int:
        return self.n_blocks * self.block_size


class KVStore:
    """A directory of blocks: `write` (producer side), `lookup` / `read` (consumer side), `evict`.

    block_size: tokens per block; fixed by the first process that opens the directory (store.json, created
    exclusively) -- a different value asked later is ignored in favour of the directory's. max_bytes: size cap of
    all blocks (None: no cap), enforced after a write that takes the tracked usage over it, by LRU eviction.
    retention_s: blocks not written or read for this long are removed (checked at most once a minute by writes).
    """

    def __init__(self, root: str | Path, *, block_size: int | None = None, max_bytes: int | None = None,
                 retention_s: float | None = None):
        self.root = Path(root)
        if retention_s is not None and (not isinstance(retention_s, (int, float)) or retention_s <= 0):
            raise ValueError(f"retention_s={retention_s!r}: a positive number of seconds")
        self.retention_s = retention_s
        self._expired_at = 0.0
        self._usage: int | None = None  # bytes of all blocks, tracked after the first eviction scan
        if block_size is not None and (not _is_int(block_size) or block_size < 1):
            raise ValueError(f"block_size={block_size!r}: a positive integer number of tokens")
        if max_bytes is not None and (not _is_int(max_bytes) or max_bytes < 0):
            raise ValueError(f"max_bytes={max_bytes!r}: a non-negative integer number of bytes")
        self.max_bytes = max_bytes
        self.block_size = self._fix_block_size(block_size)

    def _fix_block_size(self, asked: int | None) -> int:
        meta = self.root / "store.json"
        if not meta.is_file():
            _create_exclusive(meta, {"format": STORE_FORMAT, "block_size": asked or DEFAULT_BLOCK_SIZE})
        try:
            got = json.loads(meta.read_text()).get("block_size")
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"{meta} is unreadable ({err}): remove it (the store's block size is recorded there)")
        if not _is_int(got) or got < 1:
            raise ValueError(f"{meta}: block_size {got!r} is not a positive integer; remove the file")
        return got

    # ---------------------------------------------------------------- keys
    def hashes(self, token_ids, model_key: str) -> list[str]:
        """Chained hashes h_1 .. h_m of the m = len(token_ids) // block_size full blocks of a prompt."""
        ids = list(token_ids)
        h = self.seed(model_key)
        out = []
        for j in range(len(ids) // self.block_size):
            h = hashlib.sha256(h.encode() + _ids_bytes(ids[j * self.block_size:(j + 1) * self.block_size])).hexdigest()
            out.append(h)
        return out

    def seed(self, model_key: str) -> str:
        """h_0: the chain's root hash for a model key and this store's block size."""
        return hashlib.sha256(f"{STORE_FORMAT}/{model_key}/{self.block_size}".encode()).hexdigest()

    def block_path(self, model_key: str, h: str) -> Path:
        return self.root / model_key / h[:2] / f"{h}.safetensors"

    def model_keys(self) -> list[str]:
        """Model keys with a directory in the store."""
        try:
            return sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        except OSError:
            return []

    def others(self, token_ids, model_key: str) -> list[str]:
        """Keys of other models that stored the first block of these token ids (for a clear wrong_pair reason)."""
        out = []
        for key in self.model_keys():
            if key != model_key:
                first = self.hashes(list(token_ids)[:self.block_size], key)
                if first and self.block_path(key, first[0]).is_file():
                    out.append(key)
        return out

    # ---------------------------------------------------------------- producer
    def stored_blocks(self, token_ids, model_key: str) -> int:
        """How many leading full blocks of `token_ids` the store holds for `model_key` (file existence only: what a
        producer need not gather again; `lookup` checks headers)."""
        n = 0
        for h in self.hashes(token_ids, model_key):
            if not self.block_path(model_key, h).is_file():
                break
            n += 1
        return n

    def write(self, token_ids, layers: list[tuple[torch.Tensor, torch.Tensor]], model: dict, *, first: int = 0) -> int:
        """Store the full blocks of prompt `token_ids` (n ids) from token `first` on (a multiple of the block size:
        the blocks before it are already stored); `layers`: per-layer (keys, values) [n_kv, n - first, head_dim] of
        tokens first..n-1.

        model: a serving identity (kvtransfer.serve.ident, with "key"). Blocks already stored are skipped. Every
        block of the prompt's chain gets a fresh mtime, block 0 the newest, so least-recently-used eviction takes
        a chain's tail first and never strands a block behind a missing one. Returns the number of blocks written.
        ValueError on shapes that are not the model's or a `first` that is not on a block boundary.
        """
        if not isinstance(model, dict) or not isinstance(model.get("key"), str):
            raise ValueError("model must be a serving identity with a 'key' (kvtransfer.serve.ident.serving_identity)")
        B = self.block_size
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64)  # device: host-side ids, written to a file
        n = ids.numel()
        if not _is_int(first) or first < 0 or first % B or first > n:
            raise ValueError(f"first={first!r}: a multiple of the block size {B} within the prompt's {n} tokens")
        k0 = layers[0][0]
        dtype = next((name for name, dt in _DTYPES.items() if dt == k0.dtype), None)
        if dtype is None:
            raise ValueError(f"cache dtype {k0.dtype} is not storable; use one of {sorted(_DTYPES)}")
        want = (model["n_kv"], n - first, model["head_dim"])
        if len(layers) != model["n_layers"] or any(tuple(t.shape) != want for kv in layers for t in kv):
            raise ValueError(f"{len(layers)} layers of {tuple(k0.shape)} do not match the model's "
                             f"{model['n_layers']} layers of {want}")
        m = (n - first) // B * B  # the full blocks' tokens after `first`
        # one copy into block-major order [n_blocks, L, n_kv, B, d], on an integer view of the same bytes (CPU
        # copies of bfloat16 take a slow path; the bytes are all that is stored)
        keys, values = (_blocked([_raw(kv[i])[:, :m] for kv in layers], B).view(k0.dtype) for i in (0, 1))
        hashes = self.hashes(ids.tolist(), model["key"])
        written, paths = 0, []
        for j, h in enumerate(hashes):
            path = self.block_path(model["key"], h)
            paths.append(path)
            if j * B < first or path.exists():
                continue
            a = j - first // B
            bid, k, v = ids[j * B:(j + 1) * B], keys[a], values[a]
            header = {"format": FORMAT, "version": VERSION, "model": model, "block": j,
                      "parent": hashes[j - 1] if j else self.seed(model["key"]), "hash": h, "block_size": B,
                      "dtype": dtype, "checksum": checksum(bid, k, v)}
            atomic_save_tensors(path, {"token_ids": bid, "k": k, "v": v}, header)
            written += 1
            if self._usage is not None:
                self._usage += _size(path)
        _touch_chain(paths)
        if written and self.max_bytes is not None:
            if self._usage is None or self._usage > self.max_bytes:
                self.evict()
        if written and self.retention_s is not None:
            self.expire()
        return written

    # ---------------------------------------------------------------- consumer
    def check_header(self, path: Path, model_key: str, j: int, parent: str, h: str) -> dict:
        """The header of block j (hash h, parent hash `parent`) at `path`, checked against its tensors' shapes
        without reading them; raises BadEntry(reason, message). Every field is type-checked (a header written
        by anything else cannot raise anything but BadEntry)."""
        try:
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("kvtransfer", "{}"))
                shapes = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                          for name in f.keys()}
        except Exception as err:  # noqa: BLE001 -- safetensors raises RuntimeError for a file removed meanwhile
            raise _unreadable(path, err) from err
        if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
            raise BadEntry("corrupt", f"{path}: not a {FORMAT} v{VERSION} block")
        m = header.get("model")
        if not isinstance(m, dict) or not all(_is_int(m.get(k)) and m.get(k) > 0 for k in ("n_layers", "n_kv", "head_dim")):
            raise BadEntry("corrupt", f"{path}: header 'model' {m!r} is not an identity with integer n_layers, "
                                      f"n_kv, head_dim")
        if m.get("key") != model_key:
            raise BadEntry("wrong_pair", f"{path}: written by model {m.get('key')!r}, not {model_key}")
        if (not _is_int(header.get("block")) or header["block"] != j or header.get("parent") != parent
                or header.get("hash") != h):
            raise BadEntry("corrupt", f"{path}: header names block {header.get('block')!r} / hash "
                                      f"{str(header.get('hash'))[:12]}, expected block {j} / {h[:12]}")
        if not _is_int(header.get("block_size")) or header["block_size"] != self.block_size:
            raise BadEntry("mis-shaped", f"{path}: block_size {header.get('block_size')!r}, store's {self.block_size}")
        if not isinstance(header.get("dtype"), str) or header["dtype"] not in _DTYPES \
                or not isinstance(header.get("checksum"), str):
            raise BadEntry("corrupt", f"{path}: dtype {header.get('dtype')!r} or checksum missing")
        want = ((m["n_layers"], m["n_kv"], self.block_size, m["head_dim"]), _ST_DTYPES[header["dtype"]])
        for name in ("k", "v"):
            if shapes.get(name) != want:
                raise BadEntry("mis-shaped", f"{path}: {name} is {shapes.get(name)}, header says {want}")
        if shapes.get("token_ids") != ((self.block_size,), "I64"):
            raise BadEntry("mis-shaped", f"{path}: token_ids is {shapes.get('token_ids')}, not ({self.block_size},) I64")
        return header

    def lookup(self, token_ids, model_key: str) -> Prefix:
        """The longest stored prefix of `token_ids` written by model `model_key` (headers checked, data not read).

        The chain stops at the first missing block, or at a block whose header is bad (then `detail` says why,
        prefixed with its BadEntry reason: "<reason>: <message>").
        """
        parent = self.seed(model_key)
        found, model, detail = [], {}, ""
        for j, h in enumerate(self.hashes(token_ids, model_key)):
            path = self.block_path(model_key, h)
            if not path.is_file():
                break
            try:
                header = self.check_header(path, model_key, j, parent, h)
            except BadEntry as err:
                detail = f"{err.reason}: {err}"
                break
            if model and header["model"] != model:
                detail = f"corrupt: {path}: model identity differs from block 0's"
                break
            model = header["model"]
            found.append(h)
            parent = h
        return Prefix(model_key, self.block_size, tuple(found), model, detail)

    def read(self, prefix: Prefix, token_ids, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [n_kv, hi - lo, head_dim] of tokens lo..hi-1 from the blocks of `prefix`.

        token_ids: the request's prompt (at least hi ids): each block's stored ids must equal its slice.
        Every block read is checksum-verified. Raises BadEntry: "evicted" (a block is gone), "checksum"
        (its bytes changed), "corrupt" (unreadable, ids differ from the prompt), "too_short" (hi beyond the prefix).
        """
        B = self.block_size
        prompt = list(token_ids)
        if not 0 <= lo < hi <= min(prefix.n_tokens, len(prompt)):
            raise BadEntry("too_short", f"tokens {lo}..{hi} are not inside the prefix of {prefix.n_tokens} "
                                        f"stored tokens of a {len(prompt)}-token prompt")
        ks, vs = [], []
        for j in range(lo // B, (hi - 1) // B + 1):
            path = self.block_path(prefix.model_key, prefix.hashes[j])
            header, tensors, digest = _read_block(path)
            try:
                bid, k, v = tensors["token_ids"], tensors["k"], tensors["v"]
                ok = isinstance(header, dict) and digest == header.get("checksum")
            except (KeyError, RuntimeError, TypeError) as err:
                raise BadEntry("corrupt", f"{path}: {err}") from err
            if not ok:
                raise BadEntry("checksum", f"{path}: tensor bytes do not match the block's checksum (corrupt)")
            if bid.tolist() != prompt[j * B:(j + 1) * B]:
                raise BadEntry("corrupt", f"{path}: stored token ids differ from the prompt's tokens "
                                          f"{j * B}..{(j + 1) * B - 1}")
            a, b = max(lo, j * B) - j * B, min(hi, (j + 1) * B) - j * B
            ks.append(k[:, :, a:b])
            vs.append(v[:, :, a:b])
        _touch_chain([self.block_path(prefix.model_key, h) for h in prefix.hashes[:(hi - 1) // B + 1]])
        dtype = ks[0].dtype
        keys = torch.cat([_raw(k) for k in ks], dim=2).view(dtype)  # an integer view: see `write`
        values = torch.cat([_raw(v) for v in vs], dim=2).view(dtype)
        return [(keys[i], values[i]) for i in range(keys.shape[0])]

    # ---------------------------------------------------------------- size
    def blocks(self) -> list[tuple[float, int, Path]]:
        """(mtime, bytes, path) of every block file (files that vanish while listed are skipped)."""
        out = []
        for path in self.root.glob("*/??/*.safetensors"):
            try:
                st = path.stat()
            except OSError:
                continue
            out.append((st.st_mtime, st.st_size, path))
        return out

    def usage(self) -> int:
        """Bytes of all blocks."""
        return sum(size for _, size, _ in self.blocks())

    def evict(self, max_bytes: int | None = None) -> int:
        """Remove least-recently-used blocks (oldest mtime first) until the blocks take at most `max_bytes`
        (default the store's cap); returns the number removed. Within a chain the tail is always older than its
        head (`write` / `read` stamp them so), so eviction shortens chains from the end instead of breaking them.
        Safe beside readers and other evictors: a block another process removed first is skipped, and a reader of
        a removed block falls back."""
        cap = self.max_bytes if max_bytes is None else max_bytes
        if cap is None:
            return 0
        blocks = sorted(self.blocks(), key=lambda b: (b[0], str(b[2])))
        total, removed = sum(b[1] for b in blocks), 0
        for _, size, path in blocks:
            if total <= cap:
                break
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
        self._usage = total
        return removed

    def expire(self, retention_s: float | None = None, now: float | None = None) -> int:
        """Remove every block not written or read for `retention_s` seconds (default the store's retention; the
        store holds users' conversations); returns the number removed. Runs at most once a minute from `write`."""
        keep = self.retention_s if retention_s is None else retention_s
        now = time.time() if now is None else now
        if keep is None or (retention_s is None and now - self._expired_at < 60):
            return 0
        self._expired_at = now
        removed = 0
        for mtime, _, path in self.blocks():
            if now - mtime > keep:
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    pass
        if removed:
            self._usage = None
        return removed

    def delete_chain(self, tip: str) -> int:
        """Remove the block named `tip` and every block before it in its chain (following each header's parent):
        what a deleted session leaves in the store. Blocks another session shares are removed too (that session
        falls back to a prefill, or re-stores them). Returns the number removed; an unknown tip removes nothing."""
        if not isinstance(tip, str) or len(tip) != 64 or any(c not in "0123456789abcdef" for c in tip):
            raise ValueError(f"tip {tip!r} is not a block hash (64 lowercase hex characters)")
        removed = 0
        for key in self.model_keys():
            h = tip
            while True:
                path = self.block_path(key, h)
                try:
                    with safe_open(str(path), framework="pt") as f:
                        header = json.loads((f.metadata() or {}).get("kvtransfer", "{}"))
                    path.unlink()
                    removed += 1
                except Exception:  # noqa: BLE001 -- missing or unreadable: the chain ends here
                    break
                parent = header.get("parent") if isinstance(header, dict) else None
                if not isinstance(parent, str) or parent == self.seed(key):
                    break
                h = parent
        self._usage = None
        return removed

    def tip(self, token_ids, model_key: str | None = None) -> tuple[str, str, int] | None:
        """(model key, hash, tokens) of the last stored block of `token_ids`'s chain under `model_key` (default:
        whichever model in the store holds the first block); None when nothing is stored."""
        for key in ([model_key] if model_key else self.model_keys()):
            n = self.stored_blocks(token_ids, key)
            if n:
                return key, self.hashes(list(token_ids)[:n * self.block_size], key)[-1], n * self.block_size
        return None


_TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}


def _read_block(path: Path) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(kvtransfer header, tensors, checksum) of a block file, read once: the tensors are views of the file's bytes,
    and the checksum is `checksum`'s sha256 over the token_ids, k and v bytes, taken in place. BadEntry("evicted")
    for a file that is gone, "corrupt" for one that is not a readable block."""
    try:
        with open(path, "rb") as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(buf)
    except OSError as err:
        raise _unreadable(path, err) from err
    try:
        n = int.from_bytes(buf[:8], "little")
        meta = json.loads(bytes(buf[8:8 + n]))
        header = json.loads(meta.get("__metadata__", {}).get("kvtransfer", "{}"))
        view, base, h, tensors = memoryview(buf), 8 + n, hashlib.sha256(), {}
        for name in ("token_ids", "k", "v"):
            spec = meta[name]
            a, b = spec["data_offsets"]
            if not 0 <= a <= b <= len(buf) - base:
                raise ValueError(f"{name}'s bytes {a}..{b} lie outside the file")
            h.update(view[base + a:base + b])
            dtype = _TORCH_DTYPES[spec["dtype"]]
            tensors[name] = torch.frombuffer(view[base + a:base + b], dtype=dtype).view(spec["shape"]) \
                if b > a else torch.empty(spec["shape"], dtype=dtype)  # device: read from a file, as frombuffer
    except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as err:
        raise BadEntry("corrupt", f"{path}: not a readable block ({type(err).__name__}: {err})") from err
    return header, tensors, h.hexdigest()


def _raw(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor of the same element size (copies of it take the fast path)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _blocked(layers: list[torch.Tensor], block: int) -> torch.Tensor:
    """Per-layer [n_kv, m, d] (m a multiple of `block`) as one contiguous [m / block, L, n_kv, block, d] tensor."""
    x = torch.stack(layers)  # [L, n_kv, m, d]
    L, h, m, d = x.shape
    return x.view(L, h, m // block, block, d).permute(2, 0, 1, 3, 4).contiguous()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _create_exclusive(path: Path, data: dict) -> None:
    """Write JSON to `path` only if no file is there (atomic: a temporary file hard-linked into place), so two
    processes opening a fresh store agree on the first one's content."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        Path(tmp).unlink(missing_ok=True)


def _unreadable(path: Path, err: Exception) -> BadEntry:
    """The BadEntry for a block that could not be opened: "evicted" when it no longer exists, else "corrupt"."""
    if not Path(path).exists():
        return BadEntry("evicted", f"{path}: evicted after the lookup ({type(err).__name__}: {err})")
    return BadEntry("corrupt", f"{path}: unreadable ({type(err).__name__}: {err})")


def _touch_chain(paths: list[Path]) -> None:
    """Refresh the mtimes (LRU ages) of a chain's blocks, block j stamped j microseconds before block 0, so the
    chain's tail is evicted before its head; a block evicted meanwhile is not an error."""
    now = time.time_ns()
    for j, path in enumerate(paths):
        try:
            os.utime(path, ns=(now - 1000 * j, now - 1000 * j))
        except OSError:
            pass


def save_prefill(store: KVStore, model, token_ids: list[int], ref: str | None = None) -> int:
    """The project's own HF prefill of `token_ids` stored as blocks (what a vLLM producer writes); `ref`: the
    directory `model` was saved to (its weights identity; default its name_or_path). Returns blocks written."""
    from .hf import prefill_layers
    from .ident import model_serving_identity

    return store.write(token_ids, prefill_layers(model, token_ids), model_serving_identity(model, ref))
