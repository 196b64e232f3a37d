"""A rate-limited benchmark's report names the command that reproduces it."""

from benchmarks.common.limited_link import reproducing_options


def test_the_command_keeps_the_options_that_shaped_the_run_but_not_where_its_report_went():
    assert reproducing_options(["--workers", "2", "--results", "/some/dir", "--rates", "1e8"]) == \
        ["--workers", "2", "--rates", "1e8"]
    assert reproducing_options(["--quick", "--results=/some/dir"]) == ["--quick"]
    assert reproducing_options([]) == []
