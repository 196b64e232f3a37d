"""Fuzzing every compressor, alone, in a ``Grace`` bundle and wrapped in schedules.

Three promises, checked by hypothesis over shapes (0-dim to 4-D, 1 to 10^6 elements, large ones
rare), contents (zeros, constants, subnormals, huge values, inf and NaN), memory layouts
(contiguous, transposed, strided), the four gradient dtypes and parameter values:

* compress -> decompress (and a bundle's round trip through its collectives) returns a tensor
  of the input's shape and dtype, whatever the parameter, the values or the layout;
* a gradient of any other dtype (integers, bool, complex, float8) or an empty one is refused
  with a ``TypeError`` (the dtype) or ``ValueError`` (empty) that says so;
* an invalid argument is refused at construction: a value of the wrong *type* (a string, a
  bool, a complex, a tensor, ``None`` where a number is needed) raises ``TypeError``; a number
  out of range (0, negative, density > 1, NaN, inf, an int too large for a float) raises
  ``ValueError`` that names the argument, never an error from deep inside PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st

from grace_legacy import (
    DGC,
    QSGD,
    Accordion,
    DGCWarmup,
    EFSignSGD,
    Grace,
    Legacy,
    LGreCo,
    PowerSGD,
    Signum,
    Threshold,
    TopK,
)
from grace_legacy.compressors.entries import DENSITY
from grace_legacy.compressors.powersgd import RANK
from grace_legacy.compressors.qsgd import LEVELS
from grace_legacy.compressors.signsgd import MOMENTUM
from grace_legacy.compressors.threshold import THRESHOLD
from grace_legacy.core.compressor import Compressor
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.memories.efsignsgd import LEARNING_RATE
from tests.helpers import ThreadBackend, World
from tests.registry import ENTRIES, Entry, fuzz_settings, numbers_of_any_kind, parameter_values, wrong_types

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
REFUSED_DTYPES = [torch.int8, torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64,
                  torch.float8_e4m3fn, torch.float8_e5m2]


# -- what the fuzzer draws --------------------------------------------------------------------


@st.composite
def shapes(draw: st.DrawFn) -> tuple[int, ...]:
    """0 to 4 dimensions and 1 to 10^6 elements: a budget of 10^e elements (e mostly small, so
    most examples are cheap and a few are large), each dimension either anything up to its share
    of the budget or close to it (hypothesis alone would favour dimensions of 1)."""
    ndim = draw(st.sampled_from([0, 1, 1, 2, 2, 3, 4]))
    budget = 10 ** draw(st.sampled_from([1, 2, 2, 3, 3, 4, 6]))
    dims = []
    for left in range(ndim, 0, -1):
        share = max(1, math.floor(budget ** (1 / left)))
        dim = draw(st.integers(1, share) | st.integers(max(1, share // 2), share))
        dims.append(dim)
        budget //= dim
    return tuple(dims)


CONTENTS = ["normal", "zeros", "constant", "tiny", "huge", "wide", "nonfinite"]


def make_tensor(shape: tuple[int, ...], dtype: torch.dtype, content: str, layout: str, seed: int) -> torch.Tensor:
    """A gradient of ``shape`` and ``dtype`` with the given content, laid out contiguously,
    transposed (a view of a tensor of the swapped shape) or strided (every other column)."""
    generator = torch.Generator().manual_seed(seed)
    stored = list(shape)
    if layout == "transposed" and len(shape) >= 2:
        stored[0], stored[1] = stored[1], stored[0]
    elif layout == "strided" and len(shape) >= 1:
        stored[-1] *= 2
    x = torch.randn(stored, generator=generator, dtype=torch.float64)
    if content == "zeros":
        x.zero_()
    elif content == "constant":
        x.fill_(-0.75)
    elif content == "tiny":
        x *= torch.finfo(dtype).tiny / 4  # subnormal (or flushed to 0 in bf16's cast)
    elif content == "huge":
        x *= torch.finfo(dtype).max / 8
    elif content == "wide":
        x *= torch.pow(10.0, torch.randint(-30, 30, stored, generator=generator, dtype=torch.float64))
    elif content == "nonfinite" and x.numel():
        flat = x.view(-1)
        flat[torch.randint(0, flat.numel(), (3,), generator=generator)] = torch.tensor([math.inf, -math.inf, math.nan],
                                                                                      dtype=torch.float64)
    x = x.to(dtype)
    if layout == "transposed" and len(shape) >= 2:
        x = x.transpose(0, 1)
    elif layout == "strided" and len(shape) >= 1:
        x = x[..., ::2]
    assert tuple(x.shape) == shape
    return x


gradients = st.builds(make_tensor, shapes(), st.sampled_from(DTYPES), st.sampled_from(CONTENTS),
                      st.sampled_from(["contiguous", "transposed", "strided"]), st.integers(0, 2**32))

# -- every compressor, built from drawn arguments ------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """How to build one compressor from drawn arguments, and a typical one."""

    name: str
    build: Callable[..., Compressor]
    arguments: dict[str, st.SearchStrategy[Any]]
    typical: Callable[[], Compressor]


def _alone(entry: Entry) -> Spec:
    return Spec(entry.name, entry.make, entry.fuzz, entry.typical)


def _legacy(entry: Entry) -> Spec:
    def build(small: Any, large: Any, split: int) -> Compressor:
        return Legacy(entry.make(), by="layer", values=[small, large], splits=[split])

    values = st.one_of(st.none(), parameter_values(entry.compressor.parameter))
    return Spec(f"Legacy({entry.name})", build, {"small": values, "large": values, "split": st.integers(1, 10**6)},
                lambda: build(None, entry.typical().value, 1000))


def _warmup(target: float, epoch: int) -> Compressor:
    return _at_epoch(DGCWarmup(TopK(), target=target), epoch)


def _accordion() -> Compressor:
    return Accordion(QSGD(), low=127, high=2, interval=3)


def _lgreco() -> Compressor:
    return LGreCo(PowerSGD(), [1, 4, None], reference=4, interval=2)


#: Every registered compressor alone, each one with a parameter inside Legacy, and the adaptive schedules.
SPECS = [_alone(entry) for entry in ENTRIES] + [_legacy(entry) for entry in ENTRIES
                                               if entry.compressor.parameter
                                               and not entry.compressor.traits.spans_step] + [
    Spec("DGCWarmup(TopK)", _warmup, {"target": st.floats(1e-9, 1.0, exclude_max=True), "epoch": st.integers(0, 6)},
         lambda: _warmup(0.01, 1)),
    Spec("Accordion(QSGD)", _accordion, {}, _accordion),
    Spec("LGreCo(PowerSGD)", _lgreco, {}, _lgreco),
]


def _at_epoch(schedule: Compressor, epoch: int) -> Compressor:
    schedule.set_epoch(epoch)
    return schedule


@st.composite
def compressors(draw: st.DrawFn) -> tuple[str, Compressor]:
    spec = draw(st.sampled_from(SPECS))
    arguments = {key: draw(strategy, label=f"{spec.name}.{key}") for key, strategy in spec.arguments.items()}
    return spec.name, spec.build(**arguments)


# -- round trips ------------------------------------------------------------------------------


def round_trip(compressor: Compressor, tensor: torch.Tensor, name: str) -> list[torch.Tensor]:
    """What the compressor alone decodes for ``tensor``, every way it can: decompress and, for
    single-round compressors, the aggregate of two ranks' payloads. Empty if it sends it dense."""
    concrete = compressor.compressor_for(tensor, name)
    if concrete is None:
        return []
    payload, ctx = concrete.compress(tensor, name)
    for _ in range(1, concrete.traits.rounds):  # one worker: the sum over ranks is the payload itself
        payload, ctx = concrete.next_round(payload, ctx)
    if concrete.traits.rounds > 1:
        concrete.end_exchange(payload, ctx)
        return [concrete.decompress(payload, ctx)]
    return [concrete.decompress(payload, ctx), concrete.aggregate([payload, payload], ctx, average=True)]


def bundle_round_trip(compressor: Compressor, tensor: torch.Tensor, name: str, steps: int = 2) -> list[torch.Tensor]:
    """The gradient a one-rank ``Grace`` bundle delivers, packed and unpacked through a real
    (in-process) gather, with the compressor's recommended memory, for ``steps`` steps."""
    bundle = Grace(compressor, dense_fallback=False)
    backend = ThreadBackend(World(1), 0)
    out = []
    for _ in range(steps):
        out.append(bundle.start(tensor, name, backend, average=True)())
        bundle.end_step(backend)
    return out


@given(compressors(), gradients)
@fuzz_settings(200)
def test_round_trip_keeps_shape_and_dtype(named, tensor):
    label, compressor = named
    event(f"{tensor.dim()}-D, 10^{len(str(tensor.numel())) - 1} elements")
    for decoded in round_trip(compressor, tensor, "w") + bundle_round_trip(compressor, tensor, "w"):
        assert decoded.shape == tensor.shape, label
        assert decoded.dtype == tensor.dtype, label
        assert decoded.device == tensor.device, label


@pytest.mark.slow
@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_large_4d_tensor_in_every_dtype(spec):
    # Every compressor meets a 10^6-element 4-D tensor at least once, whatever hypothesis draws.
    compressor = spec.typical()
    for dtype in DTYPES:
        tensor = make_tensor((10, 10, 100, 100), dtype, "normal", "contiguous", seed=1)
        for decoded in round_trip(compressor, tensor, f"big.{dtype}"):
            assert decoded.shape == tensor.shape and decoded.dtype == dtype


# -- dtypes and shapes that are refused -------------------------------------------------------


@pytest.mark.parametrize("spec", SPECS, ids=[s.name for s in SPECS])
def test_unsupported_dtypes_and_empty_tensors_are_refused(spec):
    compressor = spec.typical()
    for dtype in REFUSED_DTYPES:
        tensor = torch.ones(4, 6).to(dtype)
        refusal = "floating point, got dtype" if not dtype.is_floating_point else "float16 or bfloat16, got"
        with pytest.raises(TypeError, match=rf"gradients must be .*{refusal} {dtype}"):
            compressor.compress(tensor, "w")
    for shape in [(0,), (3, 0), (0, 4, 2)]:
        with pytest.raises(ValueError, match="empty tensor"):
            compressor.compress(torch.zeros(shape), "w")


def test_a_dense_legacy_value_still_refuses_an_integer_gradient():
    # Regression: the dense route (None, density 1.0) passed any tensor through unchecked.
    for schedule in (Legacy(TopK(), by="layer", values=[None]), Legacy(TopK(), by="layer", values=[1.0])):
        with pytest.raises(TypeError, match="Legacy: gradients must be floating point"):
            schedule.compress(torch.arange(6), "w")


# -- invalid arguments --------------------------------------------------------------------------


def parameter_accepts(parameter: ScheduledParameter, value: Any) -> bool:
    """An independent oracle for the documented rule: an integer parameter takes whole numbers, compared
    exactly (so any int, however large); any other parameter takes the value as a float, which must be
    finite (an int or fraction too large for a float is refused). Then the range."""
    try:
        number = Fraction(value)
        if not parameter.integer:
            converted = float(value)
            if not math.isfinite(converted):
                return False
            number = Fraction(converted)
    except (ValueError, OverflowError, TypeError):  # NaN, infinities, overflow
        return False
    if parameter.integer and number.denominator != 1:
        return False
    if parameter.low is not None and (number < Fraction(parameter.low)
                                      or (number == parameter.low and not parameter.low_inclusive)):
        return False
    return not (parameter.high is not None
                and (number > Fraction(parameter.high) or (number == parameter.high and not parameter.high_inclusive)))


# (label, parameter, constructor from the one argument fuzzed): every registered compressor's parameter,
# then the other numeric arguments.
KNOB_ARGUMENTS: list[tuple[str, ScheduledParameter, Callable[[Any], Any]]] = [
    (f"{entry.name}: {entry.compressor.parameter.name}", entry.compressor.parameter, entry.make)
    for entry in ENTRIES if entry.compressor.parameter
] + [
    ("Signum: momentum", MOMENTUM, Signum),
    ("EFSignSGD: lr", LEARNING_RATE, EFSignSGD),
    ("DGC: sample_ratio", ScheduledParameter("sample_ratio", low=0.0, high=1.0, low_inclusive=False),
     lambda v: DGC(0.1, sample_ratio=v)),
    ("Legacy(values[0]): ratio", DENSITY, lambda v: Legacy(TopK(), by="layer", values=[v])),
    ("Legacy(values[1]): levels", LEVELS, lambda v: Legacy(QSGD(), by="epoch", values=[8, v], epochs=2)),
    ("Legacy(values[0]): rank", RANK, lambda v: Legacy(PowerSGD(), by="layer", values=[v, 1], splits=[10])),
    ("Legacy(values[0]): threshold", THRESHOLD, lambda v: Legacy(Threshold(), by="layer", values=[v])),
    ("DGCWarmup(target): ratio", DENSITY, lambda v: DGCWarmup(TopK(), target=v)),
    ("Accordion(low): levels", LEVELS, lambda v: Accordion(QSGD(), low=v, high=1, interval=2)),
    ("LGreCo(reference): ratio", DENSITY, lambda v: LGreCo(TopK(), [v, 0.1], reference=v, interval=2)),
]


def _usable(label: str, built: Any) -> None:
    """An accepted extreme value must still compress without an obscure error."""
    tensor = torch.randn(5, 7)
    for decoded in round_trip(built, tensor, "w"):
        assert decoded.shape == tensor.shape, label


@given(st.sampled_from(KNOB_ARGUMENTS), numbers_of_any_kind)
@fuzz_settings(300)
def test_numbers_out_of_range_raise_value_error(argument, value):
    label, parameter, build = argument
    if parameter_accepts(parameter, value):
        try:
            built = build(value)
        except ValueError as err:
            # Only the schedules' own rules may refuse a value the parameter accepts (a warm-up target
            # must compress; Accordion's low must differ from high and send more bytes).
            assert label.startswith(("DGCWarmup", "Accordion", "LGreCo")), (label, value, err)
            return
        _usable(label, built)
        return
    with pytest.raises(ValueError) as caught:
        build(value)
    assert not isinstance(caught.value, TypeError), f"{label}: {value!r} is a number, refused as a type"
    assert parameter.name in str(caught.value), (label, str(caught.value))


@given(st.sampled_from(KNOB_ARGUMENTS), wrong_types)
@fuzz_settings(200)
def test_wrong_types_raise_type_error(argument, value):
    label, parameter, build = argument
    with pytest.raises(TypeError) as caught:
        build(value)
    assert parameter.name in str(caught.value), (label, str(caught.value))


@pytest.mark.parametrize("base", [entry.compressor for entry in ENTRIES if entry.compressor.parameter],
                         ids=lambda base: base.__name__)
def test_none_is_unset_alone_and_dense_in_a_schedule(base):
    with pytest.raises(ValueError, match=r"was built without its \w+: pass one"):
        base(None).compress(torch.randn(5, 7), "w")
    # One selection over the step has no layer of its own: its schedule goes by epoch.
    by = {"by": "epoch", "epochs": 1} if base.traits.spans_step else {"by": "layer"}
    assert Legacy(base(), values=[None], **by).compressor_for(torch.randn(5, 7), "w") is None


@pytest.mark.parametrize("build", [Signum, EFSignSGD, lambda v: DGC(0.1, sample_ratio=v)])
def test_none_is_a_type_error_where_a_number_is_needed(build):
    with pytest.raises(TypeError):
        build(None)


@pytest.mark.parametrize("value", [10**400, -(10**400), Fraction(10**400, 3)])
@pytest.mark.parametrize("parameter", [DENSITY, THRESHOLD, LEVELS, RANK, MOMENTUM, LEARNING_RATE],
                         ids=lambda k: k.name)
def test_numbers_beyond_a_float_are_a_value_error_not_an_overflow(parameter, value):
    # Regression: ScheduledParameter.check called float() on them and let OverflowError escape.
    if parameter.integer and parameter.high is None and value == int(value) > 0:
        # An unbounded integer parameter (PowerSGD's rank) compares ints exactly: any rank is valid
        # (one beyond a tensor's dimensions sends it dense).
        assert parameter.check(value, "Owner") == value
        return
    with pytest.raises(ValueError, match=parameter.name) as caught:
        parameter.check(value, "Owner")
    assert not isinstance(caught.value, OverflowError)


@pytest.mark.parametrize("build", [
    lambda v: DGC(0.1, sample_ratio=v), lambda v: DGC(0.1, min_samples=v),
    lambda v: Legacy(TopK(), by="epoch", values=[0.1], epochs=v),
    lambda v: Legacy(TopK(), by="layer", values=[0.1], steps_per_epoch=v),
    lambda v: Accordion(TopK(), low=0.1, high=0.01, interval=v),
    lambda v: LGreCo(TopK(), [0.1, 0.01], reference=0.1, interval=v),
])
@pytest.mark.parametrize("value", ["3", True, [2], 2 + 0j, torch.tensor(3)])
def test_other_numeric_arguments_refuse_wrong_types_with_type_error(build, value):
    # Regression: these raised ValueError for a string or a list; wrong types are TypeErrors
    # (ArgumentTypeError, which stays catchable as ValueError for older callers).
    with pytest.raises(TypeError):
        build(value)
