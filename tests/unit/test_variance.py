"""The variance sparsifier (``compressors/variance.py``, Tsuzuku et al. 2018) against its
independent reference (``tests/reference_sparsifiers.py``), payload, decoded values and sums bit
for bit over steps, in the four gradient dtypes and on awkward contents; its compiled pass equal to
its tensor formulas at any thread count; a model's hooks feed it; its arguments, memory and the
routes it refuses."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grace_legacy import Grace, NoMemory, Residual, ScatterGather, TopK, VarianceSparsifier
from grace_legacy.runtime.cost import route_link_bytes
from tests.helpers import on_both_cpu_paths
from tests.reference_compressors import CONTENTS, DTYPES, assert_matches_reference
from tests.reference_sparsifiers import SquaredGradients, VarianceReference


def moment(name: str, gradient: torch.Tensor) -> torch.Tensor:
    """A moment that is not the squared gradient: a third of it, plus a little everywhere."""
    work = torch.float64 if gradient.dtype == torch.float64 else torch.float32
    return gradient.detach().to(work).square() / 3 + 1e-4


class Moments:
    def take(self, name, gradient):
        return moment(name, gradient)

    def clear(self):
        pass


#: Every content and dtype at the reference's alpha and ksi; no decay and full decay on a few.
REFERENCE_CASES = [((1.5, 0.999), content, dtype) for content in CONTENTS for dtype in DTYPES] + [
    (setting, content, torch.float32) for setting in ((0.5, 0.0), (4.0, 1.0)) for content in ("normal", "ties")]


@pytest.mark.parametrize(("setting", "content", "dtype"), REFERENCE_CASES, ids=str)
def test_payload_and_decoded_values_equal_the_reference(setting, content, dtype):
    compressor = VarianceSparsifier(*setting)
    compressor.attach(Moments())
    reference = VarianceReference(*setting, moment)
    assert_matches_reference(compressor, reference, content, dtype, f"VarianceSparsifier{setting}")
    if content != "nonfinite":  # a skipped step; its sums are undone, not compared
        for store, expected_store in ((compressor.sums, reference.sums), (compressor.variances, reference.variances)):
            for key, kept in store.items():
                assert torch.equal(kept, torch.tensor([float(x) for x in expected_store[key]], dtype=kept.dtype)), key


@pytest.mark.parametrize(("dtype", "threads"), [(torch.float32, 2), (torch.float64, 1)], ids=str)
def test_the_compiled_pass_is_the_tensor_formulas_at_any_thread_count(dtype, threads):
    def steps() -> list:
        compressor, out = VarianceSparsifier(1.2, 0.9), []
        compressor.attach(Moments())
        for step in range(3):
            g = torch.randn(700_003, generator=torch.Generator().manual_seed(step), dtype=dtype)
            payload, _ = compressor.compress(g, "w")
            out.append([*payload, compressor.sums["w"], compressor.variances["w"]])
        return out

    for got, want in zip(*on_both_cpu_paths(threads, steps), strict=True):
        for part, expected in zip(got, want, strict=True):
            assert part.dtype == expected.dtype and torch.equal(part, expected)


def test_a_models_hooks_give_it_each_parameters_moment_and_a_step_drops_those_not_taken():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4), nn.ReLU(), nn.Linear(4, 2))
    sparsifier = VarianceSparsifier(1.0)
    sparsifier.attach(model)
    nn.functional.cross_entropy(model(torch.randn(8, 6)), torch.randint(0, 2, (8,))).backward()
    for name, parameter in model.named_parameters():
        if name != "2.bias":
            sparsifier.compress(parameter.grad, name)
    sparsifier.end_step()
    with pytest.raises(ValueError, match="no per-sample moment of '2.bias'"):
        sparsifier.compress(model[2].bias.grad, "2.bias")


def test_it_needs_a_source_of_moments():
    with pytest.raises(ValueError, match=r"attach\(model\)"):
        VarianceSparsifier(1.0).compress(torch.randn(4), "w")
    with pytest.raises(TypeError, match="take"):
        VarianceSparsifier(1.0).attach(object())
    with pytest.raises(ValueError, match="BatchNorm1d"):
        VarianceSparsifier(1.0).attach(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))


def test_it_keeps_its_own_sums_and_whole_tensors():
    sparsifier = VarianceSparsifier(1.0)
    sparsifier.attach(SquaredGradients())
    assert isinstance(Grace(sparsifier).memory, NoMemory)
    with pytest.raises(ValueError, match="own error feedback"):
        Grace(sparsifier, memory=Residual())
    with pytest.raises(ValueError, match="whole tensors only"):
        Grace(sparsifier, communicator=ScatterGather())
    # Nor does the route of fewest link bytes cut its tensors into an owner's shards.
    assert "scattergather" not in route_link_bytes(sparsifier, (64, 64), torch.float32, 4)
    assert "scattergather" in route_link_bytes(TopK(0.01), (64, 64), torch.float32, 4)


@pytest.mark.parametrize(("arguments", "named"), [
    ({"alpha": 0.0}, "alpha"), ({"alpha": -1.0}, "alpha"), ({"alpha": float("inf")}, "alpha"),
    ({"alpha": 1.0, "ksi": -0.1}, "ksi"), ({"alpha": 1.0, "ksi": 1.5}, "ksi"), ({"alpha": 1.0, "ksi": None}, "ksi"),
])
def test_bad_arguments_are_refused_by_name(arguments, named):
    with pytest.raises(ValueError, match=named):
        VarianceSparsifier(**arguments)
