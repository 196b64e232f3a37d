"""What the entry sparsifiers share (``compressors/entries.py``): the density parameter ``ratio``
(read as the decimal written, so ``k = max(1, floor(ratio * n))`` is the k the user meant; checked
by value and type; a compressor built without it needs a schedule; density 1 means dense) and
the tensors they refuse. Each sparsifier's own selection is in its file (``test_topk.py``,
``test_randomk.py``, ``test_dgc.py``, ``test_threshold.py``)."""

import pytest
import torch

from grace_legacy import Grace, RandomK, TopK
from grace_legacy.compressors.entries import kept_count


@pytest.mark.parametrize("ratio,numel,k", [(0.01, 100, 1), (0.29, 100, 29), (0.001, 999, 1), (0.5, 7, 3),
                                           (1.0, 13, 13), (0.07, 100, 7), (1e-9, 5, 1)])
def test_kept_count_reads_the_ratio_as_written(ratio, numel, k):
    assert kept_count(ratio, numel) == k


@pytest.mark.parametrize("bad", [0, 0.0, -0.1, 1.5, float("nan"), float("inf")])
def test_invalid_ratio_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"TopK: ratio must be a number in \(0, 1\]"):
        TopK(bad)


@pytest.mark.parametrize("bad", ["0.1", True, [0.1], torch.tensor(0.1)])
def test_ratio_of_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="ratio"):
        RandomK(bad)


def test_compressor_without_its_parameter_refuses_to_run_alone():
    with pytest.raises(ValueError, match=r"TopK\(\) was built without its ratio.*Legacy"):
        Grace(TopK())
    with pytest.raises(ValueError, match="without its ratio"):
        TopK().compress(torch.randn(4), "x")


@pytest.mark.parametrize("compressor", [TopK(0.1), RandomK(0.1)])
def test_bad_tensors_are_refused_clearly(compressor):
    with pytest.raises(ValueError, match="empty tensor"):
        compressor.compress(torch.zeros(0, 3), "x")
    with pytest.raises(TypeError, match="floating point"):
        compressor.compress(torch.arange(10), "x")
    with pytest.raises(TypeError, match="torch.Tensor"):
        compressor.compress([1.0, 2.0], "x")


def test_density_one_means_dense():
    assert TopK(1.0).compressor_for(torch.randn(5), "x") is None
    assert TopK(0.5).compressor_for(torch.randn(5), "x") is not None
