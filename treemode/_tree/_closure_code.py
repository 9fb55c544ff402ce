"""What the closure search makes of each value and of each code object.

A value found in a closure cell or a global is of one *kind*, decided once per
type (`classify`): an NNX object to lift, a function to follow, a bound method or
``functools.partial`` to look into, one of treemode's wrapper objects to see
through, a plain holder to search, or something to ignore. A code object is read
once into a `Plan`: its free variables, the global names it loads (`global_names`,
from its bytecode), and whether it is the user's code. Library code (the standard
library, installed packages, treemode itself: `LIBRARY`) is never followed, as it
cannot close over the user's modules; the functions treemode's transforms return
(defined under `TRANSFORMS`) and JAX's traceback boundary around them
(`BOUNDARY_CODES`) are seen through. The search itself is `treemode._tree._closure`.
"""

from __future__ import annotations

import builtins
import dis
import functools
import os
import site
import sys
import sysconfig
import types
from typing import Any

from flax import nnx

from .. import _caches, _compat


def _library_prefixes() -> tuple[str, ...]:
    """Directories whose code is never followed: the standard library, installed
    packages and treemode itself."""
    paths = {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # treemode/
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


LIBRARY = _library_prefixes()
# The functions treemode's transforms return (``treemode.grad``, ``remat``, ...) are
# defined here, and JAX's traceback boundary (``_compat.api_boundary``) wraps them:
# their closure cells hold the user's function, so the search sees through them.
TRANSFORMS = tuple(
    os.path.join(resolve(os.path.dirname(os.path.dirname(__file__))), "_transforms", "")
    for resolve in (os.path.abspath, os.path.realpath)
)


def _boundary_codes() -> frozenset[types.CodeType]:
    """The code objects of the layers `_compat.api_boundary` wraps a function in
    (JAX's boundary, and treemode's filter of chained causes)."""

    def probe() -> None:
        pass

    codes: set[types.CodeType] = set()
    layer: Any = _compat.api_boundary(probe)
    for _ in range(8):  # the layers down to ``probe``, through ``__wrapped__``
        if layer is probe or layer is None:
            break
        code = getattr(layer, "__code__", None)
        if code is not None:
            codes.add(code)
        layer = getattr(layer, "__wrapped__", None)
    return frozenset(codes)


BOUNDARY_CODES = _boundary_codes()


def global_names(code: types.CodeType) -> tuple[str, ...]:
    """Names ``code`` (and the functions/comprehensions nested in it) load as globals.

    ``co_names`` alone also lists attribute names, so the bytecode is read once.
    """
    names: dict[str, None] = {}
    for instruction in dis.get_instructions(code):
        if instruction.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            names[instruction.argval] = None
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(dict.fromkeys(global_names(const)))
    return tuple(names)


# What a value in a cell or global is, decided once per type (`classify`).
# HOLDER: a list, tuple or dict, or an instance of a class of the user's own code,
# searched for NNX objects inside it (see `treemode._tree._closure._Walk.search`).
# TREEMODE: one of treemode's wrapper objects, seen through
# (`treemode._tree._closure.wrapper_reads`).
IGNORE, STATE, FUNCTION, WRAPPER, HOLDER, TREEMODE = range(6)
kinds: dict[type, int] = {}
_caches.register(kinds.clear)


def classify(cls: type) -> int:
    """The kind of the values of type ``cls`` (remembered in `kinds`)."""
    if issubclass(cls, (nnx.Pytree, nnx.Variable)):  # as is_graph_node / is_variable
        kind = STATE
    elif issubclass(cls, types.FunctionType):
        kind = FUNCTION
    elif issubclass(cls, (types.MethodType, functools.partial)):
        kind = WRAPPER
    elif callable(getattr(cls, "_closure_reads", None)):
        kind = TREEMODE
    elif cls in (list, tuple, dict) or _user_class(cls):
        kind = HOLDER
    else:
        kind = IGNORE
    kinds[cls] = kind
    return kind


def _user_class(cls: type) -> bool:
    """A class defined in the user's own code whose instances have attributes."""
    return is_user_class(cls)


def is_user_class(cls: type, *, instances_need_dict: bool = True) -> bool:
    """Whether ``cls`` is defined in the user's own code (not the standard library,
    an installed package or treemode), and, with ``instances_need_dict``, whether
    its instances have a ``__dict__``."""
    if issubclass(cls, (type, types.ModuleType, BaseException)):
        return False
    if instances_need_dict and "__dict__" not in dir(cls):
        return False
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if path is None:
        return cls.__module__ == "__main__"
    return not os.path.abspath(path).startswith(LIBRARY)


def holder_kind(obj: Any) -> int | None:
    """How the closure search goes through ``obj``: ``FUNCTION``, ``WRAPPER``,
    ``HOLDER`` or ``TREEMODE``; ``None`` for anything it does not enter (NNX
    objects included)."""
    kind = kinds.get(type(obj))
    if kind is None:
        kind = classify(type(obj))
    return kind if kind in (FUNCTION, WRAPPER, HOLDER, TREEMODE) else None


def user_function_kinds() -> tuple[int, int, int, int]:
    """The values of ``FUNCTION``, ``WRAPPER``, ``HOLDER`` and ``TREEMODE`` (see
    `holder_kind`)."""
    return FUNCTION, WRAPPER, HOLDER, TREEMODE


class Plan:
    """What a code object reads: computed once per code object."""

    __slots__ = (
        "code",
        "freevars",
        "global_names",
        "aliased",
        "user_code",
        "see_through",
        "snapshots",
    )

    def __init__(self, code: types.CodeType):
        self.code = code  # kept so that the id used as key stays this object's
        self.freevars = code.co_freevars
        self.user_code = not code.co_filename.startswith(LIBRARY)
        # A function a treemode transform returns: only its cells are read (its
        # globals are treemode's), and it is no hop of its own (see
        # `treemode._tree._closure._Walk.visit_function`).
        self.see_through = not self.user_code and (
            code.co_filename.startswith(TRANSFORMS) or code in BOUNDARY_CODES
        )
        self.global_names = () if self.see_through else global_names(code)
        # Names a substituted copy loads from the builtins (`treemode._pipeline._substitute`).
        self.aliased = any(n.startswith(ALIAS_PREFIX) for n in self.global_names)
        self.snapshots = 0  # cache entries made for functions of this code


plans: dict[int, Plan] = {}
_caches.register(plans.clear)

# The prefix of the names under which a function copied for a trace loads the
# globals that lead to a lifted module; they live in the builtins namespace.
ALIAS_PREFIX = "<treemode lifted "
_BUILTINS = builtins.__dict__


def globals_read(plan: Plan, module_globals: dict[str, Any]) -> list[dict[str, Any]]:
    """The namespace each of ``plan.global_names`` is read from: the globals, or the
    builtins for an alias of a copy made for a trace."""
    return [_BUILTINS if n.startswith(ALIAS_PREFIX) else module_globals for n in plan.global_names]


def global_values(plan: Plan, module_globals: dict[str, Any]) -> tuple[Any, ...]:
    """The value of each of ``plan.global_names`` (``None`` where unbound)."""
    if plan.aliased:
        return tuple(map(dict.get, globals_read(plan, module_globals), plan.global_names))
    return tuple(map(module_globals.get, plan.global_names))


def code_plan(code: types.CodeType) -> Plan:
    """What ``code`` reads (cached per code object in `plans`)."""
    plan = plans.get(id(code))
    if plan is None or plan.code is not code:
        if len(plans) >= 4096:
            plans.clear()  # lambdas made per call: bound the cache
        plan = plans[id(code)] = Plan(code)
    return plan


def plan_of(f: Any) -> Plan:
    """What the code of function ``f`` reads (cached per code object)."""
    return code_plan(f.__code__)
