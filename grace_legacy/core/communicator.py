"""The communicator interface: move a payload between ranks and turn it into the gradient."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from grace_legacy.core.backend import Backend, Pending

if TYPE_CHECKING:
    from grace_legacy.core.compressor import Compressor, Payload


class Communicator(ABC):
    """Moves payloads between ranks and turns them into the aggregated gradient."""

    #: False for communicators that sum payloads and so cannot carry indices, signs or codes.
    carries_non_additive: ClassVar[bool] = True
    #: The label byte accounting files this communicator's traffic under.
    route: ClassVar[str]
    #: Whether the bundle may send this communicator's tensors in fused buckets instead.
    fusable: ClassVar[bool] = False
    #: Whether it compresses the tensor itself (shard by shard): the bundle then hands it the
    #: compensated gradient as a one-part payload, with the compressor to use.
    compresses: ClassVar[bool] = False

    @abstractmethod
    def start(self, payload: Payload, ctx: Any, name: str, compressor: Compressor, backend: Backend,
              average: bool, on_final_payload: Callable[..., None] | None = None) -> Pending:
        """Launch the collectives for one tensor without waiting for them. ``on_final_payload(payload,
        ctx)`` is called with the last round's *local* payload once it exists (at once for one round)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
