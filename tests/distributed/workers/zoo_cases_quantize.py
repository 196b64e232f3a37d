"""Zoo cases for the quantizers of issue 4: QSGD, TernGrad and natural compression.

Every quantized tensor is gathered (each rank has its own scale) and the twin draws the same
numbers as the optimizer's compressor (same seed, rank, tensor name and step); the optimizer then
sums the decoded payloads in rank order, as the reference does, so the synchronized gradient must
equal it bit for bit: the tolerances are zero. The Legacy case also sends tensors dense, through
Horovod's allreduce, whose summation order (a ring under Gloo) differs from the reference's in
the last bit; it keeps the harness's default tolerances, which are still far below one
quantization step (``norm / levels / 4``), so a wrong draw on a quantized tensor fails it too.

The test model's parameters have 24, 4, 960, 40, 200, 5, 1 and 1 elements. The Legacy case's
splits put the 1- and 4-element ones in the dense group, 5, 24 and 40 in the 4-level group, 200 in
the 16-level group and 960 in the 300-level group (int16 levels).
"""

from zoo import Case, RuleTwin, equal_phase, first_group

from grace_legacy import QSGD, Grace, Legacy, Natural, NoMemory, TernGrad


def pair(make_compressor, dense_fallback=False):
    """The optimizer's Grace bundle and an identical, separate twin, without memory. The dense
    fallback is off by default here: it would send the smallest tensors through Horovod's
    allreduce, whose summation order is not the reference's, and these cases check every
    quantized value bit for bit."""
    return (Grace(make_compressor(), memory=NoMemory(), dense_fallback=dense_fallback), make_compressor(),
            NoMemory())


EXACT = {"rtol": 0.0, "atol": 0.0}

CASES = [
    Case("QSGD(levels=4)", lambda: pair(lambda: QSGD(4, seed=7)), routes={"allgather"}, **EXACT),
    Case("QSGD(levels=300)", lambda: pair(lambda: QSGD(300, seed=8)), routes={"allgather"}, **EXACT),
    Case("TernGrad", lambda: pair(lambda: TernGrad(seed=9)), routes={"allgather"}, **EXACT),
    Case("Natural", lambda: pair(lambda: Natural(seed=10)), routes={"allgather"}, **EXACT),
    Case("QSGD(levels=4) with the dense fallback", lambda: pair(lambda: QSGD(4, seed=14), dense_fallback=True),
         routes={"allgather", "dense-fallback"}),
    # The recommended memory (NoMemory) is taken when Grace is given none. The twins choose the
    # levels by the rules written out in zoo.py, not by Legacy. The dense fallback is off so that
    # every level the rule picks is really sent (on 4 ranks s=256, two bytes an element, would
    # otherwise go dense: its gather moves more than a ring allreduce).
    Case("Legacy(QSGD) by layer", lambda: (
        Grace(Legacy(QSGD(seed=11), by="layer", values=[None, 4, 16, 300], splits=[5, 100, 500]), dense_fallback=False),
        RuleTwin(QSGD(seed=11), lambda n, step: [None, 4, 16, 300][first_group(n, [5, 100, 500])]), NoMemory()),
        routes={"allgather", "dense"}),
    # The rebuttal's QSGD groups (<600 dense, <100k s=256, <1M s=64, else s=16) on this model: only
    # the first two groups occur, so the 960-element fc1.weight is the one compressed at s=256.
    Case("Legacy(QSGD) rebuttal groups", lambda: (
        Grace(Legacy(QSGD(seed=12), by="layer", values=[None, 256, 64, 16], splits=[600, 100_000, 1_000_000]),
              dense_fallback=False),
        RuleTwin(QSGD(seed=12), lambda n, step: [None, 256, 64, 16][first_group(n, [600, 100_000, 1_000_000])]),
        NoMemory()), routes={"allgather", "dense"}),
    # By epoch, counting steps (one epoch per step): levels 256, 64, 16 over the 4 steps the worker runs.
    Case("Legacy(QSGD) by epoch", lambda: (
        Grace(Legacy(QSGD(seed=13), by="epoch", values=[256, 64, 16], epochs=4, steps_per_epoch=1),
              dense_fallback=False),
        RuleTwin(QSGD(seed=13), lambda n, step: [256, 64, 16][equal_phase(step, 4, 3)]), NoMemory()),
        routes={"allgather"}, **EXACT),
]
