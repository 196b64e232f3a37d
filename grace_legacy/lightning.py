"""grace_legacy compression in PyTorch Lightning's ``Trainer`` and in Lightning Fabric (docs/DDP.md#lightning)::

    trainer = lightning.Trainer(accelerator="cpu", devices=4, strategy=GraceDDPStrategy(Legacy(TopK(), ...)))
    fabric = lightning.Fabric(accelerator="cpu", devices=4, strategy=GraceFabricStrategy(compression))

Lightning's own ``DDPStrategy(ddp_comm_hook=..., ddp_comm_state=...)`` registers a hook only when
the device is CUDA (on CPU the hook is never called, silently), and wants the hook's state before
the model is wrapped, while :class:`grace_legacy.ddp.GraceState` is built from the wrapped model;
Fabric's strategy takes no hook at all. These two strategies are Lightning's DDP strategies (every
keyword argument theirs) with one change: right after Lightning wraps the model in
``DistributedDataParallel``, on every device (CPU with Gloo, CUDA with NCCL), they call
:func:`grace_legacy.ddp.register` on the wrapped model. The gradients are then exactly those of a
``torchrun`` script that does the same by hand, with the same guarantees (docs/DDP.md).

``compression`` is what :func:`grace_legacy.ddp.register` accepts (a compressor, a schedule or a
``Grace`` bundle); the strategy's :attr:`stats` and :meth:`scalars` (its bundle's) report its
traffic in the training process. The Trainer's strategy enters each epoch
(``set_epoch(trainer.current_epoch)``) before the epoch's first batch, as Lightning does for a
``DistributedSampler``; with Fabric the loop is the user's, who calls :meth:`set_epoch`.

Needs the ``lightning`` package (``pip install grace-legacy[lightning]``); the rest of grace_legacy
does not.
"""

from __future__ import annotations

from typing import Any

from torch.nn import Module
from torch.nn.parallel import DistributedDataParallel

from grace_legacy.core.communicator import Communicator
from grace_legacy.core.compressor import Compressor
from grace_legacy.ddp import GraceState, register
from grace_legacy.grace import Grace, as_bundle

try:
    from lightning.fabric.strategies import DDPStrategy as _FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy as _TrainerDDPStrategy
except ImportError as error:  # only this module needs Lightning
    raise ImportError("grace_legacy.lightning needs the lightning package: pip install 'grace-legacy[lightning]'"
                      ) from error

__all__ = ["GraceDDPStrategy", "GraceFabricStrategy"]

#: DDPStrategy arguments that install a communication hook of their own: the strategy's hook is ours.
_HOOK_ARGUMENTS = ("ddp_comm_hook", "ddp_comm_state", "ddp_comm_wrapper", "model_averaging_period")


class _Compression:
    """What both strategies add to Lightning's: the bundle, the hook's state once registered, and
    the bundle's progress and traffic."""

    grace: Grace
    grace_state: GraceState | None

    def _take(self, compression: Compressor | Grace, communicator: Communicator | str | None,
              kwargs: dict[str, Any]) -> None:
        owner = type(self).__name__
        self.grace = as_bundle(compression, owner, communicator)
        given = [name for name in _HOOK_ARGUMENTS if kwargs.get(name) is not None]
        if given:
            raise ValueError(f"{owner}: {', '.join(given)} would install another communication hook; this "
                             f"strategy's hook is grace_legacy's (leave {' and '.join(given)} out)")
        self.compression = compression
        self.grace_state = None

    def _register(self, model: Module) -> GraceState:
        if not isinstance(model, DistributedDataParallel):
            raise TypeError(f"{type(self).__name__}: Lightning handed over a {type(model).__name__}, not the "
                            f"DistributedDataParallel model the hook is registered on")
        self.grace_state = register(model, self.grace)
        return self.grace_state

    def set_epoch(self, epoch: int) -> None:
        """Enter epoch ``epoch``, like ``DistributedSampler.set_epoch`` (schedules change phase)."""
        self.grace.set_epoch(epoch)

    @property
    def stats(self) -> dict[str, Any]:
        """This rank's traffic (:attr:`grace_legacy.Grace.stats`)."""
        return self.grace.stats

    def scalars(self, prefix: str = "grace") -> dict[str, float]:
        """:attr:`stats` as flat numbers for a logger (:meth:`grace_legacy.Grace.scalars`), e.g.
        ``self.log_dict(self.trainer.strategy.scalars())`` in a ``LightningModule``."""
        return self.grace.scalars(prefix)


class GraceDDPStrategy(_Compression, _TrainerDDPStrategy):
    """``lightning.pytorch.strategies.DDPStrategy`` whose gradients go through grace_legacy's DDP
    hook on every device: ``Trainer(strategy=GraceDDPStrategy(compression, **ddp_strategy_kwargs))``.

    ``ddp_strategy_kwargs`` are ``DDPStrategy``'s (``find_unused_parameters``, ``static_graph``,
    ``process_group_backend``, ``timeout``, ``start_method``, ...), except those that install a
    hook of their own (``ddp_comm_hook``, ``ddp_comm_state``, ``ddp_comm_wrapper``,
    ``model_averaging_period``): a ``ValueError`` names them. The hook is registered each time the
    Trainer wraps the model for fitting (``grace_state`` is the latest); the same bundle carries on
    from one ``fit`` to the next. The bundle's epoch follows ``trainer.current_epoch``.
    ``communicator``: for a bare compressor, the bundle's (``"auto"``: the fewest link bytes).
    """

    def __init__(self, compression: Compressor | Grace, *, communicator: Communicator | str | None = None,
                 **ddp_strategy_kwargs: Any) -> None:
        self._take(compression, communicator, ddp_strategy_kwargs)
        super().__init__(**ddp_strategy_kwargs)
        self._epoch: int | None = None

    def configure_ddp(self) -> None:
        # Lightning wraps the model (and registers a hook only on CUDA, none here); the hook goes on
        # the wrapped model, whatever the device.
        super().configure_ddp()
        self._register(self.model)
        self._epoch = None

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        super().on_train_batch_start(batch, batch_idx)
        epoch = self.lightning_module.current_epoch
        if epoch != self._epoch:
            self.set_epoch(epoch)
            self._epoch = epoch


class GraceFabricStrategy(_Compression, _FabricDDPStrategy):
    """``lightning.fabric.strategies.DDPStrategy`` whose gradients go through grace_legacy's DDP hook
    on every device: ``Fabric(strategy=GraceFabricStrategy(compression, **ddp_strategy_kwargs))``,
    then ``fabric.setup(model, optimizer)`` as usual and ``strategy.set_epoch(epoch)`` each epoch.

    ``ddp_strategy_kwargs`` are Fabric's ``DDPStrategy``'s (``find_unused_parameters``,
    ``process_group_backend``, ``timeout``, ``start_method``, ...). One model per strategy: its
    compression state (error feedback, schedule) belongs to that model's parameters, so a second
    ``fabric.setup`` of another model raises ``ValueError``.
    """

    def __init__(self, compression: Compressor | Grace, *, communicator: Communicator | str | None = None,
                 **ddp_strategy_kwargs: Any) -> None:
        self._take(compression, communicator, ddp_strategy_kwargs)
        super().__init__(**ddp_strategy_kwargs)

    def setup_module(self, module: Module) -> DistributedDataParallel:
        if self.grace_state is not None:
            raise ValueError(f"{type(self).__name__}: the compression already runs for a model set up before; "
                             f"give each model a strategy (and a Fabric) of its own")
        ddp_model = super().setup_module(module)
        self._register(ddp_model)
        return ddp_model
