"""The memory interface (state a rank carries between steps, such as error feedback), and the
memory that keeps nothing."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from grace_legacy.core.saved_state import refuse_other_state

if TYPE_CHECKING:
    from grace_legacy.core.compressor import Compressor, Payload


class Memory(ABC):
    """Per-tensor state carried between steps (error feedback and its relatives).

    ``keeps_nonfinite``: an inf or NaN in the tensor given to :meth:`compensate` is still one in
    what it returns (an element-wise sum with finite or non-finite state does that), so the
    bundle need only look at the compensated gradient to flag a step.

    ``survives_world_change``: this rank's state stays meaningful when ranks leave or join
    (elastic training). True for state that is this rank's own business, such as error
    feedback's residual (gradient this process computed and has not delivered yet, whatever its
    rank number becomes). False for state that is a function of the whole world, such as EF21's
    estimate of the mean over all ranks: every rank then :meth:`forget` s it on a change.

    Per-tensor state lives in dicts keyed by tensor name, as ``state_dict`` entries.
    """

    keeps_nonfinite: ClassVar[bool] = False
    survives_world_change: ClassVar[bool] = True

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return what should be compressed this step, e.g. ``g + e``."""

    def compensate_into(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """:meth:`compensate` for a ``tensor`` whose contents the caller will not read again
        (Horovod's optimizer replaces ``p.grad`` by the synchronized result, as its own in-place
        allreduce would overwrite it): a memory may build its result in ``tensor``'s storage
        instead of a new one. The default is :meth:`compensate`."""
        return self.compensate(tensor, name)

    @abstractmethod
    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        """Learn from what was actually sent, e.g. ``e <- compensated - D(payload)``."""

    def check_compressor(self, compressor: Compressor) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` if this memory cannot work with ``compressor``."""

    def aggregated(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The gradient to apply, given the aggregate of what all ranks sent. The identity for
        error feedback; EF21 adds the aggregate to its running estimate of the gradient."""
        return tensor

    def rollback(self, name: str) -> None:
        """Undo this step's update of ``name`` (the step will be skipped: some rank's gradient
        was not finite). Memories with state keep a ``self._journal`` (:class:`StepJournal`)."""
        journal = self.__dict__.get("_journal")
        if journal is not None:
            journal.rollback(name)
        elif set(self.state_dict()) - {"config"}:
            raise NotImplementedError(f"{type(self).__name__} keeps state but no StepJournal to roll a step back")

    def commit(self) -> None:
        """The step is over: what :meth:`rollback` would restore can be let go."""
        journal = self.__dict__.get("_journal")
        if journal is not None:
            journal.commit()

    def forget(self) -> None:
        """Drop every tensor's state, as if no step had been taken (a newcomer's state)."""
        self.load_state_dict({key: {} if isinstance(value, dict) else value
                              for key, value in self.state_dict().items()})

    def configuration(self) -> str:
        """What a saved state is only valid for: this memory's arguments, as its ``repr``."""
        return repr(self)

    def state_dict(self) -> dict[str, Any]:
        """The per-tensor state (copies) and the :meth:`configuration` it belongs to. Subclasses
        add their tensors to ``super().state_dict()``."""
        return {"config": self.configuration()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Check that ``state`` was saved by a memory configured alike (``ValueError`` naming the
        difference otherwise); subclasses then load their tensors. Call between steps."""
        owner = f"{type(self).__name__}.load_state_dict"
        refuse_other_state(state, owner, self.configuration())
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"{owner}: the state holds {sorted(unknown)}, which {type(self).__name__} does not keep")
        self.commit()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoMemory(Memory):
    """Compresses the gradient as it is and forgets what compression dropped."""

    keeps_nonfinite = True

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def update(self, compensated: torch.Tensor, name: str, compressor: Compressor,
               payload: Payload, ctx: Any) -> None:
        pass
