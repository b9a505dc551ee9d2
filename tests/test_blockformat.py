"""The block format's writer: WritePlan.encode makes each block's bytes straight from the per-layer cache, and they are
a standard safetensors blob whose tensors are the cache's block, whose header is the block's, and whose checksum is
CRC-32 over exactly the tensors' bytes -- checked here with safetensors' own reader and zlib, independently of the
code under test."""
from __future__ import annotations

import json
import zlib

import pytest
import torch
from safetensors.torch import load

from kvtransfer.serve.blockformat import (MAX_BLOCK_INDEX, BadEntry, block_header, parse_block, plan_write,
                                          verify_block)

IDENT = {"key": "0123456789abcdef", "n_layers": 3, "n_kv": 2, "head_dim": 4, "model_id": "t", "config_hash": "c"}
B = 4


def _layers(n: int, dtype, offset: int = 0):
    """Per-layer (keys, values) [n_kv, n, d] as strided views of a larger cache (as a model's cache is sliced)."""
    big = torch.arange(3 * 2 * 2 * (n + 5) * 4, dtype=torch.float32).view(3, 2, 2, n + 5, 4).to(dtype) / 7
    return [(big[layer, 0, :, offset:offset + n], big[layer, 1, :, offset:offset + n]) for layer in range(3)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_encoded_blocks_are_safetensors_of_the_cache_with_their_header_and_crc(dtype):
    n, first = 14, 4   # blocks 1 and 2 written (tokens 4..11); tokens 12, 13 are not a full block
    ids = list(range(100, 100 + n))
    layers = _layers(n - first, dtype, offset=1)
    plan = plan_write(ids, layers, IDENT, first, "ab12", B)
    rows, sizes = plan.encode(1, 3)
    assert rows.dtype == torch.uint8 and rows.shape[0] == 2 and sizes == [rows.shape[1]] * 2
    for r, j in enumerate((1, 2)):
        blob = bytes(rows[r].numpy())
        tensors = load(blob)   # safetensors' own reader
        a = j * B - first
        assert tensors["token_ids"].tolist() == ids[j * B:(j + 1) * B]
        for i, name in enumerate(("k", "v")):
            want = torch.stack([kv[i][:, a:a + B] for kv in layers])   # [L, n_kv, B, d]
            assert tensors[name].dtype == dtype and torch.equal(tensors[name], want)
        raw = b"".join(t.contiguous().view(torch.uint8).numpy().tobytes()
                       for t in (tensors["token_ids"], tensors["k"], tensors["v"]))
        digest = f"crc32:{zlib.crc32(raw):08x}"
        n_head = int.from_bytes(blob[:8], "little")
        header = json.loads(json.loads(blob[8:8 + n_head])["__metadata__"]["kvtransfer"])
        parent = plan.hashes[j - 1] if j else plan.seed
        assert header == json.loads(json.dumps(block_header(IDENT, "ab12", j, parent, plan.hashes[j], B,
                                                            plan.dtype, digest)))
        # the readers' path: parsed in place, verified against the prompt's ids
        parsed, views, got = parse_block(bytearray(blob), "b")
        assert got == digest and parsed == header
        verify_block(parsed, views, got, ids[j * B:(j + 1) * B], "b")
        # one flipped bit of a value is a checksum failure, not a silently wrong cache
        bad = bytearray(blob)
        bad[-1] ^= 1
        parsed, views, got = parse_block(bad, "b")
        with pytest.raises(BadEntry) as err:
            verify_block(parsed, views, got, ids[j * B:(j + 1) * B], "b")
        assert err.value.reason == "checksum"


def test_every_block_of_an_identity_has_one_size_and_the_tensors_start_aligned():
    n = 8
    plan = plan_write(list(range(n)), _layers(n, torch.float32), IDENT, 0, "", B)
    rows, _ = plan.encode(0, 2)
    n_head = int.from_bytes(bytes(rows[0, :8].numpy()), "little")
    assert (8 + n_head) % 8 == 0 and int.from_bytes(bytes(rows[1, :8].numpy()), "little") == n_head
    # a block index of the format's widest still fits the same header length; one beyond it is refused
    plan.hashes = plan.hashes + ["f" * 64] * 2
    with pytest.raises(ValueError, match="blocks 0..4"):
        plan.encode(0, 4)   # layers hold 2 blocks: encode reads only what the plan holds
    from kvtransfer.serve.blockformat import _padded_head
    length, head = _padded_head(IDENT, "", "float32", B, 8 * B, 3 * 2 * B * 4 * 4)
    assert length == n_head and len(head(MAX_BLOCK_INDEX, "0" * 64, "1" * 64, "crc32:00000000")) == 8 + length
    with pytest.raises(ValueError, match="beyond"):
        head(MAX_BLOCK_INDEX + 1, "0" * 64, "1" * 64, "crc32:00000000")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_assembler_reads_any_token_range_straight_from_block_bytes(dtype):
    from kvtransfer.serve.blockformat import Assembler

    n = 12
    ids = list(range(7, 7 + n))
    layers = _layers(n, dtype)
    plan = plan_write(ids, layers, IDENT, 0, "", B)
    rows, _ = plan.encode(0, 3)
    blobs = [bytes(r.numpy()) for r in rows]
    for lo, hi in ((0, 12), (2, 11), (5, 6), (4, 8)):
        out = Assembler(ids, lo, hi, B)
        for j in range(lo // B, (hi - 1) // B + 1):
            out.add(j, blobs[j], f"block {j}")   # bytes: read-only, never copied
        got = out.layers()
        assert len(got) == 3
        for (k, v), (wk, wv) in zip(got, layers):
            assert k.dtype == dtype and torch.equal(k, wk[:, lo:hi]) and torch.equal(v, wv[:, lo:hi])
    # another prompt's ids, a flipped value bit, a block of another shape: each refused with its reason
    with pytest.raises(BadEntry) as err:
        Assembler([0] * n, 0, 4, B).add(0, blobs[0], "b")
    assert err.value.reason == "corrupt"
    bad = bytearray(blobs[1])
    bad[-3] ^= 4
    with pytest.raises(BadEntry) as err:
        Assembler(ids, 4, 8, B).add(1, bad, "b")
    assert err.value.reason == "checksum"
    other = plan_write(ids[4:8], [(k[:1], v[:1]) for k, v in _layers(4, dtype)], dict(IDENT, n_kv=1), 0, "", B)
    out = Assembler(ids, 0, 8, B)
    out.add(0, blobs[0], "b")
    with pytest.raises(BadEntry) as err:
        out.add(1, bytes(other.encode(0, 1)[0][0].numpy()), "b")
    assert err.value.reason == "mis-shaped"   # the right ids and checksum, one KV head instead of two
