"""The bandwidth benchmark's statistics: each step is held to the bound of its own iteration."""

import pytest

from benchmarks.common.limited_link import paired_vs_bound, summarise


def test_each_step_is_divided_by_the_bound_of_its_own_iteration():
    compute = {"iteration": [1, 2, 3], "step_s": [1.0, 2.0, 4.0]}
    # 1e6 bytes at 8e6 bit/s: one second on the wire.
    measured = {"iteration": [0, 1, 3], "step_s": [9.0, 4.0, 10.0], "wire_bytes": [1e6, 1e6, 1e6]}
    # Iteration 0 has no compute-only step to pair with, so it is left out.
    assert paired_vs_bound(measured, compute, 8e6) == [pytest.approx(2.0), pytest.approx(2.0)]


def test_summary_reports_the_median_of_the_paired_ratios():
    # Compute-only steps alternate fast and slow, and Top-k's follow the same rhythm (same load).
    slow = [1.0, 3.0] * 4
    ways = {"compute only": {"iteration": list(range(8)), "step_s": slow, "wire_bytes": [0.0] * 8}}
    ways["Top-k"] = {"iteration": list(range(8)), "step_s": [1.5 * s for s in slow], "wire_bytes": [0.0] * 8}
    ways["dense"] = {"iteration": [0, 1], "step_s": [20.0, 22.0], "wire_bytes": [1e7, 1e7]}
    for measured in ways.values():
        measured.update({key: [0.0] * len(measured["step_s"]) for key in ("backward_s", "link_bytes",
                                                                           "payload_bytes")})
    table = summarise({"models": {"m": {"rates": {repr(1e8): ways}}}})["m"][repr(1e8)]
    assert table["Top-k"]["vs_bound"] == pytest.approx(1.5)
    assert table["Top-k"]["vs_bound_quartiles"] == [pytest.approx(1.5), pytest.approx(1.5)]
    assert table["compute only"]["vs_bound"] == pytest.approx(1.0)
    # dense: 20 / (1 + 0.8) and 22 / (3 + 0.8)
    assert table["dense"]["pairs"] == 2
    assert table["dense"]["vs_bound"] == pytest.approx((20 / 1.8 + 22 / 3.8) / 2)
