"""EF-signSGD (``compressors/efsignsgd.py``): mean magnitude times sign, the memory it needs (its
own, with the same learning rate), the learning rate's check, and through ``Grace`` on four ranks
Karimireddy et al.'s update, the mean of the ranks' steps divided by the learning rate. Its memory
is in ``test_efsignsgd_memory.py``."""

import pytest
import torch

from grace_legacy import Allgather, EFSignSGD, EFSignSGDMemory, Grace, NoMemory, Residual
from tests.helpers import synchronize
from tests.unit.test_signs import dyadic, tensor_of


def test_efsignsgd_sends_mean_magnitude_times_sign():
    x = tensor_of([[1.0, -2.0], [0.0, -5.0]])
    c = EFSignSGD(0.1)
    payload, ctx = c.compress(x, "w")
    assert torch.equal(payload[1], tensor_of([2.0]))
    assert torch.equal(c.decompress(payload, ctx), tensor_of([[2.0, -2.0], [2.0, -2.0]]))


def test_efsignsgd_requires_its_memory_with_the_same_lr():
    assert repr(Grace(EFSignSGD(0.1)).memory) == "EFSignSGDMemory(lr=0.1)"
    Grace(EFSignSGD(0.1), memory=EFSignSGDMemory(0.1))
    for other in (Residual(), NoMemory()):
        with pytest.raises(ValueError, match=r"EFSignSGD\(lr=0.1\) needs EFSignSGDMemory\(lr=0.1\), got"):
            Grace(EFSignSGD(0.1), memory=other)
    with pytest.raises(ValueError, match="same learning rate, got EFSignSGDMemory\\(lr=0.2\\)"):
        Grace(EFSignSGD(0.1), memory=EFSignSGDMemory(0.2))


@pytest.mark.parametrize("make", [EFSignSGD, EFSignSGDMemory])
@pytest.mark.parametrize("bad,error", [(0, ValueError), (-0.1, ValueError), (float("inf"), ValueError),
                                       (None, TypeError), ("0.1", TypeError)])
def test_lr_must_be_positive(make, bad, error):
    with pytest.raises(error, match=f"{make.__name__}: lr must be a number in \\(0, inf\\)"):
        make(bad)


# Through Grace, with in-process ranks. These tensors are tiny, so Grace's dense fallback would send
# them dense; it is turned off to exercise the compressor itself (the fallback has its own tests).


def test_grace_efsignsgd_applies_the_mean_of_the_ranks_steps_divided_by_lr():
    world, n, lr = 4, 8, 0.25
    steps = [dyadic(seed, n, world) for seed in range(4)]
    results = synchronize([Grace(EFSignSGD(lr), dense_fallback=False, communicator=Allgather())
                           for _ in range(world)], steps)
    # Karimireddy et al. (2019), Algorithm 1, per rank, then the mean of the ranks' steps over lr.
    errors = [torch.zeros(n, dtype=torch.float64) for _ in range(world)]
    for gradients, synced in zip(steps, results, strict=True):
        deltas = []
        for r, g in enumerate(gradients):
            p = lr * g.double() + errors[r]
            delta = p.abs().sum() / n * torch.where(p >= 0, 1.0, -1.0).double()
            errors[r] = p - delta
            deltas.append(delta)
        expected = (sum(deltas) / world / lr).float()
        for rank_result in synced:
            assert torch.equal(rank_result, expected)
