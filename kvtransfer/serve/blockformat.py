"""The block format every store backend shares: names, chained hashes, a block's header, its bytes, and the checks a
reader makes before it trusts one.

A block is a safetensors blob (token_ids int64 [B]; k, v [n_layers, n_kv, B, head_dim]) whose metadata "kvtransfer"
holds the JSON header {"format": FORMAT, "version": VERSION, "model": identity, "ns", "block": j, "parent": h_j,
"hash": h_{j+1}, "block_size": B, "dtype", "checksum"}. The directory store (kvtransfer.serve.store) keeps each as a
file, the Redis store (kvtransfer.serve.redis_store) as a value: the same bytes, made and checked by this module.

Chained hashes, as vLLM's prefix cache: h_0 = sha256("kvtransfer.kv_store/<model key>/<B>/<ns>"),
h_{j+1} = sha256(h_j || token ids of block j as little-endian int64); block j is named h_{j+1}, so a block stands
for the whole prefix 0 .. (j+1)*B - 1 through that model in that namespace.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

import torch

FORMAT, VERSION, STORE_FORMAT = "kvtransfer.kv_block", 3, "kvtransfer.kv_store"
DEFAULT_BLOCK_SIZE = 16
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
TORCH_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
MODEL_KEY = re.compile(r"[0-9a-f]{16}")
NS = re.compile(r"[0-9a-f]{1,64}")
HASH = re.compile(r"[0-9a-f]{64}")
MAX_HEADER = 1 << 20  # a block header (identity + shapes) is ~1 KB; a larger length field is a torn or foreign blob


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
    """sha256 hex of a block's bytes: token ids, then keys, then values (each contiguous, native byte order)."""
    h = hashlib.sha256()
    for t in (token_ids, k, v):
        h.update(t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())  # the buffer, not a copy
    return h.hexdigest()


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


def block_major(layers, m: int, block_size: int):
    """(keys, values), each [m / B, L, n_kv, B, d] contiguous, of the first m tokens of per-layer (keys, values):
    one copy into block-major order, on an integer view of the same bytes (CPU copies of bfloat16 take a slow
    path; the bytes are all that is stored)."""
    k0 = layers[0][0]
    return tuple(_blocked([raw_view(kv[i])[:, :m] for kv in layers], block_size).view(k0.dtype) for i in (0, 1))


@dataclass
class WritePlan:
    """A validated write: the model key, the prompt's ids, its chain (seed, hashes), the cache dtype's name, and the
    blocks' keys / values [n_blocks after `first`, L, n_kv, B, d] in block-major order."""

    key: str
    ids: torch.Tensor
    seed: str
    hashes: list[str]
    dtype: str
    keys: torch.Tensor
    values: torch.Tensor


def plan_write(token_ids, layers, model: dict, first: int, ns: str, block_size: int) -> WritePlan:
    """The checks every store makes before writing a prompt's blocks from token `first` on, and the block-major copy
    of its K/V; ValueError on a model that is not a serving identity, a bad namespace, a `first` off a block
    boundary, or shapes that are not the model's."""
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
    keys, values = block_major(layers, (n - first) // B * B, B)  # the full blocks' tokens after `first`
    return WritePlan(key, ids, chain_seed(key, B, ns), chain_hashes(ids.tolist(), key, B, ns), dtype, keys, values)


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
    the checksum being `checksum`'s sha256 over the token_ids, k and v bytes, taken in place. BadEntry("corrupt")
    for bytes that are not a readable block; `where` names the block in messages."""
    try:
        n = int.from_bytes(buf[:8], "little")
        if not 0 < n <= min(MAX_HEADER, len(buf) - 8):
            raise ValueError(f"header length {n} does not fit {len(buf)} bytes")
        meta = json.loads(bytes(buf[8:8 + n]))
        header = json.loads(meta.get("__metadata__", {}).get("kvtransfer", "{}"))
        view, base, h, tensors = memoryview(buf), 8 + n, hashlib.sha256(), {}
        for name in ("token_ids", "k", "v"):
            spec = meta[name]
            a, b = spec["data_offsets"]
            if not 0 <= a <= b <= len(buf) - base:
                raise ValueError(f"{name}'s bytes {a}..{b} lie outside the block")
            h.update(view[base + a:base + b])
            dtype = TORCH_DTYPES[spec["dtype"]]
            tensors[name] = torch.frombuffer(view[base + a:base + b], dtype=dtype).view(spec["shape"]) \
                if b > a else torch.empty(spec["shape"], dtype=dtype)  # device: read from bytes, as frombuffer
    except (ValueError, KeyError, TypeError, RuntimeError, AttributeError) as err:
        raise BadEntry("corrupt", f"{where}: not a readable block ({type(err).__name__}: {err})") from err
    return header, tensors, h.hexdigest()


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


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as an integer tensor of the same element size (copies of it take the fast path)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def _blocked(layers: list[torch.Tensor], block: int) -> torch.Tensor:
    """Per-layer [n_kv, m, d] (m a multiple of `block`) as one contiguous [m / block, L, n_kv, block, d] tensor."""
    x = torch.stack(layers)  # [L, n_kv, m, d]
    L, h, m, d = x.shape
    return x.view(L, h, m // block, block, d).permute(2, 0, 1, 3, 4).contiguous()


def concat_range(ks: list[torch.Tensor], vs: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) [n_kv, tokens, d] from per-block slices [L, n_kv, b_i, d] (an integer-view copy)."""
    dtype = ks[0].dtype
    keys = torch.cat([raw_view(k) for k in ks], dim=2).view(dtype)
    values = torch.cat([raw_view(v) for v in vs], dim=2).view(dtype)
    return [(keys[i], values[i]) for i in range(keys.shape[0])]
