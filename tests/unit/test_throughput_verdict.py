"""The throughput report's verdict on the slowest case: faster, a tie within noise, or slower."""

from benchmarks.performance.throughput import speed_verdict


def test_a_median_of_at_least_one_is_as_fast():
    assert speed_verdict(1.0, [0.9, 1.1]) == "at least as fast everywhere"


def test_quartiles_that_straddle_one_are_a_tie_not_a_win():
    verdict = speed_verdict(0.997, [0.98, 1.02])
    assert verdict.startswith("parity within the run's noise") and "0.980-1.020" in verdict


def test_quartiles_all_below_one_are_slower():
    assert speed_verdict(0.93, [0.9, 0.96]).startswith("SLOWER there")
