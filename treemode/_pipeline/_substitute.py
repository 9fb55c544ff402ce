"""Give a traced function its closure objects rebuilt, without touching the caller's.

The closure search (``_closure``) finds the NNX objects a function reaches through
its closure cells, globals, the ``self`` of a bound method, ``functools.partial``
arguments, default arguments and plain holders (lists, tuples, dicts, instances
of the user's classes). Inside a trace, the pure function (``_pure``) rebuilds
each of them from its structure key, with new Variables holding the traced
values. `Substitution.callable` then makes a version of the function that reaches the
rebuilt objects instead of the originals, by the same routes: a new function
object with new closure cells and new defaults; a new bound method or
``functools.partial``; copies of the holders on the way; for one of treemode's
own wrappers (``treemode.jit(f)`` held in a global, say), the same wrapper of
the copy of its function, made for this trace as if the function made it
inline. Only what leads to a rebuilt object is copied; everything else is
shared.

A copied function keeps its module's real globals dict, so globals behave as
under eager execution: what a helper sets the function reads, what the
function sets a helper (or ``sys.modules[__name__]``) reads, at once. The
globals that lead to a rebuilt object are loaded under aliases instead: the
copy's code (and the code nested in it) names them ``<treemode lifted NAME
ID>``, defined in the builtins namespace for the duration of the trace
(`Substitution.finish` removes them). Where a name cannot be renamed alone (the
code also uses it as an attribute or import name), that function runs over a
copy of its globals dict instead, and what it assigns there is copied back.

Nothing the caller can see is written while the function runs: another thread
reading or writing the module during the trace sees its own values, never a
tracer. What the function itself assigns while it is traced to an attribute of
a plain object it was reached through is copied back to the original when the
function returns (`Substitution.finish`), as if it had run on the originals; an
attribute or global that held a lifted module keeps the original module.
"""

from __future__ import annotations

import builtins
import copy
import dis
import functools
import types
from collections.abc import Callable
from typing import Any

from .._tree._closure import MAX_DEPTH, MAX_HOLDER_ITEMS, holder_values, wrapper_reads
from .._tree._closure_code import (
    ALIAS_PREFIX,
    global_values,
    holder_kind,
    plan_of,
    user_function_kinds,
)
from .._tree._closure_reads import EMPTY, cell_value

_FUNCTION, _WRAPPER, _HOLDER, _TREEMODE = user_function_kinds()
_MISSING = object()
_BUILTINS = builtins.__dict__
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "STORE_GLOBAL", "DELETE_GLOBAL", "LOAD_NAME"})


def _aliased_code(code: types.CodeType, aliases: dict[str, str]) -> types.CodeType | None:
    """``code`` (and the code objects nested in it) with each global named in
    ``aliases`` renamed to its alias; ``None`` where a name is also used as an
    attribute, import or local name in the same code object (renaming would
    change those too)."""
    consts = []
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            nested = _aliased_code(const, aliases)
            if nested is None:
                return None
            const = nested
        consts.append(const)
    renamed = aliases.keys() & set(code.co_names)
    if renamed:
        for instruction in dis.get_instructions(code):
            if instruction.argval in renamed and instruction.opname not in _GLOBAL_OPS:
                if instruction.opcode in dis.hasname:
                    return None
        co_names = tuple(aliases[n] if n in renamed else n for n in code.co_names)
        return code.replace(co_names=co_names, co_consts=tuple(consts))
    return code.replace(co_consts=tuple(consts))


class Substitution:
    """One function's copy reaching ``replacements`` (``id(original) -> rebuilt``)."""

    def __init__(self, replacements: dict[int, Any]):
        self.replacements = replacements
        self.used: set[int] = set()  # ids of the originals a route led to
        self._reaches: dict[int, bool] = {}
        self._followed: set[int] = set()
        self._built: dict[int, Any] = {}
        self._keep: list[Any] = []  # the originals looked at, so their ids stay theirs
        # (alias, globals, name) still to define; the aliases defined in builtins
        self._pending: list[tuple[str, dict[str, Any], str]] = []
        self._defined: list[str] = []
        # the rebuilt modules given copies of their wrappers: (attributes, name, original)
        self._patched: set[int] = set()
        self._restore: list[tuple[dict[str, Any], str, Any]] = []
        # (original dict, copy, the names whose value was substituted, the original's
        # items when the copy was made): what the function assigns goes back.
        self._dicts: list[
            tuple[dict[str, Any], dict[str, Any], frozenset[str], dict[str, Any]]
        ] = []

    # -- does a value lead to a replaced object? ----------------------------------

    def analyze(self, root: Any) -> bool:
        """Find every value reachable from ``root`` (by the closure search's routes)
        that leads to a replaced object. Returns whether ``root`` does."""
        parents: dict[int, list[int]] = {}
        seen: set[int] = set()
        # A function found directly (the root, or the function of a bound method or
        # partial) is entered even where it is library code, as the search does.
        stack = [(root, 0, True)]
        while stack:
            obj, depth, direct = stack.pop()
            key = id(obj)
            if key in seen or key in self.replacements:
                continue
            seen.add(key)
            kind = holder_kind(obj)
            if kind is None or depth > MAX_DEPTH + 1:
                continue
            self._keep.append(obj)
            # treemode's wrappers are no hop of their own, as for the search
            hop = 1
            if kind == _FUNCTION:
                plan = plan_of(obj)
                if plan.see_through:
                    hop = 0
                elif not (direct or plan.user_code):
                    continue
            elif kind == _TREEMODE:
                hop = 0
            self._followed.add(key)
            for child in self._children(obj, kind):
                parents.setdefault(id(child), []).append(key)
                stack.append((child, depth + hop, kind in (_WRAPPER, _TREEMODE)))
        frontier = [k for k in self.replacements if k in parents]
        while frontier:
            key = frontier.pop()
            for parent in parents.get(key, ()):
                if not self._reaches.get(parent, False):
                    self._reaches[parent] = True
                    frontier.append(parent)
        return id(root) in self.replacements or self._reaches.get(id(root), False)

    def reaches(self, obj: Any) -> bool:
        key = id(obj)
        return key in self.replacements or self._reaches.get(key, False)

    def _children(self, obj: Any, kind: int) -> list[Any]:
        if kind == _FUNCTION:
            plan = plan_of(obj)
            children = [cell_value(c) for c in obj.__closure__ or ()]
            children += list(obj.__defaults__ or ())
            children += list((obj.__kwdefaults__ or {}).values())
            module_globals = obj.__globals__
            children += global_values(plan, module_globals)
            return children
        if kind == _WRAPPER:
            if isinstance(obj, functools.partial):
                return [obj.func, *obj.args, *obj.keywords.values()]
            return [obj.__func__, obj.__self__]
        if kind == _TREEMODE:
            reads = wrapper_reads(obj)
            return [] if reads is None else list(reads.values())
        values = holder_values(obj)
        return [] if values is None or len(values) > MAX_HOLDER_ITEMS else list(values)

    def _module_wrappers(self, original: Any, rebuilt: Any) -> None:
        """Give a rebuilt module the copies of the treemode wrappers the original keeps
        in its attributes that reach a rebuilt object (the search sees through them:
        `_closure._Walk.module_wrappers`); `finish` puts the originals back, before
        the module's structure is checked."""
        if id(rebuilt) in self._patched:
            return
        self._patched.add(id(rebuilt))
        attrs = getattr(original, "__dict__", None)
        rebuilt_attrs = getattr(rebuilt, "__dict__", None)
        if not isinstance(attrs, dict) or not isinstance(rebuilt_attrs, dict):
            return
        for name, value in list(attrs.items()):
            if holder_kind(value) != _TREEMODE or rebuilt_attrs.get(name) is not value:
                continue
            if self.analyze(value):
                rebuilt_attrs[name] = self.value(value)
                self._restore.append((rebuilt_attrs, name, value))

    # -- copies -------------------------------------------------------------------

    def callable(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """A version of ``fn`` that reaches the rebuilt objects instead of the originals
        (``fn`` itself where it reaches none): a function, bound method, partial, or
        an NNX module called as a function."""
        if id(fn) in self.replacements:  # a module called as the function
            module = self.replacements[id(fn)]
            self.used.add(id(fn))
            self._module_wrappers(fn, module)
            call = type(fn).__call__
            if self.analyze(call):
                return functools.partial(self.value(call), module)
            return module
        if self.analyze(fn):
            return self.value(fn)
        return fn

    def value(self, obj: Any) -> Any:
        """``obj``, or a copy of it that reaches the rebuilt objects."""
        key = id(obj)
        replacement = self.replacements.get(key)
        if replacement is not None:
            self.used.add(key)
            self._module_wrappers(obj, replacement)
            return replacement
        built = self._built.get(key, _MISSING)
        if built is not _MISSING:
            return built
        if not self._reaches.get(key, False):
            return obj
        kind = holder_kind(obj)
        if kind == _FUNCTION:
            return self._function(obj)
        if kind == _WRAPPER:
            if isinstance(obj, functools.partial):
                new = functools.partial(
                    self.value(obj.func),
                    *map(self.value, obj.args),
                    **{k: self.value(v) for k, v in obj.keywords.items()},
                )
            else:
                new = types.MethodType(self.value(obj.__func__), self.value(obj.__self__))
            self._built[key] = new
            return new
        if kind == _TREEMODE:
            # The same treemode wrapper of the copies: made per trace, as one made
            # inline in the function would be (`Wrapped._closure_remake`).
            reads = wrapper_reads(obj)
            assert reads is not None  # `analyze` found a route through it
            new = obj._closure_remake({k: self.value(v) for k, v in reads.items()})
            self._built[key] = new
            return new
        return self._holder(obj)

    def _function(self, f: types.FunctionType) -> types.FunctionType:
        plan = plan_of(f)
        module_globals = f.__globals__
        names = [
            n
            for n, v in zip(plan.global_names, global_values(plan, module_globals), strict=True)
            if self.reaches(v)
        ]
        cells = f.__closure__
        if cells and any(self.reaches(cell_value(c)) for c in cells):
            new_cells = tuple(types.CellType() for _ in cells)
        else:
            new_cells = cells
        if names:
            new = self._with_aliased_globals(f, module_globals, names, new_cells)
        else:
            new = types.FunctionType(f.__code__, module_globals, f.__name__, None, new_cells)
        self._built[id(f)] = new  # before the contents: a recursive helper reaches itself
        new.__qualname__ = f.__qualname__
        new.__module__ = f.__module__
        new.__dict__ = f.__dict__
        new.__annotations__ = f.__annotations__
        if f.__defaults__:
            new.__defaults__ = tuple(map(self.value, f.__defaults__))
        if f.__kwdefaults__:
            new.__kwdefaults__ = {k: self.value(v) for k, v in f.__kwdefaults__.items()}
        self._define_aliases()
        if new_cells is not cells:
            assert cells is not None and new_cells is not None
            for old, cell in zip(cells, new_cells, strict=True):
                contents = cell_value(old)
                if contents is not EMPTY:
                    cell.cell_contents = self.value(contents)
        return new

    def _with_aliased_globals(
        self,
        f: types.FunctionType,
        module_globals: dict[str, Any],
        names: list[str],
        cells: tuple[Any, ...] | None,
    ) -> types.FunctionType:
        """A copy of ``f`` over its *real* globals whose code loads each substituted
        global under an alias that only the builtins define, for this trace.

        The function runs with its module's own globals dict, so every global it
        or anything else reads or writes during the trace is the real one (as
        under eager execution); only the names that lead to a lifted module are
        looked up elsewhere. A name that cannot be aliased in the code (used
        there by another kind of instruction as well) falls back to a copy of
        the globals dict for this function (`_copied_globals`).
        """
        aliases = {name: self._alias(name) for name in names}
        code = _aliased_code(f.__code__, aliases)
        if code is None:
            copied = self._copied_globals(module_globals, names)
            return types.FunctionType(f.__code__, copied, f.__name__, None, cells)
        for name, alias in aliases.items():
            self._pending.append((alias, module_globals, name))
        return types.FunctionType(code, module_globals, f.__name__, None, cells)

    def _alias(self, name: str) -> str:
        """The builtin name a substituted global is loaded by during this trace: not
        an identifier (no clash with a real name), unique to this substitution (two
        threads tracing the same function each see their own)."""
        return f"{ALIAS_PREFIX}{name} {id(self):x}>"

    def _define_aliases(self) -> None:
        # Defined in the builtins dict itself, so that functions the copy makes while
        # it runs (comprehensions, nested functions) resolve them too; removed by
        # `finish`. They hold traced modules: the names are unique and not
        # identifiers, so no other code reads them.
        pending, self._pending = self._pending, []
        namespace = builtins.__dict__
        for alias, module_globals, name in pending:
            value = _BUILTINS[name] if name.startswith(ALIAS_PREFIX) else module_globals[name]
            namespace[alias] = self.value(value)
            self._defined.append(alias)

    def _copied_globals(self, module_globals: dict[str, Any], names: list[str]) -> dict[str, Any]:
        copied = dict(module_globals)
        for name in names:
            value = _BUILTINS[name] if name.startswith(ALIAS_PREFIX) else module_globals[name]
            copied[name] = self.value(value)
        self._dicts.append((module_globals, copied, frozenset(names), dict(copied)))
        return copied

    def _holder(self, obj: Any) -> Any:
        key = id(obj)
        cls = type(obj)
        if cls is tuple:
            new = tuple(map(self.value, obj))
            self._built[key] = new
            return new
        if cls is list:
            new_list: list[Any] = []
            self._built[key] = new_list
            new_list.extend(map(self.value, obj))
            return new_list
        if cls is dict:
            new_dict: dict[Any, Any] = {}
            self._built[key] = new_dict
            new_dict.update({k: self.value(v) for k, v in obj.items()})
            names = frozenset(k for k, v in obj.items() if self.reaches(v))
            self._dicts.append((obj, new_dict, names, dict(obj)))
            return new_dict
        if isinstance(obj, (list, dict)):  # a subclass: a copy with the items replaced
            new_items = copy.copy(obj)
            self._built[key] = new_items
            for k, v in list(obj.items()) if isinstance(obj, dict) else enumerate(obj):
                if self.reaches(v):
                    new_items[k] = self.value(v)
            return new_items
        if isinstance(obj, tuple):
            return obj  # a subclass of tuple: left as it is (`_check_reached` tells)
        attrs = obj.__dict__
        try:
            new = object.__new__(type(obj))
        except TypeError:
            return obj  # a class object.__new__ cannot make: left as it is
        self._built[key] = new
        names = frozenset(k for k, v in attrs.items() if self.reaches(v))
        new_attrs = {k: (self.value(v) if k in names else v) for k, v in attrs.items()}
        new.__dict__.update(new_attrs)
        self._dicts.append((attrs, new.__dict__, names, dict(attrs)))
        return new

    def finish(self) -> None:
        """Copy what the function assigned to (or deleted from) the copied globals and
        attributes back; what another thread wrote to the originals meanwhile stays.
        Removes the aliases of the substituted globals from the builtins."""
        namespace = builtins.__dict__
        for alias in self._defined:
            namespace.pop(alias, None)
        self._defined.clear()
        for attrs, name, value in self._restore:
            attrs[name] = value
        self._restore.clear()
        for original, copied, substituted, before in self._dicts:
            for name, value in list(copied.items()):
                if name not in substituted and before.get(name, _MISSING) is not value:
                    original[name] = value
            for name in before:
                if name not in copied and name not in substituted:
                    original.pop(name, None)


__all__ = ["Substitution"]
