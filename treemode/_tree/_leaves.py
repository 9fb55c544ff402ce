"""Cheap predicates that classify pytree leaves.

``isinstance(x, nnx.Variable)`` goes through a metaclass ``__instancecheck__`` that
costs about a microsecond; these helpers cache the answer per type, because they
run once per leaf on every transform call.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.core import Tracer
from jax.tree_util import PyTreeDef

from .. import _caches

Variable = nnx.Variable

_variable_types: dict[type, bool] = {}
_graph_types: dict[type, bool] = {}
_caches.register(_variable_types.clear)
_caches.register(_graph_types.clear)

# Leaf types that are traced (passed to JAX as arrays).
ARRAY_TYPES: tuple[type, ...] = (jax.Array, np.ndarray, np.generic)
# Leaf types that are traced when they sit inside a Variable (counters are ints).
SCALAR_TYPES: tuple[type, ...] = (bool, int, float, complex)


def is_variable(x: Any) -> bool:
    """Whether ``x`` is an ``nnx.Variable`` (Param, BatchStat, RngKey, ...)."""
    cls = type(x)
    known = _variable_types.get(cls)
    if known is None:
        known = _variable_types[cls] = issubclass(cls, Variable)
    return known


def is_graph_node(x: Any) -> bool:
    """Whether ``x`` is an NNX object with identity (Module, Rngs, Optimizer, ...)."""
    cls = type(x)
    known = _graph_types.get(cls)
    if known is None:
        known = _graph_types[cls] = issubclass(cls, nnx.Pytree)
    return known


def is_variable_or_graph_node(x: Any) -> bool:
    return is_variable(x) or is_graph_node(x)


# Types seen to be arrays, tracers excluded: ``isinstance(tracer, jax.Array)``
# depends on the tracer's abstract value (a ``Ref`` tracer is not an array), not
# only on its type.
CONCRETE_ARRAY_TYPES: set[type] = set()


def is_array(x: Any) -> bool:
    """Whether a leaf is array data that a transform traces."""
    if type(x) in CONCRETE_ARRAY_TYPES:
        return True
    if isinstance(x, ARRAY_TYPES):
        if not isinstance(x, Tracer):
            CONCRETE_ARRAY_TYPES.add(type(x))
        return True
    return False


def is_abstract_array(x: Any) -> bool:
    """Arrays, plus ``jax.ShapeDtypeStruct`` (accepted by ``eval_shape`` and ``.lower``)."""
    return isinstance(x, ARRAY_TYPES) or isinstance(x, jax.ShapeDtypeStruct)


_PYTHON_SCALARS = frozenset(SCALAR_TYPES)


def is_python_scalar(x: Any) -> bool:
    """Whether ``x`` is a Python number (``bool``, ``int``, ``float``, ``complex``).

    Enum members that are numbers (``IntEnum``) count, as in ``jax.jit``.
    """
    return type(x) in _PYTHON_SCALARS or (
        isinstance(x, SCALAR_TYPES) and not isinstance(x, ARRAY_TYPES)
    )


def is_traced(x: Any) -> bool:
    """Whether a non-Variable leaf is traced: an array or a Python number (``jax.jit``'s rule).

    Python numbers inside Equinox modules are the exception (static, as in
    ``eqx.filter_jit``); `treemode._tree._flatten` applies it, since it needs the
    leaf's position.
    """
    return is_array(x) or is_python_scalar(x)


def is_abstract_traced(x: Any) -> bool:
    """`is_traced`, plus ``jax.ShapeDtypeStruct`` (``eval_shape`` and ``.lower``)."""
    return is_abstract_array(x) or is_python_scalar(x)


def is_variable_value_leaf(x: Any) -> bool:
    """Leaves inside a Variable's value that are traced: arrays and Python numbers."""
    return (
        isinstance(x, ARRAY_TYPES)
        or isinstance(x, SCALAR_TYPES)
        or isinstance(x, jax.ShapeDtypeStruct)
    )


def same_static(a: Any, b: Any) -> bool:
    """Equality of static values, types included; a failing ``==`` means different.

    ``2 == 2.0`` and ``True == 1``, but a trace specialized on one is not the
    program of the other (``x * 2`` is int32 where ``x * 2.0`` is float32), so,
    as ``jax.jit`` does for ``static_argnums``, values of different types (at
    any depth of a tuple, list or dict) are different.
    """
    if a is b:
        return True
    try:
        return bool(a == b) and static_types(a) == static_types(b)
    except Exception:
        return False


def static_types(value: Any) -> Any:
    """The types inside a static value, recursively: what ``==`` does not compare."""
    cls = type(value)
    if cls is PyTreeDef:
        return treedef_static_types(value)
    if isinstance(value, (tuple, list)):
        return (cls, tuple(map(static_types, value)))
    if isinstance(value, dict):
        return (cls, tuple((static_types(k), static_types(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (cls, frozenset((static_types(x), x) for x in value))
    return cls


def treedef_static_types(treedef: Any) -> tuple[Any, ...]:
    """`static_types` of every node's auxiliary data (static fields, dict keys) in a treedef.

    ``PyTreeDef.__eq__`` compares auxiliary data with ``==``, so two treedefs
    holding a module with ``s = 2`` and one with ``s = 2.0`` are equal; these
    types tell them apart.
    """
    out: list[Any] = []
    stack = [treedef]
    while stack:
        node = stack.pop()
        data = node.node_data()
        if data is not None:
            out.append(static_types(data[1]))
        stack.extend(node.children())
    return tuple(out)


def same_treedef(a: Any, b: Any) -> bool:
    """Treedef equality with the types of static values compared too (see `same_static`)."""
    return a is b or (a == b and treedef_static_types(a) == treedef_static_types(b))


def frozen_metadata(metadata: dict[str, Any]) -> tuple[tuple[str, Any], ...]:
    """A hashable, typed form of a Variable's metadata, for cache keys.

    NNX accepts any value as metadata (``nnx.Param(x, tags=["decay"])``); lists,
    dicts and sets are turned into tuples and frozensets tagged with their type,
    other unhashable values are compared by identity. The Variable keeps the
    user's values: this form is only compared.
    """
    return tuple((name, _freeze(metadata[name])) for name in sorted(metadata))


class _ByIdentity:
    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return type(other) is _ByIdentity and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __repr__(self) -> str:
        return f"<{type(self.obj).__name__} at {id(self.obj):#x}>"


def _freeze(value: Any) -> Any:
    cls = type(value)
    if isinstance(value, (tuple, list)):
        return (cls, tuple(map(_freeze, value)))
    if isinstance(value, dict):
        return (cls, tuple((_freeze(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (cls, frozenset(map(_freeze, value)))
    try:
        hash(value)
    except TypeError:
        return (cls, _ByIdentity(value))
    return (cls, value)
