"""``Grace.start(..., overwrite=True)``, as Horovod's optimizer calls it: the memory may build the
compensated gradient in the gradient's own storage. Nothing a user can see may differ from the
out-of-place path: the synchronized gradients, the memory's state, a rolled-back step."""

import pytest
import torch

from grace_legacy import QSGD, EFSignSGD, EFSignSGDMemory, Grace, Residual, TopK
from tests.helpers import bits, synchronize
from tests.registry import compressor_memory_pairs
from tests.unit.test_contract_undo import tensors_of

SETUPS = compressor_memory_pairs()
RANKS, STEPS = 2, 3


def gradients(seed: int) -> list[list[torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [[torch.randn(24, 40, generator=generator) for _ in range(RANKS)] for _ in range(STEPS)]


def assert_the_same_either_way(make, steps: list[list[torch.Tensor]]) -> None:
    """Bundles from ``make`` synchronize ``steps`` out of place and, fresh, in the gradients' own
    storage: every step's result and every tensor of the memories' state agree bit for bit."""
    apart = [make() for _ in range(RANKS)]
    in_place = [make() for _ in range(RANKS)]
    expected = synchronize(apart, steps)
    got = synchronize(in_place, [[g.clone() for g in step] for step in steps], overwrite=True)
    for step in range(len(steps)):
        for rank in range(RANKS):
            assert torch.equal(bits(got[step][rank]), bits(expected[step][rank])), (step, rank)
    for rank in range(RANKS):
        want, have = tensors_of(apart[rank].memory.state_dict()), tensors_of(in_place[rank].memory.state_dict())
        assert have.keys() == want.keys()
        for key in want:
            assert torch.equal(bits(have[key]), bits(want[key])), key


@pytest.mark.parametrize("setup", SETUPS, ids=[label for label, _ in SETUPS])
def test_overwriting_the_gradient_changes_nothing_a_user_sees(setup):
    assert_the_same_either_way(setup[1], gradients(seed=3))


@pytest.mark.parametrize("make", [lambda: (TopK(0.1), Residual()), lambda: (QSGD(8, seed=1), Residual()),
                                  lambda: (EFSignSGD(lr=0.1), EFSignSGDMemory(lr=0.1))],
                         ids=["TopK+Residual", "QSGD+Residual", "EFSignSGD+EFSignSGDMemory"])
def test_the_residual_is_untouched_until_the_step_is_kept(make):
    """The gradient's storage is written, never the residual's: a rolled-back step finds it as it was."""
    compressor, memory = make()
    bundle = Grace(compressor, memory=memory)
    steps = gradients(seed=5)
    synchronize([bundle], [[steps[0][0].clone()]], overwrite=True)
    bundle.end_step()
    before = memory.residuals["w"].clone()
    gradient = steps[1][0].clone()
    synchronize([bundle], [[gradient]], overwrite=True)
    assert not torch.equal(gradient, steps[1][0])  # it was used up
    bundle.guard.undo("w")
    assert torch.equal(bits(memory.residuals["w"]), bits(before))


def test_the_caller_may_repoint_its_gradient_afterwards():
    """Horovod's optimizer ``set_``s ``p.grad`` to the result; the residual built in p.grad's
    storage must not follow it there."""
    memory = Residual()
    bundle = Grace(TopK(0.1), memory=memory)
    grad = torch.randn(50)
    compensated_copy = grad.clone()
    result = synchronize([bundle], [[grad]], overwrite=True)[0][0]
    residual = memory.residuals["w"].clone()
    grad.set_(result)
    assert torch.equal(memory.residuals["w"], residual)
    # What was sent plus what stayed behind is the gradient handed over (no residual yet).
    assert torch.equal(memory.residuals["w"] + result, compensated_copy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_top_k_on_tensors_of_the_compiled_selection_changes_nothing(dtype):
    """Top-k with Residual on tensors large enough for the compiled selection: the same results
    and residuals in the gradient's storage as out of place, step after step."""
    generator = torch.Generator().manual_seed(11)
    steps = [[torch.randn(300, 200, generator=generator).to(dtype) for _ in range(RANKS)] for _ in range(4)]
    assert_the_same_either_way(lambda: Grace(TopK(0.01), memory=Residual()), steps)
