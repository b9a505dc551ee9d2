"""experiments/baselines/gpu_model.py: the H200 model's rates, its weight-read floor and a mode's relative cost, on
the committed bench table with answers computed by hand."""
from __future__ import annotations

from scripts import load_script
from tolerance import assert_close, assert_within

gm = load_script("experiments/baselines/gpu_model.py")
BENCH = gm.load()


def test_rates_are_the_bench_rows_interpolated_in_log_tokens_and_held_outside():
    peak = BENCH["matmul_bf16_flops_per_s"]
    assert peak == 7.8e14 and BENCH["copy_bytes_per_s"] == 4.18e12     # numbers, not strings (YAML 1.1 exponents)
    at_1k = peak * 83.4 / 131.3                                       # the 1,024-token row: ~495 TFLOP/s
    at_4k = peak * 350.4 / 532.3
    why = "a few float64 products, quotients and logs of the table's numbers"
    assert_close(gm.rate(BENCH, "prefill", 1024), at_1k, factor=16, reason=why)
    assert_close(gm.rate(BENCH, "prefill", 2048), (at_1k + at_4k) / 2, factor=16, reason=why)   # halfway in log2
    assert gm.rate(BENCH, "prefill", 16) == at_1k                    # held below the table
    assert_close(gm.rate(BENCH, "map", 10 ** 6), peak * 90.3 / 293.0, factor=16, reason=why)   # held above it


def test_a_short_prefill_pays_one_weight_read_and_the_target_costs_one():
    per_token = 2.64e9                         # ~the 1.5B's FLOPs per token: 2.64 GB of bf16 weights
    floor = per_token / 4.18e12                # 0.63 ms
    assert gm.prefill_seconds(BENCH, 16 * per_token, 16, per_token) == floor
    big = 4096 * per_token
    why = "a few float64 products and quotients"
    assert_close(gm.prefill_seconds(BENCH, big, 4096, per_token), big / gm.rate(BENCH, "prefill", 4096), factor=16,
                 reason=why)
    ref = 1024 * per_token
    assert_close(gm.mode_cost(BENCH, flops_rel=1.0, map_flops_rel=0.0, prefix_tokens=1024, reference_flops=ref), 1.0,
                 factor=16, reason=why)
    # the map (1 % of the FLOPs, at the map's 1K rate) and a 1-token sink prefill (one weight read)
    whole = ref / gm.rate(BENCH, "prefill", 1024)
    want = (0.01 * ref / gm.rate(BENCH, "map", 1024) + floor) / whole
    got = gm.mode_cost(BENCH, flops_rel=0.01 + 1 / 1024, map_flops_rel=0.01, prefix_tokens=1024, reference_flops=ref)
    assert_close(got, want, factor=64, reason=why)
    # the sink's weight read dominates: ~0.11 of a 1K re-prefill, the map ~0.06
    assert_within(got, 0.17, atol=0.03, reason="0.114 + 0.063 by hand from the table's 1K row", 
                  headroom_exempt="a hand computation of fixed table numbers, the same on every machine")
