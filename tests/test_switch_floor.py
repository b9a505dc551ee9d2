"""experiments/handoff/switch_floor.py's bookkeeping: a switch's floor (store read at the disk's rate + the map at
its floor + the new turn's prefill), switch / floor against the 1.5x goal, and the worker's parts, on rows whose
answers are set by hand; and the table experiments/handoff/collect.py writes from it (the deployment itself runs in
the serving environment: the script's smoke command in its docstring)."""
from __future__ import annotations

from scripts import load_script
from tolerance import assert_close

floor = load_script("experiments/handoff/switch_floor.py")
collect = load_script("experiments/handoff/collect.py")
WHY = "a few float64 sums and quotients of hand-set seconds"


def rows(switch: list[float], warm: float = 9.0) -> list[dict]:
    """One warm-up and len(switch) counted switches at 1,024 tokens: 100 MB read, a 0.5 s new turn, and worker
    loads of 0.2 s read + 0.3 s map + 0.1 s scatter."""
    load = {"total_s": 0.6, "read_s": 0.2, "map_s": 0.3, "scatter_s": 0.1}
    return [{"tokens": 1024, "warmup": i == 0, "switch_s": s, "next_turn_s": 0.5, "mapped": 1024,
             "store_bytes": 100e6, "load": load, "switch_prefilled": 67, "next_prefilled": 40}
            for i, s in enumerate([warm] + switch)]


MAPS = {"k": 8, "n_source_used": 12, "copy_bytes_per_s": 2e10,
        "per_tokens": {1024: {"flops": 1e11, "bytes": 1e8, "gemm_flops_per_s": 1e11, "floor_s": 0.1}}}


def test_the_floor_adds_the_read_at_the_disk_rate_the_map_floor_and_the_measured_new_turn():
    (s,) = floor.summarise(rows([0.9, 1.0, 1.1]), {1024: 1e9}, MAPS)   # read 100 MB at 1 GB/s: 0.1 s
    assert s["n"] == 3                                                  # the warm-up is not counted
    assert_close(s["floor_s"]["median"], 0.1 + 0.1 + 0.5, factor=16, reason=WHY)
    assert_close(s["ratio"]["median"], 1.0 / 0.7, factor=16, reason=WHY)
    assert s["goal_met"] is True                                       # 1.43x <= 1.5x
    assert_close(s["rest_beyond_next_turn_s"]["median"], 1.0 - 0.6 - 0.5, factor=16, magnitude=1.0, reason=WHY)
    assert s["worker_s"]["map_s"]["median"] == 0.3 and s["prefilled"] == {"switch": 67, "next_turn": 40}


def test_a_switch_past_one_and_a_half_floors_misses_the_goal_and_a_slow_disk_raises_the_floor():
    (slow,) = floor.summarise(rows([1.2, 1.3, 1.4]), {1024: 1e9}, MAPS)
    assert slow["goal_met"] is False                                   # 1.3 / 0.7 = 1.86x
    (disk,) = floor.summarise(rows([1.2, 1.3, 1.4]), {1024: 2.5e8}, MAPS)   # 0.4 s to read: floor 1.0 s
    assert_close(disk["ratio"]["median"], 1.3, factor=16, reason=WHY)
    assert disk["goal_met"] is True


def test_the_plain_read_rate_is_bytes_over_the_median_read_time(tmp_path, monkeypatch):
    ticks = iter([0, 1, 10, 14, 20, 22])                   # three reads of 1, 4 and 2 clock units: median 2
    monkeypatch.setattr(floor.time, "perf_counter", lambda: next(ticks))
    assert floor.plain_read_rate(1 << 20, tmp_path, repeats=3) == (1 << 20) / 2
    assert not list(tmp_path.iterdir())                     # its file removed


def test_the_handoff_readme_block_prints_each_part_and_the_verdict():
    summary = floor.summarise(rows([0.9, 1.0, 1.1]), {1024: 1e9}, MAPS)
    rep = {"provenance": {"commit": "abc1234", "cpus": 2, "cpu": "AMD EPYC"}, "dtype": "bfloat16",
           "map_dtype": "float32", "per_size": 3, "summary": summary, "map_floor": MAPS,
           "read_bytes_per_s": {"1024": 1e9}, "loadavg_end": [1.5, 1.2, 1.0]}
    text = collect.switch_floor_table(rep)
    assert "| 1,024 | 3 | 1.00 ± " in text and "= 0.100 + 0.100 + 0.50 ± 0.00" in text
    assert "1.43 ± " in text and "(met)" in text and "| 67 / 40 |" in text
    assert "1.00 GB/s at 1,024" in text and "k = 8" in text


def test_each_switch_gets_the_next_load_of_its_size_and_a_missing_one_is_counted_not_guessed():
    rs = [{"mapped": 1024}, {"mapped": 2048}, {"mapped": 2048}]
    loads = [{"tokens": 1024, "read_s": 1}, {"tokens": 7, "read_s": 2}, {"tokens": 2048, "failed": "x"},
             {"tokens": 2048, "read_s": 3}]
    assert floor.match_loads(rs, loads) == 1
    assert [r["load"] and r["load"]["read_s"] for r in rs] == [1, 3, None]
    (s,) = floor.summarise([{**r, "load": None} for r in rows([1.0, 1.0])], {1024: 1e9}, MAPS)
    assert s["worker_matched"] == 0 and s["worker_s"]["map_s"] is None and s["rest_beyond_next_turn_s"] is None
