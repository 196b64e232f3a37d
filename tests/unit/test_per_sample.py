"""The per-sample second moments of ``compressors/per_sample.py`` against per-sample gradients
computed independently with ``torch.func`` (``vmap`` of ``grad`` of each sample's share of the
loss), for linear layers on matrices and sequences and for convolutions with every option that
changes their patches; ready before the parameter's gradient (where the optimizer or DDP hooks
start sending it); what they cannot see refused by name."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from grace_legacy.compressors.per_sample import SampleMoments


class Sequence(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(5, 7)
        self.out = nn.Linear(7, 3, bias=False)

    def forward(self, x):  # x: (batch, positions, 5)
        return self.out(torch.tanh(self.mix(x))).mean(1)


def convolutions(**options) -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 6, 3, **options), nn.ReLU(), nn.Flatten(), nn.LazyLinear(3))


MODELS = {
    "linear": (lambda: nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3)), (6,)),
    "sequence": (Sequence, (4, 5)),
    "conv": (lambda: convolutions(), (4, 9, 9)),
    "conv strided, padded, dilated": (lambda: convolutions(stride=2, padding=1, dilation=2), (4, 11, 10)),
    "conv grouped, no bias": (lambda: convolutions(groups=2, bias=False), (4, 8, 8)),
    "conv same, reflected": (lambda: convolutions(padding="same", padding_mode="reflect"), (4, 7, 8)),
}


def per_sample_moments(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """sum_z (grad of sample z's share of the mean loss)^2, by torch.func."""
    params = {name: p.detach() for name, p in model.named_parameters()}
    batch = x.shape[0]

    def share(params, xz, yz):
        out = functional_call(model, params, (xz.unsqueeze(0),))
        return nn.functional.cross_entropy(out, yz.unsqueeze(0)) / batch

    grads = vmap(grad(share), in_dims=(None, 0, 0))(params, x, y)
    return {name: g.square().sum(0) for name, g in grads.items()}


@pytest.mark.parametrize("label", MODELS)
def test_moments_equal_the_squared_per_sample_gradients_summed(label):
    make, shape = MODELS[label]
    torch.manual_seed(0)
    model = make().double()
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, *shape, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    model(x)  # materializes LazyLinear before the hooks look at the parameters
    moments = SampleMoments(model)
    passes = 2  # two backward passes before the moments are taken: their moments add up
    for _ in range(passes):
        nn.functional.cross_entropy(model(x), y).backward()
    got = {name: moments.take(name, p.grad) for name, p in model.named_parameters()}
    moments.remove()
    expected = per_sample_moments(model, x, y)
    for name in expected:
        torch.testing.assert_close(got[name], passes * expected[name], rtol=1e-10, atol=1e-14, msg=name)


def test_a_moment_is_ready_before_its_parameters_gradient_is():
    torch.manual_seed(0)
    model = convolutions().float()
    x = torch.randn(3, 4, 9, 9)
    model(x)
    moments = SampleMoments(model)
    taken = {}

    def take(p: torch.Tensor, name: str) -> None:
        taken[name] = moments.take(name, p.grad)

    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: take(p, name))
    nn.functional.cross_entropy(model(x), torch.tensor([0, 1, 2])).backward()
    assert sorted(taken) == sorted(name for name, _ in model.named_parameters())


@pytest.mark.parametrize(("model", "named"), [
    (nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)), "'1.weight' belongs to a BatchNorm1d"),
    (nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 2)), "'0.weight' belongs to a Embedding"),
    (nn.ParameterDict({"scale": nn.Parameter(torch.ones(2))}), "'scale' belongs to a ParameterDict"),
])
def test_parameters_of_other_layers_are_refused_by_name(model, named):
    with pytest.raises(ValueError, match=named):
        SampleMoments(model)


def test_a_layer_run_twice_or_a_shared_parameter_is_refused():
    layer = nn.Linear(3, 3)
    moments = SampleMoments(layer)
    with pytest.raises(ValueError, match="ran twice before a backward pass"):
        layer(layer(torch.randn(2, 3)))
    moments.remove()
    shared = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    shared[1].weight = shared[0].weight
    with pytest.raises(ValueError, match="shared by 2 modules"):
        SampleMoments(shared)
    frozen = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))
    frozen[1].requires_grad_(False)
    SampleMoments(frozen)  # a frozen parameter sends no gradient: nothing to refuse
