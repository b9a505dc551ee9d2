"""The block format every store backend shares: names, chained hashes, a block's header, its bytes, and the checks a
reader makes before it trusts one.

A block is a safetensors blob (token_ids int64 [B]; k, v [n_layers, n_kv, B, head_dim]) whose metadata "kvtransfer"
holds the JSON header {"format": FORMAT, "version": VERSION, "model": identity, "ns", "block": j, "parent": h_j,
"hash": h_{j+1}, "block_size": B, "dtype", "checksum"}; the checksum is "crc32:<8 hex>", zlib's CRC-32 over the
token_ids, k and v bytes in that order. The directory store (kvtransfer.serve.store) keeps each as a file, the Redis
store (kvtransfer.serve.redis_store) as a value: the same bytes, made and checked by this module.

The checksum guards against torn, truncated or flipped bytes (a fault), not against a writer: whoever can write the
store can write any bytes and any checksum, so a keyed or cryptographic digest would buy nothing there, and CRC-32
runs at ~4 GB/s where SHA-256 runs at ~1.7 (it sits on the switch's critical path, once per byte read). What names a
block -- the chained hash below, which a tenant's prompt steers -- stays SHA-256.

Chained hashes, as vLLM's prefix cache: h_0 = sha256("kvtransfer.kv_store/<model key>/<B>/<ns>"),
h_{j+1} = sha256(h_j || token ids of block j as little-endian int64); block j is named h_{j+1}, so a block stands
for the whole prefix 0 .. (j+1)*B - 1 through that model in that namespace.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import threading
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

FORMAT, VERSION, STORE_FORMAT = "kvtransfer.kv_block", 4, "kvtransfer.kv_store"
DEFAULT_BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
MODEL_KEY = re.compile(r"[0-9a-f]{16}")
NS = re.compile(r"[0-9a-f]{1,64}")
HASH = re.compile(r"[0-9a-f]{64}")
MAX_HEADER = 1 << 20  # a block header (identity + shapes) is ~1 KB; a larger length field is a torn or foreign blob
MAX_BLOCK_INDEX = 10 ** 9 - 1  # the header's room for "block": j (a 16-token block size: 16 G tokens)
INT_VIEWS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
NP_INTS = {1: np.uint8, 2: np.int16, 4: np.int32, 8: np.int64}


def check_namespace(ns) -> str:
    """`ns` itself if it is a store namespace -- "" (shared) or 1..64 lowercase hex characters -- else ValueError."""
    if isinstance(ns, str) and (ns == "" or NS.fullmatch(ns)):
        return ns
    raise ValueError(f"namespace {ns!r}: use \"\" (the shared namespace) or 1..64 lowercase hex characters "
                     f"(e.g. a hex digest naming a tenant's session)")


def check_model_key(model_key) -> str:
    """`model_key` itself if it is a store model key (16 lowercase hex: kvtransfer.serve.ident.weights_key), else
    ValueError (a key names a directory or a Redis key: nothing else may reach either)."""
    if isinstance(model_key, str) and MODEL_KEY.fullmatch(model_key):
        return model_key
    raise ValueError(f"model key {model_key!r} is not 16 lowercase hex characters: pass the producer's "
                     f"kvtransfer.serve.ident serving identity's 'key'")


def check_hash(h) -> str:
    """`h` itself if it is a block hash (64 lowercase hex), else ValueError."""
    if isinstance(h, str) and HASH.fullmatch(h):
        return h
    raise ValueError(f"{h!r} is not a block hash (64 lowercase hex characters)")


class BadEntry(ValueError):
    """A block that exists but cannot be used; `reason` is a short counter name (corrupt, mis-shaped, checksum,
    evicted, store_unavailable, ...)."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def ids_bytes(token_ids) -> bytes:
    return torch.as_tensor(list(token_ids), dtype=torch.int64).numpy().astype("<i8").tobytes()  # device: host bytes for a key


def prompt_key(token_ids) -> str:
    """sha256 hex of the token ids (int64, little-endian)."""
    return hashlib.sha256(ids_bytes(token_ids)).hexdigest()


def chain_seed(model_key: str, block_size: int, ns: str = "") -> str:
    """h_0 (64 hex): the chain's root hash for a model key, a block size and a namespace (all checked)."""
    check_model_key(model_key)
    check_namespace(ns)
    return hashlib.sha256(f"{STORE_FORMAT}/{model_key}/{block_size}/{ns}".encode()).hexdigest()


def chain_hashes(token_ids, model_key: str, block_size: int, ns: str = "") -> list[str]:
    """h_1 .. h_m of the m = len(token_ids) // block_size full blocks of a prompt."""
    ids = list(token_ids)
    B = block_size
    m = len(ids) // B
    raw = ids_bytes(ids[:m * B])  # one conversion; each block hashes its 8 * B bytes of it
    h = chain_seed(model_key, B, ns)
    out = []
    for j in range(m):
        h = hashlib.sha256(h.encode() + raw[8 * B * j:8 * B * (j + 1)]).hexdigest()
        out.append(h)
    return out


def checksum(token_ids: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """"crc32:<8 hex>" of a block's bytes: token ids, then keys, then values (each contiguous, native byte order)."""
    crc = 0
    for t in (token_ids, k, v):
        crc = zlib.crc32(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy(), crc)  # the buffer
    return f"crc32:{crc:08x}"


@dataclass(frozen=True)
class Prefix:
    """The longest stored prefix of a prompt: `n_blocks` consecutive blocks (hashes in order) of `block_size`, found
    under model `model_key` in namespace `ns`."""

    model_key: str
    block_size: int
    hashes: tuple[str, ...] = ()
    model: dict = field(default_factory=dict)
    detail: str = ""  # why the chain stopped before the prompt's last full block (a bad block, an outage), if it did
    ns: str = ""

    @property
    def n_blocks(self) -> int:
        return len(self.hashes)

    @property
    def n_tokens(self) -> int:
        return self.n_blocks * self.block_size


def storable_dtype(t: torch.Tensor) -> str:
    """The header's dtype name of a cache tensor; ValueError for one the store cannot hold."""
    name = next((name for name, dt in DTYPES.items() if dt == t.dtype), None)
    if name is None:
        raise ValueError(f"cache dtype {t.dtype} is not storable; use one of {sorted(DTYPES)}")
    return name


def check_layers(layers, model: dict, n_tokens: int) -> str:
    """The dtype name of per-layer (keys, values) [n_kv, n_tokens, head_dim] that match identity `model`, else
    ValueError naming both shapes."""
    k0 = layers[0][0]
    dtype = storable_dtype(k0)
    want = (model["n_kv"], n_tokens, model["head_dim"])
    if len(layers) != model["n_layers"] or any(tuple(t.shape) != want for kv in layers for t in kv):
        raise ValueError(f"{len(layers)} layers of {tuple(k0.shape)} do not match the model's "
                         f"{model['n_layers']} layers of {want}")
    return dtype


@dataclass
class WritePlan:
    """A validated write: the model identity and key, the namespace, the block size, the prompt's ids, its chain
    (seed, hashes), the cache dtype's name, and the per-layer (keys, values) [n_kv, n - first, d] of its tokens from
    `first` (a block boundary) on. `encode` turns blocks into their bytes."""

    model: dict
    key: str
    ns: str
    block_size: int
    ids: torch.Tensor
    seed: str
    hashes: list[str]
    dtype: str
    layers: list
    first: int

    def block_bytes(self) -> int:
        """The bytes of one block's tensors (token ids, keys, values): a blob is these plus a ~1 KB header."""
        m = self.model
        return 8 * self.block_size + 2 * m["n_layers"] * m["n_kv"] * self.block_size * m["head_dim"] * \
            DTYPES[self.dtype].itemsize

    def encode(self, lo: int, hi: int, scratch: "Scratch | None" = None) -> tuple[torch.Tensor, list[int]]:
        """(blobs, sizes): blocks lo..hi-1 of the prompt (each at or after `first`) as one uint8 tensor [hi - lo,
        size], row i the whole bytes of block lo + i -- a safetensors blob (token_ids, k, v) whose metadata holds its
        header, padded with spaces to a length that depends only on the identity, namespace and dtype -- and the
        size of each row (all equal). The K/V are copied once, from the layers straight into the rows (on integer
        views: CPU copies of bfloat16 take a slow path), and each row's checksum is taken from the row itself.
        `scratch`: a buffer the rows are made in (reused across calls; the rows are valid until its next use),
        else a new one."""
        B, m = self.block_size, self.model
        top = min(len(self.hashes), (self.first + self.layers[0][0].shape[1]) // B)   # full blocks the layers hold
        if not self.first // B <= lo <= hi <= top:
            raise ValueError(f"blocks {lo}..{hi} are not among the plan's {self.first // B}..{top}")
        n, L, n_kv, d = hi - lo, m["n_layers"], m["n_kv"], m["head_dim"]
        elt = DTYPES[self.dtype].itemsize
        ids_b, kv_b = 8 * B, L * n_kv * B * d * elt
        length, head = _padded_head(self.model, self.ns, self.dtype, B, ids_b, kv_b)
        base = 8 + length
        size = base + ids_b + 2 * kv_b
        rows = (scratch or Scratch()).take(n * size).view(n, size)
        data = rows[:, base:]
        data[:, :ids_b].view(torch.int64).copy_(self.ids[lo * B:hi * B].view(n, B))
        ints = INT_VIEWS[elt]
        a = lo * B - self.first
        for i, off in enumerate((ids_b, ids_b + kv_b)):  # keys, then values
            dest = data[:, off:off + kv_b].view(ints).view(n, L, n_kv, B, d)
            for layer, kv in enumerate(self.layers):
                src = raw_view(kv[i])[:, a:a + n * B]          # [n_kv, n * B, d]
                dest[:, layer].copy_(src.reshape(n_kv, n, B, d).transpose(0, 1))
        out = rows.numpy()  # the same memory: per-row work in numpy costs microseconds, not a tensor op's overhead
        for r in range(n):
            j = lo + r
            digest = f"crc32:{zlib.crc32(out[r, base:]):08x}"
            out[r, :base] = np.frombuffer(head(j, self.hashes[j - 1] if j else self.seed, self.hashes[j], digest),
                                          dtype=np.uint8)
        return rows, [size] * n


class Scratch(threading.local):
    """A host byte buffer that grows to the largest request and is reused: fresh pages of a large allocation cost a
    page fault each on first touch (measured: ~0.5 ms per MB on a VM, five times the copy that fills them). Each
    thread sees its own buffer (a threading.local), so a store's writer thread and any other caller never share."""

    def __init__(self):
        self.buf = torch.empty(0, dtype=torch.uint8)  # device: host bytes, written to the store

    def take(self, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of the buffer (grown when smaller), uint8 [nbytes]."""
        if self.buf.numel() < nbytes:
            self.buf = torch.empty(nbytes, dtype=torch.uint8)  # device: host bytes, written to the store
        return self.buf[:nbytes]


def _padded_head(model: dict, ns: str, dtype: str, block_size: int, ids_b: int, kv_b: int):
    """(length, head): head(j, parent, h, digest) is the first 8 + length bytes of block j's blob -- the 8-byte
    length, then the safetensors header (block j's kvtransfer header in its metadata) padded with spaces to
    `length`, one length for every j <= MAX_BLOCK_INDEX, so 8 + length is a multiple of 8 (the tensors' bytes start
    aligned)."""
    st, B = ST_DTYPES[dtype], block_size
    shape = [model["n_layers"], model["n_kv"], B, model["head_dim"]]
    tensors = {"token_ids": {"dtype": "I64", "shape": [B], "data_offsets": [0, ids_b]},
               "k": {"dtype": st, "shape": shape, "data_offsets": [ids_b, ids_b + kv_b]},
               "v": {"dtype": st, "shape": shape, "data_offsets": [ids_b + kv_b, ids_b + 2 * kv_b]}}

    def text(j, parent, h, digest) -> bytes:
        header = block_header(model, ns, j, parent, h, B, dtype, digest)
        return json.dumps({"__metadata__": {"kvtransfer": json.dumps(header, default=str)}, **tensors}).encode()

    widest = len(text(MAX_BLOCK_INDEX, "0" * 64, "0" * 64, "crc32:00000000"))
    length = -(-(8 + widest) // 8) * 8 - 8

    def head(j, parent, h, digest) -> bytes:
        if not 0 <= j <= MAX_BLOCK_INDEX:
            raise ValueError(f"block index {j} is beyond the format's {MAX_BLOCK_INDEX}")
        body = text(j, parent, h, digest)
        return length.to_bytes(8, "little") + body + b" " * (length - len(body))
    return length, head


def plan_write(token_ids, layers, model: dict, first: int, ns: str, block_size: int) -> WritePlan:
    """The checks every store makes before writing a prompt's blocks from token `first` on; ValueError on a model
    that is not a serving identity, a bad namespace, a `first` off a block boundary, or shapes that are not the
    model's. Nothing is copied until `WritePlan.encode`."""
    if not isinstance(model, dict) or not isinstance(model.get("key"), str):
        raise ValueError("model must be a serving identity with a 'key' (kvtransfer.serve.ident.serving_identity)")
    key = check_model_key(model["key"])
    check_namespace(ns)
    B = block_size
    ids = torch.as_tensor(list(token_ids), dtype=torch.int64)  # device: host-side ids, written to the store
    n = ids.numel()
    if not is_int(first) or first < 0 or first % B or first > n:
        raise ValueError(f"first={first!r}: a multiple of the block size {B} within the prompt's {n} tokens")
    dtype = check_layers(layers, model, n - first)
    layers = [(k.detach().cpu(), v.detach().cpu()) for k, v in layers]
    return WritePlan(model, key, ns, B, ids, chain_seed(key, B, ns), chain_hashes(ids.tolist(), key, B, ns), dtype,
                     layers, first)


def block_header(model: dict, ns: str, j: int, parent: str, h: str, block_size: int, dtype: str,
                 digest: str) -> dict:
    """The header of block j (hash h, parent hash `parent`)."""
    return {"format": FORMAT, "version": VERSION, "model": model, "ns": ns, "block": j, "parent": parent, "hash": h,
            "block_size": block_size, "dtype": dtype, "checksum": digest}


def encode_block(tensors: dict[str, torch.Tensor], header: dict) -> bytes:
    """A block's bytes: exactly what kvtransfer.core.io.atomic_save_tensors writes to a file."""
    from safetensors.torch import save

    return save({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                metadata={"kvtransfer": json.dumps(header, default=str)})


def parse_block(buf, where: str) -> tuple[dict, dict[str, torch.Tensor], str]:
    """(kvtransfer header, tensors, checksum) of a block's bytes `buf` (a bytearray: the tensors are views of it),
    the checksum being `checksum`'s CRC-32 over the token_ids, k and v bytes, taken in place. BadEntry("corrupt")
    for bytes that are not a readable block; `where` names the block in messages."""
    header, spans, digest = _spans(buf, where)
    tensors = {}
    try:
        for name, ((a, b), shape, st) in spans.items():
            dtype = TORCH_DTYPES[st]
            tensors[name] = torch.frombuffer(memoryview(buf)[a:b], dtype=dtype).view(shape) \
                if b > a else torch.empty(shape, dtype=dtype)  # device: read from bytes, as frombuffer
    except (KeyError, TypeError, RuntimeError) as err:
        raise BadEntry("corrupt", f"{where}: not a readable block ({type(err).__name__}: {err})") from err
    return header, tensors, digest


def peek_header(head: bytes, where: str) -> tuple[dict, dict]:
    """(kvtransfer header, {tensor name: (shape, safetensors dtype)}) from a block's first bytes (enough to hold its
    safetensors header); BadEntry("corrupt") when they are not a block's. Used to check a block without its data."""
    try:
        n = int.from_bytes(head[:8], "little")
        if len(head) < 8 or not 0 < n <= MAX_HEADER or len(head) < 8 + n:
            raise ValueError(f"header length {n} does not fit the {len(head)} bytes read")
        meta = json.loads(bytes(head[8:8 + n]))
        header = json.loads(meta.get("__metadata__", {}).get("kvtransfer", "{}"))
        shapes = {name: (tuple(spec["shape"]), spec["dtype"]) for name, spec in meta.items() if name != "__metadata__"}
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadEntry("corrupt", f"{where}: not a readable block ({type(err).__name__}: {err})") from err
    return header, shapes


def check_block_header(header, shapes: dict, where: str, model_key: str, j: int, parent: str, h: str, ns: str,
                       block_size: int) -> dict:
    """`header` if it is block j's (hash h, parent `parent`, namespace `ns`, model `model_key`) and agrees with its
    tensors' `shapes` ({name: (shape, safetensors dtype)}); else BadEntry(reason, message). Every field is
    type-checked: a header written by anything else cannot raise anything but BadEntry."""
    if not isinstance(header, dict) or header.get("format") != FORMAT or header.get("version") != VERSION:
        raise BadEntry("corrupt", f"{where}: not a {FORMAT} v{VERSION} block")
    m = header.get("model")
    if not isinstance(m, dict) or not all(is_int(m.get(k)) and m.get(k) > 0 for k in ("n_layers", "n_kv", "head_dim")):
        raise BadEntry("corrupt", f"{where}: header 'model' {m!r} is not an identity with integer n_layers, "
                                  f"n_kv, head_dim")
    if m.get("key") != model_key:
        raise BadEntry("wrong_pair", f"{where}: written by model {m.get('key')!r}, not {model_key}")
    if (not is_int(header.get("block")) or header["block"] != j or header.get("parent") != parent
            or header.get("hash") != h):
        raise BadEntry("corrupt", f"{where}: header names block {header.get('block')!r} / hash "
                                  f"{str(header.get('hash'))[:12]}, expected block {j} / {h[:12]}")
    if header.get("ns") != ns:
        raise BadEntry("corrupt", f"{where}: header names namespace {str(header.get('ns'))[:64]!r}, not {ns!r}")
    if not is_int(header.get("block_size")) or header["block_size"] != block_size:
        raise BadEntry("mis-shaped", f"{where}: block_size {header.get('block_size')!r}, store's {block_size}")
    if not isinstance(header.get("dtype"), str) or header["dtype"] not in DTYPES \
            or not isinstance(header.get("checksum"), str):
        raise BadEntry("corrupt", f"{where}: dtype {header.get('dtype')!r} or checksum missing")
    want = ((m["n_layers"], m["n_kv"], block_size, m["head_dim"]), ST_DTYPES[header["dtype"]])
    for name in ("k", "v"):
        if shapes.get(name) != want:
            raise BadEntry("mis-shaped", f"{where}: {name} is {shapes.get(name)}, header says {want}")
    if shapes.get("token_ids") != ((block_size,), "I64"):
        raise BadEntry("mis-shaped", f"{where}: token_ids is {shapes.get('token_ids')}, not ({block_size},) I64")
    return header


def verify_block(header, tensors: dict, digest: str, want_ids: list[int], where: str, span: str = ""):
    """(token_ids, k, v) of a parsed block whose checksum matches its header's and whose token ids are `want_ids`
    (the request's prompt slice); else BadEntry("checksum" | "corrupt")."""
    try:
        bid, k, v = tensors["token_ids"], tensors["k"], tensors["v"]
        ok = isinstance(header, dict) and digest == header.get("checksum")
    except (KeyError, RuntimeError, TypeError) as err:
        raise BadEntry("corrupt", f"{where}: {err}") from err
    if not ok:
        raise BadEntry("checksum", f"{where}: tensor bytes do not match the block's checksum (corrupt)")
    if bid.tolist() != want_ids:
        raise BadEntry("corrupt", f"{where}: stored token ids differ from the prompt's tokens {span}".rstrip())
    return bid, k, v


class Assembler:
    """Tokens lo..hi-1 of a stored prefix, assembled block by block straight from each block's bytes: every block's
    checksum is verified and its token ids compared with the prompt's before its K/V are copied, once, into the
    per-layer output (no intermediate tensors, no copy of the block's bytes). `layers()` returns the result."""

    def __init__(self, prompt: list[int], lo: int, hi: int, block_size: int):
        self.prompt, self.lo, self.hi, self.B = prompt, lo, hi, block_size
        self.keys = self.values = None   # [L, n_kv, hi - lo, d], made from the first block's shapes

    def add(self, j: int, buf, where: str) -> None:
        """Verify block j's bytes `buf` (any buffer: bytes, bytearray, memoryview) and copy its part of lo..hi-1 into
        the output; BadEntry("corrupt" | "checksum" | "mis-shaped") when it cannot be used."""
        B = self.B
        header, spans, digest = _spans(buf, where)
        if not isinstance(header, dict) or digest != header.get("checksum"):
            raise BadEntry("checksum", f"{where}: tensor bytes do not match the block's checksum (corrupt)")
        (ia, ib), _, _ = spans["token_ids"]
        want = self.prompt[j * B:(j + 1) * B]
        if ib - ia != 8 * B or np.frombuffer(buf, dtype="<i8", count=B, offset=ia).tolist() != want:
            raise BadEntry("corrupt", f"{where}: stored token ids differ from the prompt's tokens "
                                      f"{j * B}..{(j + 1) * B - 1}")
        _, shape, st = spans["k"]
        if self.keys is None:
            if len(shape) != 4 or shape[2] != B or st not in TORCH_DTYPES or st == "I64":
                raise BadEntry("mis-shaped", f"{where}: k is {shape} {st}, not [layers, kv heads, {B}, head dim]")
            L, n_kv, _, d = shape
            self.shape, self.st = (L, n_kv, B, d), st
            out = (L, n_kv, self.hi - self.lo, d)
            self.keys = torch.empty(out, dtype=TORCH_DTYPES[st])  # device: host tensors, the read's result
            self.values = torch.empty(out, dtype=TORCH_DTYPES[st])  # device: as above
        a, b = max(self.lo, j * B) - j * B, min(self.hi, (j + 1) * B) - j * B
        t0 = j * B + a - self.lo
        for name, out in (("k", self.keys), ("v", self.values)):
            (sa, sb), shape, st = spans[name]
            if tuple(shape) != self.shape or st != self.st:
                raise BadEntry("mis-shaped", f"{where}: {name} is {shape} {st}, the prefix's blocks {self.shape} "
                                             f"{self.st}")
            elt = out.element_size()
            if sb - sa != elt * math.prod(self.shape):
                raise BadEntry("mis-shaped", f"{where}: {name} holds {sb - sa} bytes, not those of {self.shape}")
            src = np.frombuffer(buf, dtype=NP_INTS[elt], count=(sb - sa) // elt, offset=sa).reshape(self.shape)
            out.view(INT_VIEWS[elt]).numpy()[:, :, t0:t0 + b - a] = src[:, :, a:b]

    def layers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per-layer (keys, values) [n_kv, hi - lo, head_dim]: views of the assembled output."""
        return [(self.keys[i], self.values[i]) for i in range(self.keys.shape[0])]


def _spans(buf, where: str) -> tuple[dict, dict, str]:
    """(kvtransfer header, {tensor name: ((start, end) byte offsets in buf, shape, safetensors dtype)}, checksum) of a
    block's bytes, the checksum CRC-32 over the token_ids, k and v bytes in place; BadEntry("corrupt") for bytes
    that are not a readable block."""
    view = memoryview(buf)
    try:
        n = int.from_bytes(view[:8], "little")
        if not 0 < n <= min(MAX_HEADER, len(view) - 8):
            raise ValueError(f"header length {n} does not fit {len(view)} bytes")
        meta = json.loads(bytes(view[8:8 + n]))
        header = json.loads(meta.get("__metadata__", {}).get("kvtransfer", "{}"))
        base, crc, spans = 8 + n, 0, {}
        for name in ("token_ids", "k", "v"):
            spec = meta[name]
            a, b = spec["data_offsets"]
            if not (is_int(a) and is_int(b) and 0 <= a <= b <= len(view) - base):
                raise ValueError(f"{name}'s bytes {a}..{b} lie outside the block")
            crc = zlib.crc32(view[base + a:base + b], crc)
            spans[name] = ((base + a, base + b), list(spec["shape"]), spec["dtype"])
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise BadEntry("corrupt", f"{where}: not a readable block ({type(err).__name__}: {err})") from err
    return header, spans, f"crc32:{crc:08x}"


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor of the same element size (copies of it take the fast path)."""
    return t.view(INT_VIEWS[t.element_size()])
