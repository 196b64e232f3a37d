"""``scalars()``: the nested ``stats`` as flat numbers for TensorBoard or W&B, on the bundle, on the
compressor it runs and on the DDP hook's state; a pure flattening (the expected keys and values
are read off ``stats`` here by hand, not by the library's walk)."""

from fractions import Fraction

import pytest
import torch

from grace_legacy import Grace, Legacy, Residual, TopK
from grace_legacy.runtime.traffic import flatten_scalars
from tests.helpers import synchronize


def test_a_nested_dictionary_is_flattened_under_its_keys():
    stats = {"volume": 0.25, "bytes_sent": 10, "tensors_by_route": {"allgather": 2},
             "group": {0: {"volume": 1.0}, 1: {"volume": Fraction(1, 8)}},
             "lgreco": {"choices": {"fc.weight": 0.1, "fc.bias": None}, "solves": [{"step": 1}], "label": "x"},
             "flag": True}
    assert flatten_scalars(stats, "grace") == {
        "grace/volume": 0.25, "grace/bytes_sent": 10.0, "grace/tensors_by_route/allgather": 2.0,
        "grace/group/0/volume": 1.0, "grace/group/1/volume": 0.125, "grace/lgreco/choices/fc.weight": 0.1,
        "grace/flag": 1.0}
    assert flatten_scalars({"a": {"b": 1}}, "") == {"a/b": 1.0}
    assert flatten_scalars({"a": 1}, "run/") == {"run/a": 1.0}
    assert all(type(v) is float for v in flatten_scalars(stats).values())


def test_a_bundle_gives_its_stats_flat():
    schedule = Legacy(TopK(), by="epoch", values=[0.5, 0.1], boundaries=[1])
    bundle = Grace(schedule, memory=Residual())
    assert bundle.scalars()["grace/bytes_sent"] == 0 and not any(bundle.scalars().values())
    gradients = torch.randn(4, 200, generator=torch.Generator().manual_seed(0))
    synchronize([bundle], [[gradients[0]], [gradients[1]]])
    bundle.set_epoch(1)
    synchronize([bundle], [[gradients[2]], [gradients[3]]])

    stats = bundle.stats
    scalars = bundle.scalars(prefix="grace")
    assert bundle.scalars("") == {k.removeprefix("grace/"): v for k, v in scalars.items()}
    for key in ("volume", "wire_bytes", "wire_dense", "bytes_sent", "bytes_dense", "tensors"):
        assert scalars[f"grace/{key}"] == stats[key]
    for phase in (0, 1):
        assert scalars[f"grace/phase/{phase}/volume"] == stats["phase"][phase]["volume"]
        assert scalars[f"grace/phase/{phase}/tensors"] == 2
    for route, count in stats["tensors_by_route"].items():
        assert scalars[f"grace/tensors_by_route/{route}"] == count
    # Every number of the nested dictionary is there once, and nothing else.
    numbers = [v for v in stats.values() if isinstance(v, int | float)] + \
        list(stats["tensors_by_route"].values()) + \
        [v for phase in stats["phase"].values() for v in phase.values()]
    assert len(scalars) == len(numbers)


@pytest.mark.parametrize("prefix", [None, 3, b"grace"])
def test_a_prefix_that_is_not_a_string_is_refused(prefix):
    with pytest.raises(TypeError, match="prefix must be a string"):
        Grace(TopK(0.1)).scalars(prefix)
    with pytest.raises(TypeError, match="prefix must be a string"):
        flatten_scalars({}, prefix)


def test_one_compressor_in_two_bundles_each_reports_its_own_traffic():
    # The traffic is the bundle's alone: a compressor keeps no pointer to the bundle that ran it
    # last, which made a compressor shared by two bundles report the second one's bytes.
    topk = TopK(0.5)
    first, second = Grace(topk), Grace(topk)
    first.record_traffic("w", torch.zeros(10), 40, "allgather")
    assert first.stats["bytes_sent"] == 40 and second.stats["bytes_sent"] == 0
    assert not hasattr(topk, "stats") and not hasattr(topk, "scalars")
