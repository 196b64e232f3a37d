"""The package's shape: data flows one way, and the imports say so.

Read from the source with ``ast`` (every import statement, ``TYPE_CHECKING`` blocks included), so
that an import graph drawn by any tool shows what these tests check: no circle between modules,
no import of grace_legacy deferred into a function, each layer importing only the layers below it,
and ``core/`` holding the interfaces alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "grace_legacy"

#: What each part of the package may import (besides itself): the layers below it.
ALLOWED = {
    "core": set(),
    "runtime": {"core"},
    "memories": {"core", "runtime"},
    "compressors": {"core", "runtime", "memories"},
    "schedules": {"core", "runtime"},
    "communicators": {"core", "runtime", "compressors"},
    "backends": {"core", "runtime"},
    "consistency": {"core", "runtime"},
    "step_guard": {"core"},
    "lifetime": {"core", "runtime", "schedules", "communicators", "step_guard"},
    "grace": {"core", "runtime", "memories", "compressors", "schedules", "communicators", "step_guard", "lifetime"},
    "planner": {"core", "runtime", "schedules", "communicators"},
    "helper": {"core", "runtime", "memories", "compressors", "schedules", "communicators", "grace"},
    "optimizer": {"core", "runtime", "backends", "consistency", "grace"},
    "elastic": {"core", "runtime", "grace", "optimizer"},
    "ddp": {"core", "runtime", "backends", "consistency", "grace"},
    "fsdp": {"core", "runtime", "compressors", "schedules", "communicators", "backends", "consistency", "grace"},
    "lightning": {"core", "runtime", "grace", "ddp"},
    "simulate": {"core", "runtime", "schedules", "grace"},
    "__main__": {"core", "runtime", "schedules", "helper", "planner"},
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts).removesuffix(".__init__")


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(name: str) -> list[tuple[str, ast.stmt]]:
    """Every grace_legacy module that ``name``'s source imports, with the statement."""
    path = MODULES[name]
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found += [(target, node) for target in targets if target in MODULES and target != name]
    return found


def part_of(name: str) -> str:
    return name.split(".")[1] if "." in name else name


def test_no_module_imports_itself_back():
    graph = {name: {target for target, _ in imports_of(name)} for name in MODULES}
    # Depth-first search for a back edge, reporting the circle it closes.
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        path.append(name)
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                circle = path[path.index(target):] + [target]
                pytest.fail("import circle: " + " -> ".join(circle))
            if target not in state:
                visit(target)
        path.pop()
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_no_import_is_deferred_into_a_function():
    deferred = []
    for name, path in MODULES.items():
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(function):
                modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                           else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
                if any(m.startswith("grace_legacy") for m in modules):
                    deferred.append(f"{name}:{node.lineno}")
    assert not deferred, f"imports of grace_legacy inside functions: {deferred}"


@pytest.mark.parametrize("name", [n for n in MODULES if n != "grace_legacy"])
def test_each_layer_imports_only_the_layers_below_it(name):
    part = part_of(name)
    assert part in ALLOWED, f"{name} is in no layer: add {part!r} to ALLOWED (and docs/ARCHITECTURE.md)"
    wrong = sorted({f"{target} (line {node.lineno})" for target, node in imports_of(name)
                    if part_of(target) not in ALLOWED[part] | {part, "grace_legacy"}})
    assert not wrong, f"{name} ({part}) may import {sorted(ALLOWED[part])}, but imports {wrong}"


def test_core_holds_the_interfaces_only():
    # Each an interface, or a record or helper every interface shares; anything else belongs to a
    # layer above (docs/ARCHITECTURE.md).
    modules = sorted(p.stem for p in (PACKAGE / "core").glob("*.py"))
    assert modules == ["__init__", "backend", "communicator", "compressor", "memory", "parameter", "seeds", "state",
                       "traits"]


def test_architecture_names_every_module():
    text = (PACKAGE.parent / "docs" / "ARCHITECTURE.md").read_text()
    named = [path.relative_to(PACKAGE).as_posix() for path in MODULES.values()
             if path.name != "__init__.py" or path.parent == PACKAGE]
    missing = [module for module in named if f"`{module}`" not in text]
    assert not missing, f"docs/ARCHITECTURE.md does not name {missing}"


#: The house's measures (issue "the house, third pass"): a module one can read in a sitting, and a
#: README that is a user's page (history lives in benchmarks/results/).
MODULE_LINES = 450
README_BYTES = 16_000
#: The bundle's pipeline, read in one sitting (what it carries across steps is lifetime.py's).
PIPELINE_LINES = 300


def test_no_module_is_over_the_line_limit():
    long = {str(path.relative_to(PACKAGE)): n for path in PACKAGE.rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MODULE_LINES}
    assert not long, f"modules over {MODULE_LINES} lines: {long}"
    pipeline = len((PACKAGE / "grace.py").read_text().splitlines())
    assert pipeline < PIPELINE_LINES, f"grace.py has {pipeline} lines: keep the pipeline alone there"


def test_the_readme_stays_a_users_page():
    size = len((PACKAGE.parent / "README.md").read_bytes())
    assert size <= README_BYTES, f"README.md is {size} bytes, over {README_BYTES}: move history to benchmarks/results"
