"""Elastic Horovod: ``hvd.elastic.TorchState(model, optimizer, compression=compression)`` saves,
restores and synchronizes grace_legacy compression state as ranks leave and join.

Horovod's elastic state picks a handler for every keyword it is given from a registry
(``horovod.torch.elastic.state.get_handler_registry``). :func:`install` (run by ``import
grace_legacy``) puts one entry in front of it that matches only ``Grace`` bundles and grace_legacy
compressors, so every other object is handled exactly as before. The handler follows Horovod's
cycle for the bundle that runs the compression (for a bare compressor, the bundle
``hvd.DistributedOptimizer`` built around it):

* ``state.commit()`` saves a copy of the bundle's state (:meth:`Grace.state_dict`), next to the
  model's and optimizer's copies.
* A failure (a rank raising or killed: the others get ``HorovodInternalError``) restores every
  survivor to that copy, so residuals, step counters and schedule progress match the model and
  optimizer of the last commit; the interrupted step's half-filled buckets are dropped.
* After every reset (ranks lost or added), synchronization sends rank 0's shared state (its
  configuration and compressor state, not its residuals) to every rank, and each rank continues
  from it with :meth:`Grace.rejoin`: progress, decisions and the step
  counters behind every generator are rank 0's, so every rank picks the same parameter and draws
  alike; the error-feedback residuals stay with the process that owns them.

Why survivors keep their residuals: a residual is gradient its process computed and has not yet
delivered, in that process's own units; delivering it later is what error feedback does, and
nothing in it depends on the rank number, which a reset may change, or on the world size,
which divides the aggregate only when it is delivered. A newcomer starts with none, as at the
start of training. What leaves with a lost rank is its undelivered residual, the same kind of
loss as its uncommitted steps. State that is a function of the whole world (EF21's estimate of
the mean over all ranks) is not sound to keep: every rank starts it afresh.

The new rank and size reach everything that uses them at the next step, where the bundle takes
its new place (:meth:`Grace.enter`): the rank in every per-rank seed, the size in the dense
fallback's cost test, and a fresh agreement check (:mod:`grace_legacy.consistency`), which the
ranks that joined take part in. Bucket plans depend only on the parameters and stay as they are.
Only the global process set is supported: elastic Horovod renumbers ranks on a reset, so a
process set of fixed ranks would no longer name the same processes.
"""

from __future__ import annotations

import copy
from typing import Any

import horovod.torch as hvd
from horovod.torch.elastic import state as _hvd_state

from grace_legacy.core.compressor import Compressor
from grace_legacy.grace import Grace
from grace_legacy.optimizer import bundle_of

#: The type names Horovod's registry matches against: our objects and nothing else.
COMPRESSION_TYPES = (Grace, Compressor)


class CompressionStateHandler(_hvd_state.StateHandler):
    """Horovod's elastic ``StateHandler`` for a ``Grace`` bundle or a grace_legacy compressor
    (see the module docstring for what save, restore and sync do)."""

    def __init__(self, compression: Grace | Compressor) -> None:
        super().__init__(compression)
        self._saved = self._state()

    def _bundle(self) -> Grace:
        bundle = bundle_of(self.value)
        if bundle is None:
            raise ValueError(
                f"hvd.elastic.TorchState: compression={self.value!r} is not running in any optimizer yet; "
                f"build hvd.DistributedOptimizer(..., compression=compression) before TorchState, or pass "
                f"a Grace bundle")
        return bundle

    def _state(self) -> dict[str, Any] | None:
        bundle = bundle_of(self.value)
        return None if bundle is None else bundle.state_dict()

    def save(self) -> None:
        self._saved = self._state()

    def restore(self) -> None:
        bundle = self._bundle()
        bundle.undo_step()
        if self._saved is None:
            return
        state = copy.deepcopy(self._saved)
        # Reloaded as a state of this very process: where it runs next is the next step's concern.
        state["placement"] = None
        bundle.load_state_dict(state)

    def sync(self) -> None:
        bundle = self._bundle()
        shared = hvd.broadcast_object(bundle.shared_state() if hvd.rank() == 0 else None, root_rank=0,
                                      name="grace.elastic.state")
        bundle.rejoin(shared)
        self._saved = self._state()

    def set_value(self, value: Grace | Compressor) -> None:
        _check_compression(value)
        super().set_value(value)


def _check_compression(value: Any) -> None:
    if not isinstance(value, COMPRESSION_TYPES):
        raise TypeError(f"hvd.elastic.TorchState: this attribute holds grace_legacy compression (a Grace bundle or "
                        f"a Compressor) and cannot be set to {type(value).__name__}")


def _ours(entry: tuple[Any, Any]) -> bool:
    return entry[1] is CompressionStateHandler


def install() -> None:
    """Put the handler in front of Horovod's elastic handler registry (idempotent). It matches
    only ``Grace`` bundles and grace_legacy compressors."""
    registry = _hvd_state.get_handler_registry()
    if not any(_ours(entry) for entry in registry):
        _hvd_state.set_handler_registry([(COMPRESSION_TYPES, CompressionStateHandler), *registry])


def uninstall() -> None:
    """Take the handler out of Horovod's registry again (idempotent)."""
    _hvd_state.set_handler_registry([entry for entry in _hvd_state.get_handler_registry() if not _ours(entry)])


def installed() -> bool:
    return any(_ours(entry) for entry in _hvd_state.get_handler_registry())
