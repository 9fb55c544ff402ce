"""Find the NNX objects a function reaches through its closure.

A transform lifts the Variables of these objects into explicit inputs: their
current values are passed to JAX on every call (so reads are never stale) and
their changes are written back (so writes are never lost). The objects looked at
are the ones Python binds to the function itself: closure cells, the ``self`` of
a bound method, the arguments of a ``functools.partial``, module-level globals
the function names, and the function object when it is itself a Module.

Helper functions are followed too: a plain Python function (or a bound method,
or a ``functools.partial``) found in a closure cell or a global the function
names is searched the same way, recursively, so a module that a helper closes
over and mutates is lifted as well. Only the user's own code is followed: not
builtins, and not functions defined in the standard library or in installed
packages (JAX, Flax, optax, ...), which cannot close over the user's modules.
The walk stops `MAX_DEPTH` functions deep and visits each function once, so
recursive helpers terminate.

This runs on every transform call, so the per-call work is a few dictionary
lookups per closure cell and global name: what each code object reads (its free
variables and global names, and whether it is library code) is computed once
per code object, and what each value is (NNX object, followable function, or
neither) once per type. The values themselves are read on every call, since
cells and globals can be rebound between calls.
"""

from __future__ import annotations

import dis
import functools
import os
import site
import sysconfig
import types
from collections.abc import Callable
from typing import Any

from flax import nnx

from ._leaves import is_graph_node, is_variable

MAX_DEPTH = 4  # function hops followed from the transformed function

# What a value in a cell or global is, decided once per type.
_IGNORE, _STATE, _FUNCTION, _WRAPPER = range(4)
_kinds: dict[type, int] = {}


def _classify(cls: type) -> int:
    if issubclass(cls, (nnx.Pytree, nnx.Variable)):  # as is_graph_node / is_variable
        kind = _STATE
    elif issubclass(cls, types.FunctionType):
        kind = _FUNCTION
    elif issubclass(cls, (types.MethodType, functools.partial)):
        kind = _WRAPPER
    else:
        kind = _IGNORE
    _kinds[cls] = kind
    return kind


def _library_prefixes() -> tuple[str, ...]:
    """Directories whose code is never followed: the standard library, installed
    packages and treemode itself."""
    paths = {os.path.dirname(os.path.abspath(__file__))}
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        path = sysconfig.get_paths().get(key)
        if path:
            paths.add(path)
    try:
        paths.update(site.getsitepackages())
    except AttributeError:  # pragma: no cover - some embedded interpreters
        pass
    if site.ENABLE_USER_SITE and site.USER_SITE:
        paths.add(site.USER_SITE)
    prefixes = {os.path.join(os.path.abspath(p), "") for p in paths}
    prefixes |= {os.path.join(os.path.realpath(p), "") for p in paths}
    return (*sorted(prefixes), "<frozen ")


_LIBRARY = _library_prefixes()


class _Plan:
    """What a code object reads: computed once per code object."""

    __slots__ = ("code", "freevars", "global_names", "user_code")

    def __init__(self, code: types.CodeType):
        self.code = code  # kept so that the id used as key stays this object's
        self.freevars = code.co_freevars
        self.global_names = _global_names(code)
        self.user_code = not code.co_filename.startswith(_LIBRARY)


_plans: dict[int, _Plan] = {}


def _plan(code: types.CodeType) -> _Plan:
    plan = _plans.get(id(code))
    if plan is None or plan.code is not code:
        if len(_plans) >= 4096:
            _plans.clear()  # lambdas made per call: bound the cache
        plan = _plans[id(code)] = _Plan(code)
    return plan


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
    """``(name, object)`` for each NNX object or Variable bound to ``fn``.

    Includes the ones bound to the helper functions ``fn`` reaches through its
    closure cells and globals (see the module docstring).
    """
    found: list[tuple[str, Any]] = []
    _visit(fn, 0, found, set())
    return found


def _add(name: str, obj: Any, found: list[tuple[str, Any]], seen: set[int]) -> None:
    if id(obj) not in seen:
        seen.add(id(obj))
        found.append((name, obj))


def _visit(f: Any, depth: int, found: list[tuple[str, Any]], seen: set[int]) -> None:
    if depth > MAX_DEPTH:
        return
    if isinstance(f, functools.partial):
        for i, a in enumerate(f.args):
            if _holds_state(a):
                _add(f"partial.args[{i}]", a, found, seen)
        for k, a in f.keywords.items():
            if _holds_state(a):
                _add(f"partial.keywords[{k!r}]", a, found, seen)
        _visit(f.func, depth + 1, found, seen)
        return
    if isinstance(f, types.MethodType):
        if _holds_state(f.__self__):
            _add("self", f.__self__, found, seen)
        _visit(f.__func__, depth + 1, found, seen)
        return
    if _holds_state(f):
        _add(type(f).__name__, f, found, seen)
        call = getattr(type(f), "__call__", None)  # noqa: B004 - the method itself
        if call is not None:
            _visit(call, depth + 1, found, seen)
        return
    code = getattr(f, "__code__", None)
    if code is not None:
        _visit_function(f, _plan(code), depth, found, seen)


def _visit_function(
    f: Any, plan: _Plan, depth: int, found: list[tuple[str, Any]], seen: set[int]
) -> None:
    """The closure cells and the globals of a function (anything with ``__code__``)."""
    kinds = _kinds
    cells = getattr(f, "__closure__", None)
    if cells:
        for name, cell in zip(plan.freevars, cells, strict=False):
            try:
                obj = cell.cell_contents
            except ValueError:  # empty cell
                continue
            if kinds.get(type(obj)) != _IGNORE:
                _consider(name, obj, depth, found, seen)
    if plan.global_names:
        module_globals = getattr(f, "__globals__", None)
        if module_globals:
            get = module_globals.get
            for name in plan.global_names:
                obj = get(name)
                if obj is not None and kinds.get(type(obj)) != _IGNORE:
                    _consider(name, obj, depth, found, seen)


def _consider(
    name: str, obj: Any, depth: int, found: list[tuple[str, Any]], seen: set[int]
) -> None:
    """A value in a cell or a global: an NNX object to lift, or a helper to follow."""
    cls = type(obj)
    kind = _kinds.get(cls)
    if kind is None:
        kind = _classify(cls)
    if kind == _IGNORE:
        return
    if kind == _STATE:
        if id(obj) not in seen:
            seen.add(id(obj))
            found.append((name, obj))
        return
    if depth >= MAX_DEPTH or id(obj) in seen:
        return
    if kind == _FUNCTION:
        plan = _plan(obj.__code__)
        if plan.user_code:
            seen.add(id(obj))  # a function is visited once: recursion terminates
            _visit_function(obj, plan, depth + 1, found, seen)
        return
    seen.add(id(obj))
    _visit(obj, depth + 1, found, seen)
