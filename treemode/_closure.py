"""Find the NNX objects a function reaches through its closure.

A transform lifts the Variables of these objects into explicit inputs: their
current values are passed to JAX on every call (so reads are never stale) and
their changes are written back (so writes are never lost). The objects looked at
are the ones Python binds to the function itself: closure cells, the ``self`` of
a bound method, the arguments of a ``functools.partial``, module-level globals
the function names, and the function object when it is itself a Module.
"""

from __future__ import annotations

import dis
import functools
import types
from collections.abc import Callable
from typing import Any

from ._leaves import is_graph_node, is_variable


@functools.lru_cache(maxsize=1024)
def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names ``code`` (and the functions/comprehensions nested in it) load as globals.

    ``co_names`` alone also lists attribute names, so the bytecode is read once.
    """
    names: dict[str, None] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names[instruction.argval] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(_global_names(const)))
    return tuple(names)


def _holds_state(x: Any) -> bool:
    return is_graph_node(x) or is_variable(x)


def closure_objects(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """``(name, object)`` for each NNX object or Variable bound to ``fn``."""
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def add(name: str, obj: Any) -> None:
        if _holds_state(obj) and id(obj) not in seen:
            seen.add(id(obj))
            found.append((name, obj))

    def visit(f: Any, depth: int) -> None:
        if depth > 4:
            return
        if isinstance(f, functools.partial):
            for i, a in enumerate(f.args):
                add(f"partial.args[{i}]", a)
            for k, a in f.keywords.items():
                add(f"partial.keywords[{k!r}]", a)
            visit(f.func, depth + 1)
            return
        if isinstance(f, types.MethodType):
            add("self", f.__self__)
            visit(f.__func__, depth + 1)
            return
        if _holds_state(f):
            add(type(f).__name__, f)
            call = getattr(type(f), "__call__", None)  # noqa: B004 - the method itself
            if call is not None:
                visit(call, depth + 1)
            return
        code = getattr(f, "__code__", None)
        if code is None:
            return
        cells = getattr(f, "__closure__", None) or ()
        for name, cell in zip(code.co_freevars, cells, strict=False):
            try:
                add(name, cell.cell_contents)
            except ValueError:  # empty cell
                pass
        module_globals = getattr(f, "__globals__", None)
        if module_globals:
            for name in _global_names(code):
                obj = module_globals.get(name)
                if obj is not None:
                    add(name, obj)

    visit(fn, 0)
    return found
