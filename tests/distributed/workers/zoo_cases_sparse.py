"""Zoo cases for the sparsifiers of issue 4: Threshold, DGC + DGCMemory, Top-k + EF21, and the
Broadcast communicator.

Three needs go beyond the generic worker's ``rule(contributions)``, and are met here without
changing it:

* EF21 applies the running estimate ``g <- g + mean_r D(sent_r)``, not this step's mean, so its
  reference must remember ``g`` per parameter.
* A Threshold case must prove that some payloads really were empty (on some ranks, and on all).
* A Broadcast case must prove the bundle used Broadcast (the twin only knows Allgather's route).

:func:`tracked` gives a rule the (step, parameter) each call is for, from the worker's fixed call
order (one call per parameter of ``Net`` per step, ``STEPS + 1`` steps; the contributions'
shape confirms it), and runs a final check at the last call, where a failed assertion fails the
case. Each case's state lives in its closure: the worker runs every case once per process.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from harness import STEPS, Net
from zoo import Case, mean_rule

from grace_legacy import DGC, EF21, Broadcast, DGCMemory, Grace, Residual, Threshold, TopK

with torch.random.fork_rng():  # building Net draws its initial weights; leave the global RNG alone
    PARAMETERS = [(name, tuple(p.shape)) for name, p in Net().named_parameters()]

Reference = Callable[[int, str, list[torch.Tensor]], torch.Tensor]


def tracked(reference: Reference, final: Callable[[], None] | None = None) -> Callable:
    state = {"calls": 0}
    last = (STEPS + 1) * len(PARAMETERS)

    def rule(contributions: list[torch.Tensor]) -> torch.Tensor:
        step, index = divmod(state["calls"], len(PARAMETERS))
        state["calls"] += 1
        name, shape = PARAMETERS[index]
        if tuple(contributions[0].shape) != shape:
            raise AssertionError(f"call {state['calls']} should be for {name} {shape}, got shape "
                                 f"{tuple(contributions[0].shape)}: the worker's call order changed")
        expected = reference(step, name, contributions)
        if state["calls"] == last and final is not None:
            final()
        return expected

    return rule


def pair(make_compressor, make_memory, communicator=None, made: dict | None = None):
    """The optimizer's Grace bundle (kept in ``made`` for final checks) and a separate twin."""
    bundle = Grace(make_compressor(), memory=make_memory(), communicator=communicator)
    if made is not None:
        made["bundle"] = bundle
    return bundle, make_compressor(), make_memory()


def ef21_running_mean() -> Callable:
    """EF21's applied gradient: g_0 = 0, g <- g + mean_r D(sent_r) (see EF21's docstring)."""
    estimates: dict[str, torch.Tensor] = {}

    def reference(step: int, name: str, contributions: list[torch.Tensor]) -> torch.Tensor:
        total = mean_rule(contributions)
        estimates[name] = total if name not in estimates else estimates[name] + total
        return estimates[name]

    return tracked(reference)


def counting_empty_payloads(extra_final: Callable[[], None] | None = None) -> Callable:
    """The mean, and at the end: some tensor was empty on some ranks only, and some on all.

    A Threshold payload is empty exactly when its decompressed tensor is all zeros (a kept entry
    has ``|v| >= threshold > 0``)."""
    seen = {"some": 0, "all": 0}

    def reference(step: int, name: str, contributions: list[torch.Tensor]) -> torch.Tensor:
        empty = [int(torch.count_nonzero(c)) == 0 for c in contributions]
        seen["all"] += all(empty)
        seen["some"] += any(empty) and not all(empty)
        return mean_rule(contributions)

    def final() -> None:
        assert seen["some"] and seen["all"], (
            f"the threshold must leave some tensors empty on some ranks and some on all: {seen}")
        if extra_final is not None:
            extra_final()

    return tracked(reference, final)


def through_broadcast(made: dict) -> Callable[[], None]:
    def final() -> None:
        routes = made["bundle"].stats["tensors_by_route"]
        assert routes == {"broadcast": (STEPS + 1) * len(PARAMETERS)}, f"routes used: {routes}"
    return final


# At step 0 (see harness.Net): |grad| peaks near 0.03 for scale, ~1e-9 for shift (the softmax
# sums to 1, so a shift of every logit has no gradient), 0.04-0.11 for fc1.weight by rank, 0.13-0.34
# for fc2.bias. A threshold of 0.1 therefore leaves shift empty everywhere and fc1.weight empty on
# some ranks only; counting_empty_payloads checks that this really happened.
_threshold_broadcast: dict = {}
_topk_broadcast: dict = {}

CASES = [
    Case("Threshold(0.02)+Residual", lambda: pair(lambda: Threshold(0.02), Residual), routes={"allgather"}),
    Case("Threshold(0.1)+Residual with empty payloads", lambda: pair(lambda: Threshold(0.1), Residual),
         rule=counting_empty_payloads(), routes={"allgather"}),
    Case("DGC(0.1)+DGCMemory(0.9)", lambda: pair(lambda: DGC(0.1, seed=5, min_samples=16), DGCMemory),
         routes={"allgather"}),
    Case("DGC(0.1)+DGCMemory(0.5, clip=0.1)", lambda: pair(lambda: DGC(0.1, seed=5, min_samples=16),
                                                           lambda: DGCMemory(momentum=0.5, clip=0.1)),
         routes={"allgather"}),
    Case("TopK(0.1)+EF21", lambda: pair(lambda: TopK(0.1), EF21), rule=ef21_running_mean(), routes={"allgather"}),
    # The twin accounts bytes with Allgather's layout, which Broadcast matches byte for byte.
    Case("TopK(0.1)+Residual via Broadcast",
         lambda: pair(lambda: TopK(0.1), Residual, Broadcast(), _topk_broadcast),
         rule=tracked(lambda step, name, c: mean_rule(c), through_broadcast(_topk_broadcast))),
    Case("Threshold(0.1)+Residual via Broadcast with empty payloads",
         lambda: pair(lambda: Threshold(0.1), Residual, Broadcast(), _threshold_broadcast),
         rule=counting_empty_payloads(through_broadcast(_threshold_broadcast))),
]
