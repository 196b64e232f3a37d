"""A compressor's traits: one record per class (grace_legacy/core/traits.py), checked when the
record and the class are made, so a contradiction fails at import rather than inside a job."""

from __future__ import annotations

import pytest

import grace_legacy as gl
from grace_legacy import Compressor, Traits


def test_contradictory_records_are_refused_naming_the_trait():
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        Traits(rounds=0)
    with pytest.raises(ValueError, match="rounds > 1 needs additive"):
        Traits(rounds=2)
    with pytest.raises(ValueError, match="elementwise needs additive"):
        Traits(elementwise=True)
    with pytest.raises(ValueError, match="spans_step excludes"):
        Traits(additive=True, rounds=2, spans_step=True)
    with pytest.raises(TypeError, match="additive must be bool"):
        Traits(additive=1)
    with pytest.raises(TypeError, match="rounds must be int"):
        Traits(additive=True, rounds=2.0)


def _compressor(**members):
    def compress(self, tensor, name):  # pragma: no cover - never called
        return [tensor], None

    def decompress(self, payload, ctx):  # pragma: no cover - never called
        return payload[0]

    return type("Made", (Compressor,), {"compress": compress, "decompress": decompress, **members})


def test_a_flag_set_on_its_own_is_refused_with_the_record_to_write():
    with pytest.raises(TypeError, match=r"Made: additive belong to its traits record: traits = Traits\(additive=...\)"):
        _compressor(additive=True)


@pytest.mark.parametrize(("traits", "method"), [
    (Traits(sends_entries=True), "support"),
    (Traits(additive=True, elementwise=True), "decompress_flat"),
    (Traits(additive=True, rounds=2), "next_round"),
])
def test_a_trait_needs_the_method_that_serves_it(traits, method):
    with pytest.raises(TypeError, match=f"does not define {method}"):
        _compressor(traits=traits)
    _compressor(traits=traits, **{method: lambda self, *args: None})  # defined: accepted


def test_a_record_of_another_type_is_refused():
    with pytest.raises(TypeError, match="must be a Traits record, got dict"):
        _compressor(traits={"additive": True})


def test_a_schedule_has_its_bases_traits_less_what_holds_per_compressor_only():
    schedule = gl.Legacy(gl.PowerSGD(), by="layer", values=[1, 2], splits=[100])
    assert schedule.traits.rounds == 2 and schedule.traits.additive
    assert gl.PowerSGD.traits.delivers_nonfinite and not schedule.traits.delivers_nonfinite


def test_the_base_keeps_what_every_compressor_needs_and_the_rest_is_opt_in():
    from grace_legacy.core.compressor import Elementwise, MultiRound, Randomized, Sparsifier, Tunable
    from grace_legacy.core.state import Stateful

    def own_public(cls, below=()):
        skipped = (*below, object, Stateful)
        classes = [k for k in cls.__mro__ if k not in skipped and k.__module__.startswith("grace_legacy")]
        return {name for klass in classes for name in vars(klass)
                if not name.startswith("_") and callable(getattr(cls, name, None))}

    assert own_public(Compressor) == {
        "compress", "decompress", "aggregate", "payload_spec", "payload_spec_for", "scatter_context",
        "compressor_for", "for_sums", "recommended_memory", "check_memory", "set_rank", "rejoin_state"}
    assert own_public(Tunable, below=Compressor.__mro__) >= {"with_value", "check_ready", "compressor_for"}
    for opt_in, method in ((Sparsifier, "support"), (Randomized, "generator"), (MultiRound, "next_round"),
                           (Elementwise, "decompress_flat"), (Tunable, "with_value")):
        assert not hasattr(Compressor, method) and hasattr(opt_in, method), (opt_in, method)
    # Only a compressor with a parameter can be scheduled, and one without has no value to set.
    with pytest.raises(ValueError, match="no parameter to schedule"):
        gl.Legacy(gl.TernGrad(), by="layer", values=[None, 1], splits=[10])
    assert isinstance(gl.TopK(), Tunable) and not isinstance(gl.FP16(), Tunable)
