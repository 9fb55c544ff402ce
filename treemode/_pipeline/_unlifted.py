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
    MAX_DEPTH,
    MAX_HOLDER_ENTRIES,
    MAX_HOLDER_ITEMS,
    ClosureWarning,
    holder_values,
    wrapper_reads,
)
from .._tree._closure_code import ALIAS_PREFIX, global_values, is_user_class, plan_of
from .._tree._closure_reads import cell_value
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


class _Path:
    """How the walk reached an object: what the closure search would make of the route.

    ``depth`` counts the steps the search counts (a helper function, a holder
    level; treemode's wrappers are none), ``why`` is the first step the search
    never takes (``None``: every step is one it takes, so only its limits left
    the object out), ``big`` the first holder bigger than it enters, and
    ``binding`` how the last function holds what follows (a global, a closure
    cell or a default argument).
    """

    __slots__ = ("depth", "holders", "why", "big", "binding")

    def __init__(
        self,
        depth: int = 0,
        holders: int = 0,
        why: str | None = None,
        big: str | None = None,
        binding: str | None = None,
    ):
        self.depth = depth
        self.holders = holders
        self.why = why
        self.big = big
        self.binding = binding

    def step(
        self,
        *,
        hop: int = 0,
        holder: Any = None,
        why: str | None = None,
        binding: str | None = None,
    ) -> _Path:
        """The path one step further: ``hop`` counted steps, into ``holder`` (a list,
        tuple, dict or object the search enters), or by a route it never takes
        (``why``: what that route is and what to do instead)."""
        big = self.big
        if holder is not None and big is None:
            size = len(holder_values(holder) or ())
            if size > MAX_HOLDER_ITEMS:
                big = f"in {_a(type(holder).__name__)} of {size} entries"
        return _Path(
            self.depth + hop,
            self.holders + (holder is not None),
            self.why or why,
            big,
            binding if binding is not None else self.binding,
        )

    def advice(self) -> str:
        """Why the search left the object out, and what to do instead of passing it."""
        if self.why is not None:
            return self.why
        if self.big is not None:
            return (
                f"{self.big} (the search enters holders of up to {MAX_HOLDER_ITEMS}): keep "
                "it in a smaller list, dict or object"
            )
        if self.depth > MAX_DEPTH:
            if not self.holders and self.binding is not None:
                return (
                    f"{self.binding}, {self.depth - 1} helpers deep (the search follows "
                    f"helpers {MAX_DEPTH} deep): read it in a function nearer the "
                    "transformed one"
                )
            return (
                f"{self.depth} steps deep through functions and holders (the search goes "
                f"{MAX_DEPTH} deep): keep it nearer the transformed function"
            )
        return (
            f"beyond the {MAX_HOLDER_ENTRIES:,} holder entries one search looks at: keep it "
            "in smaller holders"
        )


def _binding(kind: str, function: str) -> str:
    """How ``function`` holds what follows: ``kind`` is a global, a closure cell or a
    default argument."""
    return f"{kind} that {function} reads"


def _a(noun: str) -> str:
    return f"an {noun}" if noun[:1].lower() in "aeiou" else f"a {noun}"


def unlifted_objects(
    fn: Callable[..., Any], known: set[int]
) -> tuple[list[tuple[str, Any, str]], bool]:
    """``(route, object, advice)`` for each NNX object ``fn`` reaches whose id is not
    in ``known``, and whether the walk looked at everything (``False``: it stopped
    after `MAX_OBJECTS` objects). ``advice`` says why the closure search did not
    lift it and what to do (`_Path.advice`)."""
    found: list[tuple[str, Any, str]] = []
    seen = set(known)
    name = getattr(fn, "__name__", None) or type(fn).__name__
    stack: list[tuple[str, Any, bool, _Path]] = [(name, fn, True, _Path())]
    if is_variable_or_graph_node(fn):  # a module called as the function
        stack.append((f"{name}.__call__", type(fn).__call__, True, _Path()))
    # The treemode wrappers a known (lifted or passed) module keeps are seen through
    # by the search as well: what they read is walked too.
    for obj in _known_modules(fn, known):
        stack.extend(_wrapper_attributes(type(obj).__name__, obj, _Path()))
    budget = MAX_OBJECTS
    while stack:
        route, obj, direct, path = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        budget -= 1
        if budget < 0:
            return found, False
        if is_variable_or_graph_node(obj):
            if not _made_in_a_trace(obj):
                found.append((route, obj, path.advice()))
            stack.extend(_wrapper_attributes(route, obj, path))
            continue
        stack.extend(_children(route, obj, direct, path))
    return found, True


def _known_modules(fn: Callable[..., Any], known: set[int]) -> list[Any]:
    """The lifted modules among what ``fn`` is bound to directly (its own module, the
    ``self`` of a bound method): the ones whose wrapper attributes the walk enters
    although it does not enter them (they are known)."""
    candidates = [fn, getattr(fn, "__self__", None)]
    return [c for c in candidates if id(c) in known and is_variable_or_graph_node(c)]


def _wrapper_attributes(route: str, module: Any, path: _Path) -> list[tuple[str, Any, bool, _Path]]:
    """The treemode wrappers an NNX module keeps in its own attributes."""
    if isinstance(module, nnx.Variable):
        return []
    attrs = getattr(module, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    return [
        (f"{route}.{k}", v, True, path.step(hop=1))
        for k, v in list(attrs.items())
        if _is_treemode_wrapper(v)
    ]


def _is_treemode_wrapper(obj: Any) -> bool:
    return callable(getattr(type(obj), "_closure_reads", None))


def _made_in_a_trace(obj: Any) -> bool:
    """Whether ``obj`` holds traced values: made (or changed) inside a trace, so not
    a caller's module whose values a compiled program could keep as constants."""
    try:
        leaves = jax.tree_util.tree_leaves(nnx.state(obj))
    except Exception:  # not splittable (a Variable itself, an odd graph node)
        leaves = jax.tree_util.tree_leaves(getattr(obj, "get_raw_value", lambda: obj)())
    return any(isinstance(x, Tracer) for x in leaves)


def _library_wrapper(route: str, wrapper: Any) -> str:
    """Why a function read through a wrapper another library made is not lifted."""
    if isinstance(wrapper, types.FunctionType):
        module = wrapper.__globals__.get("__name__") or ""
    else:
        module = type(wrapper).__module__
    package = module.split(".")[0].removesuffix("lib")  # jaxlib's PjitFunction: jax
    return (
        f"read through {route}, a wrapper from {package or 'a library'} (the search sees "
        "through treemode's own transforms only): use the treemode transform instead "
        "(treemode.jit, treemode.remat, ...)"
    )


def _library_inner(f: types.FunctionType) -> Any:
    """The library function a function treemode sees through (JAX's traceback
    boundary, say) holds in its cells, if it holds no function the walk follows:
    the wrapper is that library's (``jax.checkpoint``'s), not treemode's."""
    inner = None
    for cell in f.__closure__ or ():
        value = cell_value(cell)
        if isinstance(value, types.FunctionType):
            plan = plan_of(value)
            if plan.user_code or plan.see_through:
                return None
            inner = value
    return inner


def _children(
    route: str, obj: Any, direct: bool, path: _Path
) -> list[tuple[str, Any, bool, _Path]]:
    """What the walk enters from ``obj``: ``(route, child, direct, path)``."""
    if isinstance(obj, types.FunctionType):
        plan = plan_of(obj)
        if not (direct or plan.user_code or plan.see_through):
            # Library code cannot close over the user's modules, but a wrapper it
            # made (functools.wraps) holds the user's function.
            wrapped = obj.__dict__.get("__wrapped__")
            if wrapped is None:
                return []
            why = _library_wrapper(route, obj)
            return [(f"{route}.__wrapped__", wrapped, True, path.step(hop=1, why=why))]
        # A function a treemode transform returned is no step of its own.
        hop = 0 if plan.see_through else 1
        fname = obj.__name__
        children = [
            (
                f"{route}.<closure {name}>" if route else name,
                cell_value(cell),
                False,
                path.step(hop=hop, binding=_binding("a closure cell", fname)),
            )
            for name, cell in zip(obj.__code__.co_freevars, obj.__closure__ or (), strict=False)
        ]
        default = path.step(hop=1, binding=_binding("a default argument", fname))
        children += [(f"{route}.<default>", v, False, default) for v in obj.__defaults__ or ()]
        children += [
            (f"{route}.<default {k}>", v, False, default)
            for k, v in (obj.__kwdefaults__ or {}).items()
        ]
        values = global_values(plan, obj.__globals__)
        glob = path.step(hop=1, binding=_binding("a global", fname))
        children += [
            (_user_name(name), value, False, glob)
            for name, value in zip(plan.global_names, values, strict=True)
            if value is not None
        ]
        for k, v in obj.__dict__.items():
            if k == "__wrapped__" and plan.see_through:
                # treemode's wrapper: its cells lead to the function, as for the search
                inner = _library_inner(obj)
                if inner is None:
                    continue
                why = _library_wrapper(route, inner)
            elif k == "__wrapped__" and not plan.user_code:
                why = _library_wrapper(route, obj)
            elif k == "__wrapped__":
                why = None  # the user's own decorator: its cells are followed
            else:
                why = (
                    f"an attribute of the function {route} (the search reads its cells, "
                    "globals and defaults): hold it in a global or a closure cell"
                )
            children.append((f"{route}.{k}", v, True, path.step(hop=1, why=why)))
        return children
    if isinstance(obj, (types.MethodType, functools.partial)):
        step = path.step(hop=1)
        if isinstance(obj, functools.partial):
            return [
                (f"{route}.func", obj.func, True, step),
                *((f"{route}.args[{i}]", a, False, step) for i, a in enumerate(obj.args)),
                *((f"{route}.keywords[{k!r}]", v, False, step) for k, v in obj.keywords.items()),
            ]
        return [(f"{route}.__self__", obj.__self__, False, step), (route, obj.__func__, True, step)]
    if _is_treemode_wrapper(obj):
        reads = wrapper_reads(obj)
        if reads is None:
            why = f"read through {route}, {type(obj)._closure_refusal}"
            return [(f"{route}.fn", obj.fn, True, path.step(why=why))]
        children: list[tuple[str, Any, bool, _Path]] = []
        for what, value in reads.items():  # the function, at the wrapper's place
            if type(value) is tuple:
                children += [
                    (f"{route}.{what}[{i}]", v, False, path.step(hop=1))
                    for i, v in enumerate(value)
                ]
            else:
                children.append((route if what == "fn" else f"{route}.{what}", value, True, path))
        return children
    if isinstance(obj, type):
        if not is_user_class(obj, instances_need_dict=False):
            return []
        why = (
            f"a class attribute of {obj.__name__} (the search reads an instance's "
            "attributes, not its class's): hold it in a global or an instance attribute"
        )
        return [(f"{route}.{k}", v, True, path.step(why=why)) for k, v in list(vars(obj).items())]
    if type(obj) in (dict, list, tuple):
        step = path.step(hop=1, holder=obj)
        if isinstance(obj, dict):
            return [(f"{route}[{k!r}]", v, False, step) for k, v in list(obj.items())]
        return [(f"{route}[{i}]", v, False, step) for i, v in enumerate(list(obj))]
    container = (
        f"in {_a(type(obj).__name__)}, which the search does not enter (it enters lists, "
        "tuples, dicts and your own objects): hold it in one of those"
    )
    if isinstance(obj, dict):
        return [
            (f"{route}[{k!r}]", v, False, path.step(why=container)) for k, v in list(obj.items())
        ]
    if isinstance(obj, (list, tuple, collections.deque)):
        return [
            (f"{route}[{i}]", v, False, path.step(why=container)) for i, v in enumerate(list(obj))
        ]
    if isinstance(obj, (set, frozenset)):
        return [(f"{route}.<item>", v, False, path.step(why=container)) for v in list(obj)]
    if isinstance(obj, types.SimpleNamespace):
        return [
            (f"{route}.{k}", v, False, path.step(why=container)) for k, v in list(vars(obj).items())
        ]
    if isinstance(obj, _LRU_CACHE):
        # Its cached results are not reachable by attribute: ask the collector.
        wrapped = getattr(obj, "__wrapped__", None)
        cached = path.step(
            why=(
                f"a result {route} keeps (functools.lru_cache: the search cannot see what "
                "a call returns): call the getter outside the transformed function"
            )
        )
        return [
            (f"{route}() (lru_cache)" if x is not wrapped else route, x, x is wrapped, cached)
            for x in gc.get_referents(obj)
        ]
    if isinstance(obj, _CONTAINERS):
        return [
            (f"{route}.<{type(obj).__name__}>", x, False, path.step(why=container))
            for x in gc.get_referents(obj)
        ]
    cls = type(obj)
    if not is_user_class(cls, instances_need_dict=False):
        wrapped = getattr(obj, "__wrapped__", None)
        if callable(wrapped):  # a wrapper another library made (jax.jit's, say)
            why = _library_wrapper(route, obj)
            return [(f"{route}.__wrapped__", wrapped, True, path.step(hop=1, why=why))]
        return []
    children: list[tuple[str, Any, bool, _Path]] = [(cls.__name__, cls, True, path)]
    attrs = getattr(obj, "__dict__", None)
    if isinstance(attrs, dict):
        step = path.step(hop=1, holder=obj)
        children += [(f"{route}.{k}", v, False, step) for k, v in list(attrs.items())]
    slots = path.step(
        why=(
            f"a __slots__ attribute of {cls.__name__} (the search reads an object's "
            "__dict__): give the class a __dict__"
        )
    )
    for klass in cls.__mro__:
        names = vars(klass).get("__slots__", ())
        for name in (names,) if isinstance(names, str) else names:
            if name in ("__dict__", "__weakref__"):
                continue
            try:
                value = object.__getattribute__(obj, name)
            except AttributeError:
                continue
            children.append((f"{route}.{name}", value, False, slots))
    return children


def _user_name(name: str) -> str:
    """A global's name as the user wrote it (not the alias of a copy made for a trace)."""
    if name.startswith(ALIAS_PREFIX):
        return name[len(ALIAS_PREFIX) :].rsplit(" ", 1)[0]
    return name


def warn_unlifted(transform: str, fn: Callable[..., Any], known: set[int]) -> None:
    """Warn (`ClosureWarning`) about each NNX object ``fn`` reaches that is not in
    ``known`` (the ids of what was lifted or passed as an argument), each with why
    the search left it out and what to do."""
    found, complete = unlifted_objects(fn, known)
    if found:
        listed = "; ".join(
            f"{route} ({type(obj).__name__}), {advice}" for route, obj, advice in found[:8]
        )
        more = f"; and {len(found) - 8} more" if len(found) > 8 else ""
        warnings.warn(
            f"treemode.{transform}: the function reaches NNX objects the closure search "
            f"does not lift: {listed}{more}. Their values are constants of the compiled "
            "code (a later call does not see their changes) and writing them raises. "
            "Pass them as arguments instead, or do as said for each (see "
            "docs/concepts.md#closures-are-lifted).",
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
