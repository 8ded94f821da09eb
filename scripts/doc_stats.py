"""Docstring and comment shares of the package, and a check that a text-only edit left the code alone.

    python scripts/doc_stats.py                      # shares, whole package and per folder
    python scripts/doc_stats.py --check              # exit 1 unless docstrings <= 15%, comments >= 5%
    python scripts/doc_stats.py --same-code-as HEAD  # exit 1 if any file's code (its AST without
                                                     # docstrings) differs from the same path at HEAD

Docstring lines: the lines of every module, class and function docstring (`ast`). Comment lines:
full-line `#` comments (`tokenize`). Both over all lines of `lightning_mcore_rl/**/*.py`.
"""

from __future__ import annotations

import argparse
import ast
import collections
import io
import pathlib
import subprocess
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "lightning_mcore_rl"
MAX_DOCSTRING_SHARE = 0.15
MIN_COMMENT_SHARE = 0.05
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


_Owner = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef


def _docstrings(tree: ast.AST) -> list[tuple[_Owner, ast.Expr]]:
    """(owner, docstring statement) of every module, class and function docstring in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                found.append((node, first))
    return found


def line_counts(source: str) -> tuple[int, int, int]:
    """(all lines, docstring lines, full-line comment lines) of one file's source."""
    # end_lineno is set on every parsed node (Optional only for hand-built ones)
    docstrings = sum(
        (e.end_lineno or e.lineno) - e.lineno + 1 for _, e in _docstrings(ast.parse(source))
    )
    comments = sum(
        1
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT and tok.line.strip().startswith("#")
    )
    return len(source.splitlines()), docstrings, comments


def code_fingerprint(source: str) -> str:
    """The file's AST with every docstring removed: equal fingerprints mean the same code."""
    tree = ast.parse(source)
    for owner, _ in _docstrings(tree):
        # keep a body non-empty where the docstring was all of it
        owner.body = owner.body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def _shares() -> dict[str, tuple[int, int, int]]:
    per_folder: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
    for path in sorted(PACKAGE.rglob("*.py")):
        counts = line_counts(path.read_text())
        folder = str(path.parent.relative_to(PACKAGE)) if path.parent != PACKAGE else "."
        for key in (folder, "(package)"):
            per_folder[key] = [a + b for a, b in zip(per_folder[key], counts, strict=True)]
    return {k: (v[0], v[1], v[2]) for k, v in per_folder.items()}


def _changed_code(rev: str) -> list[str]:
    changed = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        old = subprocess.run(
            ["git", "-C", str(ROOT), "show", f"{rev}:{rel}"], capture_output=True, text=True
        )
        if old.returncode != 0:
            continue  # new or moved file: nothing to compare with
        if path.exists() and code_fingerprint(old.stdout) != code_fingerprint(path.read_text()):
            changed.append(rel)
    return changed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--check", action="store_true", help="fail unless both shares meet the limits"
    )
    parser.add_argument(
        "--same-code-as",
        metavar="REV",
        help="fail if code (not docstrings/comments) changed since REV",
    )
    args = parser.parse_args()
    if args.same_code_as:
        changed = _changed_code(args.same_code_as)
        for rel in changed:
            print(f"code changed: {rel}")
        return 1 if changed else 0
    shares = _shares()
    for folder, (lines, docs, comments) in sorted(shares.items()):
        print(
            f"{folder:24s} {lines:6d} lines  docstrings {docs / lines:6.1%}  comments {comments / lines:5.1%}"
        )
    lines, docs, comments = shares["(package)"]
    ok = docs / lines <= MAX_DOCSTRING_SHARE and comments / lines >= MIN_COMMENT_SHARE
    if args.check and not ok:
        print(
            f"limits: docstrings <= {MAX_DOCSTRING_SHARE:.0%}, comments >= {MIN_COMMENT_SHARE:.0%}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
