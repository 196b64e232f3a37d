"""One model trained as ``W`` data-parallel workers in one process, every worker running the
library's own compression code, and the aggregate the bits real ranks would compute.

Each step the participating workers compute their gradients of their own micro-batches
(:mod:`~grace_legacy.simulate.gradients`, vectorised over workers where the model allows), then each
worker runs its part of the optimizer's step (:func:`~grace_legacy.simulate.step.synchronize`) with
its own ``Grace`` bundle (its own compressor, memory, schedule and step counters, and its own rank
for the seeded draws) against a :class:`~grace_legacy.simulate.world.SimulatedWorld` of the
participants, the workers taking turns in lock-step (:mod:`~grace_legacy.simulate.lockstep`). Every
route runs unchanged (the bundle chooses it at the number of participants), so the result is the one
real ranks would get, bit for bit, given the same gradients and the backend's order of addition
(:mod:`~grace_legacy.simulate.sums`). The workers' results are the same by the library's guarantee
(``check=True`` compares them); the model takes worker 0's, and the caller steps its optimizer.

Partial participation: the workers taking part in a step form that step's world, as a process set
of them would (each takes its rank among them, so a bundle whose rank or world changes keeps its
error feedback, as after an elastic reset, and its two-phase owners' feedback restarts). Schedules
then must follow the epoch given to :meth:`Simulation.set_epoch` (which every worker receives), not
steps or aggregates only the participants see: a schedule that counts steps (``steps_per_epoch``)
or decides from the aggregated gradients (Accordion, L-GreCo) is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from grace_legacy.core.compressor import Compressor
from grace_legacy.grace import Grace, as_bundle
from grace_legacy.runtime.validation import ArgumentTypeError, check_flag, check_positive_int
from grace_legacy.schedules.base import Schedule
from grace_legacy.simulate.gradients import Loss, WorkerGradients
from grace_legacy.simulate.lockstep import LockStep
from grace_legacy.simulate.step import finish_all, plan_buckets, start_all
from grace_legacy.simulate.sums import Reduction
from grace_legacy.simulate.world import SimulatedWorld

Batch = tuple[torch.Tensor, torch.Tensor]


class Simulation:
    """``model`` trained as ``workers`` workers (see the module docstring). ``compression(worker)``
    builds worker ``worker``'s compression (a compressor, schedule or ``Grace`` bundle): new objects
    for each worker. ``loss(outputs, targets)``; ``average``: the optimizer's ``op`` (average, or
    sum); ``reduction``: the allreduce's order of addition
    (:data:`~grace_legacy.simulate.sums.REDUCTIONS`); ``vectorize`` as
    :class:`~grace_legacy.simulate.gradients.WorkerGradients`; ``share`` as
    :class:`~grace_legacy.simulate.world.SimulatedWorld`; ``check``: compare every worker's result
    with worker 0's, bit for bit, every step."""

    def __init__(self, model: nn.Module, compression: Callable[[int], Compressor | Grace], workers: int, *,
                 loss: Loss = nn.functional.cross_entropy, average: bool = True,
                 reduction: str | Reduction = "rank-order", vectorize: bool | str = "auto", share: bool = True,
                 check: bool = False) -> None:
        self.workers = check_positive_int(workers, "workers", "Simulation")
        if not isinstance(model, nn.Module):
            raise ArgumentTypeError(f"Simulation: model must be a torch.nn.Module, got {type(model).__name__}")
        if not callable(compression):
            raise ArgumentTypeError(f"Simulation: compression must be a function worker -> compression, got "
                                    f"{compression!r}")
        self.model = model
        self.average = check_flag(average, "average", "Simulation")
        self.check = check_flag(check, "check", "Simulation")
        self.reduction, self.share = reduction, check_flag(share, "share", "Simulation")
        self.parameters = {name: p for name, p in model.named_parameters() if p.requires_grad}
        if not self.parameters:
            raise ValueError("Simulation: the model has no trainable parameters")
        self.bundles = [as_bundle(compression(worker), "Simulation") for worker in range(self.workers)]
        _check_distinct(self.bundles)
        for bundle in self.bundles:
            plan_buckets(bundle, self.parameters.items())
        self.gradients = WorkerGradients(model, loss, vectorize)
        self.lockstep = LockStep(self.workers)
        self._worlds: dict[int, SimulatedWorld] = {}
        self._failure: BaseException | None = None
        #: seconds spent in each phase of :meth:`backward` so far: the workers' gradients, their
        #: starts (compression, launches) and their finishes (aggregation, end of step)
        self.seconds = {"gradients": 0.0, "start": 0.0, "finish": 0.0}

    def world(self, size: int) -> SimulatedWorld:
        """The world of ``size`` ranks the steps with that many participants run in."""
        world = self._worlds.get(size)
        if world is None:
            world = self._worlds[size] = SimulatedWorld(size, self.lockstep, reduction=self.reduction,
                                                        share=self.share)
        return world

    def backward(self, batches: Sequence[Batch] | Mapping[int, Batch]) -> torch.Tensor:
        """One synchronized backward pass: ``batches`` holds every worker's micro-batch in worker
        order, or ``{worker: batch}`` for the workers taking part (partial participation). Each
        parameter's ``.grad`` becomes the synchronized gradient; returns the participants' losses."""
        if self._failure is not None:
            raise RuntimeError("Simulation: an earlier step failed, so the workers' compression state is that of "
                               "a step cut short; build a new Simulation") from self._failure
        chosen = dict(batches) if isinstance(batches, Mapping) else dict(enumerate(batches))
        workers = sorted(chosen)
        if not workers or workers[0] < 0 or workers[-1] >= self.workers:
            raise ValueError(f"Simulation.backward: batches must be given for workers in [0, {self.workers}), got "
                             f"{workers[:8]}")
        if len(workers) < self.workers:
            self._check_partial()
        started_at = time.perf_counter()
        grads, losses = self.gradients([chosen[w][0] for w in workers], [chosen[w][1] for w in workers], workers)
        world = self.world(len(workers))
        computed_at = time.perf_counter()
        try:
            # What the backward pass's hooks do on every rank first (launching, never waiting), then
            # each rank's synchronize() in lock-step: only waits for collectives launched there
            # (a scatter-gather's second phase, PowerSGD's later rounds) make the ranks take turns.
            started = [start_all(self.bundles[worker], {name: grads[name][rank] for name in self.parameters},
                                 world.backend(rank), self.average) for rank, worker in enumerate(workers)]
            launched_at = time.perf_counter()
            results = self.lockstep.run([
                lambda rank=rank, worker=worker: finish_all(self.bundles[worker], started[rank], world.backend(rank))
                for rank, worker in enumerate(workers)])
        except BaseException as error:
            self._failure = error
            world.abandon()
            raise
        finished_at = time.perf_counter()
        for phase, seconds in (("gradients", computed_at - started_at), ("start", launched_at - computed_at),
                               ("finish", finished_at - launched_at)):
            self.seconds[phase] += seconds
        if self.check:
            _check_agree(results, workers)
        for name, p in self.parameters.items():
            p.grad = results[0][name]
        return losses

    def _check_partial(self) -> None:
        for worker, bundle in enumerate(self.bundles):
            schedule = bundle.compressor
            if isinstance(schedule, Schedule) and (schedule.steps_per_epoch is not None
                                                   or type(schedule).observe is not Schedule.observe):
                raise ValueError(f"Simulation: worker {worker}'s {type(schedule).__name__} counts steps or decides "
                                 f"from aggregated gradients, which only the participants of a step see: with "
                                 f"partial participation give schedules their progress by set_epoch")

    def set_epoch(self, epoch: int) -> None:
        """Every worker enters epoch ``epoch`` (schedules change phase), as each rank's would."""
        for bundle in self.bundles:
            bundle.set_epoch(epoch)

    @property
    def stats(self) -> list[dict[str, Any]]:
        """Each worker's ``stats`` (bytes it sent, its wire bytes, routes)."""
        return [bundle.stats for bundle in self.bundles]

    def memory(self) -> dict[str, int]:
        """Bytes of tensor state: every worker's compression state (residuals, momenta, estimates:
        ``Grace.state_dict()``'s tensors; ``state_max`` the largest worker's), and the workers'
        gradients of one step (``gradients``: ``W`` model-sized tensors)."""
        states = [_tensor_bytes(bundle.state_dict()) for bundle in self.bundles]
        model = sum(p.numel() * p.element_size() for p in self.parameters.values())
        return {"state_total": sum(states), "state_max": max(states), "gradients": self.workers * model,
                "model": model}

    def close(self) -> None:
        """Stop the workers' threads (a collected Simulation stops them too)."""
        self.lockstep.close()

    def __enter__(self) -> Simulation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_distinct(bundles: Sequence[Grace]) -> None:
    """Every worker must own its state: a compressor, memory or bundle shared by two workers would
    mix their residuals and step counters."""
    seen: dict[int, int] = {}
    for worker, bundle in enumerate(bundles):
        for part in (bundle, bundle.compressor, bundle.memory):
            other = seen.setdefault(id(part), worker)
            if other != worker:
                raise ValueError(f"Simulation: workers {other} and {worker} share {part!r}; compression(worker) "
                                 f"must build new objects for every worker")


def _check_agree(results: Sequence[Mapping[str, torch.Tensor]], workers: Sequence[int]) -> None:
    for rank, result in enumerate(results[1:], start=1):
        for name, tensor in result.items():
            first = results[0][name]
            same = tensor.shape == first.shape and torch.equal(tensor.view(-1).view(torch.uint8),
                                                               first.view(-1).view(torch.uint8))
            if not same:
                raise AssertionError(f"Simulation: worker {workers[rank]}'s synchronized {name!r} differs from "
                                     f"worker {workers[0]}'s")


def _tensor_bytes(state: Any) -> int:
    if isinstance(state, torch.Tensor):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(_tensor_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(_tensor_bytes(v) for v in state)
    return 0
