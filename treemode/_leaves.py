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

Variable = nnx.Variable

_variable_types: dict[type, bool] = {}
_graph_types: dict[type, bool] = {}

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
    ``eqx.filter_jit``); `treemode._flatten` applies it, since it needs the
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
    """Equality of static values, where a failing ``==`` means different."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except Exception:
        return False
