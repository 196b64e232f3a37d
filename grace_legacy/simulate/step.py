"""One rank's part of a synchronized step, as ``hvd.DistributedOptimizer`` runs it
(``grace_legacy/optimizer.py``), on any ``Backend``: a simulated rank, or a real one under
``torchrun`` (the simulator's tests run both and compare them).

The optimizer plans the bundle's buckets over the parameters in reverse registration order (the
order the backward pass delivers them), starts every gradient in that order with ``overwrite=True``
(the result replaces the gradient, so error feedback may build in its storage), waits for them in
that order, looks for infs and NaNs on any rank (a flagged tensor is NaN on every rank and the step
leaves no trace in the compression state) and ends the step. The order of the starts does not
change any result (buckets, memories and step counters are per tensor); the order of the waits
fixes the order in which ``stats`` adds the tensors' byte counts, which is why it is kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from grace_legacy.core.backend import Backend, Pending
from grace_legacy.grace import Grace


def plan_buckets(bundle: Grace, named_shapes: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Plan ``bundle``'s fused buckets as the optimizer does: ``named_shapes`` are the trainable
    parameters in registration order (``model.named_parameters()``)."""
    sizes = [(name, p.numel() * p.element_size()) for name, p in named_shapes]
    bundle.plan_buckets(list(reversed(sizes)))


def start_all(bundle: Grace, gradients: Mapping[str, torch.Tensor], backend: Backend,
              average: bool = True) -> dict[str, Pending]:
    """Start every one of this rank's ``gradients`` (name -> tensor in registration order; they are
    used up) in the optimizer's order: what the backward pass's hooks do. Launches collectives and
    never waits for one."""
    return {name: bundle.start(gradients[name], name, backend, average, overwrite=True)
            for name in reversed(list(gradients))}


def finish_all(bundle: Grace, pending: Mapping[str, Pending], backend: Backend) -> dict[str, torch.Tensor]:
    """Wait for what :func:`start_all` started and end the step, as the optimizer's
    ``synchronize()`` does; the synchronized gradients, in registration order."""
    results = {name: wait() for name, wait in pending.items()}
    names = list(reversed(list(pending)))
    flagged = bundle.guard.nonfinite_names(sorted(names), backend)
    for name in flagged:
        if bool(torch.isfinite(results[name]).all()):
            results[name] = torch.full_like(results[name], float("nan"))
    if flagged:
        for name in names:
            bundle.guard.undo(name)
    bundle.end_step(backend)
    return {name: results[name] for name in names}


def synchronize(bundle: Grace, gradients: Mapping[str, torch.Tensor], backend: Backend,
                average: bool = True) -> dict[str, torch.Tensor]:
    """This rank's synchronized gradients from its ``gradients`` (name -> tensor, in registration
    order; they are used up), as the optimizer's ``synchronize()`` computes them; a collective."""
    return finish_all(bundle, start_all(bundle, gradients, backend, average), backend)
