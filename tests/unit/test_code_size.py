"""One job per module, measured: no class over MAX_CLASS_LINES and no function over MAX_FUNCTION_LINES in the
places issue 17 names (the driver, the agent process agents/node, the engine, the controller).

A unit's size is its source lines from its ``def``/``class`` line (decorators left out) to its last line,
docstring and comments included. Run ``python tests/unit/test_code_size.py`` to print every unit over a limit.

PENDING lists the units still over a limit whose split another part of issue 17 owns; each entry must still
be over its limit (so the list shrinks as they are split, and nothing new joins it unnoticed).
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_CLASS_LINES = 250
MAX_FUNCTION_LINES = 80
PLACES = ("testbed/driver.py", "agents/node", "agents/engine.py", "controller")

# (path, qualified name): who splits it. Remove an entry once its unit is within the limits.
PENDING: dict[tuple[str, str], str] = {}


def _files() -> list[pathlib.Path]:
    out = []
    for place in PLACES:
        p = ROOT / place
        out.extend(sorted(p.rglob("*.py")) if p.is_dir() else [p])
    return out


def _units(tree: ast.AST, prefix: str = ""):
    """(qualified name, kind, lines) of every class and function, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            name = f"{prefix}{node.name}"
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            yield name, kind, node.end_lineno - node.lineno + 1
            yield from _units(node, name + ".")
        else:
            yield from _units(node, prefix)


def oversized() -> dict[tuple[str, str], str]:
    """(path, qualified name) -> what is over, for every unit over its limit in PLACES."""
    out = {}
    for path in _files():
        rel = path.relative_to(ROOT).as_posix()
        for name, kind, lines in _units(ast.parse(path.read_text(encoding="utf-8"), rel)):
            limit = MAX_CLASS_LINES if kind == "class" else MAX_FUNCTION_LINES
            if lines > limit:
                out[(rel, name)] = f"{kind} of {lines} lines (limit {limit})"
    return out


def test_places_exist():
    for place in PLACES:
        assert (ROOT / place).exists(), f"{place} moved: update PLACES"


def test_no_class_or_function_over_the_limits():
    over = {k: v for k, v in oversized().items() if k not in PENDING}
    shown = "; ".join(f"{p}:{n}: {w}" for (p, n), w in sorted(over.items()))
    assert not over, f"split these (one job per unit): {shown}"


def test_pending_entries_are_still_over():
    over = oversized()
    done = sorted(f"{p}:{n}" for p, n in PENDING if (p, n) not in over)
    assert not done, f"within the limits now: remove from PENDING: {done}"


def test_the_measure_counts_nested_units():
    tree = ast.parse("class A:\n    def f(self):\n        def g():\n            pass\n        return g\n")
    assert list(_units(tree)) == [("A", "class", 5), ("A.f", "function", 4), ("A.f.g", "function", 2)]


if __name__ == "__main__":
    for (p, n), what in sorted(oversized().items()):
        print(f"{p}:{n}: {what}" + (f"  [pending: {PENDING[(p, n)]}]" if (p, n) in PENDING else ""))
