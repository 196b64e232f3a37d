"""The bandwidth benchmarks' workers ask the driver for a link rate through files in a control
folder: the driver applies each request once, in the order asked, and never reads one still being
written (a suite run once failed on a request's temporary file)."""

import threading

from benchmarks.common.limited_link import request_rate, serve_rate_requests


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
