"""The reference cases of every compressor, for the workers that check them (``zoo_worker.py``
under horovodrun). The cases and the rules they are checked against live in the test registry
(:mod:`tests.registry`, :mod:`tests.reference`); this module is how a worker reaches them."""

from __future__ import annotations

from tests.reference import (  # noqa: F401  (re-exported for the workers)
    Case,
    Observation,
    RuleTwin,
    equal_phase,
    first_group,
    majority_vote_rule,
    mean_rule,
    some_payloads_empty,
    sum_rule,
)
from tests.registry import FAMILIES, zoo_cases


def cases(family: str | None = None) -> list[Case]:
    """The registered cases of one family (one of :data:`FAMILIES`), or of all of them."""
    return zoo_cases(family)


__all__ = ["FAMILIES", "Case", "Observation", "RuleTwin", "cases", "equal_phase", "first_group",
           "majority_vote_rule", "mean_rule", "some_payloads_empty", "sum_rule"]
