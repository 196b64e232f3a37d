"""The contract every registered compressor keeps, because the library's checks rely on it
(docs/IMPLEMENTING.md):

* its ``repr`` names every constructor argument, and two configurations with different arguments
  have different reprs: the ranks' configuration digest and the checkpoint check compare reprs,
  so an argument left out would let ranks (or a resumed run) differ unnoticed;
* a checkpoint of one configuration is refused by another, and restores the same one;
* ``payload_spec`` describes the payload ``compress`` returns, part for part, every round's in
  turn (the dense fallback and budget matching predict bytes from it), and only a payload whose size the data decides
  may leave it unimplemented, with ``uniform_payload = False``;
* an additive payload may be summed before decoding (it travels by allreduce);
* a compressor that aggregates by mean aggregates to the mean of what it decodes (so sending the
  tensor dense is its exact limit);
* its recommended memory is one ``Grace`` accepts.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from grace_legacy import Grace, Memory
from grace_legacy.consistency import description_digest
from tests.registry import ENTRIES, Entry

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(7,), (3, 5), (40, 30)]
parametrize_entries = pytest.mark.parametrize("entry", ENTRIES, ids=[entry.name for entry in ENTRIES])


def arguments(entry: Entry) -> list[str]:
    return [name for name in inspect.signature(entry.compressor.__init__).parameters if name != "self"]


@parametrize_entries
def test_repr_names_every_argument(entry):
    shown = repr(entry.typical())
    for name in arguments(entry):
        assert f"{name}=" in shown, f"{shown} does not name the argument {name!r}"


@parametrize_entries
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_different_arguments_are_a_different_configuration_and_refuse_each_others_checkpoint(entry, data):
    if not entry.fuzz:
        return
    first = data.draw(st.fixed_dictionaries(entry.fuzz), label="first")
    second = data.draw(st.fixed_dictionaries(entry.fuzz), label="second")
    a, b = Grace(entry.compressor(**first)), Grace(entry.compressor(**second))
    if first == second:
        assert a.describe() == b.describe()
        b.load_state_dict(a.state_dict())
        return
    assert description_digest(a.describe()) != description_digest(b.describe()), (first, second)
    with pytest.raises(ValueError, match="different configuration"):
        b.load_state_dict(a.state_dict())


@parametrize_entries
def test_a_checkpoint_restores_the_same_configuration(entry):
    bundle, fresh = Grace(entry.typical()), Grace(entry.typical())
    fresh.load_state_dict(bundle.state_dict())
    assert fresh.describe() == bundle.describe()


def compressed(entry: Entry, shape: tuple[int, ...], dtype: torch.dtype, rank: int = 0):
    compressor = entry.typical()
    compressor.set_rank(rank)
    tensor = torch.randn(shape, generator=torch.Generator().manual_seed(rank + 1), dtype=torch.float64).to(dtype)
    concrete = compressor.compressor_for(tensor, "w")
    if concrete is None:
        return tensor, None, None, None
    payload, ctx = concrete.compress(tensor, "w")
    return tensor, concrete, payload, ctx


@parametrize_entries
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_payload_spec_describes_the_payload(entry, shape, dtype):
    tensor, concrete, payload, ctx = compressed(entry, shape, dtype)
    if concrete is None:
        return
    try:
        spec = concrete.payload_spec_for(tensor.shape, tensor.dtype)
    except NotImplementedError:
        assert not concrete.traits.uniform_payload, f"{concrete!r} has a uniform payload but no payload_spec"
        return
    sent = list(payload)
    for _ in range(1, concrete.traits.rounds):  # one worker: each round's sum is its own payload
        payload, ctx = concrete.next_round(payload, ctx)
        sent += payload
    assert [(p.numel(), p.dtype) for p in sent] == spec


@parametrize_entries
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_additive_payloads_may_be_summed_and_means_aggregate_to_the_mean(entry, dtype):
    parts = [compressed(entry, (40, 30), dtype, rank) for rank in range(2)]
    (_, concrete, payload0, ctx0), (_, other, payload1, ctx1) = parts
    if concrete is None or concrete.traits.rounds > 1:
        return  # sent dense, or multi-round (PowerSGD's rounds have their own tests)
    decoded = [concrete.decompress(payload0, ctx0), other.decompress(payload1, ctx1)]
    # Summing in the payload's own dtype, or the gradient's, rounds at its precision (FP16 sends
    # float16; a bfloat16 gradient's decoded values are summed in bfloat16).
    coarsest = max(torch.finfo(d).eps for d in [dtype, *(p.dtype for p in payload0 if p.is_floating_point())])
    tolerance = {"rtol": max(1e-5, 2 * coarsest), "atol": 1e-6}
    if concrete.traits.additive:
        summed = [p + q for p, q in zip(payload0, payload1, strict=True)]
        torch.testing.assert_close(concrete.decompress(summed, ctx0), decoded[0] + decoded[1], **tolerance)
    if concrete.traits.aggregates_by_mean and not concrete.traits.additive:
        aggregate = concrete.aggregate([payload0, payload1], ctx0, average=True)
        torch.testing.assert_close(aggregate, (decoded[0] + decoded[1]) / 2, **tolerance)


@parametrize_entries
def test_the_recommended_memory_is_accepted(entry):
    compressor = entry.typical()
    memory = compressor.recommended_memory()
    assert isinstance(memory, Memory)
    assert Grace(compressor).memory.configuration() == memory.configuration()
