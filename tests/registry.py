"""Every public compressor, memory and schedule, once, with what the tests that cover all of them
need: how to build a typical one, the arguments the fuzzer draws, and the reference cases checked
over horovodrun.

Adding a compressor: one :class:`Entry` in :data:`ENTRIES` (see docs/IMPLEMENTING.md). From it,
the contract tests of ``tests/unit`` cover it with no other file touched:
``test_contract_compressor.py`` checks the contract the library relies on,
``test_contract_fuzz.py`` fuzzes it alone and (with a parameter) inside ``Legacy``, and
``test_contract_undo.py`` and ``test_contract_in_place.py`` pair it with every memory it accepts
(a skipped step undone without a trace; the compensated gradient built in the gradient's own
storage). Over real launches, ``tests/distributed/test_zoo.py`` compares its synchronized
gradients with its cases' independent rules, and ``tests/distributed/test_every_pair.py`` pairs it
with every memory it accepts. ``tests/unit/test_contract_registry.py`` fails, naming it, when a
public compressor, memory or schedule of ``grace_legacy`` is missing here.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from grace_legacy import (
    BF16,
    CAT,
    DGC,
    EF21,
    FP16,
    INCEPTIONN,
    QSGD,
    Accordion,
    AdaComp,
    AdaQ,
    Broadcast,
    Compressor,
    DGCMemory,
    DGCWarmup,
    EFSignSGD,
    EFSignSGDMemory,
    GlobalTopK,
    Grace,
    Legacy,
    LGreCo,
    Natural,
    NoCompression,
    NoMemory,
    OneBit,
    PowerSGD,
    PowerSGDMemory,
    RandomK,
    Residual,
    ScheduledParameter,
    SignSGD,
    Signum,
    Sketch,
    TernGrad,
    Threshold,
    TopK,
    U8bit,
    VarianceSparsifier,
)
from grace_legacy.compressors.adacomp import BIN_SIZE
from grace_legacy.compressors.entries import DENSITY
from grace_legacy.compressors.inceptionn import ERROR_BOUND
from grace_legacy.compressors.qsgd import LEVELS
from grace_legacy.compressors.signsgd import MOMENTUM
from grace_legacy.compressors.sketch import QUANTILES
from grace_legacy.compressors.threshold import THRESHOLD
from grace_legacy.compressors.variance import ALPHA, KSI
from tests.example_compressor import LEVELS as INT8_LEVELS
from tests.example_compressor import Int8Linear
from tests.reference import (
    Case,
    RuleTwin,
    equal_phase,
    first_group,
    majority_vote_rule,
    some_payloads_empty,
)
from tests.reference_compressors import (
    AdaQReference,
    BF16Reference,
    INCEPTIONNReference,
    ReferenceFamily,
    SketchReference,
    U8bitReference,
)
from tests.reference_sparsifiers import (
    AdaCompReference,
    CATReference,
    GlobalTopKReference,
    SquaredGradients,
    VarianceReference,
    squared_gradient,
)

#: The distributed workers' SGD learning rate, which EF-signSGD's memory must share.
LR = 0.05

# -- what the fuzzer draws ----------------------------------------------------------------------

seeds = st.integers(-(2**70), 2**70)


def fuzz_settings(examples: int) -> settings:
    """``examples`` drawn the same way on every run (derandomized, no example database), so a
    failure reproduces and the suite's time does not drift."""
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# Numbers of every kind: floats with NaN and infinities, ints far beyond a float's range,
# fractions, numpy scalars. Valid or not, decided by the oracle.
numbers_of_any_kind = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-(10**400), 10**400),
    st.sampled_from([0, -1, 1, 2, 0.0, -0.0, 1.0, 1.5, 2**31 - 1, 2**31, 2**63, 10**400, -(10**400), 1e308,
                     5e-324, math.nan, math.inf, -math.inf]),
    st.fractions(),
    st.integers(-(2**63), 2**63 - 1).map(np.int64),
    st.floats(allow_nan=True, allow_infinity=True).map(np.float64),
)

# Not numbers at all: the wrong type for any numeric argument.
wrong_types = st.one_of(
    st.text(max_size=5), st.booleans(), st.just(np.bool_(True)), st.complex_numbers(max_magnitude=10),
    st.decimals(allow_nan=False, allow_infinity=False, places=3), st.lists(st.floats(0.1, 0.5), max_size=2),
    st.floats(0.1, 0.5).map(torch.tensor), st.just(object()),
)


def parameter_values(parameter: ScheduledParameter) -> st.SearchStrategy[Any]:
    """Valid values of ``parameter``, extremes included (the bounds, subnormals)."""
    if parameter.integer:
        high = int(parameter.high) if parameter.high is not None else 10**30
        return st.integers(int(parameter.low), high)
    low = parameter.low if parameter.low is not None else -1e308
    high = parameter.high if parameter.high is not None else 1e308
    return st.floats(low, high, exclude_min=not parameter.low_inclusive, exclude_max=not parameter.high_inclusive)


# -- reference cases ----------------------------------------------------------------------------


def case_bundle(compressor: Compressor, memory: Any = None, **options: Any) -> Grace:
    """The bundle a case trains with: the default communicator unless the case names one, whose
    routes (allreduce, gather, dense) a case's twin models at any number of ranks. The
    scatter-gather (``communicator="auto"`` or ``ScatterGather()``) has its own reference
    (``tests/two_phase.py``), with every compressor's set-up there."""
    return Grace(compressor, memory=memory, **options)


def pair(make_compressor: Callable[[], Any], make_memory: Callable[[], Any],
         dense_fallback: bool = True) -> Callable[[], tuple]:
    """A case's set-up: the optimizer's Grace bundle (:func:`case_bundle`) and an identical,
    separate twin."""
    return lambda: (case_bundle(make_compressor(), make_memory(), dense_fallback=dense_fallback), make_compressor(),
                    make_memory())


def pair_without_memory(make_compressor: Callable[[], Any], dense_fallback: bool = False) -> Callable[[], tuple]:
    """As :func:`pair` with no memory. The dense fallback is off by default: it would send the
    smallest tensors through Horovod's allreduce, whose summation order is not the reference's,
    and the quantizers' cases check every quantized value bit for bit."""
    return lambda: (case_bundle(make_compressor(), NoMemory(), dense_fallback=dense_fallback), make_compressor(),
                    NoMemory())


def through(communicator: Any, make_compressor: Callable[[], Any], make_memory: Callable[[], Any]):
    return lambda: (case_bundle(make_compressor(), make_memory(), communicator=communicator),
                    make_compressor(), make_memory())


def against(make_reference: Callable[[], Any], make_compressor: Callable[[], Any], make_memory: Callable[[], Any],
            **grace: Any) -> Callable[[], tuple]:
    """A case whose twin is an independent reference (:mod:`tests.reference_compressors`) rather
    than a second copy of the library's compressor; ``grace``: the bundle's other arguments."""
    return lambda: (case_bundle(make_compressor(), make_memory(), **grace), make_reference(), make_memory())


#: Quantized tensors are gathered (each rank has its own scale) and the twin draws the same numbers
#: (same seed, rank, tensor name and step); the optimizer sums the decoded payloads in rank order, as
#: the rule does, so the synchronized gradient must equal it bit for bit.
EXACT = {"rtol": 0.0, "atol": 0.0}


# -- the compressors ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Entry:
    """One compressor, as every test that covers all of them builds it."""

    compressor: type[Compressor]
    #: how set-ups built from ``typical`` are labelled (e.g. ``"TopK(0.1)+Residual"``)
    label: str
    #: a typical, seeded instance, for the checks that need one
    typical: Callable[[], Compressor]
    #: the constructor's arguments as the fuzzer draws them (``compressor(**drawn)``)
    fuzz: dict[str, st.SearchStrategy[Any]]
    #: which launch of ``tests/distributed/test_zoo.py`` runs ``cases`` (one horovodrun job per family)
    family: str
    #: reference cases: the synchronized gradient equals an independent rule's
    cases: tuple[Case, ...]
    #: an independent reference of ``typical`` (``tests/reference_compressors.py``), the twin of
    #: the dtype contract (``test_contract_dtypes.py``); ``None``: a second ``typical`` is the twin
    reference: Callable[[], Compressor] | None = None
    #: builds a working compressor from the fuzzed arguments (``None``: the class itself); the
    #: variance sparsifier's also attaches a source of per-sample moments
    build: Callable[..., Compressor] | None = None

    @property
    def name(self) -> str:
        return self.compressor.__name__

    def make(self, *args: Any, **kwargs: Any) -> Compressor:
        """A compressor built from these arguments, ready to compress."""
        return (self.build or self.compressor)(*args, **kwargs)


def with_squared_gradients(alpha: float | None = None, ksi: float = 0.999) -> VarianceSparsifier:
    """A variance sparsifier whose per-sample moment is the squared gradient (one sample a batch:
    :class:`tests.reference_sparsifiers.SquaredGradients`), which works on any tensor."""
    sparsifier = VarianceSparsifier(alpha, ksi)
    sparsifier.attach(SquaredGradients())
    return sparsifier


ENTRIES: list[Entry] = [
    Entry(NoCompression, "NoCompression", NoCompression, {}, "core", (
        Case("NoCompression", pair(NoCompression, NoMemory), routes={"allreduce"}),)),
    # Both are summed in 16 bits, in the backend's order: the workers hold them to the rounding of
    # such a sum (zoo_worker.compare_with_rule) rather than to the case's tolerances.
    Entry(FP16, "FP16", FP16, {}, "core", (
        Case("FP16", pair(FP16, NoMemory), routes={"allreduce"}),)),
    Entry(BF16, "BF16", BF16, {}, "core", (
        Case("BF16", against(BF16Reference, BF16, NoMemory), routes={"allreduce"}),), reference=BF16Reference),
    Entry(TopK, "TopK(0.1)", lambda: TopK(0.1), {"ratio": parameter_values(DENSITY)}, "core", (
        Case("TopK+Residual", pair(lambda: TopK(0.1), Residual), routes={"allgather"}),
        # EF21 applies its running estimate g <- g + mean_r D(sent_r): the twin's memory.aggregated does it.
        Case("TopK(0.1)+EF21", pair(lambda: TopK(0.1), EF21), routes={"allgather"}),)),
    Entry(RandomK, "RandomK(0.1)", lambda: RandomK(0.1, seed=1), {"ratio": parameter_values(DENSITY), "seed": seeds},
          "core", (Case("RandomK+Residual", pair(lambda: RandomK(0.1, seed=11), Residual), routes={"allreduce"}),)),
    Entry(DGC, "DGC(0.1)", lambda: DGC(0.1, seed=2, min_samples=16),
          {"ratio": parameter_values(DENSITY), "seed": seeds, "sample_ratio": st.floats(1e-9, 1.0),
           "min_samples": st.integers(1, 10**9)}, "sparse", (
        Case("DGC(0.1)+DGCMemory(0.9)", pair(lambda: DGC(0.1, seed=5, min_samples=16), DGCMemory),
             routes={"allgather"}),
        Case("DGC(0.1)+DGCMemory(0.5, clip=0.1)",
             pair(lambda: DGC(0.1, seed=5, min_samples=16), lambda: DGCMemory(momentum=0.5, clip=0.1)),
             routes={"allgather"}),)),
    # At step 0 (see tests/distributed/harness.Net): |grad| peaks near 0.03 for scale, ~1e-9 for shift (the
    # softmax sums to 1, so shifting every logit has no gradient), 0.04-0.11 for fc1.weight by rank,
    # 0.13-0.34 for fc2.bias. A threshold of 0.1 therefore leaves shift empty everywhere and
    # fc1.weight empty on some ranks only; some_payloads_empty checks that this really happened.
    Entry(Threshold, "Threshold(0.02)", lambda: Threshold(0.02), {"threshold": parameter_values(THRESHOLD)}, "sparse", (
        Case("Threshold(0.02)+Residual", pair(lambda: Threshold(0.02), Residual), routes={"allgather"}),
        Case("Threshold(0.1)+Residual with empty payloads", pair(lambda: Threshold(0.1), Residual),
             routes={"allgather"}, check=some_payloads_empty),)),
    Entry(QSGD, "QSGD(4)", lambda: QSGD(4, seed=3), {"levels": parameter_values(LEVELS), "seed": seeds}, "quantize", (
        Case("QSGD(levels=4)", pair_without_memory(lambda: QSGD(4, seed=7)), routes={"allgather"}, **EXACT),
        Case("QSGD(levels=300)", pair_without_memory(lambda: QSGD(300, seed=8)), routes={"allgather"}, **EXACT),
        # Dense tensors go through Horovod's allreduce, whose summation order (a ring under Gloo)
        # differs from the rule's in the last bit: default tolerances, still far below one
        # quantization step (norm / levels / 4), so a wrong draw fails the case too.
        Case("QSGD(levels=4) with the dense fallback", pair_without_memory(lambda: QSGD(4, seed=14), True),
             routes={"allgather", "dense-fallback"}, half_routes={"dense-fallback"}),)),
    Entry(TernGrad, "TernGrad", lambda: TernGrad(seed=4), {"seed": seeds}, "quantize", (
        Case("TernGrad", pair_without_memory(lambda: TernGrad(seed=9)), routes={"allgather"}, **EXACT),)),
    Entry(Natural, "Natural", lambda: Natural(seed=5), {"seed": seeds}, "quantize", (
        Case("Natural", pair_without_memory(lambda: Natural(seed=10)), routes={"allgather"}, **EXACT),)),
    Entry(SignSGD, "SignSGD", SignSGD, {}, "sign", (
        Case("SignSGD", pair(SignSGD, NoMemory), rule=majority_vote_rule, routes={"allgather"}),)),
    Entry(Signum, "Signum(0.9)", lambda: Signum(0.9), {"momentum": parameter_values(MOMENTUM)}, "sign", (
        Case("Signum(0.9)", pair(lambda: Signum(0.9), NoMemory), rule=majority_vote_rule, routes={"allgather"}),)),
    Entry(EFSignSGD, "EFSignSGD", lambda: EFSignSGD(LR), {"lr": st.floats(1e-30, 1e30)}, "sign", (
        # The twin memory's aggregated() divides by lr.
        Case("EFSignSGD+EFSignSGDMemory", pair(lambda: EFSignSGD(LR), lambda: EFSignSGDMemory(LR)),
             routes={"allgather"}),)),
    Entry(OneBit, "OneBit", OneBit, {}, "sign", (
        Case("OneBit+Residual", pair(OneBit, Residual), routes={"allgather"}),)),
    # GRACE's TensorFlow compressors, each against its reference in tests/reference_compressors.py:
    # gathered, in fused buckets (the optimizer's default), one tensor per collective, by Broadcast,
    # and, where the size is known in advance, through the dense fallback. With a 16-bit model the
    # 1-byte payloads gathered from 4 ranks always go dense, so the cases without the fallback are
    # the ones that compress there.
    Entry(U8bit, "U8bit", U8bit, {}, "grace_tf", (
        Case("U8bit+Residual", against(U8bitReference, U8bit, Residual), routes={"allgather", "dense-fallback"},
             half_routes={"dense-fallback"}),
        Case("U8bit+Residual without the dense fallback", against(U8bitReference, U8bit, Residual,
                                                                  dense_fallback=False),
             routes={"allgather"}, **EXACT),
        Case("U8bit via Broadcast, one tensor per collective",
             against(U8bitReference, U8bit, NoMemory, communicator=Broadcast(), dense_fallback=False),
             routes={"broadcast"}, **EXACT),), reference=U8bitReference),
    Entry(Sketch, "Sketch(16)", lambda: Sketch(16), {"quantiles": parameter_values(QUANTILES)}, "grace_tf", (
        Case("Sketch(16)+Residual", against(lambda: SketchReference(16), lambda: Sketch(16), Residual),
             routes={"allgather", "dense-fallback"}, half_routes={"dense-fallback"}),
        Case("Sketch(64)+Residual without the dense fallback",
             against(lambda: SketchReference(64), lambda: Sketch(64), Residual, dense_fallback=False),
             routes={"allgather"}, **EXACT),
        Case("Sketch(3) via Broadcast", against(lambda: SketchReference(3), lambda: Sketch(3), NoMemory,
                                                communicator=Broadcast(), dense_fallback=False),
             routes={"broadcast"}, **EXACT),), reference=lambda: SketchReference(16)),
    # 2**-10 is the bound GRACE's code ends up with for its default 2e-10 (see INCEPTIONN's docstring):
    # the Net's gradients then take every form but the full one; 2e-10 itself sends most in full.
    Entry(INCEPTIONN, "INCEPTIONN(2**-10)", lambda: INCEPTIONN(2**-10), {"error_bound": parameter_values(ERROR_BOUND)},
          "grace_tf", (
        Case("INCEPTIONN(2**-10)+Residual", against(lambda: INCEPTIONNReference(2**-10), lambda: INCEPTIONN(2**-10),
                                                    Residual), routes={"allgather"}, **EXACT),
        Case("INCEPTIONN(2e-10), one tensor per collective",
             against(lambda: INCEPTIONNReference(2e-10), lambda: INCEPTIONN(2e-10), NoMemory, bucket_bytes=0),
             routes={"allgather"}, **EXACT),
        Case("INCEPTIONN(2**-20)+Residual via Broadcast",
             against(lambda: INCEPTIONNReference(2**-20), lambda: INCEPTIONN(2**-20), Residual,
                     communicator=Broadcast()), routes={"broadcast"}, **EXACT),),
          reference=lambda: INCEPTIONNReference(2**-10)),
    # min_samples=16: fc1.weight's ~480 entries of each sign are sampled, the smaller tensors taken whole.
    Entry(AdaQ, "AdaQ(0.3)", lambda: AdaQ(0.3, seed=12, min_samples=16),
          {"ratio": parameter_values(DENSITY), "seed": seeds, "sample_ratio": st.floats(1e-9, 1.0),
           "min_samples": st.integers(1, 10**9)}, "grace_tf", (
        Case("AdaQ(0.3)+Residual", against(lambda: AdaQReference(0.3, seed=15, min_samples=16),
                                           lambda: AdaQ(0.3, seed=15, min_samples=16), Residual),
             routes={"allgather"}, **EXACT),
        Case("AdaQ(0.1), one tensor per collective",
             against(lambda: AdaQReference(0.1, seed=16, sample_ratio=0.5, min_samples=8),
                     lambda: AdaQ(0.1, seed=16, sample_ratio=0.5, min_samples=8), NoMemory, bucket_bytes=0),
             routes={"allgather"}, **EXACT),
        Case("AdaQ(0.3)+Residual via Broadcast",
             against(lambda: AdaQReference(0.3, seed=17), lambda: AdaQ(0.3, seed=17), Residual,
                     communicator=Broadcast()), routes={"broadcast"}, **EXACT),),
          reference=lambda: AdaQReference(0.3, seed=12, min_samples=16)),
    # The LEGACY reference's own compressors, each against its reference in tests/reference_sparsifiers.py.
    # GlobalTopK and CAT select over the Net's 1250 entries laid end to end (tests/reference.step_units):
    # GlobalTopK(0.6)'s 750 entries gather more bytes than a dense allreduce (2 or 4 ranks), hence the dense
    # fallback; by epoch (one a step) dense for the first step, then 5%. CAT with the reference's cost keeps
    # whole packets of 22 entries, a number chosen per rank.
    Entry(GlobalTopK, "GlobalTopK(0.1)", lambda: GlobalTopK(0.1), {"ratio": parameter_values(DENSITY)}, "sign", (
        Case("GlobalTopK(0.1)+Residual", against(lambda: GlobalTopKReference(0.1), lambda: GlobalTopK(0.1), Residual),
             routes={"allgather"}),
        Case("GlobalTopK(0.6)+Residual through the dense fallback",
             against(lambda: GlobalTopKReference(0.6), lambda: GlobalTopK(0.6), Residual), routes={"dense-fallback"}),
        Case("Legacy(GlobalTopK) by epoch", lambda: (
            case_bundle(Legacy(GlobalTopK(), by="epoch", values=[1.0, 0.05], epochs=2, steps_per_epoch=1),
                        Residual()),
            RuleTwin(ReferenceFamily(GlobalTopKReference), lambda n, step: [None, 0.05][equal_phase(step, 2, 2)]),
            Residual()), routes={"dense", "allgather"}),), reference=lambda: GlobalTopKReference(0.1)),
    Entry(CAT, "CAT()", CAT, {"c0": st.floats(1e-3, 1e3), "c1": st.floats(0.0, 1e3),
                              "packet_bits": st.integers(1, 10**5)}, "sparse", (
        Case("CAT()+Residual", against(CATReference, CAT, Residual), routes={"allgather"}, **EXACT),
        Case("CAT(c0=1, c1=8, packet_bits=256)+Residual via Broadcast",
             against(lambda: CATReference(1, 8, 256), lambda: CAT(1, 8, 256), Residual, communicator=Broadcast()),
             routes={"broadcast"}, **EXACT),), reference=CATReference),
    # AdaComp and the variance sparsifier keep their own state (NoMemory). The variance cases'
    # moment is the squared gradient (SampleMoments' hooks are held to torch.func per-sample
    # gradients in tests/unit/test_per_sample.py); alpha=1.5 sends nothing at step 0, then the
    # entries whose sums grew.
    Entry(AdaComp, "AdaComp(16)", lambda: AdaComp(16), {"bin_size": parameter_values(BIN_SIZE)}, "sparse", (
        Case("AdaComp(16)", against(lambda: AdaCompReference(16), lambda: AdaComp(16), NoMemory),
             routes={"allgather"}, **EXACT),
        Case("Legacy(AdaComp) by layer", lambda: (
            case_bundle(Legacy(AdaComp(), by="layer", values=[None, 4, 64], splits=[5, 100]), NoMemory()),
            RuleTwin(ReferenceFamily(AdaCompReference), lambda n, step: [None, 4, 64][first_group(n, [5, 100])]),
            NoMemory()), routes={"allgather", "dense"}),), reference=lambda: AdaCompReference(16)),
    Entry(VarianceSparsifier, "VarianceSparsifier(1.5, 0.9)", lambda: with_squared_gradients(1.5, 0.9),
          {"alpha": parameter_values(ALPHA), "ksi": parameter_values(KSI)}, "sign", (
        Case("VarianceSparsifier(1.5, 0.9)", against(lambda: VarianceReference(1.5, 0.9, squared_gradient),
                                                     lambda: with_squared_gradients(1.5, 0.9), NoMemory),
             routes={"allgather"}, **EXACT),),
          reference=lambda: VarianceReference(1.5, 0.9, squared_gradient), build=with_squared_gradients),
    # PowerSGD's two rounds are checked by their own worker (tests/distributed/test_powersgd.py) against a
    # reference of the two allreduces; the state tests pair it with every memory.
    Entry(PowerSGD, "PowerSGD(2)", lambda: PowerSGD(2, seed=6),
          {"rank": st.integers(1, 64) | st.integers(1, 10**30), "seed": seeds}, "core", ()),
    # The worked example of docs/IMPLEMENTING.md, registered as a new compressor would be.
    Entry(Int8Linear, "Int8Linear(8)", lambda: Int8Linear(8), {"levels": parameter_values(INT8_LEVELS)}, "core", (
        Case("Int8Linear(8)+Residual", pair(lambda: Int8Linear(8), Residual), routes={"allgather"},
             half_routes={"dense-fallback"}),
        # With a 16-bit model every tensor of the case above goes dense: this one compresses them all.
        Case("Int8Linear(8)+Residual without the dense fallback", pair(lambda: Int8Linear(8), Residual, False),
             routes={"allgather"}),)),
]

ENTRY_OF: dict[type, Entry] = {entry.compressor: entry for entry in ENTRIES}

#: Cases of schedules and communicators over the compressors above.
SCHEDULE_AND_COMMUNICATOR_CASES: dict[str, list[Case]] = {
    "core": [
        Case("Legacy(TopK) by both", pair(
            lambda: Legacy(TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.05]], splits=[100], epochs=2,
                           steps_per_epoch=2), Residual), routes={"allgather", "dense"}),
    ],
    # The test model's parameters have 24, 4, 960, 40, 200, 5, 1 and 1 elements. The first case's
    # splits put the 1- and 4-element ones in the dense group, 5, 24 and 40 in the 4-level group,
    # 200 in the 16-level group and 960 in the 300-level group (int16 levels). The recommended
    # memory (NoMemory) is taken when Grace is given none; the twins choose the levels by rules
    # written out here, not by Legacy. The dense fallback is off so that every level the rule
    # picks is really sent (on 4 ranks s=256, two bytes an element, would otherwise go dense).
    "quantize": [
        Case("Legacy(QSGD) by layer", lambda: (
            case_bundle(Legacy(QSGD(seed=11), by="layer", values=[None, 4, 16, 300], splits=[5, 100, 500]),
                        dense_fallback=False),
            RuleTwin(QSGD(seed=11), lambda n, step: [None, 4, 16, 300][first_group(n, [5, 100, 500])]), NoMemory()),
            routes={"allgather", "dense"}),
        # The rebuttal's QSGD groups (<600 dense, <100k s=256, <1M s=64, else s=16) on this model:
        # only the first two groups occur, so the 960-element fc1.weight is compressed at s=256.
        Case("Legacy(QSGD) rebuttal groups", lambda: (
            case_bundle(Legacy(QSGD(seed=12), by="layer", values=[None, 256, 64, 16],
                               splits=[600, 100_000, 1_000_000]), dense_fallback=False),
            RuleTwin(QSGD(seed=12), lambda n, step: [None, 256, 64, 16][first_group(n, [600, 100_000, 1_000_000])]),
            NoMemory()), routes={"allgather", "dense"}),
        # By epoch, counting steps (one epoch per step): levels 256, 64, 16 over the 4 steps run.
        Case("Legacy(QSGD) by epoch", lambda: (
            case_bundle(Legacy(QSGD(seed=13), by="epoch", values=[256, 64, 16], epochs=4, steps_per_epoch=1),
                        dense_fallback=False),
            RuleTwin(QSGD(seed=13), lambda n, step: [256, 64, 16][equal_phase(step, 4, 3)]), NoMemory()),
            routes={"allgather"}, **EXACT),
    ],
    # LEGACY setting GRACE's TensorFlow compressors' parameters, against rules written out here
    # over their independent references. Sketch's buckets by phase, one epoch per step: 64, 8,
    # then 2 buckets (no dense fallback, so that the 16-bit runs compress too). AdaQ's ratio by size:
    # dense below 5 elements, 0.5 below 100, 0.1 from there (fc1.weight and fc2.weight); the dense
    # tensors are summed by Horovod in its own order, hence the default tolerances.
    "grace_tf": [
        Case("Legacy(Sketch) by epoch", lambda: (
            case_bundle(Legacy(Sketch(), by="epoch", values=[64, 8, 2], epochs=4, steps_per_epoch=1), Residual(),
                        dense_fallback=False),
            RuleTwin(ReferenceFamily(SketchReference), lambda n, step: [64, 8, 2][equal_phase(step, 4, 3)]),
            Residual()), routes={"allgather"}, **EXACT),
        Case("Legacy(AdaQ) by layer", lambda: (
            case_bundle(Legacy(AdaQ(seed=18, min_samples=16), by="layer", values=[None, 0.5, 0.1], splits=[5, 100])),
            RuleTwin(ReferenceFamily(lambda ratio: AdaQReference(ratio, seed=18, min_samples=16)),
                     lambda n, step: [None, 0.5, 0.1][first_group(n, [5, 100])]), Residual()),
            routes={"allgather", "dense"}),
    ],
    "sparse": [
        Case("TopK(0.1)+Residual via Broadcast", through(Broadcast(), lambda: TopK(0.1), Residual),
             routes={"broadcast"}),
        Case("Threshold(0.1)+Residual via Broadcast with empty payloads",
             through(Broadcast(), lambda: Threshold(0.1), Residual), routes={"broadcast"}, check=some_payloads_empty),
    ],
}

FAMILIES: list[str] = sorted({entry.family for entry in ENTRIES} | set(SCHEDULE_AND_COMMUNICATOR_CASES))


def zoo_cases(family: str | None = None) -> list[Case]:
    """The reference cases of one family (``FAMILIES``), or of all of them."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    return [case for f in FAMILIES if family in (None, f)
            for case in [c for entry in ENTRIES if entry.family == f for c in entry.cases]
            + SCHEDULE_AND_COMMUNICATOR_CASES.get(f, [])]


# -- memories, schedules, communicators: the set-ups of the state tests ------------------------------

Setup = tuple[str, Callable[[], Grace]]

MEMORIES: dict[str, Callable[[], Any]] = {
    "NoMemory": NoMemory,
    "Residual": Residual,
    "EF21": EF21,
    "DGCMemory": lambda: DGCMemory(0.9),
    "PowerSGDMemory": PowerSGDMemory,
    "EFSignSGDMemory": lambda: EFSignSGDMemory(LR),
}

#: Memories paired with one compressor only: with any other they are Residual again.
OWN_MEMORY = {"PowerSGDMemory": PowerSGD, "EFSignSGDMemory": EFSignSGD}


def _accepts(make_compressor: Callable, make_memory: Callable) -> bool:
    try:
        Grace(make_compressor(), memory=make_memory())
    except ValueError:
        return False
    return True


def compressor_memory_pairs() -> list[Setup]:
    """Each compressor with every memory it accepts (EF-signSGD only takes its own memory, DGC's
    memory only sparsifiers); PowerSGDMemory with PowerSGD and EFSignSGDMemory with EF-signSGD
    only (elsewhere they are Residual again)."""
    setups: list[Setup] = []
    for entry in ENTRIES:
        for m_label, make_m in MEMORIES.items():
            owner = OWN_MEMORY.get(m_label)
            if owner is not None and entry.compressor is not owner:
                continue
            if _accepts(entry.typical, make_m):
                setups.append((f"{entry.label}+{m_label}", lambda c=entry.typical, m=make_m: Grace(c(), memory=m())))
    return setups


def every_pair() -> list[Setup]:
    """Every compressor/memory pair, then the schedules and the non-default communicators."""
    return compressor_memory_pairs() + SCHEDULES + COMMUNICATORS


SCHEDULES: list[Setup] = [
    ("Legacy(TopK) by both+Residual", lambda: Grace(Legacy(
        TopK(), by="both", values=[[1.0, 0.2], [0.5, 0.05]], splits=[100], epochs=2, steps_per_epoch=2),
        memory=Residual())),
    ("Legacy(QSGD) by layer", lambda: Grace(Legacy(QSGD(seed=7), by="layer", values=[None, 4, 16],
                                                   splits=[5, 500]))),
    ("Legacy(PowerSGD) by epoch+PowerSGDMemory", lambda: Grace(Legacy(
        PowerSGD(seed=8), by="epoch", values=[3, 1], epochs=2, steps_per_epoch=2), memory=PowerSGDMemory())),
    ("DGCWarmup(DGC)+DGCMemory", lambda: Grace(DGCWarmup(
        DGC(seed=9, min_samples=16), target=0.05, warmup_epochs=2, steps_per_epoch=1), memory=DGCMemory(0.9))),
    ("Accordion(TopK)+Residual", lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=2),
                                               memory=Residual())),
    ("LGreCo(TopK)+Residual", lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=2),
                                            memory=Residual())),
]

COMMUNICATORS: list[Setup] = [
    ("TopK(0.1)+Residual via Broadcast", lambda: Grace(TopK(0.1), memory=Residual(), communicator=Broadcast())),
    ("Threshold(0.02)+Residual via Broadcast", lambda: Grace(Threshold(0.02), memory=Residual(),
                                                             communicator=Broadcast())),
    ("RandomK(0.1)+EF21, one collective per tensor", lambda: Grace(RandomK(0.1, seed=10), memory=EF21(),
                                                                   bucket_bytes=0)),
]

#: What exact resume is tested on: each kind of state a run carries (residuals, step counters of
#: stochastic compressors, warm starts, momenta, EF21's estimates, a schedule's position and its
#: adaptive decisions). Checkpoints are taken after RESUME_AT of RESUME_STEPS steps.
RESUME_SETUPS: list[Setup] = [
    ("Legacy(TopK) by epoch+Residual", lambda: Grace(Legacy(
        TopK(), by="epoch", values=[0.3, 0.1, 0.02], epochs=3, steps_per_epoch=2), memory=Residual())),
    ("QSGD(4)", lambda: Grace(QSGD(4, seed=3))),
    ("RandomK(0.1)+Residual", lambda: Grace(RandomK(0.1, seed=1), memory=Residual())),
    ("PowerSGD(2)+PowerSGDMemory", lambda: Grace(PowerSGD(2, seed=6), memory=PowerSGDMemory())),
    ("DGC(0.1)+DGCMemory", lambda: Grace(DGC(0.1, seed=2, min_samples=16), memory=DGCMemory(0.9))),
    ("TopK(0.1)+EF21", lambda: Grace(TopK(0.1), memory=EF21())),
    ("Signum(0.9)", lambda: Grace(Signum(0.9))),
    ("EFSignSGD", lambda: Grace(EFSignSGD(LR))),
    ("Accordion(TopK)+Residual", lambda: Grace(Accordion(TopK(), low=0.5, high=0.05, interval=2),
                                               memory=Residual())),
    ("LGreCo(TopK)+Residual", lambda: Grace(LGreCo(TopK(), [1.0, 0.2, 0.05], reference=0.2, interval=2),
                                            memory=Residual())),
]
RESUME_AT, RESUME_STEPS = 3, 6

