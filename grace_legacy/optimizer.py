"""``hvd.DistributedOptimizer`` with grace_legacy compression: Horovod's optimizer (hooks overlapping
the backward pass, ``backward_passes_per_step``, ``synchronize()``/``skip_synchronize()``, ``op``,
process sets) with only the launch of a gradient's communication replaced by the ``Grace`` bundle,
which picks the collective the payload needs (docs/DESIGN.md#horovod-optimizer). ``import
grace_legacy`` calls :func:`install`; any other ``compression`` (Horovod's ``Compression.none``,
``fp16``) goes to Horovod's own function untouched.

A gradient that held an inf or NaN on any rank is NaN on every rank and the step leaves no trace; a
dead rank ends the job; a rank that stops taking part makes the others raise
:class:`~grace_legacy.runtime.stall.RanksStalled` (docs/GUARANTEES.md).
"""

from __future__ import annotations

import os
import weakref
from typing import Any

import horovod.torch as hvd
import horovod.torch.optimizer as _hvd_optimizer
import torch
from horovod.torch.compression import Compression
from horovod.torch.mpi_ops import Adasum, Average, Sum, global_process_set

from grace_legacy.backends.horovod import HorovodBackend
from grace_legacy.consistency import verify_ranks_agree
from grace_legacy.core.compressor import Compressor
from grace_legacy.grace import Grace

_horovod_distributed_optimizer = _hvd_optimizer.DistributedOptimizer

class _NotGiven:
    """``compression``'s default, Horovod's ``Compression.none``, told apart from one given explicitly
    so that ``grace=`` with any ``compression=`` is refused."""

    def __repr__(self) -> str:
        return "Compression.none"


_NOT_GIVEN: Any = _NotGiven()


#: The bundle built around each bare compressor given as ``compression``, so that elastic state
#: given the same compressor saves its memory too (:func:`bundle_of`).
_bundles_built_for: weakref.WeakKeyDictionary[Compressor, Grace] = weakref.WeakKeyDictionary()


def is_grace_compression(compression: Any) -> bool:
    return isinstance(compression, (Compressor, Grace))


class _AlreadyAggregated:
    """Stands in for ``compression`` inside Horovod's optimizer: our handles return the finished
    gradient, so Horovod's final ``decompress`` must leave it alone."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> Any:
        raise AssertionError("grace_legacy launches communication itself; Horovod should not compress")

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


def _description(self: Any) -> dict[str, str | list[str]]:
    """What every rank of the process set must agree on before exchanging gradients."""
    return {
        "parameters": sorted(f"{self._parameter_names[p]}{list(p.shape)} {str(p.dtype).removeprefix('torch.')}"
                             for p in self._requires_update),
        "op": "Average" if self.op == Average else "Sum",
        "backward_passes_per_step": str(self.backward_passes_per_step),
        **self.grace.describe(),
    }


def _verify_ranks_agree(self: Any, when: str) -> None:
    ranks = self.process_set.ranks
    verify_ranks_agree(self._grace_backend, _description(self), f"consistency.{when}",
                       rank_labels=ranks if ranks else None)


def _grace_allreduce_grad_async(self: Any, p: torch.Tensor) -> tuple[Any, None]:
    if self.grace.join_world(self._grace_backend):
        if _elastic_worker():
            # A new world (the first, or one after a reset): its members post to a new board.
            self._grace_backend.open_board()
        # Again at the first gradient and after every elastic reset (docs/DESIGN.md#ranks-agree).
        _verify_ranks_agree(self, "first-step")
    if p.grad is None:
        # Unused on this rank (a branch not taken) but perhaps not on others: every rank must
        # take part in every collective, so this rank contributes zeros, exactly as Horovod does.
        p.grad = p.data.new(p.size()).zero_()
    tensor = p.grad
    if tensor.is_sparse:
        if not self.sparse_as_dense:
            raise ValueError(f"parameter {self._parameter_names.get(p)!r} has a sparse gradient: grace_legacy "
                             f"compresses dense tensors, pass sparse_as_dense=True")
        tensor = tensor.to_dense()
    # p.grad is set to the synchronized result (as Horovod's in-place allreduce would overwrite
    # it), so its contents are the bundle's to use.
    pending = self.grace.start(tensor, self._parameter_names.get(p), self._grace_backend,
                                average=self.op == Average, overwrite=True)
    return pending, None


def _start_the_rest_in_order(self: Any) -> None:
    """Start every gradient the backward pass has not (unused on this rank, or delayed by
    ``backward_passes_per_step``) and put the handles in one order every rank shares
    (docs/DESIGN.md#one-issue-order)."""
    order = [p for p in self._grace_order if p in self._requires_update]
    for p in order:
        if self._handles.get(p, (None, None))[0] is None:
            self._handles[p] = self._allreduce_grad_async(p)
    self._handles = {p: self._handles[p] for p in order}


def _average_again(self: Any) -> None:
    """A second ``synchronize()`` with no backward pass since the first: the gradients are averaged
    again dense, and no compression state moves (docs/DESIGN.md#second-synchronize)."""
    backend = self._grace_backend
    launched = [(p, backend.allreduce_async(p.grad, f"again.{self._parameter_names[p]}", self.op == Average))
                for p in self._grace_order if p in self._requires_update and p.grad is not None]
    for p, handle in launched:
        p.grad.copy_(backend.wait(handle))
    self._synchronized = True


def _grace_synchronize(self: Any) -> None:
    if self._synchronized and not self._handles:
        if self.process_set.included():
            _average_again(self)
        return
    if self.process_set.included():
        _start_the_rest_in_order(self)
    _hvd_optimizer._DistributedOptimizer.synchronize(self)
    if self._requires_update and self.process_set.included():
        by_name = {self._parameter_names[p]: p for p in self._requires_update}
        flagged = self.grace.guard.nonfinite_names(sorted(by_name), self._grace_backend)
        for name in flagged:
            grad = by_name[name].grad
            # A compressor may have dropped the inf; make sure GradScaler sees it on every rank.
            if grad is not None and bool(torch.isfinite(grad).all()):
                grad.fill_(float("nan"))
        if flagged:
            # GradScaler skips the whole step, so no tensor's memory or schedule may keep it.
            for name in by_name:
                self.grace.guard.undo(name)
    self.grace.end_step(self._grace_backend)


def _grace_load_state_dict(self: Any, *args: Any, **kwargs: Any) -> None:
    """Horovod's ``load_state_dict``, which drops the gradients of a step under way; the bundle
    drops the step too (:meth:`Grace.undo_step`), first waiting for what this rank launched."""
    if self._handles:
        self.grace.undo_step()
    _hvd_optimizer._DistributedOptimizer.load_state_dict(self, *args, **kwargs)


def DistributedOptimizer(optimizer: torch.optim.Optimizer, named_parameters: Any = None,
                         compression: Any = _NOT_GIVEN, backward_passes_per_step: int = 1,
                         op: Any = Average, gradient_predivide_factor: float = 1.0,
                         num_groups: int = 0, groups: Any = None, sparse_as_dense: bool = False,
                         process_set: Any = global_process_set, grace: Any = None) -> torch.optim.Optimizer:
    """Horovod's ``DistributedOptimizer``, with the same signature and behaviour, that also takes a
    grace_legacy ``Compressor`` or ``Grace`` bundle as ``compression`` (or as ``grace=``, GRACE's
    keyword, so GRACE scripts run unchanged; not both).

    With grace_legacy compression ``op`` is ``hvd.Average`` (divided by the process set's size) or
    ``hvd.Sum`` (``gradient_predivide_factor`` leaves the result as it is); ``op=hvd.Adasum`` and
    ``groups`` raise ``ValueError``. A parameter whose ``grad`` is ``None`` on a rank (a branch not
    taken) takes part from it with zeros (plus any residual), as in Horovod's optimizer, and every
    rank's ``p.grad`` is set to the result. Raises
    :class:`~grace_legacy.consistency.RanksDisagree` on every rank, here or at the first step, when
    ranks differ in parameters, compression set-up or schedule. Horovod's other behaviours hold: a
    second ``synchronize()`` re-averages dense, ``zero_grad()`` refuses pending gradients, and
    ``load_state_dict`` in mid-step drops the step.

    The returned optimizer's ``grace`` is the ``Grace`` bundle that runs the compression (the one
    given, or one built around a bare compressor): ``opt.grace.stats``, ``opt.grace.scalars()``,
    ``opt.grace.set_epoch(epoch)``."""
    if grace is not None:
        if compression is not _NOT_GIVEN:
            raise ValueError(f"DistributedOptimizer: got both grace={grace!r} and compression={compression!r}; "
                             f"they are the same argument (grace= is GRACE's name for it), pass one")
        if not is_grace_compression(grace):
            raise TypeError(f"DistributedOptimizer: grace must be a grace_legacy Grace bundle or Compressor "
                            f"(e.g. grace_from_params(params)), got {type(grace).__name__}")
        compression = grace
    elif compression is _NOT_GIVEN:
        compression = Compression.none
    if not is_grace_compression(compression):
        return _horovod_distributed_optimizer(
            optimizer, named_parameters=named_parameters, compression=compression,
            backward_passes_per_step=backward_passes_per_step, op=op,
            gradient_predivide_factor=gradient_predivide_factor, num_groups=num_groups, groups=groups,
            sparse_as_dense=sparse_as_dense, process_set=process_set)

    if op not in (Average, Sum):
        name = "hvd.Adasum" if op == Adasum else repr(op)
        raise ValueError(f"op={name} cannot be used with grace_legacy compression: compressed payloads "
                         f"are aggregated by sum or average only; use op=hvd.Average or op=hvd.Sum")
    if groups is not None or num_groups:
        raise ValueError("groups/num_groups cannot be used with grace_legacy compression: each gradient's "
                         "payload takes its own collective; leave groups=None")
    if backward_passes_per_step <= 0:
        raise ValueError(f"backward_passes_per_step must be > 0, got {backward_passes_per_step}")
    if gradient_predivide_factor != 1.0 and op != Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")

    if _elastic_worker() and process_set is not global_process_set:
        raise ValueError("process_set cannot be used with grace_legacy compression under elastic horovodrun: a "
                         "reset renumbers the ranks, so a process set of fixed ranks would name other "
                         "processes; leave process_set=hvd.global_process_set")
    bundle = compression if isinstance(compression, Grace) else Grace(compression)
    members = dict(_hvd_optimizer._DistributedOptimizer.__dict__)
    members["_allreduce_grad_async"] = _grace_allreduce_grad_async
    members["synchronize"] = _grace_synchronize
    members["load_state_dict"] = _grace_load_state_dict
    cls = type(optimizer.__class__.__name__, (optimizer.__class__,), members)
    distributed = cls(optimizer.param_groups, named_parameters, _AlreadyAggregated(), backward_passes_per_step,
                      op, gradient_predivide_factor, None, sparse_as_dense, process_set)
    distributed.grace = bundle
    distributed._grace_backend = HorovodBackend(process_set, bundle.stall_timeout)
    # Gradients arrive roughly in reverse registration order, so buckets fill while backward goes on.
    trainable = [p for group in distributed.param_groups for p in group["params"] if p.requires_grad]
    distributed._grace_order = list(reversed(trainable))
    bundle.plan_buckets([(distributed._parameter_names[p], p.numel() * p.element_size())
                         for p in distributed._grace_order])
    if not isinstance(compression, Grace):
        _bundles_built_for[compression] = bundle
    # Not under elastic horovodrun: a worker that joins later builds its optimizer while the others
    # synchronize state, and Horovod forbids collectives outside hvd.elastic.run.
    if process_set.included() and not _elastic_worker():
        distributed._grace_backend.open_board()
        # Before the user's broadcast_parameters, which would hang on different models.
        _verify_ranks_agree(distributed, "construction")
    return distributed


def _elastic_worker() -> bool:
    """Whether this process was started by elastic ``horovodrun`` (which sets HOROVOD_ELASTIC)."""
    return os.environ.get("HOROVOD_ELASTIC", "0") not in ("", "0")


def bundle_of(compression: Compressor | Grace) -> Grace | None:
    """The ``Grace`` bundle that runs ``compression``: itself, or the one
    :func:`DistributedOptimizer` built around a bare compressor (``None`` before that)."""
    return compression if isinstance(compression, Grace) else _bundles_built_for.get(compression)


def install() -> None:
    """Make ``hvd.DistributedOptimizer`` accept grace_legacy compression (idempotent). Only the name
    users call, ``horovod.torch.DistributedOptimizer``, is rebound; ``horovod.torch.optimizer``'s
    stays Horovod's own (docs/DESIGN.md#install-rebinds-one-name)."""
    hvd.DistributedOptimizer = DistributedOptimizer


def uninstall() -> None:
    """Give ``hvd.DistributedOptimizer`` back to Horovod's own function (idempotent). Optimizers
    already built keep working."""
    hvd.DistributedOptimizer = _horovod_distributed_optimizer


def installed() -> bool:
    """Whether ``hvd.DistributedOptimizer`` is this module's."""
    return hvd.DistributedOptimizer is DistributedOptimizer
