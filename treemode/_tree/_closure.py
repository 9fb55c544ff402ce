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
packages (JAX, Flax, optax, ...), which cannot close over the user's modules
(`treemode._tree._closure_code` says which code is library code).
The walk stops `MAX_DEPTH` functions deep and visits each function once, so
recursive helpers terminate.

treemode's own wrappers are seen through, to what their calls read: a wrapper
object (``treemode.jit``, ``vmap``, ``scan``, ... : its class defines
``_closure_reads``) gives its function and the arguments bound to it
(``jit_partial``), and the functions treemode's transforms return
(``treemode.grad``, ``remat``, ...: defined in ``treemode/_transforms``, or JAX's
traceback boundary around them) give their closure cells. So ``jit(grad(f))``
lifts what ``f`` reads, as ``jit(f)`` does; a wrapper and the function it wraps
count as one function for `MAX_DEPTH`. A wrapper's function and bound arguments
are fixed when it is made (as a ``functools.partial``'s are), so reading them is
not recorded for the cache below; what the function reads is.

Plain holders are entered too (`_Walk.search`): lists, tuples and dicts, the
attributes of instances of the user's own classes (the ``self`` of a bound
method of a plain object), and default arguments. A holder can change in place
without any read recorded below changing, so a search that finds an NNX object
in one is not cached: such a function is searched again on every call.

This runs on every transform call, so it is cached per function object: the
answer is kept with every read the search made (each global's value, each
closure cell's content, each function's code object) and reused while all of
them still give the same objects, checked mostly in bulk at C level. Cells and
globals can be rebound between calls, which simply makes the next call search
again. The cache never keeps the function alive (everything that could lead
back to it is held weakly, and the entry goes when the function does), never
keeps a cell's array or tracer (only their type matters), and stops making
entries for a code object whose functions are made per call. What each code
object reads (its free variables, global names, and whether it is library
code) is computed once per code object, and what each value is (NNX object,
followable function, or neither) once per type (`treemode._tree._closure_code`);
the reads and their check are `treemode._tree._closure_reads`.
"""

from __future__ import annotations

import functools
import types
import weakref
from collections.abc import Callable
from typing import Any

from flax import nnx

from .. import _caches
from .._accel._border import attribute_read, cell_read, closure_reads
from .._errors import PUBLIC_MODULE
from ._closure_code import (
    FUNCTION,
    HOLDER,
    IGNORE,
    STATE,
    TREEMODE,
    WRAPPER,
    Plan,
    classify,
    code_plan,
    global_values,
    globals_read,
    kinds,
)
from ._closure_reads import EMPTY, IGNORED, Reads, cell_value, hold, reads_hold_python
from ._leaves import is_variable_or_graph_node


class ClosureWarning(UserWarning):
    """A module the function reaches through its closure is not lifted: it sits
    beyond the closure search's limits (see docs/concepts.md#closures-are-lifted).
    Its values are constants of the compiled code; pass it as an argument."""

    __module__ = PUBLIC_MODULE  # shown as treemode.ClosureWarning


MAX_DEPTH = 4  # function hops followed from the transformed function
MAX_HOLDER_ITEMS = 256  # bigger lists, dicts and attribute dicts are not searched
MAX_HOLDER_ENTRIES = 4096  # entries of holders looked at by one search, in all


def wrapper_reads(wrapper: Any) -> dict[str, Any] | None:
    """What a call of treemode's wrapper object ``wrapper`` reads besides its arguments:
    ``{"fn": function, ...}``, a tuple for bound arguments, any other value a function
    (``None``: not seen through). See the module docstring."""
    return wrapper._closure_reads()


def closure_objects(fn: Callable[..., Any], transform: str = "jit") -> list[tuple[str, Any]]:
    """``(name, object)`` for each NNX object or Variable bound to ``fn``.

    Includes the ones bound to the helper functions ``fn`` reaches through its
    closure cells and globals (see the module docstring). The answer is cached
    per ``fn`` together with everything the search read; a later call reuses it
    only if every one of those reads still gives the same object.
    """
    key = id(fn)
    snapshot = _snapshots.get(key)
    if snapshot is not None and snapshot.ref() is fn and snapshot.still_valid():
        if not snapshot.found:
            return []
        found = [(name, holder()) for name, holder in snapshot.found]
        if None not in [obj for _, obj in found]:
            return found
    code = getattr(fn, "__code__", None)
    plan = code_plan(code) if code is not None else None
    if plan is not None and plan.snapshots >= _MAX_SNAPSHOTS:
        # made per call, or its reads change on every call: search without caching
        walk = _Walk(None, None)
        if type(fn) is types.FunctionType:
            walk.visit_function(fn, plan, 0)
        else:
            walk.visit(fn, 0)
        return _answer(walk, transform)
    try:
        ref = _Ref(fn, _forget)
    except TypeError:  # not weakly referenceable: no cache
        walk = _Walk(None, None)
        walk.visit(fn, 0)
        return _answer(walk, transform)
    ref.key = key
    walk = _Walk(fn, ref)
    walk.visit(fn, 0)
    if walk.volatile or walk.cut:  # held in a list, dict, object or default: search every call
        _snapshots.pop(key, None)
        return _answer(walk, transform)
    if plan is not None:
        plan.snapshots += 1
    if len(_snapshots) >= 4096:
        _snapshots.clear()  # functions made per call: bound the cache
    _snapshots[key] = _Snapshot(ref, walk)
    return walk.found


def _answer(walk: _Walk, transform: str) -> list[tuple[str, Any]]:
    # What the limits left out (`walk.cut`) is reported once per trace, with every
    # other route the search does not take (`treemode._pipeline._unlifted`).
    del transform
    return walk.found


def closure_snapshot(fn: Callable[..., Any]) -> Any:
    """The cache entry behind the last `closure_objects` answer for ``fn``.

    ``None`` when that answer was not cached (functions made per call, or not
    weakly referenceable).
    """
    snapshot = _snapshots.get(id(fn))
    if snapshot is None or snapshot.ref() is not fn:
        return None
    return snapshot


class _Ref(weakref.ref):
    """A weak reference to a function that knows its cache key."""

    __slots__ = ("key",)
    key: int


def _forget(ref: _Ref) -> None:
    if _snapshots is not None:  # None while the interpreter shuts down
        _snapshots.pop(ref.key, None)


class _Walk:
    """One search: what it found, what it visited, and (to cache) every read it made.

    The reads are kept for a `_Snapshot`, which must never keep the searched
    function alive (it is the cache key): everything that could lead back to it
    (the functions visited, what their cells hold, what was found) is held
    weakly; only module globals' values are held strongly.
    """

    __slots__ = (
        "found",
        "cut",
        "seen",
        "volatile",
        "budget",
        "top",
        "top_ref",
        "dicts",
        "names",
        "values",
        "functions",
        "codes",
        "cells",
        "attrs",
    )

    def __init__(self, top: Any, top_ref: Any) -> None:
        self.found: list[tuple[str, Any]] = []
        self.cut: list[str] = []  # holders with NNX objects that the limits left out
        self.seen: set[int] = set()
        self.volatile = False  # found an NNX object in a holder: do not cache
        self.budget = MAX_HOLDER_ENTRIES  # entries of holders still to look at
        self.top_ref = top_ref  # None: do not record the reads
        if top_ref is None:
            return
        self.top = top
        self.dicts: list[dict[str, Any]] = []
        self.names: list[str] = []
        self.values: list[Any] = []
        self.functions: list[Any] = []  # holders
        self.codes: list[types.CodeType] = []
        self.cells: list[tuple[Any, tuple[Any, ...]]] = []  # (function holder, contents)
        self.attrs: list[tuple[Any, str, Any]] = []

    def hold(self, obj: Any) -> Any:
        return self.top_ref if obj is self.top else hold(obj)

    def add(self, name: str, obj: Any, depth: int = 0) -> None:
        if id(obj) not in self.seen:
            self.seen.add(id(obj))
            self.found.append((name, obj))
            self.module_wrappers(name, obj, depth)

    def module_wrappers(self, name: str, module: Any, depth: int) -> None:
        """The treemode wrappers a module found keeps in its own attributes
        (``self.step = treemode.jit(...)``): seen through, as the function may call
        them. Each attribute read is recorded (a module's attributes can be set)."""
        if isinstance(module, nnx.Variable) or depth >= MAX_DEPTH:
            return
        attrs = getattr(module, "__dict__", None)
        if not isinstance(attrs, dict):
            return
        for key, value in list(attrs.items()):
            kind = kinds.get(type(value))
            if kind is None:
                kind = classify(type(value))
            if kind != TREEMODE or id(value) in self.seen:
                continue
            if self.top_ref is not None:
                self.attrs.append(attribute_read(module, key, value))
            self.seen.add(id(value))
            self.visit_wrapper(value, depth + 1, f"{name}.{key}")

    def visit(self, f: Any, depth: int, name: str = "") -> None:
        if depth > MAX_DEPTH:
            return
        if isinstance(f, functools.partial):
            for i, a in enumerate(f.args):
                if is_variable_or_graph_node(a):
                    self.add(f"partial.args[{i}]", a)
            for k, a in f.keywords.items():
                if is_variable_or_graph_node(a):
                    self.add(f"partial.keywords[{k!r}]", a)
            self.visit(f.func, depth + 1)
            return
        if isinstance(f, types.MethodType):
            if is_variable_or_graph_node(f.__self__):
                self.add("self", f.__self__, depth)
            else:
                self.search("self", f.__self__, depth + 1)
            self.visit(f.__func__, depth + 1)
            return
        if is_variable_or_graph_node(f):
            self.add(type(f).__name__, f, depth)
            call = getattr(type(f), "__call__", None)  # noqa: B004 - the method itself
            if self.top_ref is not None:
                self.attrs.append(attribute_read(type(f), "__call__", call))
            if call is not None:
                self.visit(call, depth + 1)
            return
        kind = kinds.get(type(f))
        if kind is None:
            kind = classify(type(f))
        if kind == TREEMODE:
            self.visit_wrapper(f, depth, name)
            return
        code = getattr(f, "__code__", None)
        if code is not None:
            self.visit_function(f, code_plan(code), depth)

    def visit_wrapper(self, wrapper: Any, depth: int, name: str) -> None:
        """A treemode wrapper object: what its calls read, at the depth of the
        function it wraps (the wrapper is no hop of its own)."""
        reads = wrapper_reads(wrapper)
        if reads is None:
            return
        name = name or getattr(wrapper, "__name__", None) or type(wrapper).__name__
        for what, value in reads.items():
            if type(value) is not tuple:  # the function (custom_vjp: and its rules)
                self.visit(value, depth, name)
                continue
            for i, a in enumerate(value):  # the bound arguments
                if is_variable_or_graph_node(a):
                    self.add(f"{name}.{what}[{i}]", a)
                else:
                    self.search(f"{name}.{what}[{i}]", a, depth + 1)

    def visit_function(self, f: Any, plan: Plan, depth: int) -> None:
        """The closure cells and the globals of a function (anything with ``__code__``)."""
        known_kinds = kinds
        keep_reads = self.top_ref is not None
        if keep_reads:
            self.functions.append(self.hold(f))
            self.codes.append(plan.code)
        cells = getattr(f, "__closure__", None)
        # A function a transform returned is no hop of its own: what its cells hold
        # is looked at as if it were where the function is.
        cell_depth = depth - 1 if plan.see_through else depth
        if cells:
            contents: list[Any] = []
            for name, cell in zip(plan.freevars, cells, strict=False):
                obj = cell_value(cell)
                if obj is EMPTY:
                    contents.append(EMPTY)
                    continue
                kind = known_kinds.get(type(obj))
                if kind is None:
                    kind = classify(type(obj))
                if kind == IGNORE:
                    contents.append(IGNORED)
                    continue
                if keep_reads:
                    contents.append(self.hold(obj))
                self.consider(name, obj, kind, cell_depth)
            if keep_reads:
                self.cells.append(cell_read(self.hold(f), tuple(contents)))
        defaults = getattr(f, "__defaults__", None)
        if defaults:
            names = plan.code.co_varnames[: plan.code.co_argcount][-len(defaults) :]
            for name, obj in zip(names, defaults, strict=False):
                self.search(f"default {name}", obj, depth, default=True)
        kwdefaults = getattr(f, "__kwdefaults__", None)
        if kwdefaults:
            for name, obj in kwdefaults.items():
                self.search(f"default {name}", obj, depth, default=True)
        module_globals = getattr(f, "__globals__", None) if plan.global_names else None
        if module_globals:
            names = plan.global_names
            values = global_values(plan, module_globals)
            if keep_reads:
                if plan.aliased:
                    self.dicts.extend(globals_read(plan, module_globals))
                else:
                    self.dicts.extend([module_globals] * len(names))
                self.names.extend(names)
                self.values.extend(values)
            for name, obj in zip(names, values, strict=True):
                if obj is None:
                    continue
                kind = known_kinds.get(type(obj))
                if kind is None:
                    kind = classify(type(obj))
                if kind != IGNORE:
                    self.consider(name, obj, kind, depth)

    def consider(self, name: str, obj: Any, kind: int, depth: int) -> None:
        """A value in a cell or a global: an NNX object to lift, or a helper to follow."""
        if kind == STATE:
            self.add(name, obj, depth)
            return
        if depth >= MAX_DEPTH or id(obj) in self.seen:
            return
        if kind == HOLDER:
            self.search(name, obj, depth + 1)
            return
        if kind == FUNCTION:
            plan = code_plan(obj.__code__)
            if plan.user_code or plan.see_through:
                self.seen.add(id(obj))  # a function is visited once: recursion terminates
                self.visit_function(obj, plan, depth + 1)
            return
        self.seen.add(id(obj))
        self.visit(obj, depth + 1, name)

    def search(self, name: str, obj: Any, depth: int, *, default: bool = False) -> None:
        """NNX objects inside a plain holder: a list, tuple or dict, a default argument,
        or an instance of a class of the user's own code (its attributes).

        Such holders can change in place (``models[0] = other``, ``self.model =
        other``) without any read of the snapshot changing, so a search that
        finds an NNX object in one is *volatile*: not cached, done again on
        every call. Holders bigger than `MAX_HOLDER_ITEMS` are not entered.
        """
        kind = kinds.get(type(obj))
        if kind is None:
            kind = classify(type(obj))
        if kind == STATE:
            self.volatile = True
            self.add(name, obj, depth)
            return
        if kind == FUNCTION or kind == WRAPPER or kind == TREEMODE:
            if not default:
                self.consider(name, obj, kind, depth)
            return
        if kind != HOLDER or id(obj) in self.seen:
            return
        self.seen.add(id(obj))
        if isinstance(obj, (dict, list, tuple)):
            size = len(obj)
            if not size and not isinstance(obj, tuple):
                # An empty list or dict, a registry filled later: a module added to
                # it changes no read of the snapshot, so it is searched every call.
                self.volatile = True
        else:
            attrs = getattr(obj, "__dict__", None)
            if not isinstance(attrs, dict):
                return
            size = len(attrs)
        self.budget -= size
        if depth > MAX_DEPTH or size > MAX_HOLDER_ITEMS or self.budget < 0:
            if _holds_nnx_object(obj):
                self.cut.append(name)
            return
        if isinstance(obj, dict):
            children = [(f"{name}[{k!r}]", v) for k, v in list(obj.items())]
        elif isinstance(obj, (list, tuple)):
            children = [(f"{name}[{i}]", v) for i, v in enumerate(list(obj))]
        else:
            children = [(f"{name}.{k}", v) for k, v in list(obj.__dict__.items())]
        for child_name, child in children:
            self.search(child_name, child, depth + 1)


def holder_values(holder: Any) -> list[Any] | tuple[Any, ...] | None:
    """The entries of a plain holder the search enters: a dict's values, a list's or
    tuple's items, an object's attribute values (``None`` for one without ``__dict__``)."""
    if isinstance(holder, dict):
        return list(holder.values())
    if isinstance(holder, (list, tuple)):
        return holder
    attrs = getattr(holder, "__dict__", None)
    return list(attrs.values()) if isinstance(attrs, dict) else None


def _holds_nnx_object(holder: Any) -> bool:
    """Whether an NNX object is among the first or last `MAX_HOLDER_ITEMS` entries
    of a holder the search does not enter (checked for `ClosureWarning` only)."""
    values = holder_values(holder) or ()
    n = MAX_HOLDER_ITEMS
    sample = values if len(values) <= 2 * n else [*values[:n], *values[-n:]]
    for v in sample:
        kind = kinds.get(type(v))
        if kind is None:
            kind = classify(type(v))
        if kind == STATE:
            return True
    return False


class _Snapshot:
    """One function's answer and every read it depends on, checked in bulk.

    `reads_hold_python` checks ``reads`` (the executor of the fast-path record
    checks the same groups in C): the global reads in one C-level pass
    (``dict.get`` over all the ``(globals, name)`` pairs, compared with ``is``);
    the functions' code objects, closure cells and Module classes one by one.
    """

    __slots__ = ("ref", "found", "reads")

    def __init__(self, ref: Any, walk: _Walk):
        self.ref = ref
        self.found = [(name, walk.hold(obj)) for name, obj in walk.found]
        self.reads: Reads = closure_reads(
            tuple(walk.dicts),
            tuple(walk.names),
            tuple(walk.values),
            tuple(walk.functions),
            tuple(walk.codes),
            tuple(walk.cells),
            tuple(walk.attrs),
        )

    def still_valid(self) -> bool:
        return reads_hold_python(self.reads)


_snapshots: dict[int, _Snapshot] = {}
_caches.register(_snapshots.clear)
# After this many cache entries for one code object, its functions are made per
# call (a lambda in a loop) or their reads change on every call: the entry would
# never be hit, so it is no longer made.
_MAX_SNAPSHOTS = 16
