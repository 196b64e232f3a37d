"""The throughput report's verdict on the slowest case (faster, a tie within noise, or slower), its
warning when the machine was oversubscribed, and the table of the reference against GRACE's code."""

import os

from benchmarks.performance import grace_comparison
from benchmarks.performance.throughput import oversubscribed, speed_verdict


def test_quartiles_at_or_above_one_are_as_fast():
    assert speed_verdict(1.2, [1.0, 1.3]).startswith("at least as fast everywhere")


def test_quartiles_that_straddle_one_are_a_tie_on_either_side_of_the_median():
    above, below = speed_verdict(1.013, [0.982, 1.018]), speed_verdict(0.997, [0.98, 1.02])
    assert above.startswith("at least 1.0, a tie within the run's noise") and "0.982-1.018" in above
    assert below.startswith("below 1.0, a tie within the run's noise") and "0.980-1.020" in below


def test_quartiles_all_below_one_are_slower():
    assert speed_verdict(0.93, [0.9, 0.96]).startswith("SLOWER there")


def test_an_oversubscribed_run_is_flagged_with_its_command():
    cores = os.cpu_count() or 1
    assert oversubscribed([cores - 0.5, cores], "python -m x") == ""
    warning = oversubscribed([0.5, cores + 1.0], "python -m x --threads 1,2")
    assert "oversubscribed" in warning and "`python -m x --threads 1,2`" in warning


def test_the_grace_comparison_table_has_every_row_and_leaves_the_empty_loop_out_of_the_range(tmp_path):
    case = {"grace_ms": 10.0, "reference_ms": 10.5, "reference_over_grace": 1.05, "quartiles": [1.01, 1.08]}
    result = {"machine": "test machine", "model": "ResNet-50", "device": "cpu", "repetitions": 3,
              "grace_commit": "abc123", "load_average": [0.1, 0.2],
              "runs": {"1": {"NoCompression": {**case, "reference_over_grace": 9.0}, "TopK 0.01": case},
                       "2": {"TopK 0.01": {**case, "reference_over_grace": 0.97}}}}
    text = grace_comparison.write(result, tmp_path, "python -m benchmarks.performance.grace_comparison")
    assert "| 1 | TopK 0.01 | 10.0 | 10.5 | **1.050** (1.010-1.080) |" in text
    assert "| 2 | TopK 0.01 |" in text and "| 1 | NoCompression |" in text
    assert "here 0.970 to 1.050 (NoCompression aside)" in text and "abc123" in text
    assert "<!-- begin grace_comparison -->" in (tmp_path / "performance.md").read_text()
    assert (tmp_path / "grace_comparison.json").exists()
