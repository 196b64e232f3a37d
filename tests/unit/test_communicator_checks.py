"""A communicator refuses, naming both, a compressor whose payload it cannot carry
(``Communicator.check_compressor``, which the bundle asks at construction): every communicator,
one written outside the library included, inherits the rule."""

from __future__ import annotations

import pytest

from grace_legacy import FP16, Allgather, Allreduce, Grace, PowerSGD, ScatterGather, TopK, VarianceSparsifier
from tests.example_communicator import Float64Sum


@pytest.mark.parametrize(("communicator", "compressor", "message"), [
    (Allreduce(), TopK(0.1), r"Allreduce\(\) sums payloads, but TopK\(ratio=0.1\) sends a non-additive payload"),
    (Float64Sum(), TopK(0.1), r"Float64Sum\(\) sums payloads, but TopK\(ratio=0.1\)"),
    (ScatterGather(), PowerSGD(2), r"ScatterGather\(\) cannot run PowerSGD\(rank=2.*\), which needs 2"),
    (ScatterGather(), VarianceSparsifier(1.0), r"ScatterGather\(\) compresses shards of tensors, but Variance"),
])
def test_a_payload_the_communicator_cannot_carry_is_refused_naming_both(communicator, compressor, message):
    with pytest.raises(ValueError, match=message):
        communicator.check_compressor(compressor)
    with pytest.raises(ValueError, match=f"Grace: {message}"):
        Grace(compressor, communicator=communicator)


@pytest.mark.parametrize("communicator", [Allgather(), Allreduce(), ScatterGather(), Float64Sum()])
def test_a_payload_it_can_carry_passes(communicator):
    communicator.check_compressor(FP16())
