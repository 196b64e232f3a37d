"""Which rank of how many a bundle runs as, and which one a loaded state was saved by. A bundle's
per-rank state (residuals, generators) belongs to one rank of one world: a state loaded on another
rank is refused before the first step, and a world that changes under a running bundle is noticed
at the next one (docs/DESIGN.md#elastic-state)."""

from __future__ import annotations

from collections.abc import Sequence


class Placement:
    """A bundle's ``(rank, size)``: :attr:`current` where it runs, :attr:`expected` where a loaded
    state must run (until the first step there)."""

    def __init__(self) -> None:
        self.current: tuple[int, int] | None = None
        self.expected: tuple[int, int] | None = None

    def is_new(self, rank: int, size: int) -> bool:
        """Whether ``(rank, size)`` is not where the bundle runs now; ``ValueError`` where a loaded
        state was saved by another rank or number of ranks."""
        placement = (rank, size)
        if placement == self.current:
            return False
        if self.expected is not None and self.expected != placement:
            saved_rank, saved_size = self.expected
            raise ValueError(
                f"Grace: this rank ({rank} of {size}) loaded the state that rank {saved_rank} of {saved_size} "
                f"saved; residuals and generators belong to one rank, so each rank must load its own "
                f"(compression.load_state_dict(states[hvd.rank()])) on as many ranks as saved them")
        return True

    def enter(self, rank: int, size: int) -> None:
        self.current, self.expected = (rank, size), None

    def leave(self) -> None:
        self.current = self.expected = None

    def saved(self) -> list[int] | None:
        """What a checkpoint records: where the state belongs."""
        placement = self.current or self.expected
        return None if placement is None else list(placement)

    def expect(self, saved: Sequence[int] | None) -> None:
        """A loaded state's :meth:`saved`: the next step must run there."""
        self.current = None
        self.expected = None if saved is None else (int(saved[0]), int(saved[1]))
