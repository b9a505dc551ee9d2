"""experiments/handoff/collect.py's store-throughput table: store / plain as the median ± SE of the per-repeat ratios
where the report has them (store_io.py's interleaved repeats), the bare ratio for an older report."""
from __future__ import annotations

from scripts import load_script

collect = load_script("experiments/handoff/collect.py")
ROW = {"tokens": 1024, "mb": 29.4, "store_write_mb_s": 280.0, "plain_write_mb_s": 900.0, "store_read_mb_s": 950.0,
       "plain_read_mb_s": 1400.0, "write_vs_plain": 3.2, "read_vs_plain": 1.47}
PROV = {"commit": "abc1234", "cpus": 2, "cpu": "AMD EPYC"}


def test_a_report_with_ses_prints_them_and_its_repeats_and_load():
    rep = {"provenance": PROV, "repeats": 5, "load_avg": {"before": [1.2, 1, 1], "after": [1.9, 1, 1]},
           "rows": [{**ROW, "write_vs_plain_se": 0.21, "read_vs_plain_se": 0.05}]}
    text = collect.store_table(rep)
    assert "5 interleaved repeats; load average 1.2 before, 1.9 after." in text
    assert "| 1,024 | 29 | 280 | 900 | 950 | 1400 | 3.20 ± 0.21x | 1.47 ± 0.05x |" in text


def test_an_older_report_without_ses_keeps_its_bare_ratios():
    text = collect.store_table({"provenance": PROV, "rows": [ROW]})
    assert "| 3.2x | 1.5x |" in text and "repeats" not in text
