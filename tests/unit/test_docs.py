"""The user's and maintainers' pages name only files that exist: a test moved or a module renamed
leaves no dangling path in the README, docs/ or the benchmark reports."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "benchmarks").rglob("*.md"))]
# A repository path written in backquotes or a link: a known top folder, then a file with a suffix.
PATH = re.compile(r"(?<![\w/.])((?:grace_legacy|tests|benchmarks|examples|scripts|docs)/[\w/.-]*"
                  r"\.(?:py|md|sh|json|png))")

#: Paths a page names on purpose without the file: a pattern, the tutorial's module-to-be, and the
#: device check's report, committed once a GPU machine has run it (docs/DEVICES.md).
NOT_FILES = {"examples/NAME.py", "grace_legacy/compressors/int8linear.py", "benchmarks/results/gpu.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_path_a_page_names_exists(page):
    named = set(PATH.findall(page.read_text()))
    missing = sorted(path for path in named - NOT_FILES if not (REPO / path).exists()
                     and not (page.parent / path).exists())
    assert not missing, f"{page.relative_to(REPO)} names files that do not exist: {missing}"


def test_the_pattern_finds_the_paths_pages_name():
    text = "see `tests/unit/test_docs.py` and [x](benchmarks/results/README.md), not foo/tests/x.py"
    assert PATH.findall(text) == ["tests/unit/test_docs.py", "benchmarks/results/README.md"]


# What a page holds where a measured result is still to be filled in: a word of capitals joined by
# underscores that ends in FIGURES, TABLE or RESULTS, such a word alone on its line, TODO or TBD.
PLACEHOLDER = re.compile(r"\b(?:[A-Z0-9]+_)+(?:FIGURES|TABLE|RESULTS)\b|^(?:FIGURES|TABLE|RESULTS)$|\bTODO\b|\bTBD\b",
                         re.MULTILINE)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_no_page_holds_a_placeholder_for_a_figure(page):
    found = sorted(set(PLACEHOLDER.findall(page.read_text())))
    assert not found, f"{page.relative_to(REPO)} holds placeholders where figures belong: {found}"


def test_the_placeholder_pattern_finds_placeholders_only():
    assert PLACEHOLDER.findall("x\nSWEEP_TABLE\nend. TORCHRUN_FIGURES\nFIGURES\nTBD") == \
        ["SWEEP_TABLE", "TORCHRUN_FIGURES", "FIGURES", "TBD"]
    assert not PLACEHOLDER.findall("the TABLE of FIGURES_X, `GRACE_FAULT_RUNS=24`, a RESULTS-dir")
