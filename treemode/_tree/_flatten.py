"""One-pass flattening of transform inputs, with Variables as leaves.

Each top-level argument is flattened on its own into an `ArgFlat`: its
treedef (which holds the modules' static attributes), one spec per leaf, the
Variables (kept for write-back and identity checks) and the dynamic arrays that
are passed to JAX. Flattening NNX modules through their pytree callbacks costs
microseconds per module, so an ``ArgFlat`` is cached per argument object and
revalidated on the next call by identity checks on the attribute dicts it walked
through (see `flatten_arg`; the checks are its guard, `treemode._tree._flat_guard`).
The public alias check (`check_no_aliases`) is here too; what it finds and how it
explains it are `treemode._tree._aliases`.
"""

from __future__ import annotations

import functools
import operator
import sys
import weakref
from collections.abc import Callable, Iterable, Sequence
from itertools import chain
from typing import Any, TypeGuard

import jax
from flax.nnx.statelib import State
from jax.core import Tracer
from jax.tree_util import PyTreeDef

from .. import _caches, _compat
from .._accel import _compiled
from .._compat import raw_value_of as _raw_value_of
from ._aliases import alias_error, first_duplicate
from ._flat_guard import Guard
from ._leaves import (
    CONCRETE_ARRAY_TYPES,
    is_array,
    is_graph_node,
    is_python_scalar,
    is_variable,
    is_variable_value_leaf,
)
from ._recursion import CycleFound, find_cycle, recursion_headroom
from ._specs import (
    DYNAMIC,
    Spec,
    StaticLeaf,
    StructureKey,
    VarSpec,
    variable_dynamic,
    variable_spec,
)

# The compiled call-site match's view of a cached flattening (treemode._accel._compiled);
# None where the extension is off.
_Guarded = _compiled.Guarded

Variable = Any  # nnx.Variable; kept loose for speed-critical annotations


class ArgFlat:
    """One flattened top-level argument.

    Attributes:
        treedef: structure with Variables as leaves.
        specs: one spec per leaf.
        leaves: the leaves themselves (Variables, arrays, static values).
        variables: the Variables, in leaf order.
        var_dynamic_counts: per Variable, how many dynamic leaves its value has.
        dynamic: the traced arrays, in leaf order (a Variable's value leaves in
            place of the Variable); empty in a cached flattening, which keeps no
            call's arrays (each call gets a copy, `_copy_for_call`).
        key: hashable structural key (treedef and specs).
    """

    __slots__ = (
        "treedef",
        "specs",
        "leaves",
        "variables",
        "var_dynamic_counts",
        "dynamic",
        "key",
        "_guard",
        "_ref",
        "variable_ids",
        "has_aliases",
        "origin",
        "writable_in",
        "_variable_specs",
        "values_only",
        "_fast",
        "__weakref__",
    )

    def __init__(
        self,
        treedef: PyTreeDef,  # pyright: ignore[reportInvalidTypeForm]
        specs: tuple[Spec, ...],
        leaves: list[Any],
    ):
        self.treedef = treedef
        self.specs = specs
        self.leaves = leaves
        self.variables: list[Any] = []
        self.var_dynamic_counts: list[int] = []
        self.dynamic: list[Any] = []
        for spec, leaf in zip(specs, leaves, strict=True):
            if type(spec) is VarSpec:
                self.variables.append(leaf)
                values = variable_dynamic(leaf, spec)
                self.var_dynamic_counts.append(len(values))
                self.dynamic.extend(values)
            elif spec is DYNAMIC:
                self.dynamic.append(leaf)
        self.key = StructureKey(treedef, specs)
        # Whether ``dynamic`` is exactly one array per Variable (the common case,
        # where refreshing it is one read per Variable).
        self.values_only = (
            self.var_dynamic_counts.count(1) == len(self.variables) == len(self.dynamic)
        )
        self.variable_ids = frozenset(map(id, self.variables))
        self.has_aliases = len(self.variable_ids) != len(self.variables)
        self._guard: Guard | None = None
        self._ref: weakref.ref[Any] | None = None
        # A copy made by `_refresh` points to its cached flattening (``None`` otherwise);
        # which remembers the trace its Variables may be written in.
        self.origin: ArgFlat | None = None
        self.writable_in: Any = None
        self._variable_specs: tuple[VarSpec, ...] | None = None
        self._fast: Any = None  # a ``_guard.Guarded`` (see `_fast_state`)

    def leaf_dynamic_counts(self) -> list[int]:
        """Per leaf, how many dynamic arrays it contributes."""
        counts = []
        var_counts = iter(self.var_dynamic_counts)
        for spec in self.specs:
            if type(spec) is VarSpec:
                counts.append(next(var_counts))
            else:
                counts.append(1 if spec is DYNAMIC else 0)
        return counts


# Immutable containers that need no guard: their children are walked instead.
_IMMUTABLE_NODES: tuple[type, ...] = (tuple, type(None))


def _flatten_uncached(arg: Any, is_dynamic: Callable[[Any], bool]) -> tuple[ArgFlat, bool]:
    containers: list[Any] = []
    seen: set[int] = set()
    revisited = False
    cacheable = True
    has_equinox = False

    def is_leaf(x: Any) -> bool:
        nonlocal cacheable, revisited, has_equinox
        if is_variable(x):
            return True
        if is_graph_node(x) or isinstance(x, (dict, list)):
            if id(x) in seen:
                # Shared, or a cycle: stop here (an exception raised inside JAX's
                # flattening would corrupt the interpreter) and check below.
                revisited = True
                return True
            seen.add(id(x))
            containers.append(x)
        elif isinstance(x, State):
            _add_state(x, containers)
        elif not isinstance(x, _IMMUTABLE_NODES):
            if not has_equinox and type(x) not in CONCRETE_ARRAY_TYPES:
                has_equinox = _is_equinox_module(x)
            if not _is_frozen_node(x):
                # A mutable pytree node we cannot guard: never reuse this flattening.
                cacheable = cacheable and _is_plain_leaf(x)
        return False

    with recursion_headroom():
        leaves, treedef = jax.tree_util.tree_flatten(arg, is_leaf=is_leaf)
        if revisited:
            if find_cycle(arg) is not None:
                raise CycleFound("reference cycle")
            # Only shared objects (no cycle): flatten them in full.
            containers.clear()
            leaves, treedef = jax.tree_util.tree_flatten(arg, is_leaf=_no_cut(containers))
    if revisited:
        has_equinox = _contains_equinox_module(arg)
    in_equinox = _in_equinox_module(arg) if has_equinox else None
    specs: list[Spec] = []
    for j, leaf in enumerate(leaves):
        if is_variable(leaf):
            specs.append(variable_spec(leaf)[0])
        elif is_dynamic(leaf) and not (in_equinox and in_equinox[j] and is_python_scalar(leaf)):
            specs.append(DYNAMIC)
        else:
            specs.append(StaticLeaf(leaf))
    flat = ArgFlat(treedef, tuple(specs), leaves)
    if cacheable and all(s.value_def is None for s in specs if type(s) is VarSpec):
        flat._guard = Guard(containers, flat.variables, arg)
    else:
        cacheable = False  # pytree-valued Variables are re-flattened every call
    return flat, cacheable


def _no_cut(containers: list[Any]) -> Callable[[Any], bool]:
    def is_leaf(x: Any) -> bool:
        if is_variable(x):
            return True
        if is_graph_node(x) or isinstance(x, (dict, list)):
            containers.append(x)
        elif isinstance(x, State):
            _add_state(x, containers)
        return False

    return is_leaf


def _add_state(state: State, containers: list[Any]) -> None:
    """Guard an ``nnx.State`` (e.g. an optimizer's ``opt_state``).

    A State keeps its entries in a plain ``_mapping`` dict, nested States as
    nested plain dicts, none of which JAX visits as nodes: guard them all.
    """
    containers.append(state)
    stack = [state.raw_mapping]
    while stack:
        mapping = stack.pop()
        containers.append(mapping)
        stack.extend(v for v in mapping.values() if type(v) is dict)


def _is_frozen_node(x: Any) -> bool:
    # Equinox modules and frozen dataclasses cannot be mutated after construction.
    params = getattr(type(x), "__dataclass_params__", None)
    return params is not None and params.frozen


def _is_equinox_module(x: Any) -> bool:
    eqx = sys.modules.get("equinox")
    return eqx is not None and isinstance(x, eqx.Module)


def _contains_equinox_module(tree: Any) -> bool:
    found = False

    def is_leaf(x: Any) -> bool:
        nonlocal found
        found = found or _is_equinox_module(x)
        return is_variable(x)

    jax.tree_util.tree_leaves(tree, is_leaf=is_leaf)
    return found


def _in_equinox_module(tree: Any) -> list[bool]:
    """Per leaf (Variables as leaves), whether it sits inside an Equinox module.

    Python numbers there are static, as ``eqx.filter_jit`` makes every non-array
    field of a module static; elsewhere they are traced, as in ``jax.jit``.
    """
    inside: list[bool] = []

    def walk(node: Any, within: bool) -> None:
        if is_variable(node):
            inside.append(within)
            return
        within = within or _is_equinox_module(node)
        children, treedef = jax.tree_util.tree_flatten(node, is_leaf=lambda x: x is not node)
        if jax.tree_util.treedef_is_leaf(treedef) and len(children) == 1 and children[0] is node:
            inside.append(within)
            return
        for child in children:
            walk(child, within)

    walk(tree, False)
    return inside


def _is_plain_leaf(x: Any) -> bool:
    return jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))


_cache: dict[int, ArgFlat] = {}
_caches.register(_cache.clear)
_ARRAY_FLAT = ArgFlat(jax.tree_util.tree_structure(0), (DYNAMIC,), [None])
ARRAY_KEY = _ARRAY_FLAT.key  # the structure key of every bare array argument


def _array_flat(arg: Any) -> ArgFlat:
    """The flattening of a bare array argument (shares one structure key)."""
    flat = ArgFlat.__new__(ArgFlat)
    flat.treedef = _ARRAY_FLAT.treedef
    flat.specs = _ARRAY_FLAT.specs
    flat.key = _ARRAY_FLAT.key
    flat.leaves = flat.dynamic = [arg]
    flat.variables = flat.var_dynamic_counts = []
    flat.variable_ids = _ARRAY_FLAT.variable_ids
    flat.has_aliases = False
    flat._guard = None
    flat._ref = None
    flat.origin = None
    flat.writable_in = None
    flat._variable_specs = ()
    flat.values_only = False
    flat._fast = None
    return flat


def variable_specs(flat: ArgFlat) -> tuple[VarSpec, ...]:
    """The specs of ``flat``'s Variables, computed once per cached flattening."""
    cached = flat.origin or flat
    specs = cached._variable_specs
    if specs is None:
        specs = cached._variable_specs = tuple(s for s in cached.specs if type(s) is VarSpec)
    return specs


def _evict(key: int, cache: dict[int, ArgFlat], ref: weakref.ref[Any]) -> None:
    # ``cache`` is bound at creation so the callback works during interpreter exit.
    cached = cache.get(key)
    if cached is not None and cached._ref is ref:
        cache.pop(key, None)  # another thread may have removed it meanwhile


def flatten_arg(arg: Any, is_dynamic: Callable[[Any], bool]) -> ArgFlat:
    """Flatten one top-level argument, reusing the previous flattening if valid.

    The cache is keyed by the argument object and validated by checking, with
    identity comparisons only, that every dict/list/NNX object walked last time
    still holds the same attribute names and values, and that every Variable
    still has the same type, metadata and value structure.
    """
    key = id(arg)
    cached = _cache.get(key)
    if cached is not None and cached._ref is not None and cached._ref() is arg:
        if still_flattens(cached, arg):
            fresh = _refresh(cached)
            if fresh is not None:
                return fresh
        _cache.pop(key, None)  # not ``del``: another thread may have removed it
    if is_dynamic(arg) and not is_variable(arg):
        return _array_flat(arg)
    flat, cacheable = _flatten_uncached(arg, is_dynamic)
    # Never cache a flattening that holds tracers (an argument built inside an
    # outer jax.jit/scan trace): the cache would keep them alive past the trace.
    if cacheable and flat.variables and not any(map(_is_tracer, flat.dynamic)):
        try:
            ref = weakref.ref(arg, functools.partial(_evict, key, _cache))
        except TypeError:
            return flat
        flat._ref = ref
        flat._fast = _fast_state(flat)
        _cache[key] = flat
        # The call gets a copy: the cached flattening keeps no array of this call
        # (a written Variable's first value would stay alive as long as the module).
        fresh = _copy_for_call(flat, flat.dynamic)
        flat.dynamic = []
        return fresh
    return flat


def _fast_state(cached: ArgFlat) -> Any:
    """What the compiled call-site match reads of a cached flattening: a ``_guard.Guarded``.

    For a cached flattening whose dynamic arrays are exactly its Variables' values and
    whose guard is compiled; ``None`` otherwise (the match asks `still_flattens`
    and `current_dynamic` instead, and no fast-path record is made).
    """
    guard = cached._guard
    if _Guarded is None or cached._ref is None or guard is None or guard.compiled_state is None:
        return None
    if not cached.values_only:
        return None
    return _Guarded(cached._ref, guard.compiled_state, tuple(cached.variables), weakref.ref(cached))


def _is_tracer(x: Any) -> bool:
    return isinstance(x, Tracer)


def still_flattens(cached: ArgFlat | None, obj: Any) -> TypeGuard[ArgFlat]:
    """Whether ``cached`` (``None`` once dropped) is still ``obj``'s flattening."""
    if cached is None or cached._ref is None or cached._ref() is not obj:
        return False
    guard = cached._guard
    return guard is not None and guard.holds(cached.variables, obj)


def variables_of(flats: Sequence[ArgFlat]) -> list[Any]:
    """The Variables of ``flats``, in order (a new list)."""
    if len(flats) == 1:
        return list(flats[0].variables)
    return list(chain.from_iterable(map(_variables_of, flats)))


_variables_of = operator.attrgetter("variables")


def _refresh(cached: ArgFlat) -> ArgFlat | None:
    """A copy of ``cached`` with the Variables' current values (``None``: a value's
    structure changed, see `current_dynamic`)."""
    dynamic = current_dynamic(cached)
    if dynamic is None:
        return None
    return _copy_for_call(cached, dynamic)


def _copy_for_call(cached: ArgFlat, dynamic: list[Any]) -> ArgFlat:
    """A call's flattening: ``cached``'s structure with this call's arrays."""
    fresh = ArgFlat.__new__(ArgFlat)
    fresh.treedef = cached.treedef
    fresh.specs = cached.specs
    fresh.leaves = cached.leaves
    fresh.variables = cached.variables
    fresh.var_dynamic_counts = cached.var_dynamic_counts
    fresh.key = cached.key
    fresh._guard = cached._guard
    fresh.variable_ids = cached.variable_ids
    fresh.has_aliases = cached.has_aliases
    fresh._ref = None
    fresh.origin = cached
    fresh.writable_in = None  # remembered on the cached flattening
    fresh._variable_specs = None
    fresh.values_only = cached.values_only
    fresh._fast = None
    fresh.dynamic = dynamic
    return fresh


def current_dynamic(cached: ArgFlat) -> list[Any] | None:
    """The dynamic arrays of a cached flattening, with the Variables' current values.

    ``None`` if a Variable's value is no longer one array (it became a dict, a
    tuple, ``None``, a string, ...): the flattening's structure key no longer
    describes the argument, which must be flattened again.
    """
    if cached.values_only:
        dynamic = list(map(_raw_value_of, cached.variables))
        return dynamic if one_leaf_values(dynamic) else None
    dynamic = []
    values: list[Any] = []
    variables = iter(cached.variables)
    for spec, leaf in zip(cached.specs, cached.leaves, strict=True):
        if type(spec) is VarSpec:
            value = _raw_value_of(next(variables))
            dynamic.append(value)
            values.append(value)
        elif spec is DYNAMIC:
            dynamic.append(leaf)
    return dynamic if one_leaf_values(values) else None


# Types seen as a Variable value that is one traced leaf (tracers excluded: see
# `CONCRETE_ARRAY_TYPES`): a cached flattening reads each value once per call.
_ONE_LEAF_TYPES: set[type] = {bool, int, float, complex}


def one_leaf_values(values: Iterable[Any]) -> bool:
    """Whether each of ``values`` (Variables' raw values) is one traced leaf.

    A cached flattening holds only Variables whose value was one array when it
    was made; a value since replaced by a pytree (or a non-array) changes the
    argument's structure, as a fresh flattening would see.
    """
    values = values if isinstance(values, list) else list(values)
    if _ONE_LEAF_TYPES.issuperset(map(type, values)):
        return True
    for value in values:
        if type(value) in _ONE_LEAF_TYPES:
            continue
        if not is_variable_value_leaf(value):
            return False
        if not isinstance(value, Tracer):
            _ONE_LEAF_TYPES.add(type(value))
            is_array(value)  # an array type: the compiled match then checks it in C
    return True


@_compat.api_boundary  # treemode's frames are left out of tracebacks
def check_no_aliases(transform: str = "check_no_aliases", /, **trees: Any) -> None:
    """Raise `AliasError` if one Variable is reachable twice from ``trees``.

    **Arguments:**

    - `transform`: name used in the error message (optional, positional).
    - `**trees`: named pytrees; the names start the paths in the message.

    **Raises:**

    `AliasError` naming both paths, e.g. `args[0].a` and `args[0].b`.

    ```python
    import jax.numpy as jnp
    import pytest
    import treemode
    from flax import nnx

    v = nnx.Param(jnp.ones(2))
    treemode.check_no_aliases(args=(v,))
    with pytest.raises(treemode.AliasError):
        treemode.check_no_aliases(args=(v,), kwargs={"w": v})
    ```
    """
    duplicate = first_duplicate(trees.items())
    if duplicate is not None:
        raise alias_error(transform, *duplicate, roots=list(trees.items()), expand=True)
