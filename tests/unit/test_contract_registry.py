"""The test registry covers the library: every public compressor, memory and schedule of
``grace_legacy`` has its place in ``tests/registry.py``, so the tests that cover all of them
(contract, fuzzing, reference cases under horovodrun, state) cannot silently skip one."""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import grace_legacy
from grace_legacy import Compressor, Memory, Schedule, TopK
from tests.registry import ENTRIES, ENTRY_OF, FAMILIES, MEMORIES, SCHEDULES, zoo_cases


def public_classes(base: type, names: Iterable[str] = grace_legacy.__all__, namespace: object = grace_legacy) -> set:
    """The concrete (instantiable) subclasses of ``base`` among ``namespace``'s public names."""
    found = set()
    for name in names:
        obj = getattr(namespace, name)
        if isinstance(obj, type) and issubclass(obj, base) and not inspect.isabstract(obj):
            found.add(obj)
    return found


def unregistered_compressors(names: Iterable[str] = grace_legacy.__all__,
                             namespace: object = grace_legacy) -> list[str]:
    """The public compressors (schedules aside) that have no registry entry."""
    compressors = {c for c in public_classes(Compressor, names, namespace) if not issubclass(c, Schedule)}
    return sorted(c.__name__ for c in compressors if c not in ENTRY_OF)


def test_every_public_compressor_has_a_registry_entry():
    missing = unregistered_compressors()
    assert not missing, f"public compressors without an Entry in tests/registry.py: {missing}"


def test_a_missing_compressor_is_named():
    class Unregistered(TopK):
        pass

    class Namespace:
        pass

    namespace = Namespace()
    namespace.TopK, namespace.Unregistered = TopK, Unregistered
    assert unregistered_compressors(["TopK", "Unregistered"], namespace) == ["Unregistered"]


def test_every_public_memory_is_registered():
    registered = {type(make()) for make in MEMORIES.values()}
    missing = sorted(m.__name__ for m in public_classes(Memory) - registered)
    assert not missing, f"public memories missing from tests/registry.py MEMORIES: {missing}"


def test_every_public_schedule_is_registered():
    registered = {type(make().compressor) for _, make in SCHEDULES}
    missing = sorted(s.__name__ for s in public_classes(Schedule) - registered)
    assert not missing, f"public schedules missing from tests/registry.py SCHEDULES: {missing}"


def test_entries_are_unique_and_their_cases_named_once():
    assert len(ENTRY_OF) == len(ENTRIES)
    labels = [case.label for case in zoo_cases()]
    assert len(labels) == len(set(labels))
    assert all(zoo_cases(family) for family in FAMILIES)
