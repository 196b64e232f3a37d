"""What the bandwidth-limited benchmarks share (``benchmarks/common/limited_link.py``): each step is
held to the bound of its own iteration and the summary reports the median of the paired ratios;
the ways are interleaved with the order rotated every iteration; a worker asks the driver for a
link rate through files in a control folder, applied once each, in the order asked, never read
while still being written (a suite run once failed on a request's temporary file); and a report
names the command that reproduces it."""

import threading

import pytest

from benchmarks.common.limited_link import (
    interleave,
    paired_vs_bound,
    reproducing_options,
    request_rate,
    serve_rate_requests,
    summarise,
)


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


def test_interleave_rotates_the_order_and_keeps_only_the_timed_steps():
    order = []

    def step(name):
        order.append(name)
        return {"step_s": float(len(order))}

    measured = interleave({"a": (1, 2), "b": (0, 1), "c": (0, 3)}, step)
    # Iteration 1 starts at b (done: one step), iteration 2 at c.
    assert order == ["a", "b", "c", "c", "a", "c", "a"]
    assert measured["a"]["iteration"] == [1, 2] and measured["b"]["iteration"] == [0]
    assert measured["c"]["iteration"] == [0, 1, 2]
    assert measured["a"]["step_s"] == [5.0, 7.0]


class Link:
    """Stands in for the cluster: records the rates set (the protocol under test is the files)."""

    def __init__(self):
        self.rates = []

    def set_rate(self, rate):
        self.rates.append(rate)


def test_each_request_is_applied_once_in_order_and_one_being_written_is_left(tmp_path):
    link = Link()
    (tmp_path / "request-10").write_text("1e9")
    (tmp_path / "request-2").write_text("1e7")
    (tmp_path / "writing-11").write_text("1e")  # half written
    (tmp_path / "request-12.tmp").write_text("1e")  # how a request was once written
    serve_rate_requests(link, tmp_path)
    serve_rate_requests(link, tmp_path)
    assert link.rates == [1e7, 1e9]
    assert sorted(p.name for p in tmp_path.glob("applied-*")) == ["applied-10", "applied-2"]


def test_a_worker_waits_until_the_driver_applied_its_rate(tmp_path):
    link, met = Link(), threading.Event()
    worker = threading.Thread(target=request_rate, args=(tmp_path, 1, 5e7, True, met.set))
    worker.start()
    while worker.is_alive():
        assert not met.is_set()
        serve_rate_requests(link, tmp_path)
        worker.join(0.01)
    assert link.rates == [5e7] and met.is_set()


def test_the_command_keeps_the_options_that_shaped_the_run_but_not_where_its_report_went():
    assert reproducing_options(["--workers", "2", "--results", "/some/dir", "--rates", "1e8"]) == \
        ["--workers", "2", "--rates", "1e8"]
    assert reproducing_options(["--quick", "--results=/some/dir"]) == ["--quick"]
    assert reproducing_options([]) == []
