"""Cost of a local model directory's weights identity (kvtransfer.config.identity) at paper scale.

Writes a sparse 14-shard, 1,008-tensor, 60 GiB checkpoint (headers real, data holes: no disk space used)
and times `directory_weights_digest` on it. Sparse holes cost no device I/O, so this measures the
syscall and hashing cost; on a real disk add ~3 reads of 64 B per tensor (SSD ~0.1 ms each).

    python experiments/identity_cost.py [DIR]     # DIR: a scratch folder on the disk to test (default: a temp dir)
"""
import json
import shutil
import struct
import sys
import tempfile
import time

from kvtransfer.config.identity import directory_weights_digest


def sparse_checkpoint(directory: str, shards: int = 14, tensors: int = 1008, total_bytes: int = 60 * 2**30) -> None:
    """Safetensors shards with real headers over `total_bytes` of sparse (unwritten) tensor data."""
    size, per, t = total_bytes // tensors, tensors // shards, 0
    for s in range(shards):
        header, off = {}, 0
        for _ in range(per):
            header[f"model.layers.{t}.weight"] = {"dtype": "BF16", "shape": [size // 2], "data_offsets": [off, off + size]}
            off, t = off + size, t + 1
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        with open(f"{directory}/model-{s:05d}-of-{shards:05d}.safetensors", "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            f.truncate(8 + len(raw) + off)


if __name__ == "__main__":
    directory = tempfile.mkdtemp(dir=sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        sparse_checkpoint(directory)
        times = []
        for _ in range(5):
            started = time.perf_counter()
            identity = directory_weights_digest(directory)
            times.append(time.perf_counter() - started)
        print(f"{identity['files']} files, {identity['tensors']} tensors, {identity['bytes'] / 2**30:.1f} GiB: "
              f"median {sorted(times)[2] * 1e3:.0f} ms over 5 runs (sparse: no device I/O)")
    finally:
        shutil.rmtree(directory)
