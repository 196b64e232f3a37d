"""The memory interface (per-tensor state carried between steps: error feedback and its relatives)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol

import torch

from grace_legacy.core.state import Stateful
from grace_legacy.core.traits import Traits


class Encoder(Protocol):
    """What a memory may ask of the compressor that encoded a payload (a ``Compressor`` is one)."""

    traits: Traits

    def decompress(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor: ...
    def support(self, payload: list[torch.Tensor], ctx: Any) -> torch.Tensor: ...


class Memory(Stateful, ABC):
    """Per-tensor state carried between steps, in dicts keyed by tensor name that are also its
    ``state_dict`` entries (the contract: docs/IMPLEMENTING.md)."""

    #: an inf or NaN in what :meth:`compensate` is given is still one in what it returns
    keeps_nonfinite: ClassVar[bool] = False
    #: the state stays meaningful when ranks leave or join (a residual: yes; EF21's mean: no, it is
    #: :meth:`reset` on every rank); see docs/DESIGN.md#elastic-state
    survives_world_change: ClassVar[bool] = True

    @abstractmethod
    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Return what should be compressed this step, e.g. ``g + e``."""

    def compensate_into(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """:meth:`compensate` for a ``tensor`` the caller will not read again (Horovod's optimizer
        overwrites ``p.grad``): the result may be built in its storage. Default: :meth:`compensate`."""
        return self.compensate(tensor, name)

    def compensate_borrowed(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """:meth:`compensate` for a ``tensor`` whose storage is lent for this step only: the caller
        reads it again only through the result, which is written there (the DDP hook's bucket). A
        memory that keeps nothing of the compensated tensor past the step may build it there
        instead of in a buffer of its own. Default: :meth:`compensate`."""
        return self.compensate(tensor, name)

    @abstractmethod
    def update(self, compensated: torch.Tensor, name: str, compressor: Encoder,
               payload: list[torch.Tensor], ctx: Any) -> None:
        """Learn from what was actually sent, e.g. ``e <- compensated - D(payload)``."""

    def check_compressor(self, compressor: Any) -> None:  # noqa: B027 (optional hook)
        """Raise ``ValueError`` if this memory cannot work with ``compressor``."""

    def aggregated(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """The gradient to apply, given the aggregate of what all ranks sent (EF21 adds it to its
        estimate); the identity by default."""
        return tensor

    def undo(self, name: str) -> None:
        if self.undo_log is None and set(self.state_dict()) - {"config"}:
            raise NotImplementedError(f"{type(self).__name__} keeps state but no undo_log to undo a step")
        super().undo(name)

    def reset(self) -> None:
        """Drop every tensor's state, as if no step had been taken (a newcomer's state)."""
        self.load_state_dict({key: {} if isinstance(value, dict) else value
                              for key, value in self.state_dict().items()})

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        unknown = set(state) - set(self.state_dict())
        if unknown:
            raise ValueError(f"{type(self).__name__}.load_state_dict: the state holds {sorted(unknown)}, which "
                             f"{type(self).__name__} does not keep")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NoMemory(Memory):
    """Compresses the gradient as it is and forgets what compression dropped."""

    keeps_nonfinite = True

    def compensate(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        return tensor

    def update(self, compensated: torch.Tensor, name: str, compressor: Encoder,
               payload: list[torch.Tensor], ctx: Any) -> None:
        pass
