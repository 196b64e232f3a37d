"""Zoo cases for the sparsifiers of issue 4: Threshold, DGC + DGCMemory, Top-k + EF21, and the
Broadcast communicator."""

from __future__ import annotations

import torch
from zoo import Case, Observation
from zoo_cases_core import pair

from grace_legacy import DGC, EF21, Broadcast, DGCMemory, Grace, Residual, Threshold, TopK


def some_payloads_empty(compression, observations: list[Observation]) -> None:
    """A Threshold payload is empty exactly when its decompressed tensor is all zeros (a kept entry
    has ``|v| >= threshold > 0``): some tensor must have been empty on some ranks only, and some
    on every rank."""
    empty = [[int(torch.count_nonzero(c)) == 0 for c in o.contributions] for o in observations]
    on_some = sum(any(e) and not all(e) for e in empty)
    on_all = sum(all(e) for e in empty)
    assert on_some and on_all, f"empty on some ranks only: {on_some} times, on all: {on_all}"


def through(communicator, make_compressor, make_memory):
    return lambda: (Grace(make_compressor(), memory=make_memory(), communicator=communicator),
                    make_compressor(), make_memory())


# At step 0 (see harness.Net): |grad| peaks near 0.03 for scale, ~1e-9 for shift (the softmax sums
# to 1, so shifting every logit has no gradient), 0.04-0.11 for fc1.weight by rank, 0.13-0.34 for
# fc2.bias. A threshold of 0.1 therefore leaves shift empty everywhere and fc1.weight empty on some
# ranks only; some_payloads_empty checks that this really happened.
CASES = [
    Case("Threshold(0.02)+Residual", lambda: pair(lambda: Threshold(0.02), Residual), routes={"allgather"}),
    Case("Threshold(0.1)+Residual with empty payloads", lambda: pair(lambda: Threshold(0.1), Residual),
         routes={"allgather"}, check=some_payloads_empty),
    Case("DGC(0.1)+DGCMemory(0.9)", lambda: pair(lambda: DGC(0.1, seed=5, min_samples=16), DGCMemory),
         routes={"allgather"}),
    Case("DGC(0.1)+DGCMemory(0.5, clip=0.1)",
         lambda: pair(lambda: DGC(0.1, seed=5, min_samples=16), lambda: DGCMemory(momentum=0.5, clip=0.1)),
         routes={"allgather"}),
    # EF21 applies its running estimate g <- g + mean_r D(sent_r): the twin's memory.aggregated does it.
    Case("TopK(0.1)+EF21", lambda: pair(lambda: TopK(0.1), EF21), routes={"allgather"}),
    Case("TopK(0.1)+Residual via Broadcast", through(Broadcast(), lambda: TopK(0.1), Residual),
         routes={"broadcast"}),
    Case("Threshold(0.1)+Residual via Broadcast with empty payloads",
         through(Broadcast(), lambda: Threshold(0.1), Residual), routes={"broadcast"}, check=some_payloads_empty),
]
