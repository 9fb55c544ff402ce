"""The reads a closure search records, and the check that they still hold.

The closure search (`treemode._tree._closure`) caches its answer per function
together with every read it made: each global's value, each function's code
object, each closure cell's content, each attribute it read. This module holds
what those reads are made of and checks them: how an object is held without
being kept alive (`hold`: a weak reference, or a `Strong` 1-tuple for an
object that cannot be weakly referenced), what a cell's content is recorded as
(`cell_value`, `EMPTY`, `IGNORED`), and `reads_hold_python`, the Python twin of
the compiled closure-read check of the executor of the fast-path record
(`read_check_args` gives that check what it compares cells with).
"""

from __future__ import annotations

import operator
import types
import weakref
from typing import Any

from ._closure_code import IGNORE, kinds


class Strong(tuple[Any]):
    """A holder for an object that cannot be weakly referenced (a Variable).

    A 1-tuple, so the compiled code reads the object without calling Python;
    called like a weak reference, it gives the object.
    """

    __slots__ = ()

    def __new__(cls, obj: Any) -> Strong:
        return super().__new__(cls, (obj,))

    def __call__(self) -> Any:
        return self[0]


def hold(obj: Any) -> Any:
    """A weak reference to ``obj``, or a `Strong` holder where it has none."""
    try:
        return weakref.ref(obj)
    except TypeError:
        return Strong(obj)


# Placeholders for cell contents in a snapshot.
EMPTY = object()  # an empty cell: what `cell_value` gives for it
IGNORED = object()  # a cell holding a value of an ignored type (not kept alive)


def cell_value(cell: Any) -> Any:
    """A closure cell's contents, or `EMPTY` for an empty cell."""
    try:
        return cell.cell_contents
    except ValueError:
        return EMPTY


# Every read a closure search made: (globals dicts, names, values) read with
# ``dict.get``, (function holders, code objects), (function holder, cell contents)
# pairs and (owner, attribute, value) triples.
Reads = tuple[
    tuple[dict[str, Any], ...],
    tuple[str, ...],
    tuple[Any, ...],
    tuple[Any, ...],
    tuple[types.CodeType, ...],
    tuple[tuple[Any, tuple[Any, ...]], ...],
    tuple[tuple[Any, str, Any], ...],
]


def reads_hold_python(reads: tuple[tuple[Any, ...], ...]) -> bool:
    """Whether every read of a closure search (a snapshot's ``reads``) still holds.

    The twin of the closure-read check the executor of the fast-path record makes
    in C (tests/test_twins.py binds them through the executor). The pipeline
    calls this one in either mode: a compiled copy saved about 0.6 µs of a
    25 µs pipeline call (docs/performance.md#what-each-compiled-piece-saves).
    """
    dicts, names, values, functions, codes, cells, attrs = reads
    if names and not all(map(operator.is_, map(dict.get, dicts, names), values)):
        return False
    if functions:
        for holder, code in zip(functions, codes, strict=True):
            if getattr(holder(), "__code__", None) is not code:  # changed, or died
                return False
    for holder, contents in cells:
        f = holder()
        if f is None:
            return False
        for cell, value in zip(f.__closure__, contents, strict=True):
            current = cell_value(cell)
            if value is IGNORED:
                if current is EMPTY or kinds.get(type(current)) != IGNORE:
                    return False
            elif value is EMPTY:
                if current is not EMPTY:
                    return False
            elif value() is not current:
                return False
    for owner, name, value in attrs:
        if getattr(owner, name, None) is not value:
            return False
    return True


def read_check_args() -> tuple[dict[type, int], int, object, object]:
    """What the executor's closure-read check compares cells with.

    ``(kinds, ignore, empty, ignored)``.
    """
    return kinds, IGNORE, EMPTY, IGNORED
