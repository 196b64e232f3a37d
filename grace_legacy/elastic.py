"""Elastic Horovod: ``hvd.elastic.TorchState(model, optimizer, compression=compression)`` saves,
restores and synchronizes grace_legacy compression state as ranks leave and join (docs/ELASTIC.md;
why: docs/DESIGN.md#elastic-state). :func:`install` (run by ``import grace_legacy``) puts one entry
in front of Horovod's elastic handler registry, matching only ``Grace`` bundles and grace_legacy
compressors. For the bundle that runs the compression (for a bare compressor, the one
``hvd.DistributedOptimizer`` built around it), ``state.commit()`` saves a copy of its state, a
failure restores every survivor to it and drops the interrupted step, and after every reset each
rank continues from rank 0's shared state (:func:`rejoin`).
"""

from __future__ import annotations

import copy
from typing import Any

import horovod.torch as hvd
from horovod.torch.elastic import state as _hvd_state

from grace_legacy.core.compressor import Compressor
from grace_legacy.core.state import refuse_other_configuration, saved_configuration
from grace_legacy.grace import Grace
from grace_legacy.optimizer import bundle_of

#: The type names Horovod's registry matches against: our objects and nothing else.
COMPRESSION_TYPES = (Grace, Compressor)


def shared_state(bundle: Grace) -> dict[str, Any]:
    """What :func:`rejoin` takes from the rank every rank follows: the configuration and the
    compressor's state, without the memory's per-rank tensors (nobody else uses them)."""
    return {"config": bundle.configuration(), "compressor": bundle.compressor.state_dict()}


def rejoin(bundle: Grace, shared: dict[str, Any]) -> None:
    """Continue in a changed world from ``shared``, rank 0's :func:`shared_state`: what every rank
    must agree on comes from it, this process's residuals and byte counts stay
    (docs/DESIGN.md#elastic-state). ``ValueError`` if another configuration saved ``shared``."""
    saved = saved_configuration(shared, "grace_legacy.elastic.rejoin")
    refuse_other_configuration("grace_legacy.elastic.rejoin", saved, bundle.configuration())
    compressor = bundle.compressor
    compressor.load_state_dict(compressor.rejoin_state(shared["compressor"], compressor.state_dict()))
    bundle.leave_world()


class CompressionStateHandler(_hvd_state.StateHandler):
    """Horovod's elastic ``StateHandler`` for a ``Grace`` bundle or a grace_legacy compressor."""

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
        shared = hvd.broadcast_object(shared_state(bundle) if hvd.rank() == 0 else None, root_rank=0,
                                      name="grace.elastic.state")
        rejoin(bundle, shared)
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
