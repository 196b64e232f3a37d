"""What the sparsifiers that send a subset of the entries share: the density parameter, ``k``, and the
base class of those whose payload is ``[values, flat indices]``."""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, ClassVar

import torch

from grace_legacy.compressors.sparse import SparseContext, densify, scatter_sum
from grace_legacy.core.compressor import Payload, Sparsifier
from grace_legacy.core.memory import Memory, NoMemory
from grace_legacy.core.parameter import ScheduledParameter
from grace_legacy.core.state import UndoLog
from grace_legacy.core.traits import Traits
from grace_legacy.runtime.buffers import LARGE, BufferPool

DENSITY = ScheduledParameter("ratio", low=0.0, high=1.0, low_inclusive=False, high_inclusive=True, dense=1.0)


@functools.lru_cache(maxsize=65536)
def kept_count(ratio: float, numel: int) -> int:
    """``k = max(1, floor(ratio * numel))``, with ``ratio`` read as the decimal the user wrote
    (``0.29 * 100`` is 29, not the float product's 28.999...)."""
    return max(1, math.floor(Fraction(repr(float(ratio))) * numel))


class EntrySparsifier(Sparsifier):
    """A sparsifier whose payload is ``[values, flat indices]`` with a :class:`SparseContext`:
    decoding scatters the values into zeros, aggregating scatter-adds every rank's entries."""

    traits = Traits(sends_entries=True)

    def __init__(self) -> None:
        super().__init__()
        # Large dense outputs are kept per size (docs/DESIGN.md#kept-buffers).
        self._outputs = BufferPool(min_bytes=LARGE)

    def _zeros(self, purpose: str, ctx: SparseContext) -> torch.Tensor:
        return self._outputs.zeros((purpose, ctx.numel, ctx.dtype, ctx.device), ctx.numel, ctx.dtype, ctx.device)

    def decompress(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        values, indices = payload
        return densify(values, indices, ctx, out=self._zeros("decompress", ctx))

    def support(self, payload: Payload, ctx: SparseContext) -> torch.Tensor:
        """The flat indices whose values ``payload`` carries (what DGC's factor masking zeroes)."""
        return payload[1].long()

    def aggregate(self, payloads: Sequence[Payload], ctx: SparseContext, average: bool) -> torch.Tensor:
        return scatter_sum(payloads, ctx, average, out=self._zeros("aggregate", ctx))

    def scatter_context(self, ctx: SparseContext) -> SparseContext:
        return ctx


class OwnFeedback(EntrySparsifier):
    """An :class:`EntrySparsifier` that keeps what it did not send itself, per tensor, in the dicts
    named by :attr:`stores` (AdaComp's residue, the variance sparsifier's sums): its own error
    feedback, so it pairs with ``NoMemory`` only; the stores are replaced out of place under an
    :class:`UndoLog`, saved by :meth:`state_dict` and, holding this rank's own gradients, kept by a
    rank that survives a change of world."""

    traits = Traits()  # it sends its state's entries, not the input's own
    #: the attributes, each a ``dict[str, torch.Tensor]`` by tensor name, that make its state
    stores: ClassVar[tuple[str, ...]] = ()

    def __init__(self) -> None:
        super().__init__()
        for store in self.stores:
            setattr(self, store, {})
        self.undo_log = UndoLog()

    def _keep(self, name: str, **tensors: torch.Tensor) -> None:
        """Store each of ``tensors`` (by store name) as ``name``'s next state, undoably."""
        for store, tensor in tensors.items():
            kept = getattr(self, store)
            self.undo_log.remember(kept, name)
            kept[name] = tensor

    def check_memory(self, memory: Memory) -> None:
        if type(memory) is not NoMemory:
            raise ValueError(f"{type(self).__name__} keeps its own error feedback ({', '.join(self.stores)}); "
                             f"{memory!r} would add a second one: use memory=NoMemory() (the default)")

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **{store: {name: t.detach().clone() for name, t in getattr(self, store).items()}
                                           for store in self.stores}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        for store in self.stores:  # in place: the copies a schedule configures share these dicts
            kept = getattr(self, store)
            kept.clear()
            kept.update({name: t.clone() for name, t in state[store].items()})

    def rejoin_state(self, shared: dict[str, Any], own: dict[str, Any]) -> dict[str, Any]:
        return {**super().rejoin_state(shared, own), **{store: own[store] for store in self.stores}}
