"""`walk_chain` (kvtransfer.serve.blockstore): the chain walk both stores' `lookup` run, each with its own way of
reading a block. Driven here by a scripted `check`, so every way a chain ends is placed on a chosen block: the
prefix must stop exactly there, pass each block its parent's hash, and never look past the end."""
from __future__ import annotations

import pytest

from kvtransfer.serve.blockformat import BadEntry
from kvtransfer.serve.blockstore import walk_chain
from kvtransfer.serve.store import KVStore

KEY = "0123456789abcdef"
NS = "a1" * 16
MODEL = {"key": KEY, "n_layers": 2, "n_kv": 1, "head_dim": 4}
M = 6  # blocks in the prompt's chain


def _walk(tmp_path, end: str | None, at: int):
    """Walk a 6-block chain whose block `at` ends it the `end` way (None: every block is stored); returns the
    prefix, the chain's hashes, its seed and the (j, h, parent) of every block the walk checked."""
    store = KVStore(tmp_path / "store", block_size=4)
    hashes = store.hashes(list(range(4 * M)), KEY, NS)
    calls = []

    def check(j, h, parent):
        calls.append((j, h, parent))
        if j == at and end == "missing":
            return None
        if j == at and end == "bad":
            raise BadEntry("mis-shaped", f"block{j}: k is wrong")
        model = {**MODEL, "model_id": "other"} if j == at and end == "other_model" else MODEL
        return f"block{j}", {"model": model}

    return walk_chain(store, KEY, NS, hashes, check), hashes, store.seed(KEY, NS), calls


ENDS = {"missing": "", "bad": "mis-shaped: block{at}: k is wrong",
        "other_model": "corrupt: block{at}: model identity differs from block 0's"}
CASES = [(end, at) for end in ENDS for at in (0, 2, M - 1)
         if not (end == "other_model" and at == 0)]  # block 0's identity is what the others are compared with


@pytest.mark.parametrize("end, at", CASES)
def test_the_walk_stops_at_the_block_that_ends_the_chain(tmp_path, end, at):
    prefix, hashes, seed, calls = _walk(tmp_path, end, at)
    assert prefix.hashes == tuple(hashes[:at])
    assert (prefix.n_blocks, prefix.n_tokens) == (at, 4 * at)
    assert prefix.detail == ENDS[end].format(at=at)
    assert (prefix.model_key, prefix.ns, prefix.block_size) == (KEY, NS, 4)
    assert prefix.model == (MODEL if at else {})
    # each block is asked for with its parent's hash (block 0 with the seed), and nothing after the end is read
    assert calls == [(j, hashes[j], hashes[j - 1] if j else seed) for j in range(at + 1)]


def test_a_whole_chain_is_found_to_its_last_block(tmp_path):
    prefix, hashes, seed, calls = _walk(tmp_path, None, -1)
    assert prefix.hashes == tuple(hashes) and prefix.n_blocks == M
    assert (prefix.detail, prefix.model) == ("", MODEL)
    assert calls == [(j, hashes[j], hashes[j - 1] if j else seed) for j in range(M)]
