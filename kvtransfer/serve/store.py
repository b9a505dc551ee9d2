"""The prefix store a producer writes and a consumer reads: fixed-size token blocks, chained hashes, namespaces.

    <root>/store.json                                   {"format": "kvtransfer.kv_store", "layout": 3, "block_size": B}
    <root>/<model key>/<ns dir>/<h[:2]>/<h>.safetensors  one block: tokens j*B .. (j+1)*B - 1 of some prompt

    model key  kvtransfer.serve.ident: the producer's architecture *and* weights (16 lowercase hex)
    ns         the namespace: "" (shared, directory "_") or 1..64 lowercase hex characters (directory = ns). The
               handoff proxy gives each tenant's session its own (request field `kvtransfer_ns`), so one tenant's
               blocks are never found, mapped or deleted under another's.
    h          chained hash, as vLLM's prefix cache: h_0 = sha256("kvtransfer.kv_store/<model key>/<B>/<ns>"),
               h_{j+1} = sha256(h_j || token ids of block j as little-endian int64); block j is named h_{j+1}.
               A block therefore stands for the whole prefix 0 .. (j+1)*B - 1, through that model, in that
               namespace: the same tokens in two namespaces never share a hash or a file.
    tensors    token_ids int64 [B]; k, v [n_layers, n_kv, B, head_dim] (keys post-RoPE, as the model caches them)
    header     (safetensors metadata "kvtransfer", JSON) {"format": "kvtransfer.kv_block", "version": 4,
               "model": identity, "ns": ns, "block": j, "parent": h_j, "hash": h_{j+1}, "block_size": B, "dtype",
               "checksum": "crc32:<8 hex>" of the token_ids, k and v bytes}

Only full blocks are stored (a prompt's last n % B tokens are the target's to compute), and no whole block is
stored twice: turn t + 1 of a conversation writes only the blocks turn t did not, and a consumer maps the
longest stored prefix of any prompt (`lookup`). Blocks are written atomically and durably (temporary file, fsync,
rename, directory fsync: kvtransfer.core.io) and never overwritten -- except a torn one (a file whose size is not
the size its own header declares, left by a crash before writes were fsynced), which counts as missing: the next
write replaces it. A write or read stamps the mtimes of the prompt's whole chain, block 0 the newest, so
least-recently-used eviction (`max_bytes`) takes a chain's tail before its head and never leaves a block
unreachable behind a missing one. `retention_s` removes blocks nobody used for that long, `delete_namespace` a
session's namespace (directory by directory: no header is read, no `parent` followed), and eviction / expiry
remove temporary files orphaned by a killed writer once they are an hour old.

Several processes may share one directory (two engines, or engines on two nodes that mount the same
shared filesystem with atomic rename, e.g. NFSv4 / Lustre / CephFS): a reader sees a whole block or none;
a block evicted between the scheduler's `lookup` and the worker's `read` is a `BadEntry("evicted")`, which the
connector turns into a recompute. Every block's checksum is verified, and its token ids compared with the
request's prompt, before it is returned (`read`); `lookup` checks headers only.
"""
from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from ..core.io import atomic_write_bytes, fsync_dir
from .blockformat import (DEFAULT_BLOCK_SIZE, DTYPES as _DTYPES, FORMAT, HASH as _HASH, MAX_HEADER as _MAX_HEADER,  # noqa: F401
                          MODEL_KEY as _MODEL_KEY, NS as _NS, STORE_FORMAT, VERSION, BadEntry, Prefix,
                          block_header, check_block_header, check_hash, check_layers, check_model_key,
                          check_namespace, checksum, ids_bytes as _ids_bytes, is_int as _is_int,
                          parse_block, plan_write, prompt_key, verify_block, Assembler, Scratch)
from .blockstore import BlockStore, walk_chain
from .ident import identity_from_config  # noqa: F401 -- re-exported (older imports)

LAYOUT = 3  # store.json's "layout": 1 (no field) had no namespace level and another chain seed; 2 held v3 blocks
#            (SHA-256 checksums), which a v4 reader refuses and a v4 writer would never replace (it skips whole files)
SHARED_NS_DIR = "_"  # the directory of namespace "" (a session namespace is hex, so never "_")
TMP_MAX_AGE_S = 3600.0  # a temporary file this old belongs to a writer that died (a block takes well under this)

log = logging.getLogger("kvtransfer.serve")


def _ns_dir(ns: str) -> str:
    return ns or SHARED_NS_DIR


class KVStore(BlockStore):
    """A directory of blocks: `write` (producer side), `lookup` / `read` (consumer side), `evict`, `expire`,
    `delete_namespace`.

    block_size: tokens per block; fixed by the first process that opens the directory (store.json, created
    exclusively) -- a different value asked later is ignored in favour of the directory's. max_bytes: size cap of
    all blocks (None: no cap): a write that takes the tracked usage over it evicts least-recently-used blocks down
    to evict_to * max_bytes (the gap is what the next writes fill before the store is scanned again).
    retention_s: blocks not written or read for this long are removed (checked at most once a minute by writes).
    `stats` counts torn blocks rewritten, orphaned temporary files removed, blocks evicted / expired, and scans.
    """

    OPTIONS = ("block_size", "max_bytes", "retention_s", "evict_to")  # what open_store passes on

    def __init__(self, root: str | Path, *, block_size: int | None = None, max_bytes: int | None = None,
                 retention_s: float | None = None, evict_to: float = 0.9):
        self.root = Path(root)
        if retention_s is not None and (not isinstance(retention_s, (int, float)) or retention_s <= 0):
            raise ValueError(f"retention_s={retention_s!r}: a positive number of seconds")
        self.retention_s = retention_s
        self._expired_at = 0.0
        self._usage: int | None = None  # bytes of all blocks: learnt by the first scan, then tracked per write
        if block_size is not None and (not _is_int(block_size) or block_size < 1):
            raise ValueError(f"block_size={block_size!r}: a positive integer number of tokens")
        if max_bytes is not None and (not _is_int(max_bytes) or max_bytes < 0):
            raise ValueError(f"max_bytes={max_bytes!r}: a non-negative integer number of bytes")
        if isinstance(evict_to, bool) or not isinstance(evict_to, (int, float)) or not 0 < evict_to <= 1:
            raise ValueError(f"evict_to={evict_to!r}: the fraction of max_bytes eviction leaves, in (0, 1]")
        self.max_bytes, self.evict_to = max_bytes, float(evict_to)
        self._whole_sizes: set[int] = set()  # file sizes of blocks seen whole (header-declared size == file size)
        self._scratch = Scratch()  # the reused encode buffer, one per writing thread
        self.stats = {"torn_rewritten": 0, "tmp_removed": 0, "evicted": 0, "expired": 0, "scans": 0}
        self.block_size = self._open_meta(block_size)

    def _meta(self, block_size: int) -> dict:
        return {"format": STORE_FORMAT, "layout": LAYOUT, "block_size": block_size}

    def _open_meta(self, asked: int | None) -> int:
        """The directory's block size from store.json (created exclusively when missing); ValueError for a file
        that is not a store of this layout."""
        meta = self.root / "store.json"
        if not meta.is_file():
            _create_exclusive(meta, self._meta(asked or DEFAULT_BLOCK_SIZE))
        try:
            data = json.loads(meta.read_text())
            fmt, layout, got = data.get("format"), data.get("layout", 1), data.get("block_size")
        except (OSError, ValueError, AttributeError) as err:
            raise ValueError(f"{meta} is unreadable ({err}): remove it (the store's block size is recorded there)")
        if fmt != STORE_FORMAT:
            raise ValueError(f"{meta}: format {fmt!r} is not a kvtransfer store's ({STORE_FORMAT!r}); point the "
                             f"store at a new directory")
        if layout != LAYOUT:
            age = "an older" if _is_int(layout) and layout < LAYOUT else "another"
            raise ValueError(f"{self.root} was written by {age} kvtransfer (layout {layout!r}; this one reads layout "
                             f"{LAYOUT}): point the store at a new directory or remove it")
        if not _is_int(got) or got < 1:
            raise ValueError(f"{meta}: block_size {got!r} is not a positive integer; remove the file")
        return got

    def _ensure_meta(self) -> None:
        """Re-create store.json when the directory was removed under a running store (so the next process to open
        it agrees on this block size instead of finding blocks without one)."""
        meta = self.root / "store.json"
        if not meta.exists():
            _create_exclusive(meta, self._meta(self.block_size))

    # ---------------------------------------------------------------- keys
    def block_path(self, model_key: str, h: str, ns: str = "") -> Path:
        """The file of block `h` (64 hex) of model `model_key` in namespace `ns`; ValueError for a key, hash or
        namespace that is not one (none can name a path outside the store)."""
        check_model_key(model_key)
        check_hash(h)
        return self._path(model_key, h, _ns_dir(check_namespace(ns)))

    def _path(self, model_key: str, h: str, ns_dir: str) -> Path:
        """block_path without the checks (for hashes this store computed from checked arguments)."""
        return self.root / model_key / ns_dir / h[:2] / f"{h}.safetensors"

    def local_dir(self) -> Path:
        """The store's own directory (the consumer's `sinks/` cache lives in it)."""
        return self.root

    def model_keys(self) -> list[str]:
        """Model keys with a directory in the store (only names that are model keys: the consumer's `sinks/`, a
        launcher's `logs/` and the like are not models)."""
        return sorted(e.name for e in _subdirs(self.root) if _MODEL_KEY.fullmatch(e.name))

    def others(self, token_ids, model_key: str, ns: str = "") -> list[str]:
        """Keys of other models that stored the first block of these token ids in namespace `ns` (for a clear
        wrong_pair reason)."""
        out = []
        for key in self.model_keys():
            if key != model_key:
                first = self.hashes(list(token_ids)[:self.block_size], key, ns)
                if first and self._whole_size(self._path(key, first[0], _ns_dir(ns))) is not None:
                    out.append(key)
        return out

    def _whole_size(self, path: Path) -> int | None:
        """The size in bytes of the block file at `path` if it is whole, else None (missing, or torn: its size is
        not the one its header declares). One stat; see `_is_whole`."""
        try:
            size = os.stat(path).st_size
        except OSError:
            return None
        return size if self._is_whole(path, size) else None

    def _is_whole(self, path: Path, size: int) -> bool:
        """Whether the file at `path`, `size` bytes, is as long as its header declares. The header is read only for
        a size not yet seen whole (a few per process: one per identity, dtype and header length), so checking a
        chain costs one stat per block."""
        if size in self._whole_sizes:
            return True
        if _declared_size(path) != size:
            return False
        if len(self._whole_sizes) < 256:  # bounded: a store of crafted files cannot grow it without limit
            self._whole_sizes.add(size)
        return True

    # ---------------------------------------------------------------- producer
    def stored_blocks(self, token_ids, model_key: str, ns: str = "") -> int:
        """How many leading full blocks of `token_ids` the store holds whole for `model_key` in namespace `ns` (what
        a producer need not gather again; `lookup` checks headers).

        Cost (the producer's writer thread asks after each save, kvtransfer.serve.writer; never vLLM's scheduler
        thread): one stat per block up to the first missing or torn one -- about
        2,000 for a 32K-token prompt whose blocks are all stored, milliseconds on a local disk -- plus, once per
        process, one header read per block file size (see `_whole_size`).
        """
        n, ns_dir = 0, _ns_dir(check_namespace(ns))
        for h in self.hashes(token_ids, model_key, ns):
            if self._whole_size(self._path(model_key, h, ns_dir)) is None:
                break
            n += 1
        return n

    def write(self, token_ids, layers: list[tuple[torch.Tensor, torch.Tensor]], model: dict, *, first: int = 0,
              ns: str = "") -> int:
        """Store the full blocks of prompt `token_ids` (n ids) from token `first` on (a multiple of the block size:
        the blocks before it are already stored) in namespace `ns`; `layers`: per-layer (keys, values)
        [n_kv, n - first, head_dim] of tokens first..n-1 (float32 / bfloat16 / float16).

        model: a serving identity (kvtransfer.serve.ident, with "key"). Whole blocks already stored are skipped; a
        torn one is replaced. Every block of the prompt's chain gets a fresh mtime, block 0 the newest, so
        least-recently-used eviction takes a chain's tail first and never strands a block behind a missing one.
        Returns the number of blocks written. ValueError on shapes that are not the model's, a `first` that is not
        on a block boundary, or a bad namespace; OSError (a full disk, ...) from the block that failed (the blocks
        before it are whole, it leaves no file).
        """
        plan = plan_write(token_ids, layers, model, first, ns, self.block_size)
        key, ns_dir, B = plan.key, _ns_dir(ns), self.block_size
        hashes = plan.hashes
        written, paths = 0, []
        renamed: set[Path] = set()  # directories that got a block: each fsynced once, after the loop
        try:
            for j, h in enumerate(hashes):
                path = self._path(key, h, ns_dir)
                paths.append(path)
                if j * B < first:
                    continue
                try:
                    old = os.stat(path).st_size
                except OSError:
                    old = None
                if old is not None:
                    if self._is_whole(path, old):
                        continue
                    self.stats["torn_rewritten"] += 1  # a crash's leftover: replaced by the rename below
                    log.warning("kvtransfer: store block %s is torn (%d bytes, not the size its header declares); "
                                "rewriting it", path, old)
                if not written:
                    self._ensure_meta()
                rows, _ = plan.encode(j, j + 1, self._scratch)
                # the file is fsynced before its rename (never torn); only the renames' durability waits for the
                # directory fsyncs below, one per directory instead of one per block
                size = atomic_write_bytes(path, memoryview(rows[0].numpy()))
                renamed.add(path.parent)
                written += 1
                if self._usage is not None:
                    self._usage += size - (old or 0)
        finally:
            for directory in renamed:
                fsync_dir(directory)
        _touch_chain(paths)
        if written and self.max_bytes is not None and (self._usage is None or self._usage > self.max_bytes):
            self.evict()
        if written and self.retention_s is not None and time.time() - self._expired_at >= 60:
            self.expire()
        return written

    # ---------------------------------------------------------------- consumer
    def check_header(self, path: Path, model_key: str, j: int, parent: str, h: str, ns: str = "") -> dict:
        """The header of block j (hash h, parent hash `parent`, namespace `ns`) at `path`, checked against its
        tensors' shapes without reading them; raises BadEntry(reason, message). Every field is type-checked (a
        header written by anything else cannot raise anything but BadEntry)."""
        try:
            with safe_open(str(path), framework="pt") as f:
                header = json.loads((f.metadata() or {}).get("kvtransfer", "{}"))
                shapes = {name: (tuple(f.get_slice(name).get_shape()), f.get_slice(name).get_dtype())
                          for name in f.keys()}
        except Exception as err:  # noqa: BLE001 -- safetensors raises RuntimeError for a file removed meanwhile
            raise _unreadable(path, err) from err
        return check_block_header(header, shapes, str(path), model_key, j, parent, h, ns, self.block_size)

    def lookup(self, token_ids, model_key: str, ns: str = "") -> Prefix:
        """The longest stored prefix of `token_ids` written by model `model_key` in namespace `ns` (headers checked,
        data not read).

        The chain stops at the first missing block, or at a block whose header is bad or torn (then `detail` says
        why, prefixed with its BadEntry reason: "<reason>: <message>").
        """
        hashes = self.hashes(token_ids, model_key, ns)
        ns_dir = _ns_dir(ns)

        def check(j: int, h: str, parent: str) -> tuple[str, dict] | None:
            path = self._path(model_key, h, ns_dir)
            if not path.is_file():
                return None
            return str(path), self.check_header(path, model_key, j, parent, h, ns)

        return walk_chain(self, model_key, ns, hashes, check)

    def read(self, prefix: Prefix, token_ids, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [n_kv, hi - lo, head_dim] of tokens lo..hi-1 from the blocks of `prefix` (in its
        namespace).

        token_ids: the request's prompt (at least hi ids): each block's stored ids must equal its slice.
        Every block read is checksum-verified. Raises BadEntry: "evicted" (a block is gone), "checksum"
        (its bytes changed), "corrupt" (unreadable, ids differ from the prompt), "too_short" (hi beyond the prefix).
        """
        B = self.block_size
        prompt = list(token_ids)
        if not 0 <= lo < hi <= min(prefix.n_tokens, len(prompt)):
            raise BadEntry("too_short", f"tokens {lo}..{hi} are not inside the prefix of {prefix.n_tokens} "
                                        f"stored tokens of a {len(prompt)}-token prompt")
        out = Assembler(prompt, lo, hi, B)
        for j in range(lo // B, (hi - 1) // B + 1):
            path = self.block_path(prefix.model_key, prefix.hashes[j], prefix.ns)
            out.add(j, _read_bytes(path), str(path))
        _touch_chain([self._path(prefix.model_key, h, _ns_dir(prefix.ns))
                      for h in prefix.hashes[:(hi - 1) // B + 1]])
        return out.layers()

    # ---------------------------------------------------------------- size
    def _files(self, ns: str | None = None):
        """(path, is_block) of every block and temporary file in the store's block directories
        (<model key>/<ns dir>/<xx>/; only `ns`'s when given). Directories are listed, never followed through a
        symlink, so nothing outside the store is reached; names are checked at every level."""
        only = None if ns is None else _ns_dir(ns)
        for key in self.model_keys():
            for ns_entry in _subdirs(self.root / key):
                name = ns_entry.name
                if only is not None and name != only:
                    continue
                if only is None and not (name == SHARED_NS_DIR or _NS.fullmatch(name)):
                    continue
                for xx in _subdirs(ns_entry.path):
                    if len(xx.name) != 2:
                        continue
                    for f in _scandir(xx.path):
                        try:
                            if not (f.is_file(follow_symlinks=False) or f.is_symlink()):
                                continue
                        except OSError:
                            continue
                        if f.name.endswith(".safetensors") and not f.name.startswith("."):
                            yield f.path, True
                        elif f.name.startswith(".") and f.name.endswith(".tmp"):
                            yield f.path, False

    def _scan(self, now: float | None = None) -> list[tuple[float, int, Path]]:
        """(mtime, bytes, path) of every block (files that vanish while listed are skipped); removes temporary files
        older than TMP_MAX_AGE_S on the way (a killed writer's), counted in stats["tmp_removed"]."""
        now = time.time() if now is None else now
        out = []
        self.stats["scans"] += 1
        for path, is_block in self._files():
            try:
                st = os.stat(path, follow_symlinks=False)
            except OSError:
                continue
            if is_block:
                out.append((st.st_mtime, st.st_size, Path(path)))
            elif now - st.st_mtime > TMP_MAX_AGE_S:
                try:
                    os.unlink(path)
                    self.stats["tmp_removed"] += 1
                except OSError:
                    pass
        return out

    def blocks(self) -> list[tuple[float, int, Path]]:
        """(mtime in seconds, bytes, path) of every block file, all namespaces (files that vanish while listed are
        skipped)."""
        return self._scan()

    def usage(self) -> int:
        """Bytes of all blocks (a scan)."""
        return sum(size for _, size, _ in self.blocks())

    def evict(self, max_bytes: int | None = None) -> int:
        """Remove least-recently-used blocks (oldest mtime first), all namespaces; returns the number removed.

        max_bytes given: down to at most max_bytes. Default: only when the blocks take more than the store's cap,
        and then down to evict_to * cap (hysteresis: the writes that follow fill the gap before the next scan, so a
        full store is scanned once per (1 - evict_to) * cap bytes written, not on every write). Within a chain the
        tail is always older than its head (`write` / `read` stamp them so), so eviction shortens chains from the
        end instead of breaking them. Safe beside readers and other evictors: a block another process removed first
        is skipped, and a reader of a removed block falls back."""
        if max_bytes is None:
            if self.max_bytes is None:
                return 0
            over, goal = self.max_bytes, int(self.max_bytes * self.evict_to)
        else:
            over = goal = max_bytes
        blocks = sorted(self._scan(), key=lambda b: (b[0], str(b[2])))
        total, removed = sum(b[1] for b in blocks), 0
        if total > over:
            for _, size, path in blocks:
                if total <= goal:
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
        self.stats["evicted"] += removed
        return removed

    def expire(self, retention_s: float | None = None, now: float | None = None) -> int:
        """Remove every block, all namespaces, not written or read for `retention_s` seconds (default the store's
        retention; none: no block), and temporary files older than TMP_MAX_AGE_S (a killed writer's, counted in
        stats["tmp_removed"]); returns the number of blocks removed. `write` calls it at most once a minute."""
        keep = self.retention_s if retention_s is None else retention_s
        now = time.time() if now is None else now
        self._expired_at = now
        removed = 0
        for mtime, size, path in self._scan(now):
            if keep is not None and now - mtime > keep:
                try:
                    path.unlink()
                except OSError:
                    continue
                removed += 1
                if self._usage is not None:
                    self._usage -= size
        self.stats["expired"] += removed
        return removed

    def delete_namespace(self, ns: str) -> int:
        """Remove every block of namespace `ns` (1..64 lowercase hex), under every model key, with its temporary
        files; returns the number of blocks removed. Only the namespace's directories are listed: no header is read
        and no `parent` field followed, so no block's content can make it delete anything else. ValueError for ""
        (the shared namespace belongs to no session) or a malformed namespace."""
        if check_namespace(ns) == "":
            raise ValueError("delete_namespace(\"\"): the shared namespace belongs to no session; its blocks leave "
                             "by eviction (max_bytes) or retention (retention_s)")
        removed = 0
        for path, is_block in self._files(ns):
            size = 0
            if is_block and self._usage is not None:
                try:
                    size = os.stat(path, follow_symlinks=False).st_size
                except OSError:
                    continue
            try:
                os.unlink(path)  # a symlink is unlinked itself, never its target
            except OSError:
                continue
            if is_block:
                removed += 1
                if self._usage is not None:
                    self._usage -= size
        for key in self.model_keys():  # the emptied directories (a write racing in keeps its own: rmdir fails)
            ns_path = self.root / key / ns
            for xx in _subdirs(ns_path):
                _rmdir(xx.path)
            _rmdir(ns_path)
        return removed

    def delete_chain(self, tip: str) -> int:
        """Removed: it followed block headers' `parent` fields, which a crafted header could point anywhere, and it
        deleted blocks other sessions share. Raises NotImplementedError naming the replacement."""
        raise NotImplementedError("KVStore.delete_chain was removed: give each session a namespace (request field "
                                  "kvtransfer_ns) and delete it with KVStore.delete_namespace(ns)")

    def tip(self, token_ids, model_key: str | None = None, ns: str = "") -> tuple[str, str, int] | None:
        """(model key, hash, tokens) of the last stored block of `token_ids`'s chain in namespace `ns` under
        `model_key` (default: whichever model in the store holds the first block); None when nothing is stored."""
        for key in ([model_key] if model_key else self.model_keys()):
            n = self.stored_blocks(token_ids, key, ns)
            if n:
                return key, self.hashes(list(token_ids)[:n * self.block_size], key, ns)[-1], n * self.block_size
        return None


def _read_bytes(path: Path) -> bytearray:
    """A block file's bytes, read once. BadEntry("evicted") for a file that is gone."""
    try:
        with open(path, "rb") as f:
            buf = bytearray(os.fstat(f.fileno()).st_size)
            f.readinto(buf)
    except OSError as err:
        raise _unreadable(path, err) from err
    return buf


def _scandir(path):
    """os.scandir's entries of `path` (none when it is gone or unreadable)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except OSError:
        return []


def _subdirs(path):
    """The entries of `path` that are directories themselves (a symlink to one is not)."""
    out = []
    for e in _scandir(path):
        try:
            if e.is_dir(follow_symlinks=False):
                out.append(e)
        except OSError:
            pass
    return out


def _rmdir(path) -> None:
    try:
        os.rmdir(path)
    except OSError:
        pass


def _declared_size(path: Path) -> int | None:
    """The size in bytes a safetensors file declares (8 + header length + its tensors' data), None when its header
    is unreadable (a torn or foreign file)."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            if len(head) < 8 or not 0 < n <= _MAX_HEADER:
                return None
            raw = f.read(n)
        meta = json.loads(raw)
        ends = [spec["data_offsets"][1] for name, spec in meta.items() if name != "__metadata__"]
        if len(raw) < n or not ends or not all(_is_int(e) and e >= 0 for e in ends):
            return None
        return 8 + n + max(ends)
    except (OSError, ValueError, KeyError, TypeError, IndexError, AttributeError):
        return None


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
