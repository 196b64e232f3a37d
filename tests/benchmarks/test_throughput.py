"""The throughput report's verdict on the slowest case: faster, a tie within noise, or slower."""

from benchmarks.performance.throughput import speed_verdict


def test_quartiles_at_or_above_one_are_as_fast():
    assert speed_verdict(1.2, [1.0, 1.3]).startswith("at least as fast everywhere")


def test_quartiles_that_straddle_one_are_a_tie_on_either_side_of_the_median():
    above, below = speed_verdict(1.013, [0.982, 1.018]), speed_verdict(0.997, [0.98, 1.02])
    assert above.startswith("at least 1.0, a tie within the run's noise") and "0.982-1.018" in above
    assert below.startswith("below 1.0, a tie within the run's noise") and "0.980-1.020" in below


def test_quartiles_all_below_one_are_slower():
    assert speed_verdict(0.93, [0.9, 0.96]).startswith("SLOWER there")
