"""kvtransfer's vLLM connector end to end (issue 22): slow, and only in the serving environment
(scripts/setup_serve.sh cpu), since vLLM is not a dependency of the harness:
    .venv-serve/bin/python -m pytest -q -m slow tests/test_serve_vllm.py
    KVT_REAL_DIR=~/.cache/kvtransfer-real KVT_REAL_MAPPER=<mapper dir> ... adds the real pair (Qwen2.5-Coder
    0.5B -> 1.5B, a few windows of experiments/serve/equivalence.py; the full proof is results/serve/)
"""
from __future__ import annotations

import json
import os

import pytest
from tolerance import assert_within
from vllm_tests import SERVE_ONLY, run_script, shared_logprobs as _shared_logprobs

pytestmark = SERVE_ONLY


def _run(script: str, *args, timeout=1800):
    run_script(f"experiments/serve/{script}", *args, timeout=timeout)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("e2e")
    _run("e2e_tiny.py", out)
    return json.loads((out / "report.json").read_text())


def _by_name(tiny) -> dict[str, tuple[dict, dict]]:
    """name -> (the consumer's output, its stats record), via the request tags the script sent."""
    stats = tiny["consumer_stats"]
    out = {}
    for key, got in tiny["consumer"].items():
        name = key.split(":", 1)[1]
        out.setdefault(name, []).append((got, stats["requests"][stats["tags"][key]]))
    return out


def test_plumbing_identity_map_reproduces_the_cold_prefill(tiny):
    """Target -> target with the identity map through the connector == vLLM's cold prefill: greedy tokens
    exactly, first-token top-5 logprobs to float32 rounding; the longest stored prefix (whole 16-token blocks) is
    mapped and only the rest prefilled -- also for a second turn of the conversation, whose new tokens are not
    stored -- and the response's kv_transfer_params says so."""
    cold, rows, B = tiny["cold"], _by_name(tiny), tiny["block_size"]
    for name in ("good", "short_block", "turn2"):
        for got, rec in rows[name]:
            n = tiny["prompts"][name]
            stored = tiny["prompts"]["good"] if name == "turn2" else n  # turn 2's new tokens were never stored
            want_mapped = min(stored // B * B, n - 1)
            assert rec["reason"] == "mapped" and rec["mapped"] == want_mapped, (name, rec)
            assert rec["prompt"] == n and rec["prefilled"] == n - want_mapped and rec["cached"] == 0
            assert got["kv_transfer_params"] == {"kvtransfer": {k: v for k, v in rec.items() if k != "tag"}}
            want = cold[name]
            assert got["tokens"] == want["tokens"], name
            assert set(got["first_logprobs"]) == set(want["first_logprobs"])
            # tol: float32 logits over 6 layers, K re-rotated (strip/apply: a few ulps), two attention kernels
            assert_within(*_shared_logprobs(got, want), atol=1e-4,
                          reason="float32 logits over 6 layers, K re-rotated (strip/apply: a few ulps), two attention kernels")
    assert tiny["prompts"]["turn2"] - tiny["prompts"]["good"] == 40 and len(rows["good"]) == 2


BAD = {"no_entry": "no_entry", "other_model": "wrong_pair", "foreign": "wrong_pair", "context_start": "context_start",
       "corrupt": "corrupt", "mis_shaped": "mis-shaped", "n_layers_two": "corrupt", "model_list": "corrupt",
       "flipped": "load_failed", "nan": "load_failed", "field_str": "bad_request", "field_float": "bad_request",
       "field_bool": "bad_request"}


def test_every_bad_input_falls_back_to_the_cold_prefill_and_the_engine_keeps_serving(tiny):
    """Issue 31 §1: each crash of the review, fed to a running engine, gives a normal prefill and its counted reason:
    block headers with "n_layers": "two" / "model": [...], kvtransfer_source_len "5" / 2.5 / true, flipped bytes in K
    (header intact: the worker's checksum), a same-architecture model with other weights; every request is counted
    once."""
    cold, rows = tiny["cold"], _by_name(tiny)
    stats = tiny["consumer_stats"]
    assert {name: rows[name][0][1]["reason"] for name in BAD} == BAD
    for name in BAD:
        got, rec = rows[name][0]
        assert got["tokens"] == cold[name if name in cold else "good"]["tokens"], name  # the cold output
        assert rec["mapped"] == 0 and rec["prefilled"] == rec["prompt"], name
        assert got["kv_transfer_params"]["kvtransfer"]["reason"] == BAD[name], name
    assert sum(stats["reasons"].values()) == len(tiny["consumer"])  # one count per request, no double counting
    assert not [r for r in stats["reasons"] if r.startswith("error")]
    failed = [load["failed"] for load in tiny["consumer_worker"]["loads"] if "failed" in load]
    assert len(failed) == 2 and sum("checksum" in f for f in failed) == 1 and sum("NaN" in f for f in failed) == 1
    assert tiny["wrong_pair_stats"]["reasons"] == {"wrong_pair": 1}  # a mapper for another target: no mapping
    assert tiny["wrong_pair"]["good"]["tokens"] == cold["good"]["tokens"]


def test_mapped_blocks_never_serve_unsalted_requests_from_the_prefix_cache(tiny):
    """Prefix caching on, a perturbed map: the salted request is mapped (and differs from cold); the same prompt
    unsalted right after gets the cold output, not the mapped blocks; the salted one again gets the mapped output."""
    p, cold = tiny["prefix"], tiny["cold"]["good"]
    assert tiny["prefix_stats"]["reasons"] == {"mapped": 2, "unsalted": 1}
    assert p["salted"]["tokens"] != cold["tokens"]
    assert p["unsalted"]["tokens"] == cold["tokens"]
    assert p["salted_again"]["tokens"] == p["salted"]["tokens"]


def test_cpu_layouts_match_vllms_own_writer():
    """kvtransfer.serve.paged writes exactly what vLLM's cpu_attn_reshape_and_cache writes, for every CPU_ATTN
    ISA it implements: vec (float32 and bfloat16), vec16, and amx (bfloat16; the writer only moves bytes, so it
    runs on CPUs without AMX too) -- and reads back what it wrote."""
    import torch
    from vllm import _custom_ops as ops

    from kvtransfer.serve import paged

    for isa, head_dim, dtype in (("vec", 64, torch.float32), ("vec", 64, torch.bfloat16), ("vec16", 80, torch.float32),
                                 ("amx", 64, torch.bfloat16), ("amx", 128, torch.bfloat16)):
        mine, theirs = (torch.zeros(4, 2, 32, 2 * head_dim, dtype=dtype) for _ in range(2))
        keys, values = torch.randn(2, 70, head_dim).to(dtype), torch.randn(2, 70, head_dim).to(dtype)
        slots = paged.slot_mapping([3, 0, 2], 32, 5, 75)
        layout = paged.select_layout("CPU_ATTN", isa)
        layout.scatter(mine, keys, values, slots)
        k_cache, v_cache = theirs.view(4, 2, 64, head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(keys.transpose(0, 1).contiguous(), values.transpose(0, 1).contiguous(),
                                       k_cache, v_cache, slots, isa, k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")
        assert torch.equal(mine, theirs), (isa, head_dim, dtype)
        k, v = layout.gather(theirs, slots)
        assert torch.equal(k, keys) and torch.equal(v, values), (isa, head_dim, dtype)


def test_gpu_layout_on_vllms_own_cache_views():
    """The GPU backends' layout (FLASH_ATTN / FLASHINFER / TRITON_ATTN) on the per-layer views vLLM's own allocator
    (`create_kv_cache_views`, the same code in vLLM 0.33) hands a connector, for the layer- and block-outer
    physical orders: scatter == FlashAttention's `kv_cache.transpose(1, 2).split(head_size, -1)` written slot by
    slot, byte for byte; the other layers untouched; gather reads it back. No GPU needed: only views."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheTensor, create_kv_cache_views
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvtransfer.serve import paged

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    page, n_blocks, n_layers = spec.page_size_bytes, 5, 3
    keys, values = torch.randn(2, 20, 8).bfloat16(), torch.randn(2, 20, 8).bfloat16()
    slots = paged.slot_mapping([3, 1], 16, 0, 20)
    for layout in (KVCacheLayout.LBNHC, KVCacheLayout.LBHNC, KVCacheLayout.BLHNC, KVCacheLayout.BLNHC):
        outer = layout.is_layer_compact
        tensor = KVCacheTensor(size=page * n_blocks * n_layers, layers=[f"model.layers.{i}.attn" for i in range(3)],
                               layer_stride=page * n_blocks if outer else page,
                               block_stride=page if outer else page * n_layers)
        mine, theirs = (torch.zeros(page * n_blocks * n_layers, dtype=torch.int8) for _ in range(2))
        view = create_kv_cache_views(mine, spec, n_blocks, layout, tensor)[1]
        paged.select_layout("FLASH_ATTN").scatter(view, keys, values, slots)
        key_cache, value_cache = create_kv_cache_views(theirs, spec, n_blocks, layout, tensor)[1].transpose(1, 2).split(
            8, dim=-1)
        for i, s in enumerate(slots.tolist()):
            key_cache[s // 16, s % 16] = keys[:, i]
            value_cache[s // 16, s % 16] = values[:, i]
        assert torch.equal(mine, theirs), layout.name
        k, v = paged.select_layout("FLASHINFER").gather(view, slots)
        assert torch.equal(k, keys) and torch.equal(v, values), layout.name
        others = [w for j, w in enumerate(create_kv_cache_views(mine, spec, n_blocks, layout, tensor)) if j != 1]
        assert all(int((w != 0).sum()) == 0 for w in others), layout.name


@pytest.mark.skipif(not (os.environ.get("KVT_REAL_DIR") and os.environ.get("KVT_REAL_MAPPER")),
                    reason="set KVT_REAL_DIR (experiments/qwen25coder/get_models.sh's directory) and KVT_REAL_MAPPER (the fitted main mapper)")
def test_real_pair_serves_what_the_harness_computes(tmp_path):
    """Two WikiText-2 windows at P = 256 through producer 0.5B -> consumer 1.5B vs the harness's transfer mode
    (experiments/serve/equivalence.py; the 32-window table is results/serve/equivalence.md)."""
    _run("equivalence.py", "--out", tmp_path, "--windows", 2, "--max-new", 8)
    rows = json.loads((tmp_path / "equivalence.json").read_text())["windows"]
    assert len(rows) == 2
    for row in rows:
        assert row["reason"] == "mapped" and row["tail"] == 1
        assert row["first_token_equal"]
        assert row["first_logprob_gap"] < json.loads((tmp_path / "equivalence.json").read_text())["bound"]
