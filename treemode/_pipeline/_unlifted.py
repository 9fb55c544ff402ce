"""Report the NNX objects a traced function reaches but the closure search did not lift.

The closure search (``_closure``) runs on every call, so it is bounded: it
follows closure cells, the globals a function names, defaults, ``self`` and
``functools.partial`` arguments, and enters lists, tuples, dicts and the
``__dict__`` of the user's own objects up to fixed limits. A module reached any
other way (a ``__slots__`` attribute, a class attribute, a helper deeper than
the search goes, a big list, an ``OrderedDict``, a ``SimpleNamespace``, a
``frozenset``, an ``lru_cache``) would be read as a constant of the compiled
code: a later call would see its old values.

So once per trace, where a search cost does not matter, `unlifted_objects` walks
everything the function can reach through the same kind of routes, without the
limits, and through every container the interpreter can enumerate
(``gc.get_referents``); `warn_unlifted` names each NNX object found there that
was neither lifted nor passed as an argument, with the route to it.
"""

from __future__ import annotations

import collections
import functools
import gc
import types
import warnings
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx
from jax.core import Tracer

from .._errors import user_stacklevel
from .._tree._closure import (
    ALIAS_PREFIX,
    ClosureWarning,
    cell_value,
    global_values,
    is_user_class,
    plan_of,
)
from .._tree._leaves import is_variable_or_graph_node

MAX_OBJECTS = 50_000  # objects one walk looks at before it gives up (and says so)

# Containers of the standard library whose contents are entered (besides the
# instances and classes of the user's own code).
_CONTAINERS = (
    list,
    tuple,
    dict,
    set,
    frozenset,
    collections.OrderedDict,
    collections.defaultdict,
    collections.deque,
    collections.ChainMap,
    types.SimpleNamespace,
    types.MappingProxyType,
    types.CellType,
    functools.partial,
    types.MethodType,
    staticmethod,
    classmethod,
    property,
)
_LRU_CACHE = type(functools.lru_cache(maxsize=None)(lambda: None))


def unlifted_objects(fn: Callable[..., Any], known: set[int]) -> tuple[list[tuple[str, Any]], bool]:
    """``(route, object)`` for each NNX object ``fn`` reaches whose id is not in
    ``known``, and whether the walk looked at everything (``False``: it stopped
    after `MAX_OBJECTS` objects)."""
    found: list[tuple[str, Any]] = []
    seen = set(known)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    stack: list[tuple[str, Any, bool]] = [(name, fn, True)]
    if is_variable_or_graph_node(fn):  # a module called as the function
        stack.append((f"{name}.__call__", type(fn).__call__, True))
    budget = MAX_OBJECTS
    while stack:
        route, obj, direct = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        budget -= 1
        if budget < 0:
            return found, False
        if is_variable_or_graph_node(obj):
            if not _made_in_a_trace(obj):
                found.append((route, obj))
            continue
        stack.extend(_children(route, obj, direct))
    return found, True


def _made_in_a_trace(obj: Any) -> bool:
    """Whether ``obj`` holds traced values: made (or changed) inside a trace, so not
    a caller's module whose values a compiled program could keep as constants."""
    try:
        leaves = jax.tree_util.tree_leaves(nnx.state(obj))
    except Exception:  # not splittable (a Variable itself, an odd graph node)
        leaves = jax.tree_util.tree_leaves(getattr(obj, "get_raw_value", lambda: obj)())
    return any(isinstance(x, Tracer) for x in leaves)


def _children(route: str, obj: Any, direct: bool) -> list[tuple[str, Any, bool]]:
    """What the walk enters from ``obj``: ``(route, child, direct)`` triples."""
    if isinstance(obj, types.FunctionType):
        plan = plan_of(obj)
        if not (direct or plan.user_code):
            return []  # library code cannot close over the user's modules
        children = [
            (f"{route}.<closure {name}>" if route else name, cell_value(cell), False)
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False)
        ]
        children += [(f"{route}.<default>", v, False) for v in obj.__defaults__ or ()]
        children += [
            (f"{route}.<default {k}>", v, False) for k, v in (obj.__kwdefaults__ or {}).items()
        ]
        values = global_values(plan, obj.__globals__)
        children += [
            (_user_name(name), value, False)
            for name, value in zip(plan.global_names, values, strict=True)
            if value is not None
        ]
        children += [(f"{route}.{k}", v, True) for k, v in obj.__dict__.items()]
        return children
    if isinstance(obj, (types.MethodType, functools.partial)):
        if isinstance(obj, functools.partial):
            return [
                (f"{route}.func", obj.func, True),
                *((f"{route}.args[{i}]", a, False) for i, a in enumerate(obj.args)),
                *((f"{route}.keywords[{k!r}]", v, False) for k, v in obj.keywords.items()),
            ]
        return [(f"{route}.__self__", obj.__self__, False), (route, obj.__func__, True)]
    if isinstance(obj, type):
        if not is_user_class(obj, instances_need_dict=False):
            return []
        return [(f"{route}.{k}", v, True) for k, v in list(vars(obj).items())]
    if isinstance(obj, dict):
        return [(f"{route}[{k!r}]", v, False) for k, v in list(obj.items())]
    if isinstance(obj, (list, tuple, collections.deque)):
        return [(f"{route}[{i}]", v, False) for i, v in enumerate(list(obj))]
    if isinstance(obj, (set, frozenset)):
        return [(f"{route}.<item>", v, False) for v in list(obj)]
    if isinstance(obj, types.SimpleNamespace):
        return [(f"{route}.{k}", v, False) for k, v in list(vars(obj).items())]
    if isinstance(obj, _LRU_CACHE):
        # Its cached results are not reachable by attribute: ask the collector.
        wrapped = getattr(obj, "__wrapped__", None)
        return [
            (f"{route}() (lru_cache)" if x is not wrapped else route, x, x is wrapped)
            for x in gc.get_referents(obj)
        ]
    if isinstance(obj, _CONTAINERS):
        return [(f"{route}.<{type(obj).__name__}>", x, False) for x in gc.get_referents(obj)]
    cls = type(obj)
    if not is_user_class(cls, instances_need_dict=False):
        return []
    children: list[tuple[str, Any, bool]] = [(cls.__name__, cls, True)]
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        children += [(f"{route}.{k}", v, False) for k, v in list(attrs.items())]
    for klass in cls.__mro__:
        slots = vars(klass).get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                children.append((f"{route}.{name}", object.__getattribute__(obj, name), False))
            except AttributeError:
                continue
    return children


def _user_name(name: str) -> str:
    """A global's name as the user wrote it (not the alias of a copy made for a trace)."""
    if name.startswith(ALIAS_PREFIX):
        return name[len(ALIAS_PREFIX) :].rsplit(" ", 1)[0]
    return name


def warn_unlifted(transform: str, fn: Callable[..., Any], known: set[int]) -> None:
    """Warn (`ClosureWarning`) about each NNX object ``fn`` reaches that is not in
    ``known`` (the ids of what was lifted or passed as an argument)."""
    found, complete = unlifted_objects(fn, known)
    if found:
        listed = ", ".join(f"{route} ({type(obj).__name__})" for route, obj in found[:8])
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        warnings.warn(
            f"treemode.{transform}: the function reaches NNX objects the closure search "
            f"does not lift: {listed}{more}. Their values are constants of the compiled "
            "code (a later call does not see their changes) and writing them raises. "
            "Pass them as arguments instead (or hold them where the search looks: a "
            "closure cell, a global, a list, dict or attribute of your own object; "
            "see docs/concepts.md#closures-are-lifted).",
            ClosureWarning,
            stacklevel=user_stacklevel("jax", "flax"),
        )
    if not complete:
        warnings.warn(
            f"treemode.{transform}: the function's closure holds more than {MAX_OBJECTS} "
            "objects; treemode stopped looking for NNX objects in it after that many. "
            "Any NNX object beyond is a constant of the compiled code: pass modules "
            "as arguments.",
            ClosureWarning,
            stacklevel=user_stacklevel("jax", "flax"),
        )


__all__ = ["MAX_OBJECTS", "unlifted_objects", "warn_unlifted"]
