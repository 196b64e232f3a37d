"""Bad input, everywhere a user types it: every flag of ``python -m grace_legacy plan`` and every
argument of the public constructors and functions that ``test_fuzz.py`` (which covers the
compressors' parameters) does not.

The promise checked, with hypothesis drawing the values:

* a bad CLI value is an argparse usage error (exit status 2) whose message names the flag;
* a bad library argument fails where it is given: a value of the wrong type (a string, a bool,
  a tensor, a complex, ``None`` where a number is needed) with a ``TypeError``, a number out of
  range (0, negatives, NaN, infinities, ints beyond a float) with a ``ValueError`` that is not a
  ``TypeError``; both name the argument;
* a good value still works: the plan is printed and sums the sizes given, the object is built.

Which values are good is decided by oracles written here from the documented ranges, not by
calling the library's own checks.
"""

from __future__ import annotations

import io
import math
import numbers
import re
import sys
from collections.abc import Callable
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grace_legacy import (
    DGC,
    Accordion,
    DGCMemory,
    DGCWarmup,
    EFSignSGDMemory,
    Grace,
    Legacy,
    LGreCo,
    TopK,
    grace_from_params,
)
from grace_legacy import ddp as grace_ddp
from grace_legacy.__main__ import main
from grace_legacy.backends.torch_distributed import TorchDistributedBackend
from grace_legacy.planner import model_shapes, plan
from tests.registry import fuzz_settings, numbers_of_any_kind, wrong_types

#: The most elements a tensor holds (an int64 count), as documented for --sizes.
LARGEST = 2**63 - 1


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``python -m grace_legacy plan ARGV`` in this process: (exit status, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(["plan", *argv])
        except SystemExit as exit_:
            code = exit_.code
    return code, out.getvalue(), err.getvalue()


def assert_refused(argv: list[str], flag: str) -> None:
    code, out, err = run_cli(*argv)
    assert code == 2, (argv, out, err)
    assert "Traceback" not in err, err
    assert flag in err.splitlines()[-1], (argv, err)


# -- the CLI: lists drawn item by item, each good or bad by construction ------------------------------


@dataclass(frozen=True)
class Drawn:
    """A flag's text and whether it is valid, known from how it was drawn."""

    text: str
    valid: bool
    values: tuple = ()


def spaced(token: str) -> st.SearchStrategy[str]:
    return st.sampled_from(["{}", " {}", "{} "]).map(lambda pattern: pattern.format(token))


#: Not a size, a split or a count: the last two only beyond an int64, as the CLI documents.
BAD_INTEGERS = ["0", "-5", "-1", "1.5", "1e3", "abc", "nan", "inf", "0x10", "1/2", str(LARGEST + 1), "9" * 25]
BAD_NUMBERS = ["0", "-1", "-0.5", "nan", "inf", "-inf", "1e400", "abc", "1,5x", "--1"]
#: Separators between items: the first is the valid one, the others malformed.
SEPARATORS = [",", ";", ",,", ", ,"]


@st.composite
def drawn_list(draw: st.DrawFn, good: st.SearchStrategy[Any], bad: list[str], increasing: bool = False,
               count: int | None = None) -> Drawn:
    """A comma-separated list: all good items (valid) or one broken part: a bad item, an empty
    item, a wrong separator or a trailing comma."""
    n = count if count is not None else draw(st.integers(1, 4))
    values = draw(st.lists(good, min_size=n, max_size=n, unique=increasing))
    if increasing:
        values = sorted(values)
    tokens = [draw(spaced(str(v))) for v in values]
    broken = draw(st.sampled_from([None, None, "item", "empty", "separator", "trailing"]))
    valid = broken is None
    separators = [","] * (n - 1)
    if broken == "item":
        tokens[draw(st.integers(0, n - 1))] = draw(st.sampled_from(bad))
    elif broken == "empty":
        tokens.insert(draw(st.integers(0, n)), draw(st.sampled_from(["", " "])))
        separators.append(",")
    elif broken == "separator" and n > 1:
        separators[draw(st.integers(0, n - 2))] = draw(st.sampled_from(SEPARATORS[1:]))
    elif broken == "separator":
        tokens[0] = tokens[0] + draw(st.sampled_from([";", ";2"]))
    elif broken == "trailing":
        separators.append(",")
        tokens.append("")
    text = tokens[0] + "".join(sep + token for sep, token in zip(separators, tokens[1:], strict=True))
    return Drawn(text, valid, tuple(values))


sizes_drawn = drawn_list(st.integers(1, 10**6) | st.sampled_from([LARGEST, 2**40]), BAD_INTEGERS)
splits_drawn = drawn_list(st.integers(1, 10**6), BAD_INTEGERS, increasing=True)
factors_drawn = drawn_list(st.floats(1e-3, 1e3).map(lambda f: float(f"{f:.6g}")) | st.sampled_from([1, 2.5, 1e-9]),
                           BAD_NUMBERS)
percents_drawn = drawn_list(st.floats(1e-3, 100).map(lambda f: float(f"{f:.6g}")) | st.sampled_from([100, "none"]),
                            BAD_NUMBERS + ["101", "1e-400"])


@given(sizes_drawn)
@fuzz_settings(150)
def test_sizes(drawn):
    code, out, err = run_cli("--sizes", drawn.text)
    if drawn.valid:
        assert code == 0, (drawn, err)
        # The plan counts exactly the elements given (the bug: '10,-5' planned 5 elements at 160%).
        total = re.search(r"all \(100% of run\)\s+(\d+)\s+([\d,]+)", out)
        assert total and int(total.group(1)) == len(drawn.values), out
        assert int(total.group(2).replace(",", "")) == sum(drawn.values), out
        volume = float(re.fullmatch(r"expected volume ([\d.]+)%", out.splitlines()[-1]).group(1))
        assert 0 < volume < math.inf, out
    else:
        assert_refused(["--sizes", drawn.text], "--sizes")


@given(splits_drawn)
@fuzz_settings(60)
def test_group_splits(drawn):
    argv = ["--sizes", "10,100000,20000000", "--group-splits", drawn.text,
            "--group-compressions", ",".join(["1"] * (len(drawn.values) + 1))]
    if drawn.valid:
        code, out, err = run_cli(*argv)
        assert code == 0, (drawn, err)
        assert f"--group-splits '{','.join(map(str, drawn.values))}'" in out
    else:
        assert_refused(argv, "--group-splits")


@given(percents_drawn)
@fuzz_settings(80)
def test_group_compressions(drawn):
    # As many values as size groups: the splits 10, 20, ... cut as many groups as the list has items.
    splits = ",".join(str(10 * (i + 1)) for i in range(len(drawn.values) - 1))
    argv = ["--sizes", "5,15,25,35", "--group-compressions", drawn.text]
    if splits:
        argv += ["--group-splits", splits]
    code, out, err = run_cli(*argv)
    if drawn.valid:
        assert code == 0, (drawn, err)
        assert "expected volume" in out
    else:
        assert_refused(argv, "--group-compressions")


@given(factors_drawn, st.sampled_from(["--layer-factors", "--phase-factors"]))
@fuzz_settings(60)
def test_factors(drawn, flag):
    n = len(drawn.values)
    if flag == "--layer-factors":
        splits = ",".join(str(10 * 4**i) for i in range(n - 1))
        shape = ["--by", "layer", *(["--group-splits", splits] if splits else [])]
    else:
        shape = ["--by", "epoch", "--epochs", str(n)]
    argv = ["--sizes", "5,50,500,5000,50000", "--budget", "1", *shape, flag, drawn.text]
    code, out, err = run_cli(*argv)
    if drawn.valid:
        # A shape that no scale of the budget can meet is refused by name, and only that.
        assert code == 0 or "no scale of this shape matches" in err, (drawn, err)
    else:
        assert_refused(argv, flag)


@given(st.sampled_from(["--epochs", "--workers"]),
       st.integers(1, 10**6).map(str) | st.sampled_from([str(LARGEST)]) | st.sampled_from(BAD_INTEGERS))
@fuzz_settings(40)
def test_whole_numbers(flag, token):
    argv = ["--sizes", "100,100000", flag, token]
    if flag == "--epochs":
        argv += ["--by", "epoch", "--group-compressions", "10,1"]
    if token in BAD_INTEGERS:
        assert_refused(argv, flag)
    else:
        code, out, err = run_cli(*argv)
        assert code == 0, (flag, token, err)


@pytest.mark.parametrize("token", ["0", "-1", "nan", "inf", "-inf", "1e400", "abc", "", "1/2", "101", "1,2"])
def test_budget_refused(token):
    assert_refused(["--sizes", "100,100000", "--budget", token], "--budget")


@pytest.mark.parametrize("token", ["100", "1", "0.5", " 2 ", "1e-3"])
def test_budget_accepted(token):
    code, out, err = run_cli("--sizes", "100,100000", "--budget", token)
    assert code == 0, err


@pytest.mark.parametrize(("argv", "flag"), [
    (["--sizes", "10,-5"], "--sizes"),  # the report: it planned 5 elements at 160%
    (["--sizes", ""], "--sizes"),
    (["--sizes", "10", "--compressor", "nosuch"], "--compressor"),
    (["--sizes", "10", "--by", "rows", "--group-compressions", "1"], "--by"),
    (["--sizes", "10", "--by", "uniform", "--group-compressions", "1,2"], "--group-compressions"),
    (["--sizes", "10", "--by", "uniform", "--group-compressions", "1", "--group-splits", "5"], "--group-splits"),
    (["--sizes", "10", "--by", "layer", "--group-compressions", "1", "--epochs", "3"], "--epochs"),
    (["--sizes", "10", "--by", "epoch", "--group-compressions", "1,2"], "--epochs"),
    (["--sizes", "10", "--by", "epoch", "--epochs", "2", "--group-compressions", "1", "--group-splits", "5"],
     "--group-splits"),
    (["--sizes", "10", "--by", "layer", "--group-compressions", "1;2"], "--group-compressions"),
    (["--sizes", "10", "--group-compressions", "1,2", "--group-splits", "50,5"], "--group-splits"),
    (["--sizes", "10", "--budget", "1", "--by", "layer", "--phase-factors", "1,2"], "--phase-factors"),
    (["--sizes", "10", "--budget", "1", "--by", "epoch", "--epochs", "2", "--layer-factors", "1"],
     "--layer-factors"),
    (["--sizes", "10", "--budget", "1", "--group-splits", "5", "--layer-factors", "1,2,3"], "--layer-factors"),
    (["--sizes", "10", "--compressor", "qsgd", "--group-compressions", "4.5"], "--group-compressions"),
    (["--sizes", "10", "--compressor", "qsgd", "--budget", "4"], "--budget"),
    (["--model", "no_such_module_here:f"], "--model"),
    (["--model", "math:sqrt"], "--model"),
    (["--model", "torch.nn:Identity"], "--model"),  # no parameter at all
    (["--sizes", "10", "--plot", ""], "--plot"),
    (["--sizes", "10", "--plot", "plan.pdf"], "--plot"),
    (["--sizes", "10", "--plot", "no/such/directory/plan.png"], "--plot"),
])
def test_flags_named_in_the_usage_error(argv, flag):
    assert_refused(argv, flag)


# -- the library: numeric and flag arguments -----------------------------------------------------------


@dataclass(frozen=True)
class Accepts:
    """A numeric argument's documented range. ``whole``: ``"type"`` asks for an integer type
    (``2.0`` refused), ``"value"`` for a whole value of any number type (a parameter's rule);
    ``none``: whether ``None`` is accepted."""

    low: float | None = None
    low_inclusive: bool = True
    high: float | None = None
    high_inclusive: bool = True
    whole: str | None = None
    none: bool = False

    def __call__(self, value: Any) -> bool:
        if value is None:
            return self.none
        if kind(value) != "number":
            return False
        if self.whole == "type" and not isinstance(value, numbers.Integral):
            return False
        try:
            number = Fraction(value)
        except (ValueError, OverflowError):  # NaN, infinities
            return False
        if self.whole is None:
            try:
                converted = float(value)
            except OverflowError:
                return False
            if not math.isfinite(converted):
                return False
            number = Fraction(converted)
        if self.whole and number.denominator != 1:
            return False
        if self.low is not None and (number < Fraction(self.low) or (number == self.low and not self.low_inclusive)):
            return False
        return self.high is None or number < Fraction(self.high) or (number == self.high and self.high_inclusive)


def kind(value: Any) -> str:
    """``"number"`` for a real number (numpy's included), else ``"type"``: the wrong type."""
    if isinstance(value, (bool, np.bool_, torch.Tensor)) or not isinstance(value, numbers.Real):
        return "type"
    return "number"


POSITIVE = Accepts(low=0, low_inclusive=False)
POSITIVE_INT = Accepts(low=1, whole="type")


@dataclass(frozen=True)
class Argument:
    """One argument: where it is given, what it accepts, and the name its error must carry."""

    label: str
    name: str
    accepts: Callable[[Any], bool]
    build: Callable[[Any], Any]
    #: a refusal a valid value may still meet, from a rule beyond the argument's own range
    may_refuse: str | None = None
    #: a number is the right type (out of range: ValueError); else only True/False are (TypeError)
    numeric: bool = True


def _budget(**kwargs: Any) -> Legacy:
    base = {"by": "layer", "sizes": [5, 500, 50_000], "splits": [100]}
    return Legacy.budget_matched(TopK(), 0.01, **{**base, **kwargs})


def _params(**params: Any) -> Grace:
    return grace_from_params(params)


ARGUMENTS = [
    Argument("Grace(stall_timeout)", "stall_timeout", Accepts(low=0, low_inclusive=False, none=True),
             lambda v: Grace(TopK(0.1), stall_timeout=v)),
    Argument("Grace(bucket_bytes)", "bucket_bytes", Accepts(low=0, whole="type", none=True),
             lambda v: Grace(TopK(0.1), bucket_bytes=v)),
    Argument("Grace(dense_fallback)", "dense_fallback", lambda v: v is True or v is False,
             lambda v: Grace(TopK(0.1), dense_fallback=v), numeric=False),
    Argument("DGC(min_samples)", "min_samples", POSITIVE_INT, lambda v: DGC(0.1, min_samples=v)),
    Argument("DGCMemory(momentum)", "momentum", Accepts(low=0, high=1, high_inclusive=False), DGCMemory),
    Argument("DGCMemory(clip)", "clip", Accepts(low=0, low_inclusive=False, none=True),
             lambda v: DGCMemory(0.9, clip=v)),
    Argument("EFSignSGDMemory(lr)", "lr", POSITIVE, EFSignSGDMemory),
    Argument("Legacy(epochs)", "epochs", POSITIVE_INT, lambda v: Legacy(TopK(), by="epoch", values=[0.1], epochs=v)),
    Argument("Legacy(steps_per_epoch)", "steps_per_epoch", Accepts(low=1, whole="type", none=True),
             lambda v: Legacy(TopK(), by="layer", values=[0.1], steps_per_epoch=v)),
    Argument("DGCWarmup(warmup_epochs)", "warmup_epochs", Accepts(low=0, high=10_000, whole="type"),
             lambda v: DGCWarmup(TopK(), 0.01, v)),
    # From start 1.0 down to 0.01, so only a coefficient < 1 moves towards the target.
    Argument("DGCWarmup(coeff)", "coeff", Accepts(low=0, low_inclusive=False, high=1, high_inclusive=False,
                                                  none=True), lambda v: DGCWarmup(TopK(), 0.01, coeff=v)),
    Argument("Accordion(eta)", "eta", POSITIVE, lambda v: Accordion(TopK(), 0.1, 0.01, eta=v, interval=2)),
    Argument("Accordion(interval)", "interval", POSITIVE_INT, lambda v: Accordion(TopK(), 0.1, 0.01, interval=v)),
    Argument("Accordion(history)", "history", Accepts(low=1, high=sys.maxsize, whole="type", none=True),
             lambda v: Accordion(TopK(), 0.1, 0.01, interval=2, history=v)),
    Argument("LGreCo(budget)", "budget", POSITIVE,
             lambda v: LGreCo(TopK(), [0.5, 0.1], reference=0.1, interval=2, budget=v)),
    Argument("LGreCo(resolution)", "resolution", Accepts(low=1, high=10**6, whole="type"),
             lambda v: LGreCo(TopK(), [0.5, 0.1], reference=0.1, interval=2, resolution=v)),
    Argument("LGreCo(history)", "history", Accepts(low=1, high=sys.maxsize, whole="type", none=True),
             lambda v: LGreCo(TopK(), [0.5, 0.1], reference=0.1, interval=2, history=v)),
    Argument("Legacy.budget_matched(tolerance)", "tolerance", Accepts(low=0), lambda v: _budget(tolerance=v),
             may_refuse="no scale of this shape matches"),
    Argument("Legacy.budget_matched(world_size)", "world_size", Accepts(low=1, high=LARGEST, whole="type", none=True),
             lambda v: _budget(world_size=v)),
    Argument("Legacy.budget_matched(layer_factors)", "layer_factors[0]", POSITIVE,
             lambda v: _budget(layer_factors=[v, 1]), may_refuse="no scale of this shape matches"),
    Argument("plan(world_size)", "world_size", Accepts(low=1, high=LARGEST, whole="type", none=True),
             lambda v: plan(TopK(0.1), [10, 1000], world_size=v)),
    Argument("grace_from_params(world_size)", "world_size", Accepts(low=1, whole="type", none=True),
             lambda v: _params(world_size=v)),
    Argument("grace_from_params(compress_ratio)", "compress_ratio", Accepts(low=0, low_inclusive=False, high=1),
             lambda v: _params(compressor="topk", memory="residual", communicator="allgather", compress_ratio=v)),
    Argument("grace_from_params(quantum_num)", "quantum_num", Accepts(low=1, high=2**31 - 1, whole="value"),
             lambda v: _params(compressor="qsgd", communicator="allgather", quantum_num=v)),
    Argument("grace_from_params(threshold)", "threshold", POSITIVE,
             lambda v: _params(compressor="threshold", memory="residual", communicator="allgather", threshold=v)),
    Argument("grace_from_params(momentum)", "momentum", Accepts(low=0, high=1, high_inclusive=False),
             lambda v: _params(compressor="dgc", memory="dgc", communicator="allgather", momentum=v)),
    Argument("grace_from_params(lr)", "lr", POSITIVE,
             lambda v: _params(compressor="efsignsgd", memory="efsignsgd", communicator="allgather", lr=v)),
    Argument("grace_from_params(compress_rank)", "compress_rank", Accepts(low=1, whole="value"),
             lambda v: _params(compressor="powersgd", memory="powersgd", compress_rank=v)),
    # GRACE's False means no clipping; any other value is the clipping norm.
    Argument("grace_from_params(gradient_clipping)", "gradient_clipping",
             lambda v: v is False or Accepts(low=0, low_inclusive=False, none=True)(v),
             lambda v: _params(compressor="dgc", memory="dgc", communicator="allgather", gradient_clipping=v)),
    Argument("grace_from_params(epochs)", "epochs", POSITIVE_INT,
             lambda v: _params(compressor="topk", memory="residual", communicator="allgather", legacy_by="epoch",
                               group_compressions="1,0.1", epochs=v)),
]


@pytest.mark.parametrize("argument", ARGUMENTS, ids=lambda a: a.label)
@given(value=numbers_of_any_kind | wrong_types | st.none())
@fuzz_settings(40)
def test_numeric_and_flag_arguments(argument, value):
    if argument.accepts(value):
        try:
            argument.build(value)
        except ValueError as err:
            assert argument.may_refuse and argument.may_refuse in str(err), (argument.label, value, err)
        return
    with pytest.raises((TypeError, ValueError)) as caught:
        argument.build(value)
    error = caught.value
    assert argument.name in str(error), (argument.label, value, str(error))
    if value is not None and kind(value) == "number" and argument.numeric:
        assert not isinstance(error, TypeError), f"{argument.label}: {value!r} is a number, refused as a type"
    elif value is not None:
        assert isinstance(error, TypeError), (argument.label, value, error)


@pytest.mark.parametrize("argument", ARGUMENTS, ids=lambda a: a.label)
def test_a_typical_good_value_still_works(argument):
    for value in (1, 0.5, 2, 0, None, False):
        if argument.accepts(value):
            argument.build(value)
            return
    pytest.fail(f"{argument.label}: no typical value accepted")


# -- the library: lists and strings ------------------------------------------------------------------


entries = st.integers(-3, 10**6) | numbers_of_any_kind | wrong_types
containers = st.sampled_from([list, tuple, lambda items: ",".join(map(str, items)), lambda items: None])


def increasing_positive_ints(value: Any) -> bool:
    """The oracle for splits and boundaries: a list or tuple of ints (not bools) > 0, increasing."""
    if not isinstance(value, (list, tuple)):
        return False
    if not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value):
        return False
    return all(v > 0 for v in value) and all(b > a for a, b in zip(value, value[1:], strict=False))


@given(st.lists(entries, max_size=4), containers,
       st.sampled_from(["Legacy(splits)", "Legacy(boundaries)", "budget_matched(splits)"]))
@fuzz_settings(150)
def test_lists_of_increasing_integers(items, container, where):
    value = container(items)
    if value is None:
        return
    count = len(items) + 1
    if where == "Legacy(splits)":
        def build():
            return Legacy(TopK(), by="layer", values=[0.1] * count, splits=value)
    elif where == "Legacy(boundaries)":
        def build():
            return Legacy(TopK(), by="epoch", values=[0.1] * count, boundaries=value)
    else:
        def build():
            return _budget(splits=value)
    name = where.split("(")[1].rstrip(")")
    if increasing_positive_ints(value):
        build()
        return
    with pytest.raises((TypeError, ValueError), match=name):
        build()


def shape_numel(entry: Any) -> int | None:
    """The elements of an element count (an int >= 0), a shape (a list or tuple of ints >= 0) or
    a (name, shape) pair; ``None`` if it is none of them or holds more than 2**63 - 1."""
    if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
        entry = entry[1]
    dims = [entry] if isinstance(entry, (int, np.integer)) and not isinstance(entry, bool) else entry
    if not isinstance(dims, (list, tuple, torch.Size)):
        return None
    if not all(isinstance(d, (int, np.integer)) and not isinstance(d, bool) and d >= 0 for d in dims):
        return None
    numel = math.prod(int(d) for d in dims)
    return numel if numel <= LARGEST else None


shape_entries = (entries | st.lists(st.integers(-2, 2**40), max_size=3).map(tuple)
                 | st.tuples(st.just("w"), st.lists(st.integers(0, 10**4), max_size=3)))


@given(st.lists(shape_entries, min_size=1, max_size=3), st.sampled_from(["plan", "budget_matched"]))
@fuzz_settings(150)
def test_shapes_and_sizes(shapes, where):
    def build():
        return plan(TopK(0.1), shapes) if where == "plan" else _budget(sizes=shapes)

    name = "shapes" if where == "plan" else "sizes"
    counts = [shape_numel(s) for s in shapes]
    if None not in counts and not any(counts):  # every tensor empty: nothing to plan or match
        with pytest.raises(ValueError, match="no tensor with elements"):
            build()
    elif None not in counts:
        result = build()
        if where == "plan":
            assert sum(c.elements for c in result.cells) == sum(counts)
            assert 0 < result.volume < math.inf
    else:
        with pytest.raises((TypeError, ValueError), match=name):
            build()


@pytest.mark.parametrize("value", [12, 1.5, None, ["1", "2"], b"1,2", torch.tensor(3)])
@pytest.mark.parametrize("argument", ["group_compressions", "group_splits"])
def test_reference_flags_must_be_strings(argument, value):
    given = {"group_compressions": "1,0.1", "group_splits": "100", argument: value}
    with pytest.raises(TypeError, match=argument):
        Legacy.from_flags(TopK(), "layer", **given)


#: The library takes any positive split, however large; only the CLI bounds them to an int64.
library_splits_drawn = drawn_list(st.integers(1, 10**6), [b for b in BAD_INTEGERS if len(b) < 19], increasing=True)


@given(percents_drawn, library_splits_drawn)
@fuzz_settings(80)
def test_reference_flag_strings(compressions, splits):
    """``Legacy.from_flags`` and ``grace_from_params``'s LEGACY keys read what the CLI reads."""
    values = len(compressions.values)
    splits_text = splits.text if values == len(splits.values) + 1 else ",".join(
        str(10 * (i + 1)) for i in range(values - 1))
    splits_valid = splits.valid or splits_text != splits.text
    for build in (lambda: Legacy.from_flags(TopK(), "layer", compressions.text, splits_text),
                  lambda: _params(compressor="topk", memory="residual", communicator="allgather", legacy_by="layer",
                                  group_compressions=compressions.text, group_splits=splits_text)):
        if compressions.valid and splits_valid:
            build()
            continue
        with pytest.raises(ValueError, match="group_compressions|group_splits|values|splits") as caught:
            build()
        assert not isinstance(caught.value, OverflowError)


def test_legacy_keys_of_the_wrong_type_are_named():
    base = {"compressor": "topk", "memory": "residual", "communicator": "allgather", "legacy_by": "layer"}
    for key, value in (("group_compressions", None), ("group_compressions", [1, 2]), ("group_splits", None),
                       ("group_splits", 100), ("group_splits", [1.5])):
        with pytest.raises((TypeError, ValueError), match=key):
            grace_from_params({**base, "group_compressions": "1,1", key: value})
    # Regression: epochs went through int(), so 1.5 and True were one epoch.
    for epochs in (1.5, True, "3"):
        with pytest.raises(TypeError if not isinstance(epochs, float) else ValueError, match="epochs"):
            grace_from_params({**base, "legacy_by": "epoch", "group_compressions": "1,0.1", "epochs": epochs})


@pytest.mark.parametrize("name", [None, ["topk"], 3, "TopK", ""])
@pytest.mark.parametrize("key", ["compressor", "memory", "communicator"])
def test_names_are_refused_with_the_accepted_ones(key, name):
    with pytest.raises(ValueError, match=rf"{key}=.* is not known; accepted: "):
        grace_from_params({key: name})


@pytest.mark.parametrize("value", ["exact ", "Auto", None, 0, ["auto"], torch.tensor(1)])
def test_variable_gather_is_checked_without_a_process_group(value):
    with pytest.raises(ValueError, match="variable_gather must be one of"):
        TorchDistributedBackend(variable_gather=value)


@pytest.mark.parametrize("compression", [None, "topk", TopK, 0.1, torch.nn.Linear(2, 2)])
def test_ddp_compression_is_checked_without_a_process_group(compression):
    with pytest.raises(TypeError, match="compression must be a grace_legacy compressor"):
        grace_ddp.register(torch.nn.Linear(2, 2), compression)
    with pytest.raises(TypeError, match="compression must be a grace_legacy compressor"):
        grace_ddp.GraceState(torch.nn.Linear(2, 2), compression)


def test_ddp_model_is_named_when_the_compression_is_good():
    with pytest.raises(TypeError, match="ddp_model must be a torch.nn.parallel.DistributedDataParallel"):
        grace_ddp.register(torch.nn.Linear(2, 2), TopK(0.1))


@pytest.mark.parametrize("value", [None, 3, ["torchvision:resnet18"], b"torchvision:resnet18"])
def test_model_spec_must_be_a_string(value):
    with pytest.raises(TypeError, match="model must be a string"):
        model_shapes(value)


@pytest.mark.parametrize("dtype", [None, "float32", torch.int32, torch.complex64, np.float32])
@pytest.mark.parametrize("where", ["plan", "budget_matched"])
def test_dtype_must_be_a_gradient_dtype(where, dtype):
    with pytest.raises((TypeError, ValueError), match="dtype must be torch.float32"):
        plan(TopK(0.1), [10], dtype=dtype) if where == "plan" else _budget(dtype=dtype)


def test_budget_matched_refuses_what_its_mode_does_not_use():
    # Regression: these were dropped, so the schedule silently lost the shape that was asked for.
    for kwargs, name in (({"phase_factors": [2, 1]}, "phase_factors"), ({"epochs": 4}, "epochs")):
        with pytest.raises(ValueError, match=f"{name} is not used with by='layer'"):
            _budget(**kwargs)
    with pytest.raises(ValueError, match="layer_factors is not used with by='epoch'"):
        Legacy.budget_matched(TopK(), 0.01, by="epoch", sizes=[10], epochs=2, layer_factors=[1])
    with pytest.raises(ValueError, match=r"layer_factors needs 2 entries \(one per size group\)"):
        _budget(layer_factors=[1])


def test_huge_epoch_counts_are_planned_and_labelled():
    # Regression: the phase labels went through float(), which overflowed.
    result = plan(Legacy(TopK(), by="epoch", values=[0.1, 0.01], epochs=10**400), [10, 100])
    assert result.phase_labels == ["epochs 0 - 5.000e+399", "epochs 5.000e+399 - 1.000e+400"]
