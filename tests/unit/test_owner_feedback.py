"""``ScatterGather(owner_feedback=...)``: the owners' error feedback kept (the default) or dropped,
step after step, against a reference written here from the algorithm's definition: EF-signSGD
compressed shard by shard on every rank, the owner's mean of the decoded shards re-compressed with
(or without) the owner's own residual, every rank decoding the owners' payloads."""

import pytest
import torch
from torch import nn

from grace_legacy import EFSignSGD, Grace, ScatterGather, TopK
from grace_legacy.runtime.validation import ArgumentTypeError
from grace_legacy.simulate import Simulation
from tests.two_phase import shards

N, LR, STEPS = 41, 0.5, 5


def scaled_sign(x: torch.Tensor) -> torch.Tensor:
    """EF-signSGD's encoding, decoded: the mean magnitude with each element's sign (0 counts as +)."""
    scale = x.abs().mean()
    return torch.where(x >= 0, scale, -scale)


def reference(gradients: torch.Tensor, owner_feedback: bool) -> list[torch.Tensor]:
    """The gradient every rank applies at each step; ``gradients``: steps x ranks x N."""
    steps, world_size, n = gradients.shape
    error = torch.zeros(world_size, n)
    owner_error = torch.zeros(n)
    out = []
    for t in range(steps):
        compensated = LR * gradients[t] + error
        sent = torch.zeros_like(compensated)
        for start, stop in shards(n, world_size):
            for r in range(world_size):
                sent[r, start:stop] = scaled_sign(compensated[r, start:stop])
        error = compensated - sent
        total = sent.mean(0) + (owner_error if owner_feedback else 0)
        step = torch.cat([scaled_sign(total[start:stop]) for start, stop in shards(n, world_size)])
        if owner_feedback:
            owner_error = total - step
        out.append(step / LR)
    return out


class Linear(nn.Module):
    """A model whose gradient is its batch's one row: the gradients are chosen by the test."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(N))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum(1)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("owner_feedback", [True, False])
def test_each_step_equals_the_reference_with_the_owners_feedback_kept_or_dropped(world_size, owner_feedback):
    gradients = torch.randn(STEPS, world_size, N, generator=torch.Generator().manual_seed(world_size))
    expected = reference(gradients, owner_feedback)
    model = Linear()
    communicator = ScatterGather() if owner_feedback else ScatterGather(owner_feedback=False)
    with Simulation(model, lambda worker: Grace(EFSignSGD(lr=LR), communicator=communicator),
                    world_size, loss=lambda outputs, targets: outputs.sum(), check=True) as simulation:
        for t in range(STEPS):
            simulation.backward([(gradients[t, r:r + 1], torch.zeros(1)) for r in range(world_size)])
            torch.testing.assert_close(model.w.grad, expected[t], rtol=0, atol=1e-6)
            assert simulation.stats[0]["tensors_by_route"] == {"scattergather": t + 1}
    # From the second step on the two differ: the owner's residual is what sets them apart.
    other = reference(gradients, not owner_feedback)
    assert torch.equal(expected[0], other[0]) and not torch.allclose(expected[-1], other[-1])


@pytest.mark.parametrize("owner_feedback", [True, False])
def test_an_owner_keeps_a_residual_only_with_its_feedback(owner_feedback):
    model = Linear()
    gradients = torch.randn(3, 2, N, generator=torch.Generator().manual_seed(0))
    bundles = []

    def build(worker: int) -> Grace:
        bundles.append(Grace(TopK(0.2), communicator=ScatterGather(owner_feedback=owner_feedback)))
        return bundles[-1]

    with Simulation(model, build, 2, loss=lambda outputs, targets: outputs.sum()) as simulation:
        for t in range(3):
            simulation.backward([(gradients[t, r:r + 1], torch.zeros(1)) for r in range(2)])
    assert all(bool(bundle.owner_memory.state_dict()["residuals"]) == owner_feedback for bundle in bundles)
    assert all(bundle.memory.state_dict()["residuals"] for bundle in bundles)  # the ranks' own feedback stays


@pytest.mark.parametrize("value", ["False", 0, None, 1.0])
def test_owner_feedback_must_be_a_bool(value):
    with pytest.raises(ArgumentTypeError, match=r"ScatterGather: owner_feedback must be True or False, got"):
        ScatterGather(owner_feedback=value)


def test_the_repr_says_when_the_owners_feedback_is_dropped():
    assert repr(ScatterGather()) == "ScatterGather()"
    assert repr(ScatterGather(owner_feedback=False)) == "ScatterGather(owner_feedback=False)"
    assert repr(Grace(TopK(0.1), communicator=ScatterGather(owner_feedback=False))).count("owner_feedback=False") == 1
