"""Docstring lines against all lines of a package, per subpackage (issue #32, item 4).

    python scripts/docstring_share.py [grace_legacy] [--files]

Counts, with ``ast``, the lines of module, class and function docstrings, and, with ``tokenize``,
the lines holding a comment (so that text moved from docstrings into comments shows up).
``--files`` lists every file, most docstring lines first.
"""

from __future__ import annotations

import argparse
import ast
import io
import pathlib
import tokenize
from collections import Counter

ORDER = ("core", "runtime", "compressors", "memories", "communicators", "schedules", "backends", "top level")


def docstring_lines(source: str) -> int:
    lines = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                lines += first.end_lineno - first.lineno + 1
    return lines


def comment_lines(source: str) -> int:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return len({token.start[0] for token in tokens if token.type == tokenize.COMMENT})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", nargs="?", default="grace_legacy")
    parser.add_argument("--files", action="store_true", help="list every file")
    args = parser.parse_args()
    root = pathlib.Path(args.package)
    docs, totals, comments, files = Counter(), Counter(), Counter(), []
    for path in sorted(root.rglob("*.py")):
        source = path.read_text()
        relative = path.relative_to(root)
        group = relative.parts[0] if len(relative.parts) > 1 else "top level"
        doc, total = docstring_lines(source), len(source.splitlines())
        docs[group] += doc
        totals[group] += total
        comments[group] += comment_lines(source)
        files.append((doc, total, str(relative)))
    print(f"{'package':15} {'docstring':>9} {'lines':>6} {'share':>6} {'comment':>8}")
    for group in [*ORDER, *sorted(set(totals) - set(ORDER))]:
        if totals[group]:
            print(f"{group:15} {docs[group]:9} {totals[group]:6} {docs[group] / totals[group]:6.1%} "
                  f"{comments[group]:8}")
    doc, total = sum(docs.values()), sum(totals.values())
    print(f"{'all':15} {doc:9} {total:6} {doc / total:6.1%} {sum(comments.values()):8}")
    if args.files:
        for doc, total, name in sorted(files, key=lambda row: -row[0]):
            print(f"{doc:5} {total:5} {doc / max(total, 1):6.1%} {name}")


if __name__ == "__main__":
    main()
